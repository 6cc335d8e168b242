"""Tiered KV (device -> host -> Redis) on the real engine and a real Redis: greedy tokens equal
with caching off, every tier exercised, replicas sharing one Redis, corrupt values and outages."""

from __future__ import annotations

import socket
import subprocess
import time
import uuid

import pytest
import redis

from llm_svc.attention import FULL, SLIDING
from mmserve.testing.in_process import InProcessEngine
from llm_svc.engine.engine import Engine
from llm_svc.engine.model_runner import ModelRunner
from llm_svc.engine.scheduler import Scheduler, SchedulerConfig
from llm_svc.models import build_model
from llm_svc.offload.host_kv import HostKV
from llm_svc.offload.l3 import PAGE, L3Store, chain_hashes, decode, encode, fingerprint
from llm_svc.offload.tiers import KVTiers
from llm_svc.types.request import PreparedRequest
from shared.schemas import SamplingParams
from tests.conftest import SMALL_W
from tests.integration.test_llm_engine import conversation_trace, run_to_end

pytestmark = pytest.mark.integration
W = SMALL_W
PAGE_TOKENS = 16
REDIS = "redis://127.0.0.1:6379/0"


def make_engine(lm, *, cache=True, host=(0, 0), l3_url=None, fp=None, num_full=700, extra_swa=40,
                prefetch_timeout=2.0, l3_timeout=0.5) -> InProcessEngine:
    cfg = SchedulerConfig(window=W, max_batch_tokens=48, max_running=6, enable_prefix_cache=cache,
                          l3_page_tokens=PAGE_TOKENS if l3_url else 0)
    num_swa = cfg.min_swa_slots() + extra_swa
    model = build_model(lm.arch, lm.model)
    sched = Scheduler(cfg, num_full, num_swa, num_host_full=host[0], num_host_swa=host[1])
    runner = ModelRunner(model, num_full, num_swa)
    tiers = None
    if host[0]:
        hkv = HostKV(runner.kv, [s.kind for s in model.layers], host[0], host[1])
        l3 = None
        if l3_url:
            l3 = L3Store(l3_url, fp, PAGE_TOKENS, W, hkv.token_bytes(FULL), hkv.token_bytes(SLIDING),
                         ttl_s=600, timeout_s=l3_timeout)
        tiers = KVTiers(sched.kv, hkv, l3, prefetch_timeout=prefetch_timeout)
    return InProcessEngine(Engine(runner, sched, lm.eos_token_ids, tiers=tiers), lm.tokenizer)


def drop_keys(fp: str, url: str = REDIS) -> None:
    r = redis.Redis.from_url(url)
    for k in r.scan_iter(match=f"mmkv:{{{fp}:*", count=1000):
        r.delete(k)


def flush_l3(engine: InProcessEngine) -> None:
    t = engine.engine.tiers
    if t is not None and t.l3 is not None:
        t.l3.flush()


def run_rounds(engine: InProcessEngine, lm, seed=0, rounds_to_run=None):
    rounds, sessions = conversation_trace(lm, seed)
    results = {}
    for r, batch in enumerate(rounds):
        if rounds_to_run is not None and r not in rounds_to_run:
            continue
        streams = run_to_end(engine, batch)
        flush_l3(engine)
        for p in batch:
            results[p.request_id] = streams[p.request_id]
    return results


@pytest.fixture
def fp():
    f = fingerprint({"test": uuid.uuid4().hex})
    yield f
    drop_keys(f)


def test_three_tiers_give_the_same_tokens_and_each_tier_serves(mimo16, fp):
    lm = mimo16
    off = run_rounds(make_engine(lm, cache=False), lm)
    dev = make_engine(lm, num_full=260)
    on_dev = run_rounds(dev, lm)
    host = make_engine(lm, num_full=260, host=(2000, 400))
    on_host = run_rounds(host, lm)
    full = make_engine(lm, num_full=260, host=(300, 80), l3_url=REDIS, fp=fp)
    on_full = run_rounds(full, lm)
    for rid in off:
        assert on_dev[rid].tokens == off[rid].tokens == on_host[rid].tokens == on_full[rid].tokens, rid
    cached = {name: sum(s.outs[-1].cached_tokens for s in res.values())
              for name, res in (("dev", on_dev), ("host", on_host), ("full", on_full))}
    assert cached["host"] > cached["dev"] > 0, cached  # the host tier turns evictions into hits
    st_host = host.engine.stats()
    assert st_host["tree_demoted_full"] > 0 and st_host["tree_loaded_full"] > 0, st_host
    st = full.engine.stats()
    assert st["tree_demoted_full"] > 0 and st["tree_host_evictions"] > 0, st  # device and host evicted
    # L3 hits bring full KV the tree lost, or just the SWA window it lacks (full KV still in a tier)
    assert st["l3_hits"] > 0 and st["l3_ingested_full"] + st["l3_ingested_swa"] > 0, st
    assert st["l3_pages_written"] > 0 and st["l3_windows_written"] > 0, st
    assert st["l3_errors"] == 0 and st["l3_corrupt"] == 0
    for e in (dev, host, full):
        e.scheduler.check_integrity()
        u = e.scheduler.stats()
        assert u["full_free"] + u["full_cached"] == u["full_total"]
        assert u["running"] == u["waiting"] == 0


def session_turns(lm, n_turns=2, seed=3):
    """One conversation: turn k's prompt = turn k-1's prompt + answer + new text."""
    import random

    rng = random.Random(seed)
    ids = [rng.randrange(20, lm.vocab_size) for _ in range(70)]
    return rng, ids


def test_next_turn_on_another_replica_hits_l3(mimo16, fp):
    lm = mimo16
    rng, ids = session_turns(lm)
    a = make_engine(lm, host=(1000, 300), l3_url=REDIS, fp=fp)
    b = make_engine(lm, host=(1000, 300), l3_url=REDIS, fp=fp)
    ref = make_engine(lm, cache=False)

    def prep(rid, prompt):
        return PreparedRequest(request_id=rid, prompt_ids=list(prompt),
                               sampling=SamplingParams(max_tokens=6, ignore_eos=True))

    t1 = run_to_end(a, [prep("t1", ids)])["t1"]
    flush_l3(a)
    turn2 = ids + t1.tokens + [rng.randrange(20, lm.vocab_size) for _ in range(9)]
    on_b = run_to_end(b, [prep("t2", turn2)])["t2"]
    want = run_to_end(ref, [prep("t2", turn2)])["t2"]
    assert on_b.tokens == want.tokens
    cached = on_b.outs[-1].cached_tokens
    assert cached >= (len(ids) // PAGE_TOKENS) * PAGE_TOKENS, cached  # the turn-1 prompt, page-aligned
    st = b.engine.stats()
    assert st["l3_hits"] == 1 and st["l3_ingested_full"] == cached and st["tree_loaded_full"] >= cached
    # the SWA-masked transfer: full KV for every token, SWA only for one window
    assert st["l3_ingested_swa"] == W
    b.scheduler.check_integrity()


@pytest.mark.parametrize("pages", [4, 5])
def test_the_same_page_aligned_prompt_on_another_replica_hits_l3(mimo16, fp, pages):
    """A prompt of exactly k pages, sent again to another replica (a P/D fallback, a retry): that
    request must compute its last token, so its lookup can use k - 1 pages, and finds the SWA
    window at that boundary too (written beside the one at k pages)."""
    import random

    lm = mimo16
    rng = random.Random(pages)
    ids = [rng.randrange(20, lm.vocab_size) for _ in range(pages * PAGE_TOKENS)]
    a = make_engine(lm, host=(1000, 300), l3_url=REDIS, fp=fp)
    b = make_engine(lm, host=(1000, 300), l3_url=REDIS, fp=fp)

    def prep(rid):
        return PreparedRequest(request_id=rid, prompt_ids=list(ids), sampling=SamplingParams(max_tokens=4,
                                                                                           ignore_eos=True))

    first = run_to_end(a, [prep("p1")])["p1"]
    flush_l3(a)
    again = run_to_end(b, [prep("p2")])["p2"]
    assert again.tokens == first.tokens
    assert again.outs[-1].cached_tokens == (pages - 1) * PAGE_TOKENS
    st = b.engine.stats()
    assert st["l3_hits"] == 1 and st["l3_ingested_swa"] == W
    a.scheduler.check_integrity()
    b.scheduler.check_integrity()


def test_corrupt_truncated_and_foreign_values_are_misses(mimo16, fp):
    lm = mimo16
    rng, ids = session_turns(lm, seed=5)
    a = make_engine(lm, host=(1000, 300), l3_url=REDIS, fp=fp)
    ref = make_engine(lm, cache=False)
    prompt = ids[:64] + [7]

    def prep(rid):
        return PreparedRequest(request_id=rid, prompt_ids=list(prompt), sampling=SamplingParams(max_tokens=5, ignore_eos=True))

    want = run_to_end(ref, [prep("r")])["r"].tokens
    run_to_end(a, [prep("w")])
    flush_l3(a)
    store = a.engine.tiers.l3
    hashes = chain_hashes(prompt[:64], PAGE_TOKENS)
    r = redis.Redis.from_url(REDIS)
    key = store.page_key(hashes, 2)
    good = r.get(key)
    payload = decode(good, PAGE, PAGE_TOKENS, fp, PAGE_TOKENS * store.full_token_bytes, key, store.peer)
    assert payload is not None
    # (value, whether it fails the HMAC): a tagged value of another model or size is no hit either
    bad_values = {
        "checksum": (good[:-1] + bytes([good[-1] ^ 0xFF]), True),
        "truncated": (good[: len(good) // 2], True),
        "other model": (encode(PAGE, PAGE_TOKENS, fingerprint({"other": 1}), payload, key, store.peer), False),
        "other dtype / page size": (encode(PAGE, PAGE_TOKENS, fp, payload[: len(payload) // 2], key, store.peer),
                                    False),
        "garbage": (b"not a kv page", True),
    }
    for i, (name, (value, forged)) in enumerate(bad_values.items()):
        r.set(key, value)
        fresh = make_engine(lm, host=(1000, 300), l3_url=REDIS, fp=fp)
        out = run_to_end(fresh, [prep(f"c{i}")])[f"c{i}"]
        st = fresh.engine.stats()
        assert st["l3_corrupt"] == 1 and st["l3_hits"] == 0, (name, st)
        assert st["l3_auth_failures"] == int(forged), (name, st)
        assert out.tokens == want, name
        assert out.outs[-1].cached_tokens == 0, name
    r.set(key, good)
    fresh = make_engine(lm, host=(1000, 300), l3_url=REDIS, fp=fp)
    out = run_to_end(fresh, [prep("ok")])["ok"]
    assert out.tokens == want and fresh.engine.stats()["l3_hits"] == 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(port: int) -> subprocess.Popen:
    p = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                          "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    r = redis.Redis(port=port)
    for _ in range(100):
        try:
            if r.ping():
                return p
        except redis.ConnectionError:
            time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


def test_redis_down_slow_and_back(mimo16, fp):
    lm = mimo16
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    srv = start_redis(port)
    try:
        rng, ids = session_turns(lm, seed=7)
        eng = make_engine(lm, host=(1000, 300), l3_url=url, fp=fp, prefetch_timeout=0.3, l3_timeout=0.2)
        ref = make_engine(lm, cache=False)

        def prep(rid, prompt):
            return PreparedRequest(request_id=rid, prompt_ids=list(prompt),
                                   sampling=SamplingParams(max_tokens=4, ignore_eos=True))

        prompts = [ids[: 40 + 9 * i] for i in range(4)]
        want = {f"p{i}": run_to_end(ref, [prep(f"p{i}", p)])[f"p{i}"].tokens for i, p in enumerate(prompts)}
        assert run_to_end(eng, [prep("p0", prompts[0])])["p0"].tokens == want["p0"]
        flush_l3(eng)
        srv.kill()
        srv.wait()
        # down: every request still served from device + host
        assert run_to_end(eng, [prep("p1", prompts[1])])["p1"].tokens == want["p1"]
        st = eng.engine.stats()
        assert st["l3_up"] == 0 and st["l3_errors"] >= 1, st
        # slow: a paused server answers nothing for 3 s; the lookup gives up, the request goes on
        srv = start_redis(port)
        redis.Redis(port=port).execute_command("CLIENT", "PAUSE", "3000", "ALL")
        time.sleep(1.0)  # past the outage backoff
        t0 = time.monotonic()
        assert run_to_end(eng, [prep("p2", prompts[2])])["p2"].tokens == want["p2"]
        assert time.monotonic() - t0 < 2.5
        time.sleep(3.5)
        # back: the store reconnects on its own and writes again
        before = eng.engine.stats()["l3_pages_written"]
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            assert run_to_end(eng, [prep("p3", prompts[3])])["p3"].tokens == want["p3"]
            flush_l3(eng)
            if eng.engine.stats()["l3_up"] == 1 and eng.engine.stats()["l3_pages_written"] > before:
                break
            time.sleep(0.5)
        st = eng.engine.stats()
        assert st["l3_up"] == 1 and st["l3_pages_written"] > before, st
        eng.scheduler.check_integrity()
    finally:
        srv.kill()
        srv.wait()


def test_redis_full_is_not_an_outage(mimo16, fp):
    """A Redis at maxmemory that refuses writes (noeviction): requests are served, the store
    stays up, refused writes are counted."""
    lm = mimo16
    port = free_port()
    srv = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                            "--appendonly", "no", "--maxmemory-policy", "noeviction"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        r = redis.Redis(port=port)
        for _ in range(100):
            try:
                r.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        r.set("filler", b"x" * (4 << 20))
        r.config_set("maxmemory", "2mb")  # now past maxmemory: every later write is refused
        eng = make_engine(lm, host=(1000, 300), l3_url=f"redis://127.0.0.1:{port}/0", fp=fp)
        ref = make_engine(lm, cache=False)
        rng, ids = session_turns(lm, seed=9)
        for i in range(3):
            p = PreparedRequest(request_id=f"f{i}", prompt_ids=ids[: 40 + 10 * i],
                                sampling=SamplingParams(max_tokens=4, ignore_eos=True))
            q = PreparedRequest(request_id=f"f{i}", prompt_ids=ids[: 40 + 10 * i],
                                sampling=SamplingParams(max_tokens=4, ignore_eos=True))
            assert run_to_end(eng, [p])[p.request_id].tokens == run_to_end(ref, [q])[q.request_id].tokens
            flush_l3(eng)
        st = eng.engine.stats()
        assert st["l3_rejected_writes"] >= 1 and st["l3_up"] == 1 and st["l3_errors"] == 0, st
    finally:
        srv.kill()
        srv.wait()
