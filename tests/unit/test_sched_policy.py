"""Admission policies: FCFS order, compute-aware order (uncached work, cache hits, aging, the wait
bound), and both driven through the real scheduler on a simulated clock."""

from __future__ import annotations

import random

import pytest
import torch

from llm_svc.types.request import Request
from llm_svc.engine.sched_policy import ComputeAwarePolicy, FCFSPolicy, make_policy, uncached_tokens
from mmserve.testing.sched_sim import SimRunner
from llm_svc.engine.scheduler import Scheduler, SchedulerConfig
from shared.schemas import SamplingParams

pytestmark = pytest.mark.unit

NO_CACHE = lambda keys: 0  # noqa: E731


def req(rid: str, n_tokens: int, arrival: float, max_tokens: int = 2, base: int = 1, **kw) -> Request:
    prompt = [base + i for i in range(n_tokens)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival_time=arrival, **kw)


def ids(rs: list[Request]) -> list[str]:
    return [r.req_id for r in rs]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_sched(policy: str, clock: Clock, **cfg) -> tuple[Scheduler, SimRunner]:
    conf = SchedulerConfig(**{"max_batch_tokens": 16, "window": 4, **cfg, "policy": policy})
    sched = Scheduler(conf, 600, 200, clock=clock)
    return sched, SimRunner(lambda rid: sched.requests[rid], conf.window)


def step(sched: Scheduler, runner: SimRunner) -> list[str]:
    """One engine step; the ids in the batch."""
    batch = sched.schedule()
    if batch is None:
        return []
    sched.postprocess(batch, runner.run(batch))
    sched.check_integrity()
    return [sf.req_id for sf in batch.seqs]


# ---------------------------------------------------------------------------- ordering alone
def test_orders_by_uncached_tokens_when_arrivals_are_equal():
    rs = [req("a", 300, 5.0), req("b", 50, 5.0), req("c", 120, 5.0), req("d", 51, 5.0)]
    assert ids(ComputeAwarePolicy().order(rs, 5.0, NO_CACHE)) == ["b", "d", "c", "a"]
    # the cache hit counts: "a" is mostly cached, so it is the cheapest
    hit = lambda keys: 295 if len(keys) >= 299 else 0  # noqa: E731
    assert ids(ComputeAwarePolicy().order(rs, 5.0, hit)) == ["a", "b", "d", "c"]


def test_uncached_tokens_counts_outputs_and_skips_the_last_key():
    r = req("a", 10, 0.0)
    r.output_ids = [7, 8]
    seen = []
    assert uncached_tokens(r, lambda keys: seen.append(list(keys)) or 4) == 12 - 4
    assert seen == [r.all_keys[:-1]]


def test_fcfs_orders_by_arrival_with_preempted_first():
    rs = [req("late", 5, 3.0), req("early", 500, 1.0), req("mid", 50, 2.0), req("pre", 900, 9.0)]
    rs[3].num_preemptions = 1
    for now in (3.0, 1000.0):
        assert ids(FCFSPolicy().order(rs, now, NO_CACHE)) == ["pre", "early", "mid", "late"]
        assert ids(FCFSPolicy().order(rs, now, lambda k: len(k))) == ["pre", "early", "mid", "late"]
    # compute-aware keeps preempted requests first too
    assert ids(ComputeAwarePolicy().order(rs, 3.0, NO_CACHE))[0] == "pre"


def test_aging_lets_a_long_wait_beat_a_short_newcomer():
    pol = ComputeAwarePolicy(aging_tokens_per_s=10.0, max_wait_s=1000.0)
    long_r, short_r = req("long", 200, 100.0), req("short", 10, 101.0)
    assert ids(pol.order([long_r, short_r], 102.0, NO_CACHE)) == ["short", "long"]
    # long's key: arrival + 200/10 = 120; a short arriving after 119 goes behind it
    short_r.arrival_time = 119.5
    assert ids(pol.order([long_r, short_r], 120.0, NO_CACHE)) == ["long", "short"]
    short_r.arrival_time = 118.5
    assert ids(pol.order([long_r, short_r], 120.0, NO_CACHE)) == ["short", "long"]


@pytest.mark.parametrize("seed", range(5))
def test_never_overtaken_by_a_request_arriving_max_wait_later(seed):
    rng = random.Random(seed)
    pol = ComputeAwarePolicy(aging_tokens_per_s=rng.choice([1.0, 50.0, 1000.0]), max_wait_s=3.0, window=500)
    rs = [req(f"r{i}", rng.randint(1, 400), rng.uniform(0, 30)) for i in range(60)]
    order = pol.order(rs, 30.0, NO_CACHE)
    assert sorted(ids(order)) == sorted(ids(rs))
    for i, r in enumerate(order):
        for earlier in order[:i]:
            assert earlier.arrival_time <= r.arrival_time + 3.0 + 1e-9


def test_only_the_window_is_reordered():
    rs = [req(f"r{i}", 400 - 10 * i, float(i)) for i in range(6)]
    order = ids(ComputeAwarePolicy(aging_tokens_per_s=1e-3, max_wait_s=1e9, window=3).order(rs, 6.0, NO_CACHE))
    assert order == ["r2", "r1", "r0", "r3", "r4", "r5"]


def test_policy_validation():
    with pytest.raises(ValueError, match="unknown scheduling policy 'sjf'"):
        make_policy("sjf")
    for bad in (dict(aging_tokens_per_s=0), dict(max_wait_s=-1), dict(window=0)):
        with pytest.raises(ValueError, match="aging_tokens_per_s"):
            ComputeAwarePolicy(**bad)
    pol = make_policy("compute_aware", aging_tokens_per_s=5.0, max_wait_s=2.0)
    assert (pol.aging, pol.max_wait_s) == (5.0, 2.0)
    assert isinstance(make_policy("fcfs"), FCFSPolicy)


# ---------------------------------------------------------------------------- through the scheduler
@pytest.mark.parametrize("policy, first", [("compute_aware", "long_cached"), ("fcfs", "medium")])
def test_cached_long_prompt_is_admitted_before_an_uncached_medium_one(policy, first):
    clock = Clock()
    sched, runner = make_sched(policy, clock, max_running=1)
    warm = req("warm", 120, 0.0, max_tokens=1, base=1000)
    sched.add(warm)
    while sched.has_unfinished():
        step(sched, runner)
    clock.now = 10.0
    long_cached = Request("long_cached", warm.prompt_ids + [7, 8, 9], SamplingParams(max_tokens=2, ignore_eos=True),
                          arrival_time=9.5)
    medium = req("medium", 40, 9.5, base=5000)  # same arrival; queued first (FCFS keeps that on a tie)
    sched.add(medium)
    sched.add(long_cached)
    assert uncached_tokens(long_cached, sched.kv.tree.peek_match_len) < 10 < 40
    assert step(sched, runner) == [first]
    while sched.has_unfinished():
        step(sched, runner)
    assert long_cached.num_cached_tokens >= 110  # it really was a cache hit


def run_stream(policy: ComputeAwarePolicy | None, n_shorts: int = 60) -> tuple[float, float]:
    """One request at a time, a short (8 tokens) arriving every simulated second (1 s per step)
    plus one long (60 tokens) at t=0.5. Returns (long's wait until admission, time the short
    stream's last request was admitted)."""
    clock = Clock()
    sched, runner = make_sched("compute_aware", clock, max_running=1)
    if policy is not None:
        sched.policy = policy
    shorts = [req(f"s{i}", 8, float(i), base=100 * i + 7) for i in range(n_shorts)]
    long_r = req("long", 60, 0.5, max_tokens=1, base=90_000)
    arrivals = sorted(shorts + [long_r], key=lambda r: r.arrival_time)
    admitted: dict[str, float] = {}
    while arrivals or sched.has_unfinished():
        while arrivals and arrivals[0].arrival_time <= clock.now:
            sched.add(arrivals.pop(0))
        for rid in step(sched, runner):
            admitted.setdefault(rid, clock.now)
        clock.now += 1.0
    return admitted["long"] - long_r.arrival_time, max(admitted[s.req_id] for s in shorts)


def test_aging_admits_a_long_request_under_a_steady_stream_of_short_ones():
    # control: with (almost) no aging the long request waits for the whole stream
    wait, stream_end = run_stream(ComputeAwarePolicy(aging_tokens_per_s=1e-6, max_wait_s=1e9))
    assert wait > stream_end - 1
    # aging: its key is arrival + 60/10 s, so only the shorts that arrived in its first 6 s
    # (each served in 2 steps) go before it
    wait, stream_end = run_stream(ComputeAwarePolicy(aging_tokens_per_s=10.0, max_wait_s=1e9))
    assert wait <= 2 * 8 + 2 < stream_end / 2
    # the wait bound alone also does it, whatever the aging rate
    wait, _ = run_stream(ComputeAwarePolicy(aging_tokens_per_s=1e-6, max_wait_s=4.0))
    assert wait <= 2 * 6 + 2


def test_fcfs_through_the_scheduler_admits_in_arrival_order():
    clock = Clock()
    sched, runner = make_sched("fcfs", clock, max_running=1)
    rs = [req("a", 60, 0.0, base=1), req("b", 5, 0.1, base=200), req("c", 30, 0.2, base=400)]
    for r in rs:
        sched.add(r)
    order: list[str] = []
    while sched.has_unfinished():
        for rid in step(sched, runner):
            if rid not in order:
                order.append(rid)
        clock.now += 1.0
    assert order == ["a", "b", "c"]


@pytest.mark.parametrize("env, expected", [(None, ComputeAwarePolicy), ("fcfs", FCFSPolicy)])
def test_llm_settings_choose_the_engine_policy(mimo_bundle, monkeypatch, env, expected):
    from llm_svc.backends.swa import build_engine
    from llm_svc.loading.loader import load_lm
    from shared.settings import LLMSettings

    if env is not None:
        monkeypatch.setenv("MMSERVE_LLM_SCHEDULE_POLICY", env)
    settings = LLMSettings(model_dir=str(mimo_bundle), kv_bytes=8 * 1024 * 1024)
    lm = load_lm(str(mimo_bundle))
    engine = build_engine(settings, lm)
    assert isinstance(engine.scheduler.policy, expected)
    assert engine.scheduler.config.policy == (env or "compute_aware")
    with pytest.raises(ValueError, match="unknown scheduling policy 'lifo'"):
        build_engine(settings.model_copy(update={"schedule_policy": "lifo"}), lm)


@pytest.mark.parametrize("policy", [FCFSPolicy(), ComputeAwarePolicy()])
def test_vllm_priority_orders_admission_lower_first(policy):
    """``priority`` (vLLM's field, lower first) wins over arrival and over compute cost; equal
    priorities keep the policy's own order; preempted requests still come first."""
    def with_priority(rid, n, arrival, priority, **kw):
        r = req(rid, n, arrival, **kw)
        r.sampling = SamplingParams(max_tokens=2, ignore_eos=True, priority=priority)
        return r

    waiting = [with_priority("old-low", 8, 0.0, 5), with_priority("new-high", 64, 1.0, -1),
               with_priority("mid", 8, 0.5, 0), with_priority("mid2", 8, 0.6, 0)]
    order = ids(policy.order(waiting, 2.0, lambda keys: 0))
    assert order == ["new-high", "mid", "mid2", "old-low"]
    pre = with_priority("preempted", 8, 3.0, 9)
    pre.num_preemptions = 1
    assert ids(policy.order([*waiting, pre], 4.0, lambda keys: 0))[0] == "preempted"


def test_priority_crosses_the_engine_core_protocol():
    from llm_svc.core.convert import request_from_core, to_core_add
    from llm_svc.types.request import PreparedRequest

    prep = PreparedRequest(request_id="p", prompt_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=3, priority=-7))
    back = request_from_core(to_core_add(prep, epoch=1), "cpu", torch.float32, [0])
    assert back.sampling.priority == -7
