"""Model runner vs transformers: same logits through pool slots, chunked, batched, multimodal.

No scheduler here: a tiny slot simulator hands out shuffled slots and *recycles* SWA slots that
left the window, so reading anything outside the window would corrupt the logits.
"""

from __future__ import annotations

import random

import pytest
import torch

from llm_svc.attention import create_attention_backend
from llm_svc.attention.torch_batched import BucketPolicy, TorchBatchedAttention
from llm_svc.types.request import ForwardBatch, SeqForward
from llm_svc.engine.model_runner import ModelRunner
from tests.conftest import SMALL_W
from llm_svc.models import build_model

pytestmark = pytest.mark.unit
W = SMALL_W
ATOL = 2e-4


class SlotSim:
    """Hands out slots like the real allocator would (any order), frees SWA slots out of window."""

    def __init__(self, num_full: int, num_swa: int, seed: int = 0):
        rng = random.Random(seed)
        self.free_full = list(range(num_full))
        self.free_swa = list(range(num_swa))
        rng.shuffle(self.free_full)
        rng.shuffle(self.free_swa)
        self.full: dict[str, list[int]] = {}
        self.swa: dict[str, list[int]] = {}

    def seq(self, rid: str, tokens: list[int], start: int, need_logits: bool, mm_rows=(), mm_items=(),
            spans=()) -> SeqForward:
        full, swa = self.full.setdefault(rid, []), self.swa.setdefault(rid, [])
        end = start + len(tokens)
        assert len(full) == start
        for _ in range(start, end):
            full.append(self.free_full.pop())
            swa.append(self.free_swa.pop())
        s0 = max(0, start - W + 1)
        return SeqForward(  # the runner keeps the tables: only the new slots travel
            req_id=rid, token_ids=list(tokens), start=start,
            out_full_slots=full[start:end], out_swa_slots=swa[start:end], swa_ctx_start=s0, need_logits=need_logits,
            mm_rows=list(mm_rows), mm_items=list(mm_items), bidirectional_spans=list(spans),
        )

    def release(self, rid: str) -> None:
        """Free SWA slots no future query can see (positions < len - W + 1), put them at the
        front of the free list so they are reused first."""
        swa = self.swa[rid]
        for p in range(0, max(0, len(swa) - W + 1)):
            if swa[p] >= 0:
                self.free_swa.append(swa[p])
                swa[p] = -1


def hf_logits(lm, ids: list[int], embeds: torch.Tensor | None = None, token_type_ids=None) -> torch.Tensor:
    """transformers' own full forward: logits [T, V]."""
    with torch.no_grad():
        kw = {"attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
        if embeds is not None:
            kw["inputs_embeds"] = embeds[None]
        else:
            kw["input_ids"] = torch.tensor([ids])
        if token_type_ids is not None:
            kw["token_type_ids"] = token_type_ids[None]
        return lm.model(**kw).logits[0].float()


def make_runner(lm, num_full=2048, num_swa=256, attention="auto"):
    runner = ModelRunner(build_model(lm.arch, lm.model), num_full, num_swa)
    if attention == "blocks8":  # tiny query blocks: every chunk is cut, image spans straddle blocks
        runner.attn = TorchBatchedAttention(BucketPolicy(q_block=8))
    else:
        runner.attn = create_attention_backend(attention)
    return runner


def run_chunked(runner, sim, rid, ids, chunk, n_prompt, mm=None):
    """Prefill ``ids[:n_prompt]`` in chunks, then teacher-forced decodes; logits per position."""
    out = {}
    pos = 0
    while pos < len(ids):
        end = min(pos + chunk, n_prompt) if pos < n_prompt else pos + 1
        kw = mm(pos, end) if mm else {}
        sf = sim.seq(rid, ids[pos:end], pos, need_logits=True, **kw)
        out[end - 1] = runner.run(ForwardBatch([sf]))[rid]
        sim.release(rid)
        pos = end
    return out


@pytest.mark.parametrize("arch", ["mimo", "gemma3"])
@pytest.mark.parametrize("chunk", [5, 16, 37, 200])
def test_chunked_prefill_and_decode_match_transformers(arch, chunk, mimo16, gemma16):
    lm = mimo16 if arch == "mimo" else gemma16
    g = torch.Generator().manual_seed(1)
    n_prompt = 150  # > 9 windows of 16
    ids = torch.randint(10, lm.vocab_size, (n_prompt + 12,), generator=g).tolist()
    ref = hf_logits(lm, ids)
    runner, sim = make_runner(lm), SlotSim(2048, 256, seed=chunk)
    got = run_chunked(runner, sim, "a", ids, chunk, n_prompt)
    assert len(got) >= 12
    for p, logits in got.items():
        torch.testing.assert_close(logits, ref[p], atol=ATOL, rtol=1e-4)
        assert int(logits.argmax()) == int(ref[p].argmax())


def test_greedy_tokens_match_generate(mimo16):
    lm = mimo16
    ids = torch.randint(10, lm.vocab_size, (90,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        ref = lm.model.generate(torch.tensor([ids]), max_new_tokens=30, do_sample=False, eos_token_id=[])
    expected = ref[0, len(ids):].tolist()
    runner, sim = make_runner(lm), SlotSim(1024, 128)
    seq = list(ids)
    logits = runner.run(ForwardBatch([sim.seq("g", seq, 0, True)]))["g"]
    got = []
    for _ in range(30):
        tok = int(logits.argmax())
        got.append(tok)
        sim.release("g")
        logits = runner.run(ForwardBatch([sim.seq("g", [tok], len(seq), True)]))["g"]
        seq.append(tok)
    assert got == expected


@pytest.mark.parametrize("attention", ["torch", "torch_sdpa_loop", "blocks8", "sdpa", "cpu_flash"])
@pytest.mark.parametrize("arch", ["mimo", "gemma3"])
def test_mixed_batch_of_prefills_and_decodes(arch, attention, mimo16, gemma16):
    lm = mimo16 if arch == "mimo" else gemma16
    g = torch.Generator().manual_seed(3)
    seqs = {r: torch.randint(10, lm.vocab_size, (n,), generator=g).tolist()
            for r, n in (("a", 60), ("b", 45), ("c", 80), ("d", 30))}
    refs = {r: hf_logits(lm, ids) for r, ids in seqs.items()}
    runner, sim = make_runner(lm, 4096, 512, attention), SlotSim(4096, 512, seed=3)
    done = {r: 0 for r in seqs}
    prompt = {"a": 50, "b": 20, "c": 70, "d": 30}
    chunk = {"a": 50, "b": 7, "c": 23, "d": 11}
    checked = 0
    step = 0
    while any(done[r] < len(seqs[r]) for r in seqs):
        batch = []
        for r, ids in seqs.items():
            p = done[r]
            if p >= len(ids) or (r == "d" and step < 2):  # d arrives late
                continue
            end = min(p + chunk[r], prompt[r]) if p < prompt[r] else p + 1
            batch.append(sim.seq(r, ids[p:end], p, need_logits=end >= prompt[r]))
        random.Random(step).shuffle(batch)  # order inside a batch must not matter
        out = ForwardBatch(batch)
        res = runner.run(out)
        for sf in batch:
            end = sf.positions[-1] + 1
            if sf.need_logits:
                torch.testing.assert_close(res[sf.req_id], refs[sf.req_id][end - 1], atol=ATOL, rtol=1e-4)
                checked += 1
            else:
                assert sf.req_id not in res
            done[sf.req_id] = end
            sim.release(sf.req_id)
        step += 1
    assert checked >= 4 + 10 + 25 + 10


def test_mimo_image_rows_are_injected(mimo16):
    lm = mimo16
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(10, lm.vocab_size, (70,), generator=g).tolist()
    pad = lm.pad_ids["image"]
    s0, n = 20, 16
    ids[s0 : s0 + n] = [pad] * n
    item = torch.randn(n, lm.hidden_size, generator=g)
    with torch.no_grad():
        emb = lm.embed(torch.tensor(ids))
        emb[s0 : s0 + n] = item
    ref = hf_logits(lm, ids, embeds=emb)
    plain = hf_logits(lm, ids)

    def mm(start, end):
        rows = [(p - start, p - s0, 0) for p in range(max(start, s0), min(end, s0 + n))]
        return {"mm_rows": rows, "mm_items": [item] if rows else []}

    runner, sim = make_runner(lm), SlotSim(1024, 128, seed=4)
    got = run_chunked(runner, sim, "m", ids, 9, 70, mm=mm)  # chunks split the image: fine for causal
    torch.testing.assert_close(got[69], ref[69], atol=ATOL, rtol=1e-4)
    assert not torch.allclose(ref[69], plain[69], atol=1e-3)  # the image changed the output


@pytest.mark.parametrize("attention", ["torch", "torch_sdpa_loop", "blocks8", "sdpa", "cpu_flash"])
def test_gemma3_image_attends_bidirectionally(attention, gemma16):
    lm = gemma16
    g = torch.Generator().manual_seed(5)
    n_prompt, s0, n = 80, 30, 16
    ids = torch.randint(10, lm.vocab_size, (n_prompt,), generator=g).tolist()
    pad = lm.pad_ids["image"]
    ids[s0 : s0 + n] = [pad] * n
    item = torch.randn(n, lm.hidden_size, generator=g)
    with torch.no_grad():
        emb = lm.embed(torch.tensor(ids))
        emb[s0 : s0 + n] = item
    tt = torch.zeros(n_prompt, dtype=torch.long)
    tt[s0 : s0 + n] = 1
    ref = hf_logits(lm, ids, embeds=emb, token_type_ids=tt)
    causal = hf_logits(lm, ids, embeds=emb)
    assert not torch.allclose(ref, causal, atol=1e-3)

    def mm(start, end):
        rows = [(p - start, p - s0, 0) for p in range(max(start, s0), min(end, s0 + n))]
        spans = [(s0, s0 + n)] if rows else []
        return {"mm_rows": rows, "mm_items": [item] if rows else [], "spans": spans}

    # chunk boundaries at 25 and 50: the image (30..46) lies inside one chunk, as the scheduler keeps it
    runner, sim = make_runner(lm, attention=attention), SlotSim(1024, 128, seed=5)
    got = run_chunked(runner, sim, "i", ids, 25, n_prompt, mm=mm)
    for p in (49, 74, 79):
        torch.testing.assert_close(got[p], ref[p], atol=ATOL, rtol=1e-4)


def test_kv_tensor_shapes_follow_layer_geometry(mimo16):
    runner = make_runner(mimo16, 100, 50)
    kinds = [t for t in mimo16.model.config.layer_types]
    for layer_kv, t in zip(runner.kv, kinds):
        assert layer_kv.num_slots == (100 if t == "full_attention" else 50)
        assert layer_kv.k.shape[-1] == 24 and layer_kv.v.shape[-1] == 16  # qk 24, v 16
    # MiMo's sliding layers have twice the KV heads of its full layers (head-major pools)
    assert runner.kv[1].k.shape[0] == 2 * runner.kv[0].k.shape[0]


def test_gemma3_text_only_lm_with_softcaps():
    """Gemma3ForCausalLM (text checkpoints) incl. final logit soft-capping (transformers ignores
    attn_logit_softcapping for Gemma 3; so must we)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from llm_svc.models.gemma3 import Gemma3Model

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                           layer_types=["sliding_attention"] * 3 + ["full_attention"], num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, sliding_window=W, attn_logit_softcapping=5.0,
                           final_logit_softcapping=3.0, max_position_embeddings=512, attn_implementation="eager")
    hf = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.ndim == 1:
                p.normal_(0.0, 0.5)
    ids = torch.randint(0, 300, (60,), generator=torch.Generator().manual_seed(6)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert ref.abs().max() <= 3.0  # the final soft-cap is on
    runner, sim = ModelRunner(Gemma3Model(hf), 256, 64), SlotSim(256, 64, seed=6)
    got = run_chunked(runner, sim, "t", ids, 13, 50)
    for p, logits in got.items():
        torch.testing.assert_close(logits, ref[p], atol=ATOL, rtol=1e-4)


def test_gemma3_fused_layers_equal_the_eager_modules(gemma16):
    """On the CPU in float32 Gemma 3 runs its fused layers (q | k | v and gate | up GEMMs, C norm
    and rope passes); the eager module path gives the same logits, and the fused one is what
    ran (its norm weights were taken)."""
    from llm_svc.models.gemma3 import Gemma3Model

    lm = gemma16
    ids = torch.randint(10, lm.vocab_size, (70,), generator=torch.Generator().manual_seed(11)).tolist()
    outs = []
    for fused in (True, False):
        model = Gemma3Model(lm.model)
        assert model.fused
        model.fused = fused
        runner, sim = ModelRunner(model, 1024, 128), SlotSim(1024, 128, seed=11)
        outs.append(run_chunked(runner, sim, "f", ids, 23, 60))
    assert outs[0].keys() == outs[1].keys() and len(outs[0]) >= 10
    for p in outs[0]:
        torch.testing.assert_close(outs[0][p], outs[1][p], atol=1e-4, rtol=1e-4)


def test_table_reset_after_kv_moved_to_other_slots(mimo16):
    """A rewritten view (the scheduler switched a request to the prefix tree's slots): the KV
    now lives in other slots, the step sends a reset, and the logits are unchanged."""
    lm = mimo16
    ids = torch.randint(10, lm.vocab_size, (60,), generator=torch.Generator().manual_seed(7)).tolist()
    ref = hf_logits(lm, ids)
    runner, sim = make_runner(lm, 1024, 128), SlotSim(1024, 128, seed=7)
    run_chunked(runner, sim, "m", ids[:40], 16, 40)
    full, swa = sim.full["m"], sim.swa["m"]
    s0 = max(0, 40 - W + 1)
    new_full = [sim.free_full.pop() for _ in full]
    new_swa = [sim.free_swa.pop() for _ in range(s0, 40)]
    for layer, spec in zip(runner.kv, runner.model.layers):
        src, dst = (full, new_full) if spec.kind == "full" else (swa[s0:40], new_swa)
        for t in (layer.k, layer.v):
            t[:, dst] = t[:, src]
            t[:, src] = 0.0  # the old slots are gone: reading them would change the logits
    sim.full["m"], sim.swa["m"] = new_full, [-1] * s0 + new_swa
    sf = sim.seq("m", ids[40:41], 40, True)
    sf.reset_full, sf.reset_swa = new_full[:40], new_swa
    got = runner.run(ForwardBatch([sf]))["m"]
    torch.testing.assert_close(got, ref[40], atol=ATOL, rtol=1e-4)


def test_kv_dtype_is_separate_from_the_compute_dtype(mimo16):
    """bf16 pools under a float32 model: K/V are cast on write and read; logits stay close."""
    lm = mimo16
    ids = torch.randint(10, lm.vocab_size, (50,), generator=torch.Generator().manual_seed(8)).tolist()
    ref = hf_logits(lm, ids)
    runner = ModelRunner(build_model(lm.arch, lm.model), 512, 128, kv_dtype=torch.bfloat16)
    assert all(t.k.dtype == t.v.dtype == torch.bfloat16 for t in runner.kv)
    got = run_chunked(runner, SlotSim(512, 128, seed=8), "b", ids, 13, 45)
    for p, logits in got.items():
        torch.testing.assert_close(logits, ref[p], atol=5e-2, rtol=5e-2)
