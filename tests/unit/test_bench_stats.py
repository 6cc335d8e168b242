"""benchmarks._stats: one percentile definition (linear between closest ranks, the same as
``statistics.quantiles(method="inclusive")``) and the summary dict built from it."""

from __future__ import annotations

import random
import statistics

import pytest

from benchmarks._stats import percentile, scaled, summary

pytestmark = pytest.mark.unit


def test_percentile_known_answers():
    xs = [4.0, 1.0, 3.0, 2.0]  # sorted 1 2 3 4: position (n - 1) q / 100
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile(xs, 50) == 2.5
    assert percentile(xs, 90) == pytest.approx(3.7)
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None


def test_percentile_matches_statistics_inclusive_quantiles():
    rng = random.Random(0)
    for n in (2, 3, 10, 101, 1000):
        xs = [rng.expovariate(1.0) for _ in range(n)]
        cuts = statistics.quantiles(xs, n=100, method="inclusive")
        for q in (1, 50, 90, 99):
            assert percentile(xs, q) == pytest.approx(cuts[q - 1])


def test_percentile_refuses_fractions_of_one_passed_as_q():
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_scaled_and_summary():
    assert scaled(0.01234, 1000) == 12.3 and scaled(None, 1000) is None and scaled(0.5, 2, None) == 1.0
    s = summary([1.0, 2.0, 3.0, 4.0])
    assert s == {"n": 4, "p50": 2.5, "p90": 3.7, "p99": 3.97, "mean": 2.5, "max": 4.0}
    assert summary([0.001, 0.002], factor=1000, ndigits=1)["p50"] == 1.5
    assert summary([]) == {"n": 0, "p50": None, "p90": None, "p99": None, "mean": None, "max": None}
