"""Where a benchmark's figures go: one JSON file per run, with where and how they were measured.

Every ``python -m benchmarks.NAME`` ends with ``record(...)``: it writes
``benchmarks/results/NAME[-OPTIONS].MODE.json`` (commit, date, machine facts, mode, ``kind``,
the baseline named, a one-line summary for the README, the figures) and prints the figures as
the last stdout line, a JSON object that carries ``"kind"``. ``python -m benchmarks.table``
builds the README's benchmark table from these files.

Modes: ``full`` (the default), ``quick`` (``--quick``) and ``smoke`` (``--smoke``: tiniest sizes,
one repetition, seconds long, for CI). Smoke results never land beside the measured ones: they
go to ``$MMSERVE_BENCH_RESULTS`` or, unset, ``$TMPDIR/mmserve-bench-smoke``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = Path(__file__).resolve().parent / "results"
KINDS = ("simulation", "wall-clock")
MODES = ("smoke", "quick", "full")
ISA_FLAGS = ("avx", "avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "neon", "asimd")
# options that say how long to wait, where to log, not what is measured: left out of file names
_NOT_CONFIG = {"quick", "smoke", "lock_timeout", "quiet_timeout", "keep_logs", "profile", "profile_native", "worker"}


def add_mode_args(ap: argparse.ArgumentParser) -> None:
    """``--smoke`` (every benchmark has it; ``--quick`` stays each script's own)."""
    ap.add_argument("--smoke", action="store_true",
                    help="CI check: tiniest sizes, one repetition, seconds long; results go to a temp dir")


def mode_of(args: argparse.Namespace) -> str:
    if getattr(args, "smoke", False):
        return "smoke"
    return "quick" if getattr(args, "quick", False) else "full"


def options_of(ap: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """The options of this run as typed (``argv``, one entry per option with its values), less the
    mode flags and the waiting / logging options: what was measured, not the defaults a script
    fills in afterwards."""
    dests = {s: a.dest for a in ap._actions for s in a.option_strings}
    groups: list[list[str]] = []
    for tok in argv:
        if tok.startswith("--") or not groups:
            groups.append([tok])
        else:
            groups[-1].append(tok)
    keep = [g for g in groups if dests.get(g[0].partition("=")[0]) not in _NOT_CONFIG]
    return [" ".join(shlex.quote(x) for x in g) for g in keep]


def machine() -> dict:
    """CPU model, cores, the ISA flags that change kernel choice, RAM, OS and Python."""
    facts: dict = {"cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
        flags = re.search(r"^(?:flags|Features)\s*:\s*(.+)$", cpuinfo, re.M)
        facts["cpu_model"] = model.group(1).strip() if model else platform.processor()
        present = set(flags.group(1).split()) if flags else set()
        facts["isa"] = [f for f in ISA_FLAGS if f in present]
        mem = re.search(r"^MemTotal:\s*(\d+) kB", Path("/proc/meminfo").read_text(), re.M)
        facts["ram_gib"] = round(int(mem.group(1)) / 2**20, 1) if mem else None
    except OSError:
        facts.update(cpu_model=platform.processor(), isa=[], ram_gib=None)
    return facts


def git_commit() -> tuple[str | None, bool]:
    """HEAD of the checkout and whether its tracked files differ from it (None outside git)."""
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None, False
    return head, bool(dirty)


def results_dir(mode: str) -> Path:
    env = os.environ.get("MMSERVE_BENCH_RESULTS")
    if env:
        return Path(env)
    return Path(tempfile.gettempdir()) / "mmserve-bench-smoke" if mode == "smoke" else RESULTS_DIR


def file_name(name: str, mode: str, options: list[str]) -> str:
    slug = re.sub(r"[^A-Za-z0-9.]+", "-", " ".join(options)).strip("-")[:80]
    return f"{name}{'-' + slug if slug else ''}.{mode}.json"


def record(name: str, ap: argparse.ArgumentParser, args: argparse.Namespace, figures: dict, *, kind: str,
           baseline: str, summary: str, skipped: list[str] = ()) -> Path:
    """Write this run's results file and print ``figures`` (with ``benchmark``, ``kind``,
    ``mode``) as the last stdout line. ``summary`` is the README cell's text, built from the
    figures; ``skipped`` names what a smoke run left out and why (empty otherwise)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
    mode = mode_of(args)
    commit, dirty = git_commit()
    options = options_of(ap, sys.argv[1:])
    line = {**figures, "benchmark": name, "kind": kind, "mode": mode}
    if skipped:
        line["smoke_skipped"] = list(skipped)
    doc = {
        "benchmark": name, "kind": kind, "mode": mode, "options": options,
        "command": " ".join(["python -m benchmarks." + name, *sys.argv[1:]]),
        "source": "measured", "commit": commit, "dirty": dirty,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(), "baseline": baseline, "summary": summary, "figures": line,
    }  # fmt: skip
    out_dir = results_dir(mode)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / file_name(name, mode, options)
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(f"results: {path}", flush=True)
    print(json.dumps(line, default=str), flush=True)
    return path


def run(main) -> None:
    """``python -m benchmarks.NAME``: ``main()`` under the benchmark lock (two benchmarks never
    run at once; wait up to ``$MMSERVE_BENCH_LOCK_WAIT`` s, 3600 by default), exit with its code."""
    from benchmarks._bench_host import bench_lock

    with bench_lock(float(os.environ.get("MMSERVE_BENCH_LOCK_WAIT", 3600))):
        code = main()
    sys.exit(code or 0)
