"""The engine core's torch threads: the setting when given, else every CPU but one (min 1)."""

import os

import pytest

from llm_svc.core.process import core_threads
from shared.settings import LLMSettings

pytestmark = pytest.mark.unit


def test_explicit_threads_win():
    assert core_threads(LLMSettings(model_dir="m", threads=3)) == 3


def test_default_leaves_one_cpu_free():
    cpus = len(os.sched_getaffinity(0))
    assert core_threads(LLMSettings(model_dir="m")) == max(1, cpus - 1)
