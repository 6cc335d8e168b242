"""Speculative decoding (n-gram drafts) in the swa engine: greedy outputs token for token the same
as without it, across chunked prefill, tight pools (evictions, preemption), the prefix cache on
and off, stop strings, stop tokens, ``min_tokens``, exact ``max_tokens`` and aborts in the middle
of a speculation; ``check_integrity()`` after every step; drafts really accepted."""

from __future__ import annotations

import pytest
import torch

from mmserve.testing.in_process import InProcessEngine
from llm_svc.engine.engine import Engine
from llm_svc.engine.model_runner import ModelRunner
from llm_svc.engine.scheduler import Scheduler, SchedulerConfig
from llm_svc.engine.speculate import Speculator
from llm_svc.models import build_model
from llm_svc.engine.spec import SpeculativeConfig
from llm_svc.types.request import PreparedRequest
from shared.schemas import SamplingParams
from tests.conftest import SMALL_W
from tests.integration.test_llm_engine import ListStream, conversation_trace, run_to_end

pytestmark = pytest.mark.integration
W = SMALL_W
# the mechanics' tests draft every step the lookup finds drafts ("fixed"): the automatic policy's
# k follows the machine's timing (its own test below checks it keeps the output exact)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
         "draft_policy": "fixed"}
NGRAM_FIXED = NGRAM
NGRAM_AUTO = {**NGRAM, "draft_policy": "auto"}


def make_engine(lm, spec: dict | None, num_full=4096, num_swa=None, **cfg) -> InProcessEngine:
    cfg.setdefault("max_batch_tokens", 64)
    config = SchedulerConfig(window=W, **cfg)
    num_swa = num_swa or config.min_swa_slots() * 4
    model = build_model(lm.arch, lm.model)
    sc = SpeculativeConfig.parse(spec)
    engine = Engine(ModelRunner(model, num_full, num_swa), Scheduler(config, num_full, num_swa), lm.eos_token_ids,
                    speculator=Speculator(sc, lm.eos_token_ids) if sc is not None else None)
    return InProcessEngine(engine, lm.tokenizer)


def looping_prep(lm, rid: str, n: int, pseed: int, max_tokens: int = 40, **sampling) -> PreparedRequest:
    """A prompt of a few random phrases repeated (text an n-gram lookup can draft from)."""
    g = torch.Generator().manual_seed(pseed)
    phrases = [torch.randint(20, lm.vocab_size, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g).tolist()
               for _ in range(4)]
    ids: list[int] = []
    while len(ids) < n:
        ids += phrases[int(torch.randint(0, 4, (1,), generator=g))]
    sampling.setdefault("ignore_eos", True)
    return PreparedRequest(request_id=rid, prompt_ids=ids[:n], sampling=SamplingParams(max_tokens=max_tokens, **sampling))


def workload(lm) -> list[PreparedRequest]:
    return [looping_prep(lm, f"r{i}", 12 + 23 * i, pseed=i, max_tokens=30 + 5 * (i % 3)) for i in range(6)]


def accepted(engine: InProcessEngine) -> int:
    return int(engine.engine.stats()["spec_num_accepted_tokens"])


@pytest.mark.parametrize("arch", ["mimo", "gemma3"])
@pytest.mark.parametrize("chunk", [16, 64])
def test_greedy_tokens_equal_without_speculation(arch, chunk, mimo16, gemma16):
    lm = mimo16 if arch == "mimo" else gemma16
    off = run_to_end(make_engine(lm, None, max_batch_tokens=chunk), workload(lm))
    eng = make_engine(lm, NGRAM, max_batch_tokens=chunk)
    on = run_to_end(eng, workload(lm))
    for rid in off:
        assert on[rid].tokens == off[rid].tokens, rid
        assert on[rid].outs[-1].completion_tokens == len(off[rid].tokens)
        assert "".join(o.text for o in on[rid].outs) == "".join(o.text for o in off[rid].outs)
    st = eng.engine.stats()
    assert st["spec_num_drafts"] > 0 and st["spec_num_accepted_tokens"] > 0, st
    assert st["spec_num_accepted_tokens"] <= st["spec_num_draft_tokens"]
    # a step emitted several tokens of one request: fewer steps than tokens
    assert eng.engine.steps < sum(len(s.tokens) for s in on.values())
    u = eng.scheduler.stats()
    assert u["running"] == u["waiting"] == 0 and u["full_free"] + u["full_cached"] == u["full_total"]


@pytest.mark.parametrize("enable_prefix_cache", [True, False])
def test_tight_pools_preempt_and_evict_with_the_same_tokens(mimo16, enable_prefix_cache):
    lm = mimo16
    cfg = SchedulerConfig(window=W, max_batch_tokens=32)
    kw = dict(num_full=900, num_swa=cfg.min_swa_slots() + 10, max_batch_tokens=32, max_running=8,
              enable_prefix_cache=enable_prefix_cache)
    preps = lambda: [looping_prep(lm, f"p{i}", 20 + 9 * i, pseed=40 + i, max_tokens=48) for i in range(8)]  # noqa: E731
    off = run_to_end(make_engine(lm, None, **kw), preps())
    eng = make_engine(lm, NGRAM, **kw)
    on = run_to_end(eng, preps())
    assert eng.scheduler.stats()["preemptions"] > 0
    assert accepted(eng) > 0
    for rid in off:
        assert on[rid].tokens == off[rid].tokens, rid


def test_prefix_cache_on_off_identical_with_speculation(mimo16):
    """A multi-turn trace under eviction pressure, speculation on in both runs."""
    lm = mimo16

    def run(enable_prefix_cache: bool):
        engine = make_engine(lm, NGRAM, num_full=700, num_swa=SchedulerConfig(window=W, max_batch_tokens=48)
                             .min_swa_slots() + 40, max_batch_tokens=48, max_running=6,
                             enable_prefix_cache=enable_prefix_cache)
        rounds, sessions = conversation_trace(lm)
        out = {}
        for batch in rounds:
            streams = run_to_end(engine, batch)
            for p in batch:
                out[p.request_id] = streams[p.request_id]
                i = int(p.request_id[1:p.request_id.index("-")])
                sessions[i]["ids"] += streams[p.request_id].tokens
        return out, engine

    on, eng_on = run(True)
    off, _ = run(False)
    for rid in on:
        assert on[rid].tokens == off[rid].tokens, rid
    assert sum(s.outs[-1].cached_tokens for s in on.values()) > 0
    assert accepted(eng_on) > 0
    st = eng_on.scheduler.kv.tree.stats
    assert st["node_evictions"] > 0, st


def test_stops_inside_a_burst_are_exact(mimo16):
    """Stop strings, stop token ids and max_tokens cut a burst of accepted drafts exactly where
    one token at a time would; min_tokens holds EOS-like stops back at every draft position."""
    lm = mimo16
    base = looping_prep(lm, "free", 40, pseed=10, max_tokens=40)
    free = run_to_end(make_engine(lm, None), [base])["free"]
    text = "".join(o.text for o in free.outs)
    toks = free.tokens
    cut = text[len(text) // 2:len(text) // 2 + 3]
    cases = {
        "stop_str": dict(stop=[cut]),
        "stop_tok": dict(stop_token_ids=[toks[25]]),
        "min_tok": dict(stop_token_ids=[toks[1], toks[2]], min_tokens=6),
        "len7": dict(),
    }

    def preps():
        return [looping_prep(lm, name, 40, pseed=10, max_tokens=7 if name == "len7" else 40, **kw)
                for name, kw in cases.items()]

    off = run_to_end(make_engine(lm, None), preps())
    eng = make_engine(lm, NGRAM)
    on = run_to_end(eng, preps())
    for rid in cases:
        assert on[rid].tokens == off[rid].tokens, rid
        assert on[rid].outs[-1].finish_reason == off[rid].outs[-1].finish_reason, rid
        assert "".join(o.text for o in on[rid].outs) == "".join(o.text for o in off[rid].outs), rid
    assert "".join(o.text for o in on["stop_str"].outs) == text[:text.index(cut)]
    assert len(on["len7"].tokens) == 7 and on["len7"].outs[-1].finish_reason == "length"
    assert accepted(eng) > 0


def test_abort_mid_speculation_frees_everything(mimo16):
    lm = mimo16
    eng = make_engine(lm, NGRAM_FIXED, max_batch_tokens=32)
    preps = [looping_prep(lm, f"a{i}", 30 + 10 * i, pseed=60 + i, max_tokens=200) for i in range(4)]
    streams = {p.request_id: ListStream(p.request_id) for p in preps}
    for p in preps:
        eng.submit(p, streams[p.request_id])
    steps = 0
    while accepted(eng) < 8 and steps < 400:
        eng.step()
        eng.scheduler.check_integrity()
        steps += 1
    assert any(r.spec_tokens for r in eng.scheduler.running), "no request holds drafts to abort"
    for p in preps[:2]:
        eng.abort(p.request_id)
    while not all(s.done for s in streams.values()):
        eng.step()
        eng.scheduler.check_integrity()
    assert [streams[p.request_id].outs[-1].finish_reason for p in preps] == ["abort", "abort", "length", "length"]
    u = eng.scheduler.stats()
    assert u["running"] == u["waiting"] == 0 and u["full_free"] + u["full_cached"] == u["full_total"]
    assert u["swa_free"] + u["swa_cached"] == u["swa_total"]


def test_logprobs_and_seeded_sampling_with_speculation(mimo16):
    """Greedy logprobs equal the plain run's at every position; a seeded sampled request with
    top-p runs to its exact length and reproduces itself."""
    lm = mimo16
    g = looping_prep(lm, "lp", 40, pseed=3, max_tokens=24)
    g.return_logprobs, g.top_logprobs = True, 2
    off = run_to_end(make_engine(lm, None), [g])["lp"]
    g2 = looping_prep(lm, "lp", 40, pseed=3, max_tokens=24)
    g2.return_logprobs, g2.top_logprobs = True, 2
    eng = make_engine(lm, NGRAM)
    on = run_to_end(eng, [g2])["lp"]
    assert on.tokens == off.tokens and accepted(eng) > 0
    lp_on = [x for o in on.outs for x in o.logprobs]
    lp_off = [x for o in off.outs for x in o.logprobs]
    assert len(lp_on) == len(lp_off) == 24
    assert lp_on == pytest.approx(lp_off, abs=1e-4)
    assert [[t for t, _ in e] for e in on.top] == [[t for t, _ in e] for e in off.top]

    def sampled():
        p = looping_prep(lm, "s", 40, pseed=5, max_tokens=30, temperature=1.0, top_p=0.9, seed=1234)
        return run_to_end(make_engine(lm, NGRAM), [p])["s"].tokens

    a, b = sampled(), sampled()
    assert len(a) == 30 and a == b



def test_penalties_bias_and_grammars_at_every_draft_position(mimo16):
    """Penalties over the tokens before each draft position, logit_bias, and a grammar's mask in
    the state after the drafts before it: the same tokens as one at a time, greedy; a grammar
    that completes inside a burst ends the request there."""
    import json

    from llm_svc.engine.grammar import GrammarCache
    from shared.schemas import StructuredSpec

    lm = mimo16
    regex = StructuredSpec(kind="regex", spec=r"(ab|cd){3,12}x")
    schema = StructuredSpec(kind="json", spec=json.dumps({"type": "object", "properties": {
        "k": {"type": "array", "items": {"enum": ["aa", "bb"]}, "maxItems": 6}}, "required": ["k"],
        "additionalProperties": False}), any_whitespace=False)
    cases = {
        "pen": dict(presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.2),
        "bias": dict(logit_bias={"30": 3.0, "31": 2.5}),
        "regex": dict(structured=regex, ignore_eos=False),
        "json": dict(structured=schema, ignore_eos=False),
    }

    def run(spec):
        eng = make_engine(lm, spec)
        eng.engine.grammars = GrammarCache(lm.tokenizer, lm.vocab_size, lm.eos_token_ids)
        preps = [looping_prep(lm, name, 40, pseed=10, max_tokens=60, **kw) for name, kw in cases.items()]
        return run_to_end(eng, preps), eng

    off, _ = run(None)
    on, eng = run(NGRAM)
    for rid in cases:
        assert on[rid].tokens == off[rid].tokens, rid
        assert on[rid].outs[-1].finish_reason == off[rid].outs[-1].finish_reason, rid
    text = {rid: "".join(o.text for o in on[rid].outs) for rid in ("regex", "json")}
    assert on["regex"].outs[-1].finish_reason == "stop" and text["regex"].endswith("x")
    assert set(json.loads(text["json"])) == {"k"}
    assert accepted(eng) > 0


# ---------------------------------------------------------------------------- MTP drafts
MTP = {"method": "mtp", "num_speculative_tokens": 3, "draft_policy": "fixed"}
MTP_FIXED = MTP  # every step all layers: the MTP KV as the dense chain's


@pytest.fixture(scope="module")
def mimo_mtp(tmp_path_factory):
    """The tiny published-layout MiMo-V2.5 (3 MTP layers), window 32: loaded with its MTP layers."""
    from llm_svc.loading.loader import load_lm
    from mmserve.tiny_model import write_tiny_model

    lm = load_lm(str(write_tiny_model(tmp_path_factory.mktemp("b") / "v25", arch="mimo-v2.5", sliding_window=32)))
    assert len(lm.model.mtp) == 3
    return lm


def make_mtp_engine(lm, spec, window, num_full=4096, num_swa=None, **cfg) -> InProcessEngine:
    from llm_svc.engine.mtp_runner import MTPRunner

    cfg.setdefault("max_batch_tokens", 64)
    config = SchedulerConfig(window=window, **cfg)
    num_swa = num_swa or config.min_swa_slots() * 4
    model = build_model(lm.arch, lm.model)
    runner = ModelRunner(model, num_full, num_swa)
    sc = SpeculativeConfig.parse(spec)
    speculator = None
    if sc is not None:
        sc = sc.with_mtp_layers(len(lm.model.mtp))
        mtp = MTPRunner(runner, lm.model.mtp[:sc.num_speculative_tokens], lm.model.get_input_embeddings(),
                        lm.model.get_output_embeddings(), model.window) if sc.method == "mtp" else None
        speculator = Speculator(sc, lm.eos_token_ids, mtp)
    engine = Engine(runner, Scheduler(config, num_full, num_swa), lm.eos_token_ids, speculator=speculator)
    return InProcessEngine(engine, lm.tokenizer)


@pytest.mark.parametrize("chunk", [7, 40], ids=["decode-form", "prefill-form"])  # MTP attention of <= 8 rows / more
def test_mtp_drafts_equal_the_dense_chain(mimo_mtp, chunk):
    """While a sequence is shorter than the window, the MTP layers' paged KV gives exactly the
    drafts of the dense teacher-forced chain (``mimo_mtp.chain``) over its committed tokens and
    the drafts before each: layer k's last row -> draft k + 1, at every step (chunked prefill
    with chunk ends mid-prompt, verified bursts, rejected drafts recomputed)."""
    from llm_svc.models.mimo_reference import lm_hidden
    from llm_svc.models.mimo_mtp import chain

    lm = mimo_mtp
    eng = make_mtp_engine(lm, MTP_FIXED, 32, max_batch_tokens=chunk)
    p = looping_prep(lm, "m", 15, pseed=2, max_tokens=14)
    s = ListStream("m")
    eng.submit(p, s)
    checked = 0
    m = lm.model
    while not s.done:
        eng.step()
        eng.scheduler.check_integrity()
        req = eng.scheduler.requests.get("m")
        if req is None or not req.spec_tokens:
            continue
        ids = torch.tensor(req.all_ids + req.spec_tokens[:-1])
        with torch.no_grad():
            outs = chain(m.mtp, m.get_input_embeddings(), lm_hidden(m, ids), ids)
            n = req.num_tokens
            want = [int(m.lm_head(outs[k][n - 2]).argmax()) for k in range(len(req.spec_tokens))]
        assert req.spec_tokens == want, (n, req.spec_tokens, want)
        checked += 1
    assert checked >= 3
    assert eng.engine.stats()["spec_num_drafts"] >= 3


def test_mtp_layers_skip_the_prompt_rows_no_later_step_reads(mimo_mtp, monkeypatch):
    """The MTP layers are sliding layers: of a prompt longer than the window they run only over
    its last W + K positions. The drafts of every step are the ones every row would give (the
    rows skipped are never read), and far fewer rows run."""
    from llm_svc.engine.mtp_runner import MTPRunner

    lm = mimo_mtp

    def run():
        rows = []
        real = MTPRunner._layer

        def layer(self, k, mod, parts, prev, drafts):
            rows.append(sum(stop - lo for _, lo, stop, _ in parts))
            return real(self, k, mod, parts, prev, drafts)

        with monkeypatch.context() as m:
            m.setattr(MTPRunner, "_layer", layer)
            eng = make_mtp_engine(lm, MTP_FIXED, 32, max_batch_tokens=24)
            s = ListStream("m")
            eng.submit(looping_prep(lm, "m", 150, pseed=4, max_tokens=12), s)
            drafts = []
            while not s.done:
                eng.step()
                eng.scheduler.check_integrity()
                req = eng.scheduler.requests.get("m")
                drafts.append(list(req.spec_tokens) if req is not None else None)
        return drafts, sum(rows), s.tokens

    skipped = run()
    monkeypatch.setattr(MTPRunner, "useful_from", lambda self, n: 0)
    every = run()
    assert skipped[0] == every[0] and any(skipped[0])  # the same drafts at every step
    assert skipped[2] == every[2]
    assert skipped[1] < every[1] - 2 * 100  # 3 layers over ~115 fewer prompt positions


@pytest.mark.parametrize("spec,enable_prefix_cache", [(MTP, True), (MTP, False), (NGRAM, True)])
def test_published_mimo_greedy_tokens_equal_without_speculation(mimo_mtp, spec, enable_prefix_cache):
    """The published-layout MiMo-V2.5: random MTP weights draft badly, n-gram drafts hit;
    whatever they draft, the tokens are the plain engine's, through chunked prefill, a window
    shorter than the contexts and tight pools."""
    lm = mimo_mtp
    cfg = SchedulerConfig(window=32, max_batch_tokens=24)
    kw = dict(num_full=1200, num_swa=cfg.min_swa_slots() + 24, max_batch_tokens=24, max_running=6,
              enable_prefix_cache=enable_prefix_cache)
    preps = lambda: [looping_prep(lm, f"q{i}", 20 + 17 * i, pseed=80 + i, max_tokens=40) for i in range(6)]  # noqa: E731
    off = run_to_end(make_mtp_engine(lm, None, 32, **kw), preps())
    eng = make_mtp_engine(lm, spec, 32, **kw)
    on = run_to_end(eng, preps())
    for rid in off:
        assert on[rid].tokens == off[rid].tokens, rid
    st = eng.engine.stats()
    assert st["spec_num_drafts"] > 0
    if spec is MTP:  # three layers: three drafts whenever max_tokens leaves room
        assert st["spec_num_draft_tokens"] >= 2 * st["spec_num_drafts"]
    else:
        assert st["spec_num_accepted_tokens"] > 0


def test_gpt_oss_greedy_tokens_equal_with_ngram(tmp_path):
    """gpt-oss (sinks, alternating sliding layers, MoE): n-gram speculation, same tokens."""
    from llm_svc.loading.loader import load_lm
    from mmserve.tiny_model import write_tiny_model

    lm = load_lm(str(write_tiny_model(tmp_path / "oss", arch="gpt-oss", sliding_window=W)))
    preps = lambda: [looping_prep(lm, f"o{i}", 18 + 21 * i, pseed=120 + i, max_tokens=36) for i in range(4)]  # noqa: E731
    off = run_to_end(make_engine(lm, None, max_batch_tokens=24), preps())
    eng = make_engine(lm, NGRAM, max_batch_tokens=24)
    on = run_to_end(eng, preps())
    for rid in off:
        assert on[rid].tokens == off[rid].tokens, rid
    assert accepted(eng) > 0


def test_sampled_outputs_keep_their_distribution(mimo16):
    """Temperature 1 with top-k 2, 400 seeds each: the tokens at every output position are
    distributed alike with and without n-gram speculation (drafts verified by the Leviathan-Chen
    rule, some accepted, some not). The rule itself is tested against the exact target
    distribution in tests/unit/test_spec_rejection.py; this is the engine's plumbing of it."""
    from collections import Counter

    lm = mimo16
    n = 400

    def run(spec):
        eng = make_engine(lm, spec, max_batch_tokens=256, max_running=64)
        preps = [looping_prep(lm, f"s{i}", 40, pseed=10, max_tokens=5, temperature=1.0, top_k=2, seed=i)
                 for i in range(n)]
        return run_to_end(eng, preps), eng

    off, _ = run(None)
    on, eng = run(NGRAM)
    st = eng.engine.stats()
    assert st["spec_num_drafts"] > 20 and 0 < st["spec_num_accepted_tokens"] < st["spec_num_draft_tokens"]
    for pos in range(5):
        a = Counter(s.tokens[pos] for s in off.values())
        b = Counter(s.tokens[pos] for s in on.values())
        tv = 0.5 * sum(abs(a[t] - b[t]) for t in a.keys() | b.keys()) / n
        assert tv < 0.15, (pos, tv, a.most_common(4), b.most_common(4))


def test_automatic_k_keeps_greedy_output_while_k_changes(mimo16):
    """The default policy (``draft_policy: auto``) picks k per request and step from its cost model
    and the requests' acceptance: under a load that rises (8 requests at once) and falls (the last
    ones alone), with tight pools (preemption) and the prefix cache, it uses more than one k, and
    every token is spec-off's."""
    lm = mimo16
    cfg = SchedulerConfig(window=W, max_batch_tokens=32)
    kw = dict(num_full=900, num_swa=cfg.min_swa_slots() + 10, max_batch_tokens=32, max_running=8,
              enable_prefix_cache=True)
    preps = lambda: [looping_prep(lm, f"p{i}", 20 + 9 * i, pseed=70 + i, max_tokens=12 + 10 * i)  # noqa: E731
                     for i in range(8)]
    off = run_to_end(make_engine(lm, None, **kw), preps())
    eng = make_engine(lm, NGRAM_AUTO, **kw)
    # a step whose every token costs as much as its fixed part (1 ms each): drafts pay for one or
    # two requests, not for eight (this tiny model's real steps would make every draft pay)
    eng.engine.speculator.policy.cost = FrozenCost(0.001, 0.001)
    on = run_to_end(eng, preps())
    for rid in off:
        assert on[rid].tokens == off[rid].tokens, rid
    st = eng.engine.stats()
    used = {k for k in range(5) if st.get(f"spec_steps_k{k}", 0) > 0}
    assert len(used) >= 2, st  # k changed between steps
    assert eng.engine.speculator.policy.name == "auto" and accepted(eng) > 0
    assert st["spec_cost_model_error"] >= 0


class FrozenCost:
    """A step cost ``a + b T`` that does not learn (the policy's ``StepCost`` interface)."""

    def __init__(self, a: float, b: float):
        self.a, self.b, self.n, self.err = a, b, 10**6, 0.0

    def coefficients(self):
        return self.a, self.b

    def predict(self, tokens: int) -> float:
        return self.a + self.b * tokens

    def observe(self, tokens: int, seconds: float) -> None:
        self.err = abs(self.predict(tokens) - seconds) / seconds
