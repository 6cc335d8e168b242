"""Every benchmark runs in its seconds-long smoke mode (``--smoke``: the real code path at its
tiniest), so none rots unseen: it exits 0, its last stdout line is a JSON object with ``kind``,
and its results file lands in the smoke directory, never beside the measured figures. The whole
module holds the benchmark lock, so no smoke run lands in the middle of someone's measurement."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks._bench_host import bench_lock
from benchmarks._results import KINDS, RESULTS_DIR

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = sorted(p.stem for p in (REPO / "benchmarks").glob("[a-z]*.py") if p.stem != "table")


@pytest.fixture(scope="module")
def lock_held():
    """The benchmark lock for the whole module; the benchmarks it runs inherit it (re-entrant)."""
    with bench_lock(timeout_s=480) as held:
        yield held


def test_every_benchmark_is_listed():
    assert len(BENCHMARKS) >= 20 and "vs_vllm" in BENCHMARKS and "overload" in BENCHMARKS


@pytest.mark.parametrize("name", BENCHMARKS)
def test_smoke(name, lock_held, tmp_path):
    before = sorted(p.name for p in RESULTS_DIR.iterdir())
    env = {**os.environ, "MMSERVE_BENCH_RESULTS": str(tmp_path), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", "--smoke"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{name} --smoke exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["benchmark"] == name and last["kind"] in KINDS and last["mode"] == "smoke"
    (path,) = tmp_path.glob(f"{name}*.smoke.json")
    doc = json.loads(path.read_text())
    assert doc["mode"] == "smoke" and doc["source"] == "measured" and doc["commit"] and doc["machine"]["cores"]
    assert doc["figures"] == last and doc["summary"]
    assert sorted(p.name for p in RESULTS_DIR.iterdir()) == before  # the figures' directory untouched
