"""Speculative decoding served through the whole stack: an LLM service started with vLLM's
``--speculative-config`` JSON behind the gateway (n-gram drafts on the default tiny MiMo; MTP
drafts from every MTP layer of a published-layout MiMo-V2.5) answers greedy completions,
streamed and not, with exactly the text the engine writes without speculation; /readyz shows the
config in force and /metrics the drafts; a bad config is refused at start-up with a message that
names the field."""

from __future__ import annotations

import json
import os
import sys
import time

import httpx
import openai
import pytest
import torch

from llm_svc.core.build import build_engine
from mmserve.testing.in_process import InProcessEngine
from llm_svc.loading.loader import load_lm
from llm_svc.types.request import PreparedRequest
from mmserve.launcher import LocalStack, Service, StackSpec, free_port
from shared.schemas import SamplingParams
from shared.settings import LLMSettings
from tests.integration.test_llm_engine import run_to_end

pytestmark = pytest.mark.e2e
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
MTP = {"method": "mtp"}
# (bundle, config as sent, config as /readyz shows it)
RESOLVED = {"num_speculative_tokens_per_batch_size": None, "draft_policy": "auto"}  # what /readyz adds
CASES = {"ngram": (NGRAM, {**NGRAM, **RESOLVED}),
         "mtp": (MTP, {"method": "mtp", "num_speculative_tokens": 3, "prompt_lookup_min": 0, "prompt_lookup_max": 0,
                       **RESOLVED})}


def prompts(vocab: int) -> list[list[int]]:
    """Token-id prompts of repeated random phrases (what n-gram lookup drafts from)."""
    out = []
    for seed in range(4):
        g = torch.Generator().manual_seed(100 + seed)
        phrases = [torch.randint(20, vocab, (4 + seed,), generator=g).tolist() for _ in range(3)]
        ids: list[int] = []
        while len(ids) < 60 + 20 * seed:
            ids += phrases[int(torch.randint(0, 3, (1,), generator=g))]
        out.append(ids)
    return out


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, mimo_bundle, tmp_path_factory):
    if request.param == "ngram":
        return request.param, mimo_bundle
    from mmserve.tiny_model import write_tiny_model

    return request.param, write_tiny_model(tmp_path_factory.mktemp("b") / "tiny-v25", arch="mimo-v2.5")


@pytest.fixture(scope="module")
def stack(case, tmp_path_factory):
    name, bundle = case
    spec = StackSpec(model_dir=str(bundle), gateway_port=0, encoders=0,
                     extra_env={"MMSERVE_LLM_SPECULATIVE_CONFIG": json.dumps(CASES[name][0])})
    with LocalStack(spec, log_dir=tmp_path_factory.mktemp("stack-logs")) as s:
        s.wait_ready(timeout=240)
        yield s


@pytest.fixture(scope="module")
def plain_texts(case):
    """The same prompts on the engine without speculation."""
    bundle = case[1]
    lm = load_lm(str(bundle))
    engine = InProcessEngine(build_engine(LLMSettings(model_dir=str(bundle), speculative_config="off"), lm),
                             lm.tokenizer)
    assert engine.engine.speculator is None
    preps = [PreparedRequest(request_id=f"p{i}", prompt_ids=ids,
                             sampling=SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))
             for i, ids in enumerate(prompts(lm.vocab_size))]
    streams = run_to_end(engine, preps)
    return [("".join(o.text for o in streams[p.request_id].outs), lm.vocab_size) for p in preps]


def test_completions_equal_the_plain_engine_streamed_and_not(case, stack, plain_texts):
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", timeout=120, max_retries=0)
    vocab = plain_texts[0][1]
    for ids, (want, _) in zip(prompts(vocab), plain_texts):
        kw = dict(model=stack.model_name, prompt=ids, max_tokens=48, temperature=0, extra_body={"ignore_eos": True})
        r = client.completions.create(**kw)
        assert r.choices[0].text == want
        assert r.usage.completion_tokens == 48
        pieces = [c.choices[0].text for c in client.completions.create(**kw, stream=True) if c.choices]
        assert "".join(pieces) == want
    llm = stack.llms[0].url
    ready = httpx.get(f"{llm}/readyz").json()
    assert ready["speculative_config"] == CASES[case[0]][1]
    metrics = httpx.get(f"{llm}/metrics").text

    def value(name: str) -> float:
        got = [float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(name + " ")]
        assert got, (name, metrics[-3000:])
        return got[0]

    assert value("mmserve_llm_spec_decode_num_drafts") > 0
    if case[0] == "ngram":  # (random MTP layers draft what they draft: only n-gram must hit here)
        assert value("mmserve_llm_spec_decode_num_accepted_tokens") > 0
    assert 'mmserve_llm_spec_decode_num_accepted_tokens_per_pos{position="0"}' in metrics


def test_bad_speculative_config_is_refused_at_start(mimo_bundle, tmp_path):
    port = free_port()
    svc = Service("llm", f"http://127.0.0.1:{port}",
                  [sys.executable, "-m", "mmserve.cli", "llm", "--model", str(mimo_bundle), "--port", str(port),
                   "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'],
                  dict(os.environ), tmp_path / "llm.log")
    svc.start()
    try:
        deadline = time.monotonic() + 120
        body = None
        while time.monotonic() < deadline:
            try:
                r = httpx.get(f"{svc.url}/readyz", timeout=1)
                body = r.json()
                if body.get("status") == "error":
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        assert body is not None and body["status"] == "error", body
        assert "num_speculative_tokens" in body["detail"] and "Traceback" not in body["detail"]
    finally:
        svc.stop()
