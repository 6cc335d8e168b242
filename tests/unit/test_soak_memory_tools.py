"""The soak's memory tools: the opt-in tracemalloc report (``shared.memtrace``) names the site
that grew, the per-process reading and the slopes say what a known series says."""

from __future__ import annotations

import os
import subprocess
import sys
import tracemalloc

from benchmarks._proc_mem import memory_mb, slope_pct_per_30min, stack_processes, theil_sen_pct_per_30min
from shared import memtrace

_kept: list = []


def _grow(n: int) -> None:
    _kept.extend(bytearray(1000) for _ in range(n))


def test_growth_report_names_the_growing_line():
    tracemalloc.start(2)
    try:
        before = tracemalloc.take_snapshot()
        _grow(500)
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    top = memtrace.growth_report(before, after, top=1)
    assert len(top) == 1 and f"{__file__}:" in top[0] and float(top[0].split()[0]) >= 500  # KiB


def test_off_unless_asked(tmp_path):
    assert memtrace.maybe_start("x", environ={}) is None
    assert not memtrace.enabled({"MMSERVE_TRACEMALLOC": "0"}) and memtrace.enabled({"MMSERVE_TRACEMALLOC": "1"})


def test_report_file_in_a_fresh_process(tmp_path):
    """Tracing starts one interval in; the next report names what grew since."""
    code = ("import time; from shared import memtrace; memtrace.maybe_start('svc'); time.sleep(0.5); "
            "keep = [bytes(4000) for _ in range(300)]; time.sleep(1.0)")
    env = {**os.environ, "MMSERVE_TRACEMALLOC": "1", "MMSERVE_TRACEMALLOC_DIR": str(tmp_path),
           "MMSERVE_TRACEMALLOC_INTERVAL": "0.4"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60,
                   cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    (path,) = tmp_path.glob("svc-*.txt")
    report = path.read_text()
    assert report.startswith("== t=") and "<string>:1" in report and "since the first snapshot" in report


def test_slopes_of_known_series():
    ts = [float(t) for t in range(0, 600, 20)]
    flat = [100.0] * len(ts)
    rising = [100.0 + 0.001 * t for t in ts]  # 1.8 per 30 min on a mean of ~100.3
    assert slope_pct_per_30min(ts, flat) == 0.0 and theil_sen_pct_per_30min(ts, flat) == 0.0
    assert abs(slope_pct_per_30min(ts, rising) - 1.795) < 0.01
    spiked = list(rising)
    spiked[5] += 50  # one outlier sample moves the fit, not the median of slopes
    assert abs(theil_sen_pct_per_30min(ts, spiked) - 1.8) < 0.1


def test_process_tree_by_role():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        procs = stack_processes({"svc": os.getpid()}, llms={"svc"})
        assert procs["svc/front"] == os.getpid() and child.pid in procs.values()
        rss, uss = memory_mb(os.getpid())
        assert rss >= uss > 0
        assert memory_mb(2**22 + 7) is None
    finally:
        child.kill()
        child.wait()


def _point(t, requests, rss, pid=None, full=True):
    pid = pid or {name: 1 for name in rss}
    return {"t": t, "requests": requests, "pid": pid, "rss_mb": rss, "uss_mb": {k: v / 2 for k, v in rss.items()},
            "full": full}


def test_growth_after_warmup_fits_each_process_from_the_cut():
    from benchmarks.soak import growth_after_warmup

    series = []
    for k in range(60):  # 10 min: "front" flat after filling for the first 100 s, "core" leaking
        t = 10.0 * k
        series.append(_point(t, 10 * k, {"front": 100.0 + min(t, 100.0) / 10, "core": 200.0 + t / 100},
                             full=t >= 50))
    out = growth_after_warmup(series, minutes=10, warmup_minutes=None)
    assert out["warm_from_s"] == 200 and out["bounded_structures_full_at_s"] == 50  # a third of the run
    growth = out["growth_pct_per_30min_after_warmup"]
    assert growth["front"] == 0.0 and abs(growth["core"] - 100 * 18 / 204) < 0.2
    assert out["max_growth_process"] == "core" and out["max_growth_pct_per_30min"] == growth["core"]
    assert out["requests_after_warmup"] == 390


def test_growth_after_warmup_follows_a_restarted_process():
    from benchmarks.soak import growth_after_warmup

    series = [_point(10.0 * k, k, {"core": 300.0 - 100 * (k >= 30)}, pid={"core": 7 if k < 30 else 8})
              for k in range(60)]
    out = growth_after_warmup(series, minutes=10, warmup_minutes=1)
    # the old pid's samples (300 MB) are left out: the new process is flat at 200 MB
    assert out["growth_pct_per_30min_after_warmup"]["core"] == 0.0
    assert out["rss_mb_after_warmup"]["core"] == [200.0, 200.0]
