"""The benchmark tables, generated from the results files under ``benchmarks/results/``.

One row per benchmark and machine kind (CPU model, widest vector ISA, cores): the newest clean
run's headline figure against its baseline, its commit, date and mode, and its target met or
not (``benchmarks/table_rows.json``: per benchmark its command, what it measures, its baseline,
the headline figure and the target with its source). Which run a row shows:
``benchmarks._table_select``. Two outputs: the README's short headline table between its
``perf-table`` markers, and ``docs/benchmarks.md`` (the full table, then a section per
benchmark).

    python -m benchmarks.table            # print the README table
    python -m benchmarks.table --write    # regenerate README.md's table and docs/benchmarks.md
    python -m benchmarks.table --check    # exit 1 if either differs from what would be generated
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks._results import MODES, RESULTS_DIR
from benchmarks._table_select import TRANSCRIBED, Row, select_rows

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs" / "benchmarks.md"
ROWS_FILE = Path(__file__).resolve().parent / "table_rows.json"
BEGIN, END = "<!-- perf-table:begin -->\n", "<!-- perf-table:end -->"


def load_results(results_dir: Path = RESULTS_DIR) -> dict[str, list[dict]]:
    """benchmark -> its results files (smoke runs refused: they are not figures), in file order."""
    out: dict[str, list[dict]] = {}
    for path in sorted(results_dir.glob("*.json")):
        doc = json.loads(path.read_text())
        if doc.get("mode") not in (*MODES, None) or doc.get("mode") == "smoke":
            raise ValueError(f"{path.name}: mode {doc.get('mode')!r} is not a figure (quick / full / null)")
        doc["_file"] = path.name
        out.setdefault(doc["benchmark"], []).append(doc)
    return out


def load_rows() -> list[dict]:
    """The benchmarks in table order: ``benchmark``, ``command``, ``measures``, ``baseline``,
    ``headline`` (``figure`` key path or ``figures`` + ``reduce``, optional ``baseline_figure``,
    ``label``, ``unit``; null: no headline figure), ``target`` (``compare``, ``threshold``,
    ``source``; null: none stated), optional ``kind_note`` (e.g. "in-process"), and for a benchmark
    with more than one row (a variant by option): ``name`` (the row's name and anchor) and
    ``where`` (figure key -> the values a results file's figures must hold; null: the key absent)."""
    return json.loads(ROWS_FILE.read_text())


def name_of(spec: dict) -> str:
    return spec.get("name", spec["benchmark"])


def docs_of(spec: dict, results: dict[str, list[dict]]) -> list[dict]:
    """The results files of ``spec``'s benchmark that its ``where`` admits (all without one)."""
    where = spec.get("where") or {}
    return [d for d in results.get(spec["benchmark"], [])
            if all(d.get("figures", {}).get(k) in allowed for k, allowed in where.items())]


def all_rows(results: dict[str, list[dict]], specs: list[dict]) -> list[tuple[dict, Row]]:
    stray = sorted(set(results) - {s["benchmark"] for s in specs})
    if stray:
        raise ValueError(f"results files of benchmarks without a row: {stray} (add them to {ROWS_FILE.name})")
    return [(s, r) for s in specs for r in select_rows(s["benchmark"], docs_of(s, results), s["headline"],
                                                       s["target"])]


# ---- cells -------------------------------------------------------------------------------------
def fmt(value: float, unit: str) -> str:
    if unit == "%":
        return f"{100 * value:.1f}%"
    if unit == "x" or unit.startswith("%"):
        return f"{value:.3g}{unit}"
    return f"{value:.3g} {unit}".strip()


def headline_cell(spec: dict, row: Row) -> str:
    doc, h = row.doc, spec["headline"]
    if doc["source"] == TRANSCRIBED:
        return f"no clean run; transcribed from the README of `{doc['readme_commit'][:7]}`: {doc['summary']}"
    if h is None or row.value is None:
        figure = doc["summary"]
    else:
        figure = f"{h['label']}: **{fmt(row.value, h['unit'])}**"
        if row.baseline is not None:
            figure += f" vs {fmt(row.baseline, h['unit'])} ({spec['baseline']})"
    return figure if row.clean else f"no clean run; newest dirty run: {figure}"


def target_cell(spec: dict) -> str:
    t = spec["target"]
    if t is None:
        return "none stated"
    unit = spec["headline"]["unit"] if spec["headline"] else ""
    return f"{t['compare']} {fmt(t['threshold'], unit)}"


def met_cell(spec: dict, row: Row) -> str:
    if spec["target"] is None:
        return "-"
    if not row.clean:
        return "not judged (no clean run)"
    return {True: "met", False: "**not met**", None: "not judged (no figure)"}[row.met]


def run_cell(doc: dict) -> str:
    if doc["source"] == TRANSCRIBED:
        return "commit not recorded"
    return f"`{doc['commit'][:7]}` {doc['date'][:10]} {doc['mode']}"


def _kind_note(doc: dict) -> str:
    return " (simulation)" if doc.get("kind") == "simulation" else ""


def _md(cells: list[str]) -> str:
    return "| " + " | ".join(c.replace("\n", " ") for c in cells) + " |"


# ---- outputs -----------------------------------------------------------------------------------
def render_readme(rows: list[tuple[dict, Row]]) -> str:
    """The README's short headline table (the lines between its markers)."""
    lines = [
        "| benchmark | machine | headline (newest clean run) | target | met | run |",
        "|---|---|---|---|---|---|",
    ]
    for spec, row in rows:
        name = f"[{name_of(spec)}](docs/benchmarks.md#{name_of(spec)})" + _kind_note(row.doc)
        lines.append(_md([name, row.machine, headline_cell(spec, row), target_cell(spec), met_cell(spec, row),
                          run_cell(row.doc)]))
    return "\n".join(lines) + "\n"


def render_docs(rows: list[tuple[dict, Row]], specs: list[dict], results: dict[str, list[dict]]) -> str:
    """``docs/benchmarks.md``: the full table, then a section per benchmark."""
    out = [
        "# Benchmarks",
        "",
        "<!-- generated by `python -m benchmarks.table --write` from benchmarks/results/*.json and",
        "benchmarks/table_rows.json: edit those, not this file -->",
        "",
        "One row per benchmark and machine kind (CPU model, widest vector ISA, cores). A row shows the",
        "newest **clean** run (measured at a commit with no uncommitted changes) that holds the headline",
        "figure; where a machine kind has no clean run, the newest run is shown as such and is not",
        "judged against the target. Older runs stay in their results files",
        "([benchmarks/results/](../benchmarks/results/)), not in the table. Figures transcribed from",
        "older READMEs (machine and date not recorded) show only where a benchmark has no measured run.",
        "",
        "| benchmark | machine | mode | commit | date | headline | target | met | results file |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for spec, row in rows:
        d = row.doc
        measured = d["source"] != TRANSCRIBED
        out.append(_md([
            f"[{name_of(spec)}](#{name_of(spec)})" + _kind_note(row.doc), row.machine, d.get("mode") or "not stated",
            f"`{d['commit'][:7]}`" if measured else "not recorded", d["date"][:10] if measured else "not recorded",
            headline_cell(spec, row), target_cell(spec), met_cell(spec, row), f"`{d['_file']}`",
        ]))  # fmt: skip
    for spec in specs:
        kinds = " / ".join(dict.fromkeys(d["kind"] for d in docs_of(spec, results))) or "not yet measured"
        note = f" ({spec['kind_note']})" if spec.get("kind_note") else ""
        out += ["", f"### {name_of(spec)}", "", f"What it measures: {spec['measures']}.", "",
                f"Kind: {kinds}{note}.", f"Baseline: {spec['baseline']}."]
        if spec["headline"]:
            out.append(f"Headline figure: {spec['headline']['label']}.")
        t = spec["target"]
        out.append("Target: none stated." if t is None else f"Target: {target_cell(spec)} (source: {t['source']}).")
        out += ["", f"    {spec['command'].strip('`').replace(chr(92) + '|', '|')}", ""]
        files = [d["_file"] for d in docs_of(spec, results)]
        out.append("Results files: " + (", ".join(f"`{f}`" for f in files) if files else "none yet") + ".")
    return "\n".join(out) + "\n"


def readme_span(text: str) -> tuple[int, int]:
    """Start and end offsets of the generated part of the README (between the markers)."""
    start = text.index(BEGIN) + len(BEGIN)
    return start, text.index(END, start)


def generated() -> tuple[str, str]:
    """(README.md, docs/benchmarks.md) as they would be generated from the files now."""
    results, specs = load_results(), load_rows()
    rows = all_rows(results, specs)
    text = README.read_text()
    start, end = readme_span(text)
    return text[:start] + render_readme(rows) + text[end:], render_docs(rows, specs, results)


def stale() -> list[str]:
    """The generated files that differ from what the results files give (empty: all current)."""
    readme, docs = generated()
    out = []
    if README.read_text() != readme:
        out.append("README.md")
    if not DOCS.exists() or DOCS.read_text() != docs:
        out.append("docs/benchmarks.md")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write", action="store_true", help="regenerate README.md's table and docs/benchmarks.md")
    ap.add_argument("--check", action="store_true", help="exit 1 if either is not the generated one")
    args = ap.parse_args()
    if args.write:
        readme, docs = generated()
        README.write_text(readme)
        DOCS.write_text(docs)
    elif args.check:
        if bad := stale():
            print(f"stale against benchmarks/results/: {', '.join(bad)}; run python -m benchmarks.table --write",
                  file=sys.stderr)
            return 1
    else:
        print(render_readme(all_rows(load_results(), load_rows())), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
