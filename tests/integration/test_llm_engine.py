"""The swa engine end to end (scheduler + runner + sampler + detokenizer) against transformers,
and the caching-on vs caching-off oracle under eviction pressure."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import StoppingCriteriaList

from llm_svc.types.request import GenOutput, RequestStream
from llm_svc.backends.hf import generate_kwargs, generation_config, media_rows_injected
from mmserve.testing.in_process import InProcessEngine
from llm_svc.engine.engine import Engine
from llm_svc.engine.model_runner import ModelRunner
from llm_svc.engine.scheduler import Scheduler, SchedulerConfig
from tests.conftest import SMALL_W
from llm_svc.models import build_model
from llm_svc.types.request import PreparedRequest
from shared.schemas import SamplingParams

pytestmark = pytest.mark.integration
W = SMALL_W


class ListStream(RequestStream):
    """Collects outputs in a list (the engine is stepped synchronously in these tests)."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.outs: list[GenOutput] = []

    def put(self, out: GenOutput) -> None:
        self.outs.append(out)

    @property
    def done(self) -> bool:
        return bool(self.outs) and self.outs[-1].final

    @property
    def tokens(self) -> list[int]:
        return [t for o in self.outs for t in o.token_ids]

    @property
    def top(self) -> list[list[tuple[int, float]]]:
        """Per generated token, its ``top_logprobs`` alternatives as (id, logprob)."""
        return [[(a.token_id, a.logprob) for a in e.top] for o in self.outs for e in o.token_logprobs]


def make_engine(lm, num_full=4096, num_swa=None, **cfg) -> InProcessEngine:
    cfg.setdefault("max_batch_tokens", 64)
    config = SchedulerConfig(window=W, **cfg)
    num_swa = num_swa or config.min_swa_slots() * 4
    model = build_model(lm.arch, lm.model)
    engine = Engine(ModelRunner(model, num_full, num_swa), Scheduler(config, num_full, num_swa), lm.eos_token_ids)
    return InProcessEngine(engine, lm.tokenizer)


def run_to_end(engine: InProcessEngine, preps: list[PreparedRequest], max_steps: int = 5000) -> dict[str, ListStream]:
    streams = {p.request_id: ListStream(p.request_id) for p in preps}
    for p in preps:
        engine.submit(p, streams[p.request_id])
    for _ in range(max_steps):
        if all(s.done for s in streams.values()):
            break
        engine.step()
        engine.scheduler.check_integrity()
    assert all(s.done for s in streams.values()), "engine did not finish"
    return streams


def image_prep(lm, rid, n_text, img_at, seed, max_tokens=12, n_img=16, **sampling) -> PreparedRequest:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(20, lm.vocab_size, (n_text,), generator=g).tolist()
    spans, items, hashes = [], [], []
    if img_at is not None:
        ids[img_at:img_at] = [lm.pad_ids["image"]] * n_img
        spans, items, hashes = [(img_at, n_img, 0)], [torch.randn(n_img, lm.hidden_size, generator=g)], [f"img{seed}"]
    return PreparedRequest(
        request_id=rid, prompt_ids=ids, sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling),
        mm_items=items, mm_spans=spans, mm_hashes=hashes, bidirectional=lm.bidirectional_media and bool(spans),
    )


def hf_tokens(lm, prep: PreparedRequest) -> list[int]:
    """The reference: transformers generate, one request at a time (the hf backend's inputs)."""
    with torch.no_grad(), media_rows_injected(lm, prep):
        out = lm.model.generate(**generate_kwargs(lm, prep), generation_config=generation_config(lm, prep),
                                stopping_criteria=StoppingCriteriaList([]))
    return out[0, len(prep.prompt_ids):].tolist()


def workload(lm):
    return [
        image_prep(lm, "long", 150, None, 1),  # > 9 windows
        image_prep(lm, "img-early", 40, 3, 2),
        image_prep(lm, "img-late", 70, 50, 3),
        image_prep(lm, "short", 5, None, 4),
        image_prep(lm, "mid", 60, None, 5, max_tokens=20),
        image_prep(lm, "img-mid", 33, 17, 6),
    ]


@pytest.fixture(scope="module")
def references(mimo16, gemma16):
    return {arch: {p.request_id: hf_tokens(lm, p) for p in workload(lm)}
            for arch, lm in (("mimo", mimo16), ("gemma3", gemma16))}


@pytest.mark.parametrize("arch", ["mimo", "gemma3"])
@pytest.mark.parametrize("chunk", [16, 40, 256])
def test_concurrent_requests_match_transformers(arch, chunk, mimo16, gemma16, references):
    lm = mimo16 if arch == "mimo" else gemma16
    engine = make_engine(lm, max_batch_tokens=chunk)
    streams = run_to_end(engine, workload(lm))
    for rid, expected in references[arch].items():
        assert streams[rid].tokens == expected, rid
        assert streams[rid].outs[-1].finish_reason == "length"
    u = engine.scheduler.stats()
    assert u["full_free"] + u["full_cached"] == u["full_total"]  # nothing leaked
    assert u["swa_free"] + u["swa_cached"] == u["swa_total"]


def conversation_trace(lm, seed=0):
    """Rounds of requests: 3 system prompts x sessions whose turns grow (prompt = previous prompt
    + previous answer + new text), some with images; same text with a different image in
    another session."""
    rng = random.Random(seed)

    def text(n):
        return [rng.randrange(20, lm.vocab_size) for _ in range(n)]

    systems = [text(40), text(55), text(30)]
    sessions = [{"ids": list(systems[i % 3]), "spans": [], "items": [], "hashes": []} for i in range(8)]
    rounds = []
    for r in range(3):
        batch = []
        for i, s in enumerate(sessions):
            s["ids"] += text(rng.randint(3, 25))
            if r == 1 and i % 3 == 0:  # an image: sessions 0 and 3 share text but not the image
                g = torch.Generator().manual_seed(100 + i)
                s["spans"].append((len(s["ids"]), 16, len(s["items"])))
                s["items"].append(torch.randn(16, lm.hidden_size, generator=g))
                s["hashes"].append(f"img-{i}")
                s["ids"] += [lm.pad_ids["image"]] * 16
                s["ids"] += text(5)
            batch.append(PreparedRequest(
                request_id=f"s{i}-r{r}", prompt_ids=list(s["ids"]),
                sampling=SamplingParams(max_tokens=rng.randint(4, 10), ignore_eos=True),
                mm_items=list(s["items"]), mm_spans=list(s["spans"]), mm_hashes=list(s["hashes"]),
                bidirectional=lm.bidirectional_media and bool(s["spans"]),
            ))
        rounds.append(batch)
    return rounds, sessions


def run_trace(lm, enable_prefix_cache: bool):
    # pools far smaller than the trace's KV: whole-node and SWA-only evictions happen mid-run
    engine = make_engine(lm, num_full=700, num_swa=SchedulerConfig(window=W, max_batch_tokens=48).min_swa_slots() + 40,
                         max_batch_tokens=48, max_running=6, enable_prefix_cache=enable_prefix_cache)
    rounds, sessions = conversation_trace(lm)
    results = {}
    for batch in rounds:
        streams = run_to_end(engine, batch)
        for p in batch:
            results[p.request_id] = streams[p.request_id]
            i = int(p.request_id[1 : p.request_id.index("-")])
            sessions[i]["ids"] += streams[p.request_id].tokens  # the answer becomes part of the chat
    engine.scheduler.check_integrity()
    return results, engine


@pytest.mark.parametrize("arch", ["mimo", "gemma3"])
def test_prefix_cache_on_off_identical_under_eviction(arch, mimo16, gemma16):
    lm = mimo16 if arch == "mimo" else gemma16
    on, eng_on = run_trace(lm, True)
    off, _ = run_trace(lm, False)
    assert set(on) == set(off)
    for rid in on:
        assert on[rid].tokens == off[rid].tokens, rid
    cached = sum(s.outs[-1].cached_tokens for s in on.values())
    assert cached > 0 and all(s.outs[-1].cached_tokens == 0 for s in off.values())
    st = eng_on.scheduler.kv.tree.stats
    assert st["node_evictions"] > 0 and st["swa_evictions"] > 0, st


def test_stop_string_and_abort_free_everything(mimo16):
    lm = mimo16
    engine = make_engine(lm)
    free_run = run_to_end(engine, [image_prep(lm, "free", 30, None, 9, max_tokens=30)])["free"]
    text = "".join(o.text for o in free_run.outs)
    stop = text[6:9]
    p = image_prep(lm, "stop", 30, None, 9, max_tokens=30, stop=[stop])
    a = image_prep(lm, "gone", 50, None, 10, max_tokens=200)
    streams = {x.request_id: ListStream(x.request_id) for x in (p, a)}
    engine.submit(p, streams["stop"])
    engine.submit(a, streams["gone"])
    for _ in range(5):
        engine.step()
    engine.abort("gone")
    while not (streams["stop"].done and streams["gone"].done):
        engine.step()
        engine.scheduler.check_integrity()
    assert streams["gone"].outs[-1].finish_reason == "abort"
    assert streams["stop"].outs[-1].finish_reason == "stop"
    assert "".join(o.text for o in streams["stop"].outs) == text[: text.index(stop)]
    u = engine.scheduler.stats()
    assert u["running"] == u["waiting"] == 0
    assert u["full_free"] + u["full_cached"] == u["full_total"]


def test_min_tokens_masks_stop_tokens_until_reached(mimo16):
    """Greedy tokens t1..tn; with stop_token_ids=[t1, t2] the free run would stop at once, but
    min_tokens=4 masks both for four tokens: four tokens come out, none of them t1 or t2, and
    the usage count is what the client got. ignore_eos + max_tokens holds the length exactly."""
    lm = mimo16
    engine = make_engine(lm)
    free = run_to_end(engine, [image_prep(lm, "free", 30, None, 9, max_tokens=6)])["free"].tokens
    banned = free[:2]
    p = image_prep(lm, "min", 30, None, 9, max_tokens=4, min_tokens=4, stop_token_ids=banned)
    q = image_prep(lm, "nomin", 30, None, 9, max_tokens=4, stop_token_ids=banned)
    r = image_prep(lm, "len", 30, None, 9, max_tokens=13)
    s = run_to_end(engine, [p, q, r])
    assert len(s["min"].tokens) == 4 and not set(s["min"].tokens) & set(banned)
    assert s["min"].outs[-1].finish_reason == "length" and s["min"].outs[-1].completion_tokens == 4
    assert s["nomin"].tokens == free[:1] and s["nomin"].outs[-1].finish_reason == "stop"
    assert len(s["len"].tokens) == s["len"].outs[-1].completion_tokens == 13
    engine.scheduler.check_integrity()


def preempt_workload(lm):
    return [image_prep(lm, f"p{i}", 20 + 7 * i, 3 if i % 3 == 0 else None, 50 + i, max_tokens=40) for i in range(8)]


@pytest.fixture(scope="module")
def preempt_refs(mimo16):
    return {p.request_id: hf_tokens(mimo16, p) for p in preempt_workload(mimo16)}


@pytest.mark.parametrize("enable_prefix_cache", [True, False])
def test_preemption_with_recompute_keeps_greedy_outputs(mimo16, preempt_refs, enable_prefix_cache):
    """An SWA pool at its minimum with 8 long decodes: requests get preempted mid-decode and
    recompute prompt + outputs so far; the tokens still equal transformers' one at a time."""
    lm = mimo16
    preps = preempt_workload(lm)
    cfg = SchedulerConfig(window=W, max_batch_tokens=32)
    engine = make_engine(lm, num_full=2000, num_swa=cfg.min_swa_slots() + 10, max_batch_tokens=32, max_running=8,
                         enable_prefix_cache=enable_prefix_cache)
    streams = run_to_end(engine, preps)
    assert engine.scheduler.stats()["preemptions"] > 0
    for p in preps:
        assert streams[p.request_id].tokens == preempt_refs[p.request_id], p.request_id
        assert streams[p.request_id].outs[-1].completion_tokens == 40


def test_failed_step_fails_only_its_requests(mimo16):
    """A step that raises fails the requests in it; a waiting request is served afterwards."""
    engine = make_engine(mimo16, max_running=1)
    real_run = engine.runner.run

    def run(batch):
        if any(sf.req_id == "doomed" for sf in batch.seqs):
            raise RuntimeError("injected failure")
        return real_run(batch)

    engine.runner.run = run
    doomed, fine = image_prep(mimo16, "doomed", 30, None, 11), image_prep(mimo16, "fine", 30, None, 12)
    streams = {"doomed": ListStream("doomed"), "fine": ListStream("fine")}
    engine.submit(doomed, streams["doomed"])
    engine.submit(fine, streams["fine"])
    for _ in range(200):
        if all(s.done for s in streams.values()):
            break
        engine.step()
        engine.scheduler.check_integrity()
    assert "RuntimeError" in streams["doomed"].outs[-1].error
    assert streams["doomed"].outs[-1].error_status == 500
    assert streams["fine"].outs[-1].finish_reason == "length"
    assert streams["fine"].tokens == hf_tokens(mimo16, fine)
    assert engine.scheduler.stats()["running"] == 0
