"""Results files say where their figures came from (the tables built from them:
tests/unit/test_bench_tables.py)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from benchmarks import _bench_host, _results, table
from benchmarks._table_select import TRANSCRIBED

pytestmark = pytest.mark.unit


def test_every_results_file_names_its_provenance():
    results = table.load_results()
    assert set(results) <= {r["benchmark"] for r in table.load_rows()}
    for docs in results.values():
        for d in docs:
            assert d["kind"] in _results.KINDS, d["_file"]
            assert d["mode"] in ("quick", "full", None), d["_file"]
            assert d["summary"] and d["baseline"], d["_file"]
            if d["source"] == TRANSCRIBED:
                assert len(d["readme_commit"]) == 40, d["_file"]  # the README text it was copied from
            else:
                assert d["source"] == "measured" and d["commit"] and d["date"] and d["machine"]["cores"], d["_file"]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tower", default="small")
    ap.add_argument("--lock-timeout", type=float, default=600.0)
    _results.add_mode_args(ap)
    return ap


def test_record_writes_a_file_and_prints_the_figures_last(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MMSERVE_BENCH_RESULTS", str(tmp_path))
    ap = _parser()
    argv = ["--quick", "--tower", "so400m", "--lock-timeout", "5"]
    monkeypatch.setattr(sys, "argv", ["encoder_batching.py", *argv])
    args = ap.parse_args(argv)
    args.rounds = 3  # a default the script fills in is not an option of the run
    path = _results.record("encoder_batching", ap, args, {"speedup": 2.5, "kind": "not-a-kind"}, kind="wall-clock",
                           baseline="batch size 1", summary="2.50x")
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last == {"speedup": 2.5, "benchmark": "encoder_batching", "kind": "wall-clock", "mode": "quick"}
    assert path == tmp_path / "encoder_batching-tower-so400m.quick.json"  # waiting options are not the config
    doc = json.loads(path.read_text())
    assert doc["options"] == ["--tower so400m"] and doc["source"] == "measured" and doc["summary"] == "2.50x"
    assert {"cpu_model", "cores", "isa", "ram_gib"} <= set(doc["machine"])


def test_smoke_results_never_land_beside_the_figures(monkeypatch):
    monkeypatch.delenv("MMSERVE_BENCH_RESULTS", raising=False)
    assert _results.results_dir("smoke") != _results.RESULTS_DIR
    assert _results.results_dir("quick") == _results.RESULTS_DIR
    with pytest.raises(ValueError):
        _results.record("x", _parser(), _parser().parse_args([]), {}, kind="vs_vllm", baseline="b", summary="s")


def test_a_smoke_file_in_the_results_dir_is_refused(tmp_path):
    (tmp_path / "kv_capacity.smoke.json").write_text(json.dumps({"benchmark": "kv_capacity", "mode": "smoke"}))
    with pytest.raises(ValueError, match="not a figure"):
        table.load_results(tmp_path)


def test_the_benchmark_lock_is_reentrant_down_the_process_tree(tmp_path, monkeypatch):
    monkeypatch.setattr(_bench_host, "LOCK_PATH", str(tmp_path / "bench.lock"))
    monkeypatch.delenv(_bench_host.HELD_ENV, raising=False)
    child = "from benchmarks._bench_host import bench_lock\nwith bench_lock(0) as held: print(held)"
    with _bench_host.bench_lock(1) as held:
        assert held and os.environ[_bench_host.HELD_ENV] == "1"
        # a benchmark the holder runs takes the lock as held (it would otherwise wait on its parent)
        out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True)
        assert out.stdout.strip() == "True"
    assert _bench_host.HELD_ENV not in os.environ


def test_options_are_what_was_typed_less_mode_and_waiting():
    ap = _parser()
    ap.add_argument("--seconds", type=float, nargs="+")
    ap.add_argument("--baseline-ref", default="d5857b8")
    got = _results.options_of(ap, ["--seconds", "10", "60", "--smoke", "--baseline-ref", "", "--lock-timeout=9"])
    assert got == ["--seconds 10 60", "--baseline-ref ''"]
