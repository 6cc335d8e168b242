"""Profile a server under load with ``py-spy record --subprocesses --threads --idle --format raw``
and summarize the samples per (process, thread): the share of the thread's samples (so of wall
time, waits included) by innermost Python frame. A frame inside a torch.compile'd graph
(``Runner.call (<hash>.py:N)``, vLLM) is named by the op on line N of that generated file, found
under ``~/.cache/vllm`` or ``/tmp/torchinductor_*``. Threads that only wait are left out."""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
from collections import Counter, defaultdict
from pathlib import Path

# frames of a thread that waits (an event loop in C shows as ``Runner.run``); a spin-wait
# (``sched_yield``) burns a core and counts as busy
IDLE = re.compile(r"wait|select|poll|_worker\b|acquire_read|recv|\bread\b|sleep|accept|"
                  r"^Runner\.run \(asyncio|resource_tracker", re.I)
_PY_FRAME = re.compile(r"^(?P<func>.+) \((?P<file>[^():]+\.py):(?P<line>\d+)\)$")
_GRAPH_OP = re.compile(r"(torch\.ops\.[\w.]+|extern_kernels\.\w+|cpp_fused_\w+|aten\.\w+)")


def record(pid: int, out: Path, native: bool = False, rate: int = 50) -> subprocess.Popen | None:
    """Start py-spy on ``pid`` and its subprocesses until SIGINT (None if py-spy is missing)."""
    exe = shutil.which("py-spy")
    if exe is None:
        return None
    argv = [exe, "record", "--pid", str(pid), "--subprocesses", "--threads", "--idle", "--format", "raw",
            "--rate", str(rate), "--nonblocking", "-o", str(out)]  # fmt: skip
    if native:
        argv.append("--native")
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


@functools.lru_cache(maxsize=64)
def _generated_source(name: str) -> list[str] | None:
    for root in [Path.home() / ".cache" / "vllm", *Path("/tmp").glob("torchinductor_*")]:
        for p in root.rglob(name) if root.exists() else ():
            return p.read_text(errors="replace").splitlines()
    return None


def _name(frame: str) -> str:
    """``func (file)``; a compiled-graph frame becomes ``graph: <op>``."""
    m = _PY_FRAME.match(frame)
    if m is None:
        return frame
    if m["func"] == "Runner.call" and re.fullmatch(r"c\w{40,}\.py", Path(m["file"]).name):
        src = _generated_source(Path(m["file"]).name)
        line = int(m["line"])
        if src and line <= len(src):
            op = _GRAPH_OP.search(src[line - 1])
            return f"graph: {op.group(1) if op else src[line - 1].strip()[:60]}"
    return f"{m['func']} ({m['file']})"


def summarize(path: Path, top: int = 12, min_busy: float = 0.05) -> dict:
    """``{"pid comm / thread": {"samples", "busy", "frames": [(frame, pct)]}}``."""
    per: dict[str, Counter] = defaultdict(Counter)
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        proc = thread = "?"
        while frames and frames[0].startswith(("process ", "thread ")):
            head = frames.pop(0)
            if head.startswith("process "):
                proc = re.sub(r'^process (\d+):"?([^"]*)"?$', r"\1 \2", head)[:70]
            else:
                thread = re.sub(r"^thread \(\w+\):?\s*", "", head)[:30]
        # torch/_ops.py is the op-call shim: name the caller (a model line or a graph op)
        py = [f for f in frames if _PY_FRAME.match(f) and "torch/_ops.py" not in f]
        per[f"{proc} / {thread}"][_name(py[-1]) if py else (frames[-1] if frames else "?")] += int(count)
    out = {}
    for key, c in per.items():
        total = sum(c.values())
        busy = sum(n for f, n in c.items() if not IDLE.search(f))
        if total < 20 or busy / total < min_busy:
            continue
        out[key] = {
            "samples": total,
            "busy": round(busy / total, 3),
            "frames": [(f, round(100 * n / total, 1)) for f, n in c.most_common(top)],
        }
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["samples"] * kv[1]["busy"]))


def format_summary(side: str, summary: dict) -> str:
    lines = []
    for key, s in summary.items():
        lines.append(f"[{side}] {key}: {s['samples']} samples, {100 * s['busy']:.0f}% not waiting")
        lines.extend(f"  {pct:5.1f}%  {f}" for f, pct in s["frames"])
    return "\n".join(lines)
