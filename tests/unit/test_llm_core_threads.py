"""The engine core's torch threads (the setting when given, else every allowed CPU) and its
OpenMP spin bound (unless the user chose a wait policy)."""

import os

import pytest

from llm_svc.core.process import core_env, core_threads
from shared.settings import LLMSettings

pytestmark = pytest.mark.unit


def test_explicit_threads_win():
    assert core_threads(LLMSettings(model_dir="m", threads=3)) == 3


def test_default_uses_every_allowed_cpu():
    assert core_threads(LLMSettings(model_dir="m")) == len(os.sched_getaffinity(0))


def test_core_env_bounds_openmp_spinning_unless_the_user_chose():
    assert core_env({"PATH": "/bin"}) == {"PATH": "/bin", "GOMP_SPINCOUNT": "10000"}
    assert core_env({"OMP_WAIT_POLICY": "ACTIVE"}) == {"OMP_WAIT_POLICY": "ACTIVE"}
    assert core_env({"GOMP_SPINCOUNT": "5"}) == {"GOMP_SPINCOUNT": "5"}


def test_core_env_preloads_tcmalloc_with_bounded_thread_caches():
    from llm_svc.core.process import TCMALLOC_CACHE_BYTES, TCMALLOC_CACHE_VAR, find_tcmalloc

    lib = find_tcmalloc()
    assert lib is not None  # setup.sh installs libtcmalloc-minimal4
    env = core_env({"PATH": "/bin"}, malloc="auto")
    assert env["LD_PRELOAD"] == lib and env[TCMALLOC_CACHE_VAR] == str(TCMALLOC_CACHE_BYTES)
    assert core_env({TCMALLOC_CACHE_VAR: "1"}, malloc="auto")[TCMALLOC_CACHE_VAR] == "1"  # the user's wins
    assert TCMALLOC_CACHE_VAR not in core_env({"PATH": "/bin"}, malloc="system")



def test_small_steps_run_on_fewer_threads_than_big_ones():
    from dataclasses import replace

    import torch

    from llm_svc.core.process import step_threads
    from llm_svc.engine.step_threads import OtherLoad, StepThreads

    plan = step_threads(LLMSettings(model_dir="m", threads=2, small_step_threads=1, small_step_tokens=64))
    assert plan == StepThreads(large=2, small=1, min_tokens=64, gemv=2)
    assert [plan.threads_for(n) for n in (1, 63, 64, 2048)] == [1, 1, 2, 2]
    clock = [0.0]

    def quiet():  # a second later each call, only this process busy
        clock[0] += 1.0
        return clock[0], clock[0], clock[0]

    plan = replace(plan, cpus=2, others=OtherLoad(interval=0.0, sample=quiet))
    plan.others.cores()
    before = torch.get_num_threads()
    try:
        assert plan.apply(16) == 1 and torch.get_num_threads() == 1
        assert plan.apply(512) == 2 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    same = step_threads(LLMSettings(model_dir="m", threads=3, small_step_threads=0))
    assert same.threads_for(1) == same.threads_for(4096) == 3


def test_few_row_kernel_runs_on_every_core_while_one_is_spare():
    """The few-row kernel takes ``gemv_threads`` (every core by default) while the rest of the
    machine leaves a core spare, one thread otherwise; each step sets it."""
    from dataclasses import replace

    import torch

    from llm_svc.attention import cpu_paged
    from llm_svc.core.process import step_threads
    from llm_svc.engine.step_threads import OtherLoad
    from llm_svc.models import cpu_gemv

    busy = [0.2]  # cores the rest of the machine takes, as the fake /proc/stat reports it
    clock = {"wall": 0.0, "machine": 0.0, "own": 0.0}

    def sample():  # one second later each call: this process took 1 core, the others ``busy``
        clock["wall"] += 1.0
        clock["own"] += 1.0
        clock["machine"] += 1.0 + busy[0]
        return clock["wall"], clock["machine"], clock["own"]

    plan = replace(step_threads(LLMSettings(model_dir="m", threads=2)), cpus=2,
                   others=OtherLoad(interval=0.0, sample=sample))
    assert plan.gemv == 2
    assert plan.gemv_threads() == 1  # nothing measured yet: read as busy
    before, gemv_before = torch.get_num_threads(), cpu_gemv._threads
    try:
        assert plan.gemv_threads() == 2
        plan.apply(4)
        assert cpu_gemv._threads == 2 and torch.get_num_threads() == 1
        # the attention kernels take the same pool and count
        assert cpu_paged.pool() == (cpu_gemv.par_for_address(), 2) and cpu_paged.pool()[0] is not None
        busy[0] = 0.9  # the other core is busy (another process): one thread
        plan.apply(4)
        assert cpu_gemv._threads == 1
        assert cpu_paged.pool() == (None, 1)
        busy[0] = 0.7  # most of it: still a quarter core left for the helper
        assert plan.gemv_threads() == 2
        # a big step's torch threads: every core while they are spare, one while another process
        # holds a core (an OpenMP barrier would wait for the thread that lost it)
        busy[0] = 0.2
        assert plan.apply(2048) == 2 == torch.get_num_threads()
        busy[0] = 0.9
        assert plan.apply(2048) == 1 == torch.get_num_threads()
        assert plan.threads_for(2048) == 2  # the plan itself is unchanged
        pinned = replace(step_threads(LLMSettings(model_dir="m", threads=2, gemv_threads=1)), cpus=2,
                         others=OtherLoad(interval=0.0, sample=sample))
        assert [pinned.gemv_threads() for _ in range(3)] == [1, 1, 1]
    finally:
        torch.set_num_threads(before)
        cpu_gemv.set_threads(gemv_before)
        cpu_paged.use_pool(None, 1)
    assert step_threads(LLMSettings(model_dir="m", device="cuda")) is None


def test_other_load_is_the_rest_of_the_machine_not_this_process():
    """``OtherLoad`` subtracts this process's own CPU time from the machine's busy time, reads
    unknown as busy, and re-reads at most once per interval; the real reader gives a sample."""
    from llm_svc.engine.step_threads import OtherLoad, _cpu_sample

    samples = iter([(10.0, 100.0, 5.0), (12.0, 104.0, 8.0), None])
    load = OtherLoad(interval=0.0, sample=lambda: next(samples))
    assert load.cores() == float("inf")  # no interval measured yet
    assert load.cores() == 0.5  # 4 busy s over 2 s, 3 of them this process's
    assert load.cores() == float("inf")  # the reader failed
    cached = OtherLoad(interval=3600.0, sample=lambda: (0.0, 0.0, 0.0))
    cached._last, cached._value = (1e18, 0.0, 0.0), 0.25
    assert cached.cores() == 0.25  # inside the interval: not re-read
    real = _cpu_sample()
    assert real is not None and real[1] > 0 and real[2] > 0  # Linux: /proc/stat is there


def test_core_env_preloads_tcmalloc_only_when_asked_and_found(monkeypatch):
    from llm_svc.core import process

    monkeypatch.setattr(process, "find_tcmalloc", lambda: "/x/libtcmalloc_minimal.so.4")
    assert core_env({}, "auto")["LD_PRELOAD"] == "/x/libtcmalloc_minimal.so.4"
    assert core_env({"LD_PRELOAD": "/y/a.so"}, "auto")["LD_PRELOAD"] == "/x/libtcmalloc_minimal.so.4:/y/a.so"
    assert core_env({"LD_PRELOAD": "/z/libtcmalloc.so"}, "auto")["LD_PRELOAD"] == "/z/libtcmalloc.so"
    assert "LD_PRELOAD" not in core_env({}, "system")
    monkeypatch.setattr(process, "find_tcmalloc", lambda: None)
    assert "LD_PRELOAD" not in core_env({}, "auto")


def test_prefill_step_tokens_default_follows_the_device():
    from llm_svc.core.build import CPU_PREFILL_STEP_TOKENS, prefill_step_tokens

    assert prefill_step_tokens(LLMSettings(model_dir="m")) == CPU_PREFILL_STEP_TOKENS
    assert prefill_step_tokens(LLMSettings(model_dir="m", device="cuda")) == 0
    assert prefill_step_tokens(LLMSettings(model_dir="m", prefill_step_tokens=0)) == 0
    assert prefill_step_tokens(LLMSettings(model_dir="m", device="cuda", prefill_step_tokens=512)) == 512
