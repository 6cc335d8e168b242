"""The benchmark tables: the committed README table and docs/benchmarks.md are the ones
``benchmarks.table`` generates from ``benchmarks/results/`` (CI fails when they are stale), and
the row selection (one row per machine kind, the newest clean run in the headline, dirty runs
only noted as such) on synthetic results."""

from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks import table
from benchmarks._table_select import NOT_RECORDED, TRANSCRIBED, headline_value, judge, machine_kind, select_rows

pytestmark = pytest.mark.unit

EPYC_512 = {"cpu_model": "AMD EPYC", "cores": 2, "isa": ["avx", "avx2", "fma", "avx512f"]}
EPYC_AVX2 = {"cpu_model": "AMD EPYC", "cores": 2, "isa": ["avx", "avx2", "fma"]}
XEON = {"cpu_model": "Intel(R) Xeon(R) Processor", "cores": 2, "isa": ["avx2", "avx512f", "amx_tile"]}
HEADLINE = {"figure": ["ratio"], "label": "ratio", "unit": "x"}
TARGET = {"compare": ">=", "threshold": 2.0, "source": "issue 0"}


def run(file: str, date: str, ratio: float | None, *, dirty: bool = False, machine: dict = EPYC_512) -> dict:
    figures = {} if ratio is None else {"ratio": ratio}
    return {"benchmark": "b", "kind": "wall-clock", "mode": "quick", "source": "measured", "commit": "c" * 40,
            "dirty": dirty, "date": date, "machine": machine, "summary": f"{ratio}", "figures": figures, "_file": file}


def transcribed(file: str) -> dict:
    return {"benchmark": "b", "kind": "wall-clock", "mode": None, "source": TRANSCRIBED, "commit": None,
            "readme_commit": "r" * 40, "date": None, "machine": "AVX-512 Xeon", "summary": "old", "figures": {},
            "_file": file}


# ---- the committed files -----------------------------------------------------------------------
def test_committed_tables_are_not_stale():
    assert table.stale() == [], "run: python -m benchmarks.table --write"


def test_check_command_passes_on_the_committed_files():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.table", "--check"], cwd=table.REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_check_fails_when_a_results_file_changes(tmp_path, monkeypatch):
    readme, docs = table.generated()
    monkeypatch.setattr(table, "README", tmp_path / "README.md")
    monkeypatch.setattr(table, "DOCS", tmp_path / "benchmarks.md")
    table.README.write_text(readme)
    table.DOCS.write_text(docs)
    assert table.stale() == []
    load = table.load_results

    def newer_clean_run() -> dict[str, list[dict]]:
        results = load()
        doc = dict(results["kv_capacity"][0], dirty=False, date="2099-01-01T00:00:00+00:00", _file="new.full.json")
        doc["figures"] = dict(doc["figures"], ratio=1.0)
        results["kv_capacity"].append(doc)
        return results

    monkeypatch.setattr(table, "load_results", newer_clean_run)
    assert table.stale() == ["README.md", "docs/benchmarks.md"]
    monkeypatch.setattr(table, "load_results", load)
    start, end = table.readme_span(readme)
    table.README.write_text(readme[:start] + readme[start:end].replace("| met |", "| ok |") + readme[end:])
    assert table.stale() == ["README.md"]  # a hand edit between the markers


def test_every_benchmark_has_a_row_spec_and_every_spec_a_results_file():
    results, specs = table.load_results(), table.load_rows()
    names = [table.name_of(s) for s in specs]  # a row's name: its benchmark's, or its variant's
    assert len(names) == len(set(names)) and set(results) <= {s["benchmark"] for s in specs}
    assert [table.name_of(s) for s in specs if not table.docs_of(s, results)] == []
    for s in specs:
        assert s["command"] and s["measures"] and s["baseline"], s["benchmark"]
        if s["target"] is not None:
            assert s["headline"] and s["target"]["compare"] in (">=", ">", "<=", "<") and s["target"]["source"]


def test_every_headline_figure_resolves_in_some_results_file():
    results = table.load_results()
    for s in table.load_rows():
        if s["headline"]:
            assert any(headline_value(d, s["headline"]) is not None for d in results[s["benchmark"]]), s["benchmark"]


def test_the_readme_table_names_cpu_models_apart():
    readme, _ = table.generated()
    start, end = table.readme_span(readme)
    body = readme[start:end]
    assert "AMD EPYC, AVX2, 2 cores" in body and "AMD EPYC, AVX-512, 2 cores" in body
    assert "Intel Xeon Processor, AVX-512 + AMX, 2 cores" in body


# ---- row selection -----------------------------------------------------------------------------
def test_machine_kind_names_the_cpu_model_and_isa():
    assert machine_kind(run("a", "2026-01-01", 1.0, machine=EPYC_512)) == "AMD EPYC, AVX-512, 2 cores"
    assert machine_kind(run("a", "2026-01-01", 1.0, machine=EPYC_AVX2)) == "AMD EPYC, AVX2, 2 cores"
    assert machine_kind(run("a", "2026-01-01", 1.0, machine=XEON)) == "Intel Xeon Processor, AVX-512 + AMX, 2 cores"
    assert machine_kind(transcribed("t")) == NOT_RECORDED


def test_newest_clean_run_wins():
    docs = [run("old.json", "2026-01-01T00:00:00", 2.5), run("new.json", "2026-02-01T00:00:00", 1.5),
            run("mid.json", "2026-01-15T00:00:00", 3.0)]
    (row,) = select_rows("b", docs, HEADLINE, TARGET)
    assert row.doc["_file"] == "new.json" and row.clean and row.value == 1.5 and row.met is False


def test_dirty_runs_never_take_the_headline():
    docs = [run("clean.json", "2026-01-01", 2.5), run("dirty.json", "2026-03-01", 9.0, dirty=True)]
    (row,) = select_rows("b", docs, HEADLINE, TARGET)
    assert row.doc["_file"] == "clean.json" and row.value == 2.5 and row.met is True


def test_only_dirty_runs_show_no_clean_run_and_the_newest_dirty_figure():
    docs = [run("d1.json", "2026-01-01", 1.0, dirty=True), run("d2.json", "2026-02-01", 3.0, dirty=True)]
    (row,) = select_rows("b", docs, HEADLINE, TARGET)
    assert not row.clean and row.doc["_file"] == "d2.json" and row.met is None
    spec = {"benchmark": "b", "baseline": "base", "headline": HEADLINE, "target": TARGET}
    assert table.headline_cell(spec, row).startswith("no clean run; newest dirty run: ")
    assert "**3x**" in table.headline_cell(spec, row)
    assert table.met_cell(spec, row) == "not judged (no clean run)"


def test_unknown_cleanliness_is_not_clean():
    doc = run("u.json", "2026-01-01", 2.5)
    del doc["dirty"]
    (row,) = select_rows("b", [doc], HEADLINE, TARGET)
    assert not row.clean


def test_one_row_per_machine_kind():
    docs = [run("e1", "2026-01-01", 2.1, machine=EPYC_512), run("e2", "2026-01-02", 2.2, machine=EPYC_512),
            run("a1", "2026-01-03", 2.3, machine=EPYC_AVX2), run("x1", "2026-01-04", 1.0, machine=XEON)]
    rows = select_rows("b", docs, HEADLINE, TARGET)
    assert [(r.machine, r.doc["_file"]) for r in rows] == [
        ("AMD EPYC, AVX-512, 2 cores", "e2"), ("AMD EPYC, AVX2, 2 cores", "a1"),
        ("Intel Xeon Processor, AVX-512 + AMX, 2 cores", "x1")]
    assert [r.met for r in rows] == [True, True, False]


def test_runs_without_the_headline_figure_give_way():
    docs = [run("with.json", "2026-01-01", 2.5), run("without.json", "2026-02-01", None)]
    (row,) = select_rows("b", docs, HEADLINE, TARGET)
    assert row.doc["_file"] == "with.json"


def test_transcribed_figures_only_where_nothing_was_measured():
    (row,) = select_rows("b", [transcribed("t.json"), run("m.json", "2026-01-01", 2.5)], HEADLINE, TARGET)
    assert row.doc["_file"] == "m.json"
    (row,) = select_rows("b", [transcribed("t.json")], HEADLINE, TARGET)
    assert row.machine == NOT_RECORDED and not row.clean and row.met is None


def test_headline_reductions_and_judging():
    doc = run("r", "2026-01-01", None)
    doc["figures"] = {"growth": {"a": 0.5, "b": 1.5}, "x": 1.1, "y": 1.3, "clips": [{"rt": 0.55}]}
    assert headline_value(doc, {"figure": ["growth"], "reduce": "max"}) == 1.5
    assert headline_value(doc, {"figures": [["x"], ["y"], ["missing"]], "reduce": "max"}) == 1.3
    assert headline_value(doc, {"figure": ["clips", 0, "rt"]}) == 0.55
    assert headline_value(doc, {"figure": ["growth", "c"]}) is None
    assert judge(1.0, {"compare": "<", "threshold": 1.0}) is False
    assert judge(1.0, {"compare": "<=", "threshold": 1.0}) is True
    assert judge(None, TARGET) is None and judge(3.0, None) is None


def test_a_variant_row_holds_only_its_own_results_files():
    results, specs = table.load_results(), table.load_rows()
    by_name = {table.name_of(s): s for s in specs}
    bf16 = table.docs_of(by_name["vs_vllm_bfloat16"], results)
    f32 = table.docs_of(by_name["vs_vllm"], results)
    assert bf16 and all(d["figures"]["dtype"] == "bfloat16" for d in bf16)
    assert f32 and all(d["figures"].get("dtype", "float32") == "float32" for d in f32)
    assert len(bf16) + len(f32) == len(results["vs_vllm"])
