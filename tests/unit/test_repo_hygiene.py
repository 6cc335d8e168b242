"""The repository holds source, not binaries: every tracked file over 1 MB is a committed model
fixture named here (issue 43, item 5)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_BYTES = 1_000_000
# the trained tiny MiMos: checkpoints the tests and the quickstart load (no hub is reachable); the
# qk = v one is the trained checkpoint vLLM's CPU build serves (the vLLM oracle tests, spec_decode)
LARGE_FIXTURES = {"mmserve/tiny/trained_mimo/model.safetensors", "mmserve/tiny/trained_mimo_qkv/model.safetensors"}


def tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.fail("the tests run from a git checkout (git ls-files failed)")
    return [p for p in out.decode().split("\0") if p]


def test_no_tracked_file_over_1_mb_but_the_listed_fixtures():
    files = tracked_files()
    assert "pyproject.toml" in files  # the listing is the repository's, not an empty one
    large = {p for p in files if (ROOT / p).is_file() and (ROOT / p).stat().st_size > MAX_BYTES}
    assert large <= LARGE_FIXTURES, f"tracked files over 1 MB: {sorted(large - LARGE_FIXTURES)}"


def test_no_wheel_or_archive_is_tracked():
    assert [p for p in tracked_files() if p.endswith((".whl", ".tar.gz", ".zip"))] == []
