"""The README's benchmark table, generated from the results files under ``benchmarks/results/``.

Each row is one benchmark (``benchmarks/table_rows.json``: its command and what it compares);
its kind and result come from every results file of that benchmark, oldest first, each saying
its mode and commit (a re-run lands beside the figures it replaces until that file is removed).
Files marked ``"source": "transcribed from README"`` hold figures measured before the results
files existed, copied from the README with the commit and mode it named.

    python -m benchmarks.table            # print the table
    python -m benchmarks.table --write    # replace the table in README.md
    python -m benchmarks.table --check    # exit 1 if README.md's table differs
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks._results import MODES, RESULTS_DIR

README = Path(__file__).resolve().parents[1] / "README.md"
ROWS_FILE = Path(__file__).resolve().parent / "table_rows.json"
HEADER = "| command | kind | what it compares (baseline named) | result |\n|---|---|---|---|"
TRANSCRIBED = "transcribed from README"


def load_results(results_dir: Path = RESULTS_DIR) -> dict[str, list[dict]]:
    """benchmark -> its results files (smoke runs refused: they are not figures), oldest first."""
    out: dict[str, list[dict]] = {}
    for path in sorted(results_dir.glob("*.json")):
        doc = json.loads(path.read_text())
        if doc.get("mode") not in (*MODES, None) or doc.get("mode") == "smoke":
            raise ValueError(f"{path.name}: mode {doc.get('mode')!r} is not a figure (quick / full / null)")
        doc["_file"] = path.name
        out.setdefault(doc["benchmark"], []).append(doc)
    for docs in out.values():
        # transcribed first, in file order (their dates are mostly unknown), then runs by date
        docs.sort(key=lambda d: (d["source"] != TRANSCRIBED, "" if d["source"] == TRANSCRIBED else d["date"], d["_file"]))
    return out


def _mode(doc: dict) -> str:
    flags = " ".join([*(["--quick"] if doc["mode"] == "quick" else []), *doc.get("options", [])])
    if doc["mode"] is None:
        return f"`{flags}` (mode not stated)" if flags else "mode not stated"
    if doc["mode"] == "full":
        return f"full run `{flags}`" if flags else "full run"
    return f"`{flags}`"


def _machine(doc: dict) -> str:
    m = doc.get("machine")
    if isinstance(m, dict):  # measured: the facts recorded in the run
        isa = "AVX-512" if "avx512f" in m.get("isa", []) else "AVX2" if "avx2" in m.get("isa", []) else "no AVX2"
        return f"{m.get('cores')} cores, {isa}"
    return m or ""  # transcribed: what the README said, if anything


def cell(doc: dict) -> str:
    """One results file's part of a result cell: mode, commit, machine and date, then the summary."""
    head = _mode(doc) + (f" at `{doc['commit'][:7]}`" if doc.get("commit") else ", commit not recorded")
    notes = [x for x in (_machine(doc), (doc.get("date") or "")[:10]) if x]
    if doc.get("dirty"):
        notes.append("uncommitted changes")
    if doc["source"] == TRANSCRIBED:
        notes.append(f"transcribed from the README of `{doc['readme_commit'][:7]}`")
    return f"{head} ({'; '.join(notes)}): {doc['summary']}"


def load_rows() -> list[dict]:
    """The README rows in order: ``benchmark``, ``command`` and ``compares`` (markdown, the
    baseline named), optional ``kind_note`` (shown after the kind, e.g. "in-process")."""
    return json.loads(ROWS_FILE.read_text())


def render(results: dict[str, list[dict]]) -> str:
    """The whole table (header and one line per row), from ``results``."""
    rows = load_rows()
    cited = {r["benchmark"] for r in rows}
    stray = sorted(set(results) - cited)
    if stray:
        raise ValueError(f"results files of benchmarks without a README row: {stray} (add them to {ROWS_FILE.name})")
    lines = [HEADER]
    for row in rows:
        docs = results.get(row["benchmark"], [])
        kinds = list(dict.fromkeys(d["kind"] for d in docs)) or ["not yet measured"]
        kind = " / ".join(kinds) + (f" ({row['kind_note']})" if row.get("kind_note") else "")
        result = "<br>".join(cell(d) for d in docs) or "no results file yet"
        lines.append(f"| {row['command']} | {kind} | {row['compares']} | {result} |")
    return "\n".join(lines)


def readme_table(text: str) -> tuple[int, int]:
    """Start and end offsets of the table under ``## Benchmarks`` in the README's text."""
    section = text.index("\n## Benchmarks\n")
    start = text.index(HEADER.split("\n")[0], section)
    end = start
    while end < len(text) and text.startswith("|", end):
        end = text.index("\n", end) + 1
    return start, end - 1  # the last row's newline stays outside


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write", action="store_true", help="replace the table in README.md")
    ap.add_argument("--check", action="store_true", help="exit 1 if README.md's table is not the generated one")
    args = ap.parse_args()
    table = render(load_results())
    text = README.read_text()
    start, end = readme_table(text)
    if args.write:
        README.write_text(text[:start] + table + text[end:])
    elif args.check:
        if text[start:end] != table:
            print("README.md's benchmark table is not generated from benchmarks/results/: "
                  "run python -m benchmarks.table --write", file=sys.stderr)
            return 1
    else:
        print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
