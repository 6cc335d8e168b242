"""Tier markers come from a test's folder (tests/conftest.py): ``-m unit`` selects a unit test
file that carries no ``pytestmark`` of its own, and no other tier's marker selects it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
UNMARKED = "tests/unit/test_registry.py"  # a unit test file without pytestmark


def _collected(marker: str) -> int:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q",
                           "-m", marker, UNMARKED], cwd=REPO, capture_output=True, text=True)  # fmt: skip
    assert proc.returncode in (0, 5), proc.stdout + proc.stderr  # 5: nothing selected
    return sum(1 for line in proc.stdout.splitlines() if "::" in line)


def test_unmarked_unit_file_is_selected_by_its_folder():
    assert "pytestmark" not in (REPO / UNMARKED).read_text()
    assert _collected("unit") > 0
    assert _collected("integration") == 0 and _collected("e2e") == 0
