"""How many CPUs this process may use: its affinity mask, bounded by its cgroup's CPU quota.

A container started with ``cpus: 2`` (Docker / Compose) or a Kubernetes CPU limit of 2 still sees
every core of the host in its affinity mask and ``os.cpu_count()``; only the CFS quota says it
gets two cores' time. Sizing thread pools from the mask there runs one thread per host core on
two cores' worth of time slices, which stalls every OpenMP barrier. So the quota wins when it is
lower (rounded up: a quota of 1.5 CPUs still keeps two threads busy most of the time)."""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")


def _affinity() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cgroup_quota(root: Path = CGROUP) -> float | None:
    """CPUs the cgroup quota allows (None: no quota). cgroup v2's ``cpu.max`` (``"max 100000"``
    when unlimited) or v1's ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (quota -1 when
    unlimited), for the cgroup this process sees at ``root`` (a container's own namespace)."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    for base in (root / "cpu,cpuacct", root / "cpu"):
        try:
            quota = int((base / "cpu.cfs_quota_us").read_text())
            period = int((base / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        return None if quota <= 0 or period <= 0 else quota / period
    return None


def usable_cpus(root: Path = CGROUP) -> int:
    """CPUs to size thread pools by: the affinity mask's count, capped by the cgroup quota."""
    n = _affinity()
    quota = cgroup_quota(root)
    return max(1, min(n, math.ceil(quota))) if quota else max(1, n)
