"""``kv_dtype``: the KV pools take the chosen dtype, are sized by its bytes, and a bf16/fp16
pool gives logits close to the fp32 one (the same model, the same prompts)."""

from __future__ import annotations

import pytest
import torch

from llm_svc.core.build import build_engine
from mmserve.testing.in_process import InProcessEngine
from llm_svc.types.request import PreparedRequest
from shared.schemas import SamplingParams
from shared.settings import LLMSettings

pytestmark = pytest.mark.integration


class Sink:
    def __init__(self):
        self.outs = []

    def put(self, out):
        self.outs.append(out)


def run(lm, kv_dtype: str):
    settings = LLMSettings(model_dir=str(lm.spec.root), kv_bytes=8 * 1024 * 1024, kv_dtype=kv_dtype,
                           max_batch_tokens=64)
    engine = InProcessEngine(build_engine(settings, lm), lm.tokenizer)
    g = torch.Generator().manual_seed(3)
    sinks = {}
    for i in range(3):
        ids = torch.randint(20, lm.vocab_size, (40 + 30 * i,), generator=g).tolist()
        sinks[f"r{i}"] = Sink()
        engine.submit(PreparedRequest(f"r{i}", ids, SamplingParams(max_tokens=6, ignore_eos=True),
                                      return_logprobs=True), sinks[f"r{i}"])
    while engine.has_work():
        engine.step()
        engine.scheduler.check_integrity()
    return engine, {r: ([t for o in s.outs for t in o.token_ids], [x for o in s.outs for x in o.logprobs])
                    for r, s in sinks.items()}


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float16"])
def test_low_precision_kv_pools(mimo16, kv_dtype):
    ref_engine, ref = run(mimo16, "float32")
    engine, got = run(mimo16, kv_dtype)
    want = getattr(torch, kv_dtype)
    assert all(layer.k.dtype == want and layer.v.dtype == want for layer in engine.runner.kv)
    assert ref_engine.runner.kv[0].k.dtype == torch.float32
    # the same byte budget holds about twice the slots at half the bytes per slot
    assert engine.runner.num_full_slots >= 1.9 * ref_engine.runner.num_full_slots
    agree = sum(a == b for r in ref for a, b in zip(ref[r][0], got[r][0]))
    assert agree >= 15, (agree, ref, got)  # of 18: a random model may flip a near-tie
    first = [abs(ref[r][1][0] - got[r][1][0]) for r in ref]  # the first token's log-prob: same prefix
    assert max(first) < 0.05, first


@pytest.mark.parametrize("warmup", [True, False])
def test_build_engine_warms_the_linear_buckets_when_asked(mimo16, monkeypatch, warmup):
    """``warmup`` (the default) builds every row bucket's matmul primitive up to the step budget at
    start-up, with the engine's thread counts; off, nothing is built ahead."""
    from llm_svc.core import build

    calls = []
    monkeypatch.setattr(build, "warm_buckets", lambda rows, threads: calls.append((rows, threads)) or 0)
    settings = LLMSettings(model_dir=str(mimo16.spec.root), kv_bytes=8 * 1024 * 1024, max_batch_tokens=96,
                           warmup=warmup)
    build_engine(settings, mimo16)
    assert calls == ([(96, None)] if warmup else [])
    assert LLMSettings.model_fields["warmup"].default is True
