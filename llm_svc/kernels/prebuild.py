"""Build every C kernel ahead of time for fixed x86-64 levels (the container image's build stage).

    python -m llm_svc.kernels.prebuild --out /opt/mmserve/kernels [--levels x86-64-v3,x86-64-v2]

writes ``<out>/<level>/kernels/<name>-<digest>.so`` per kernel and level (``CKernel.library_path``
with that level); a process with ``MMSERVE_KERNEL_PREBUILT=<out>`` and no compiler loads the
highest level its CPU runs. Levels this CPU runs are also loaded and bound here, so a build
whose symbols do not match fails the image build, not a service at start. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from llm_svc.kernels.ckernels import LEVELS, REGISTRY, CKernel, cpu_runs

# the modules that define the engine's kernels (importing one registers its CKernels)
KERNEL_MODULES = ("llm_svc.attention.cpu_paged", "llm_svc.attention.cpu_prefill", "llm_svc.models.cpu_fused",
                  "llm_svc.models.cpu_gemv", "llm_svc.models.cpu_packed")


def all_kernels() -> list[CKernel]:
    """Every kernel the engine defines (their modules imported), each once."""
    for mod in KERNEL_MODULES:
        importlib.import_module(mod)
    seen: dict[str, CKernel] = {}
    for k in REGISTRY:
        seen.setdefault(k.name, k)
    return list(seen.values())


def prebuild(out: Path, levels: list[str], jobs: int = 2) -> dict:
    import ctypes

    kernels = all_kernels()

    def one(item: tuple[CKernel, str]) -> str:
        k, level = item
        path = k.library_path(level, out / level)
        if not path.exists():
            k._build(path, level)
            path.chmod(0o755)  # built as a private temp file: readable by the services' own user
        if cpu_runs(level):
            k.bind(ctypes.CDLL(str(path)))
        return str(path)

    t0 = time.monotonic()
    with ThreadPoolExecutor(jobs) as pool:
        paths = list(pool.map(one, [(k, lv) for lv in levels for k in kernels]))
    return {"kernels": len(kernels), "levels": levels, "libraries": len(paths),
            "seconds": round(time.monotonic() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--levels", default=",".join(LEVELS), help="comma-separated x86-64 levels")
    ap.add_argument("--jobs", type=int, default=2)
    a = ap.parse_args(argv)
    levels = [lv for lv in a.levels.split(",") if lv]
    unknown = set(levels) - set(LEVELS)
    if unknown:
        ap.error(f"unknown levels {sorted(unknown)}; known: {list(LEVELS)}")
    print(json.dumps(prebuild(a.out, levels, a.jobs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
