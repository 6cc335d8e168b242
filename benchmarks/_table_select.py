"""Which results file each benchmark table row shows: pure bookkeeping over result dicts.

A row is one (benchmark, machine kind). The machine kind names the CPU model, its widest vector
ISA and the core count (two EPYC generations both report "AMD EPYC": AVX2 only vs AVX-512).
Per row the headline is the newest *clean* run (``dirty`` is false: measured at a commit with
no uncommitted changes) whose figures hold the headline figure; with no clean run the row shows
the newest run as such, and nothing is judged against the target. Figures transcribed from old
READMEs (no machine, no date, cleanliness unknown) fill a row only for a benchmark with no
measured run at all. Older runs stay in their files, not in the tables.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass

TRANSCRIBED = "transcribed from README"
NOT_RECORDED = "not recorded"
COMPARE = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt}
REDUCE = {"max": max, "min": min}


def machine_kind(doc: dict) -> str:
    """``"AMD EPYC, AVX-512, 2 cores"``; :data:`NOT_RECORDED` for transcribed figures."""
    m = doc.get("machine")
    if not isinstance(m, dict):
        return NOT_RECORDED
    model = re.sub(r"\s+", " ", re.sub(r"\((R|TM|tm)\)", "", m.get("cpu_model") or "unknown CPU")).strip()
    isa = set(m.get("isa") or ())
    tier = ("AVX-512 + AMX" if "amx_tile" in isa else "AVX-512" if "avx512f" in isa else "AVX2" if "avx2" in isa
            else "NEON" if {"neon", "asimd"} & isa else "no AVX2")  # fmt: skip
    return f"{model}, {tier}, {m.get('cores')} cores"


def is_clean(doc: dict) -> bool:
    """Measured at a recorded commit with no uncommitted changes (``dirty`` explicitly false)."""
    return doc.get("source") == "measured" and bool(doc.get("commit")) and doc.get("dirty") is False


def _at(figures, path: list):
    x = figures
    for key in path:
        if isinstance(x, dict) and key in x:
            x = x[key]
        elif isinstance(x, list) and isinstance(key, int) and -len(x) <= key < len(x):
            x = x[key]
        else:
            return None
    return x


def _number(x, reduce: str | None) -> float | None:
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, list):
        nums = [v for v in x if isinstance(v, (int, float)) and not isinstance(v, bool)]
        return REDUCE[reduce](nums) if reduce and nums else None
    return x if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def headline_value(doc: dict, headline: dict | None) -> float | None:
    """The headline figure of one run: ``figure`` (a key path into ``figures``; a dict or list
    there is reduced by ``reduce``) or ``figures`` (several paths, reduced by ``reduce``)."""
    if not headline:
        return None
    figs = doc.get("figures") or {}
    if "figures" in headline:
        vals = [_number(_at(figs, p), None) for p in headline["figures"]]
        vals = [v for v in vals if v is not None]
        return REDUCE[headline["reduce"]](vals) if vals else None
    return _number(_at(figs, headline["figure"]), headline.get("reduce"))


def baseline_value(doc: dict, headline: dict | None) -> float | None:
    if not headline or "baseline_figure" not in headline:
        return None
    return _number(_at(doc.get("figures") or {}, headline["baseline_figure"]), None)


def judge(value: float | None, target: dict | None) -> bool | None:
    """Met (True) / not met (False) / not judged (None: no target or no figure)."""
    if target is None or value is None:
        return None
    return bool(COMPARE[target["compare"]](value, target["threshold"]))


@dataclass(frozen=True)
class Row:
    """One table row: ``doc`` is the run shown; ``clean`` says whether it is a clean run (the
    headline) or, with no clean run for this machine kind, the newest run, shown as such."""

    benchmark: str
    machine: str
    doc: dict
    clean: bool
    value: float | None
    baseline: float | None
    met: bool | None  # None when not judged: no target, no figure, or no clean run


def _newest(docs: list[dict]) -> dict:
    return max(docs, key=lambda d: (d.get("date") or "", d.get("_file", "")))


def select_rows(benchmark: str, docs: list[dict], headline: dict | None, target: dict | None) -> list[Row]:
    """The rows of one benchmark from all its results files, sorted by machine kind."""
    measured = [d for d in docs if d.get("source") != TRANSCRIBED]
    groups: dict[str, list[dict]] = {}
    for d in measured or docs:
        groups.setdefault(machine_kind(d), []).append(d)
    rows = []
    for kind in sorted(groups):
        group = groups[kind]
        holding = [d for d in group if headline is None or headline_value(d, headline) is not None] or group
        clean = [d for d in holding if is_clean(d)]
        doc = _newest(clean or holding)
        value = headline_value(doc, headline)
        rows.append(Row(benchmark, kind, doc, bool(clean), value, baseline_value(doc, headline),
                        judge(value, target) if clean else None))
    return rows
