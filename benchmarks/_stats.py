"""The one percentile every benchmark reports, and a summary dict built from it.

Definition: linear interpolation between the closest ranks (``statistics.quantiles(...,
method="inclusive")``, numpy's default, R type 7): the q-th percentile of n sorted values sits at
position ``(n - 1) * q / 100``. One value is every percentile of itself; no values give None.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def percentile(values: Iterable[float], q: float) -> float | None:
    """The ``q``-th percentile (0 <= q <= 100) of ``values``; None when there are none."""
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], not {q}")
    s = sorted(values)
    if not s:
        return None
    k = (len(s) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def scaled(x: float | None, factor: float = 1.0, ndigits: int | None = 1) -> float | None:
    """``round(x * factor, ndigits)`` (not rounded when ``ndigits`` is None), None through;
    seconds to ms: ``scaled(p, 1000)``."""
    if x is None:
        return None
    return x * factor if ndigits is None else round(x * factor, ndigits)


def summary(values: Iterable[float], qs: tuple[float, ...] = (50, 90, 99), factor: float = 1.0,
            ndigits: int = 3) -> dict:
    """``{"n", "p50", "p90", "p99", "mean", "max"}`` of ``values`` times ``factor``, rounded;
    with no values every figure but ``n`` is None."""
    xs = list(values)
    out: dict = {"n": len(xs)}
    for q in qs:
        out[f"p{q:g}"] = scaled(percentile(xs, q), factor, ndigits)
    out["mean"] = scaled(sum(xs) / len(xs), factor, ndigits) if xs else None
    out["max"] = scaled(max(xs), factor, ndigits) if xs else None
    return out
