"""The start-up heap frozen out of the collector's scans, and thawed at shutdown."""

from __future__ import annotations

import gc

import pytest

from shared.gc_tuning import freeze_startup_heap, thaw_heap

pytestmark = pytest.mark.unit


def test_freeze_then_thaw_leaves_nothing_frozen():
    class Cycle:
        pass

    before = gc.get_freeze_count()
    assert before == 0
    try:
        n = freeze_startup_heap("test")
        assert n == gc.get_freeze_count() > 1000  # this process's modules at least
        a = Cycle()
        a.me = a  # garbage made after the freeze is still collected
        del a
        assert gc.collect() >= 1
    finally:
        thaw_heap()
    assert gc.get_freeze_count() == 0
