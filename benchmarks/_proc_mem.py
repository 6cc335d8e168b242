"""Memory of every process of a local stack, one by one, and the slope of a series.

A stack's service is a process tree: the gateway and an encoder are one process each (plus
whatever helpers they start), an LLM service is its HTTP front and, as the front's child, its
engine core (which may start grammar-compile workers of its own). ``stack_processes`` names
each live process of that tree anew at every call (a restarted core has a new pid):
``llm-0/front``, ``llm-0/core``, ``gateway``, ``encoder-0``; any other descendant is
``<service>/<command>`` (numbered when there are several). ``memory_mb`` reads its RSS and USS
(memory only it maps: private clean + private dirty, from ``/proc/PID/smaps_rollup``).
"""

from __future__ import annotations

from pathlib import Path

from benchmarks._bench_host import proc_table, tree_pids

CORE_MODULE = "llm_svc.core.process"


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def memory_mb(pid: int) -> tuple[float, float] | None:
    """``(rss, uss)`` of ``pid`` in MiB (None once it is gone)."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    kb = {}
    for line in text.splitlines()[1:]:
        key, _, rest = line.partition(":")
        if rest.strip().endswith("kB"):
            kb[key] = int(rest.split()[0])
    uss = kb.get("Private_Clean", 0) + kb.get("Private_Dirty", 0)
    return round(kb.get("Rss", 0) / 1024, 2), round(uss / 1024, 2)


def role(service: str, pid: int, parent_is_root: bool) -> str:
    argv = cmdline(pid)
    if CORE_MODULE in argv and parent_is_root:
        return f"{service}/core"
    name = Path(argv[0]).name if argv and argv[0] else "proc"
    return f"{service}/{name}"


def stack_processes(roots: dict[str, int], llms: set[str]) -> dict[str, int]:
    """``roots``: service name -> its process. Every live process of those trees by role (see
    module doc); an LLM service's root is ``<name>/front``."""
    table = proc_table()
    out: dict[str, int] = {}
    for service, root in roots.items():
        if root not in table:
            continue
        out[f"{service}/front" if service in llms else service] = root
        for pid in sorted(tree_pids(table, [root]) - {root}):
            name = role(service, pid, table[pid][0] == root)
            k, base = 2, name
            while name in out:
                name, k = f"{base}-{k}", k + 1
            out[name] = pid
    return out


def slope_pct_per_30min(ts: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ``ys`` over ``ts`` (s), as % of the mean per 30 minutes."""
    n = len(ts)
    if n < 3:
        return None
    mt, my = sum(ts) / n, sum(ys) / n
    var = sum((t - mt) ** 2 for t in ts)
    if var == 0 or my == 0:
        return None
    slope = sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / var  # units per s
    return round(100.0 * slope * 1800.0 / my, 3)


def theil_sen_pct_per_30min(ts: list[float], ys: list[float]) -> float | None:
    """Median of the pairwise slopes (Theil-Sen; one outlier sample cannot move it), as % of the
    mean per 30 minutes. Beside the least-squares slope: where RSS rises in a few steps the
    median can be 0 while the fit is not, so the fit is the headline."""
    n = len(ts)
    if n < 3 or not sum(ys):
        return None
    pairs = sorted((ys[j] - ys[i]) / (ts[j] - ts[i]) for i in range(n) for j in range(i + 1, n) if ts[j] > ts[i])
    if not pairs:
        return None
    m = len(pairs)
    med = pairs[m // 2] if m % 2 else (pairs[m // 2 - 1] + pairs[m // 2]) / 2
    return round(100.0 * med * 1800.0 / (sum(ys) / n), 3)
