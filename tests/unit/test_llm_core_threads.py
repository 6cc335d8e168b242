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



def test_small_steps_run_on_fewer_threads_than_big_ones():
    import torch

    from llm_svc.core.process import step_threads
    from llm_svc.engine.step_threads import StepThreads

    plan = step_threads(LLMSettings(model_dir="m", threads=2, small_step_threads=1, small_step_tokens=64))
    assert plan == StepThreads(large=2, small=1, min_tokens=64, gemv=1, gemv_few=2, few_seqs=2)
    assert [plan.threads_for(n) for n in (1, 63, 64, 2048)] == [1, 1, 2, 2]
    before = torch.get_num_threads()
    try:
        assert plan.apply(16) == 1 and torch.get_num_threads() == 1
        assert plan.apply(512) == 2 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    same = step_threads(LLMSettings(model_dir="m", threads=3, small_step_threads=0))
    assert same.threads_for(1) == same.threads_for(4096) == 3


def test_few_row_kernel_threads_follow_the_steps_sequences():
    """A decode step of at most ``few_seqs`` sequences streams its weights on every core, a
    bigger one on ``gemv_threads``; the kernel's count is set by each step."""
    import torch

    from llm_svc.core.process import step_threads
    from llm_svc.models import cpu_gemv

    plan = step_threads(LLMSettings(model_dir="m", threads=2, gemv_threads=1))
    plan._load[:] = [0.2, float("inf")]  # an idle machine, read "just now" (never re-read here)
    before, gemv_before = torch.get_num_threads(), cpu_gemv._threads
    try:
        assert [plan.gemv_for(n) for n in (1, 2, 3, 16)] == [2, 2, 1, 1]
        plan.apply(1, 1)
        assert cpu_gemv._threads == 2
        plan.apply(4, 4)
        assert cpu_gemv._threads == 1
        plan.apply(4)  # no sequence count: the kernel's count is left alone
        assert cpu_gemv._threads == 1
        plan._load[0] = 1.7  # the other core is busy (another process): one thread, whatever the step
        assert [plan.gemv_for(n) for n in (1, 2, 3)] == [1, 1, 1]
        off = step_threads(LLMSettings(model_dir="m", threads=2, few_seqs=0, gemv_threads=1))
        assert off.gemv_for(1) == 1
        pinned = step_threads(LLMSettings(model_dir="m", threads=2, few_seqs_gemv_threads=1))
        assert pinned.gemv_for(1) == 1
    finally:
        torch.set_num_threads(before)
        cpu_gemv.set_threads(gemv_before)
    assert step_threads(LLMSettings(model_dir="m", device="cuda")) is None


def test_core_env_preloads_tcmalloc_only_when_asked_and_found(monkeypatch):
    from llm_svc.core import process

    monkeypatch.setattr(process, "find_tcmalloc", lambda: "/x/libtcmalloc_minimal.so.4")
    assert core_env({}, "auto")["LD_PRELOAD"] == "/x/libtcmalloc_minimal.so.4"
    assert core_env({"LD_PRELOAD": "/y/a.so"}, "auto")["LD_PRELOAD"] == "/x/libtcmalloc_minimal.so.4:/y/a.so"
    assert core_env({"LD_PRELOAD": "/z/libtcmalloc.so"}, "auto")["LD_PRELOAD"] == "/z/libtcmalloc.so"
    assert "LD_PRELOAD" not in core_env({}, "system")
    monkeypatch.setattr(process, "find_tcmalloc", lambda: None)
    assert "LD_PRELOAD" not in core_env({}, "auto")
