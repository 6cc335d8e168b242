"""vLLM 0.32 (CPU) as the second oracle for the LMs in their published layouts: greedy tokens
equal and logprobs within tolerance, our engine vs vLLM, on the same tiny checkpoints.

vLLM runs from its own venv (``scripts/vllm_venv.sh``, cached outside the clone) in a
subprocess (``scripts/vllm_oracle.py``) that writes JSON; one subprocess serves every model.
Geometry picked for vLLM's CPU build: qk head dim = v head dim (otherwise it picks a Triton-only
path), an even rotary dim, and sliding layers with their own KV heads
(``swa_num_key_value_heads``: V2-Flash doubles them, V2.5 keeps them)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from llm_svc.loading.loader import load_lm
from llm_svc.types.request import PreparedRequest
from mmserve.cli import CACHE_DIR
from shared.schemas import SamplingParams
from mmserve.tiny import mimo_published as mp
from mmserve.tiny.gpt_oss import write_gpt_oss
from tests.conftest import SMALL_W
from tests.integration.test_llm_engine import make_engine, run_to_end
from tests.unit.test_llm_runner import SlotSim, make_runner, run_chunked

pytestmark = [pytest.mark.integration, pytest.mark.vllm]
REPO = Path(__file__).resolve().parents[2]
MAX_TOKENS = 12
LOGPROB_ATOL = 2e-3
WRITERS = {
    "mimo-v2-flash": lambda d: mp.write_mimo_published(d, replace(mp.FLASH, v_head_dim=32), sliding_window=SMALL_W),
    "mimo-v2.5": lambda d: mp.write_mimo_published(d, replace(mp.V25, v_head_dim=32), sliding_window=SMALL_W),
    "gpt-oss": lambda d: write_gpt_oss(d, sliding_window=SMALL_W),
}


# greedy runs with each sampling knob on (vLLM's semantics are the oracle); biases on tokens the
# random model does emit, so that they change the path
VARIANT_MODEL = "mimo-v2-flash"
VARIANTS = {
    "repetition": {"repetition_penalty": 1.8},
    "frequency": {"frequency_penalty": 1.5},
    "presence": {"presence_penalty": 2.0},
    "bias": {"logit_bias": {"17": 8.0, "250": -100.0, "333": 5.5}},
    "mixed": {"repetition_penalty": 1.3, "frequency_penalty": 0.7, "presence_penalty": -0.5,
              "logit_bias": {"42": 3.0}},
}
# greedy under a grammar (vLLM's default whitespace), stopping at EOS: the same tokens as vLLM
STRUCTURED = {
    "json_schema": {"json": {"type": "object", "properties": {
        "kind": {"enum": ["cat", "dog", "fish"]}, "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"}, "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
        "required": ["kind", "age", "ok", "tags"], "additionalProperties": False}},
    "regex": {"regex": "[a-z]{2,5}-[0-9]{1,3}"},
    "choice": {"choice": ["alpha", "beta", "gamma delta"]},
    "grammar": {"grammar": 'root ::= "(" item ("," item)* ")"\nitem ::= [a-d]+ | "x"'},
}
STRUCTURED_MAX_TOKENS = 48


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(10, 600, (n,), generator=g).tolist() for n in (5, 40, 100)]


@pytest.fixture(scope="module")
def vllm_python() -> str:
    """The vLLM venv's python (built on first use by the script, then cached)."""
    out = subprocess.run(["bash", str(REPO / "scripts" / "vllm_venv.sh")], capture_output=True, text=True, timeout=1200)
    if out.returncode != 0:
        pytest.fail(f"scripts/vllm_venv.sh failed:\n{out.stderr[-3000:]}")
    return out.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vllm-ckpt")
    return {name: w(root / name) for name, w in WRITERS.items()}


def _inputs_key(vllm_python: str, checkpoints: dict[str, Path], jobs: list[dict]) -> str:
    """Hash of everything vLLM's answer depends on: every checkpoint byte, the jobs, the oracle
    script and the venv's vLLM version stamp."""
    h = hashlib.sha256(json.dumps([{**j, "model": j["name"]} for j in jobs], sort_keys=True).encode())
    h.update((REPO / "scripts" / "vllm_oracle.py").read_bytes())
    h.update(" ".join(sorted(p.name for p in Path(vllm_python).parents[1].glob(".mmserve-vllm-*"))).encode())
    for name, d in sorted(checkpoints.items()):
        for f in sorted(d.iterdir()):
            h.update(f"{name}/{f.name}".encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:24]


@pytest.fixture(scope="module")
def vllm_results(vllm_python, checkpoints, tmp_path_factory) -> dict:
    # trust_remote_code: the V2.5 directory's config class is its own configuration_mimo_v2.py, as on the hub
    jobs = [{"name": n, "model": str(d), "prompts": _prompts(), "max_tokens": MAX_TOKENS, "logprobs": 5,
             "trust_remote_code": (d / "configuration_mimo_v2.py").exists(),
             **({"variants": {**VARIANTS, **{f"so-{k}": {"structured_outputs": v, "max_tokens": STRUCTURED_MAX_TOKENS}
                                             for k, v in STRUCTURED.items()}}} if n == VARIANT_MODEL else {})}
            for n, d in checkpoints.items()]
    return run_vllm(vllm_python, checkpoints, jobs, tmp_path_factory.mktemp("vllm-run"))


def run_vllm(vllm_python: str, checkpoints: dict[str, Path], jobs: list[dict], work: Path) -> dict:
    """vLLM's answers to ``jobs``; kept under ~/.cache/mmserve/vllm-oracle keyed by a hash of all
    its inputs (the checkpoints are seeded, so a repeat run with unchanged writers reuses them and
    only our side is recomputed; any change to a checkpoint, prompt, script or vLLM reruns vLLM)."""
    cached = CACHE_DIR / "vllm-oracle" / f"{_inputs_key(vllm_python, checkpoints, jobs)}.json"
    if cached.exists():
        return json.loads(cached.read_text())
    (work / "jobs.json").write_text(json.dumps(jobs))
    proc = subprocess.run([vllm_python, str(REPO / "scripts" / "vllm_oracle.py"), str(work / "jobs.json"),
                           str(work / "out.json")], capture_output=True, text=True, timeout=1500,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "HF_HUB_OFFLINE": "1",
                               "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"})
    if proc.returncode != 0:
        pytest.fail(f"vLLM failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    results = json.loads((work / "out.json").read_text())
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_text(json.dumps(results))
    return results


@pytest.mark.timeout(1800)  # the first one also waits for vLLM (its start-up dominates)
@pytest.mark.parametrize("name", list(WRITERS))
def test_engine_matches_vllm(name, checkpoints, vllm_results):
    lm = load_lm(str(checkpoints[name]))
    prompts, ref = _prompts(), vllm_results[name]
    preps = [PreparedRequest(request_id=f"p{i}", prompt_ids=p, sampling=SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
             for i, p in enumerate(prompts)]
    streams = run_to_end(make_engine(lm), preps)
    equal, worst, distinct = 0, 0.0, set()
    for i, p in enumerate(prompts):
        want = ref[i]["tokens"]
        distinct |= set(want)
        equal += streams[f"p{i}"].tokens == want
        # teacher-forced on vLLM's tokens: our logprobs of vLLM's top-5 at every generated step
        ids = p + want
        got = run_chunked(make_runner(lm), SlotSim(2048, 256, seed=i), f"t{i}", ids, 32, len(p))
        for j, step in enumerate(ref[i]["logprobs"]):
            ours = torch.log_softmax(got[len(p) - 1 + j].float(), -1)
            worst = max(worst, max(abs(float(ours[int(t)]) - lp) for t, lp in step.items()))
    print(f"\n[vllm-oracle] {name}: greedy equal {equal}/{len(prompts)}, max |logprob diff| {worst:.2e}, "
          f"{len(distinct)} distinct tokens", file=sys.stderr)
    assert len(distinct) > 6  # outputs vary: a repeated token would prove little
    assert equal == len(prompts)
    assert worst < LOGPROB_ATOL


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_sampling_knobs_match_vllm(variant, checkpoints, vllm_results):
    """Greedy under each penalty and ``logit_bias``: the engine's tokens equal vLLM's, and the
    engine's ``top_logprobs`` (raw model, as vLLM's default) name vLLM's top-5 tokens with the
    same values along the path; each knob changes the path (else it would prove nothing)."""
    lm = load_lm(str(checkpoints[VARIANT_MODEL]))
    extra = dict(VARIANTS[variant])
    if "logit_bias" in extra:
        extra["logit_bias"] = {int(k): v for k, v in extra["logit_bias"].items()}
    prompts, ref, plain = _prompts(), vllm_results[f"{VARIANT_MODEL}/{variant}"], vllm_results[VARIANT_MODEL]
    preps = [PreparedRequest(request_id=f"p{i}", prompt_ids=p, return_logprobs=True, top_logprobs=5,
                             sampling=SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **extra))
             for i, p in enumerate(prompts)]
    streams = run_to_end(make_engine(lm), preps)
    assert [r["tokens"] for r in ref] != [r["tokens"] for r in plain]
    worst = 0.0
    for i in range(len(prompts)):
        s = streams[f"p{i}"]
        assert s.tokens == ref[i]["tokens"], (variant, i)
        for step, want in zip(s.top, ref[i]["logprobs"]):
            got = dict(step)
            # vLLM lists the top-5 plus the sampled token: ours holds the same top-5 ids
            top5 = sorted(want, key=lambda t: -want[t])[:5]
            assert set(map(str, got)) >= set(top5[:4]), (variant, i, got, want)
            worst = max(worst, max(abs(got[int(t)] - want[t]) for t in top5 if int(t) in got))
    assert worst < LOGPROB_ATOL


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("kind", list(STRUCTURED))
def test_structured_outputs_match_vllm(kind, checkpoints, vllm_results):
    """Greedy under a json schema, a regex, a choice and an EBNF grammar (vLLM's default
    whitespace, stopping at EOS): the engine's tokens equal vLLM's 0.32 (xgrammar) on each prompt."""
    from llm_svc.engine.grammar import GrammarCache
    from gateway.openai_api.requests import StructuredOutputs

    lm = load_lm(str(checkpoints[VARIANT_MODEL]))
    ref = vllm_results[f"{VARIANT_MODEL}/so-{kind}"]
    spec = StructuredOutputs.model_validate(STRUCTURED[kind]).spec()
    preps = [PreparedRequest(request_id=f"p{i}", prompt_ids=p,
                             sampling=SamplingParams(max_tokens=STRUCTURED_MAX_TOKENS, structured=spec))
             for i, p in enumerate(_prompts())]
    eng = make_engine(lm)
    eng.engine.grammars = GrammarCache(lm.tokenizer, lm.vocab_size, lm.eos_token_ids)
    streams = run_to_end(eng, preps)
    for i in range(len(preps)):
        assert streams[f"p{i}"].tokens == ref[i]["tokens"], (kind, i, lm.tokenizer.decode(streams[f"p{i}"].tokens),
                                                              lm.tokenizer.decode(ref[i]["tokens"]))


PROMPT_K = 5


@pytest.fixture(scope="module")
def vllm_prompt_results(vllm_python, checkpoints, tmp_path_factory) -> dict:
    d = checkpoints[VARIANT_MODEL]
    jobs = [{"name": VARIANT_MODEL, "model": str(d), "prompts": _prompts(), "max_tokens": 1, "logprobs": 1,
             "variants": {"prompt": {"prompt_logprobs": PROMPT_K}}}]
    return run_vllm(vllm_python, checkpoints, jobs, tmp_path_factory.mktemp("vllm-prompt"))


@pytest.mark.timeout(1800)
def test_prompt_logprobs_match_vllm(checkpoints, vllm_prompt_results):
    """vLLM's ``prompt_logprobs`` (none for the first token; then the prompt token's logprob and
    rank, and the top 5): the engine's equal them, ids equal and values within 1e-3, with a
    chunk of 16 tokens (the 40- and 100-token prompts span several; a chunk's last row scores
    the next chunk's first token)."""
    lm = load_lm(str(checkpoints[VARIANT_MODEL]))
    prompts, ref = _prompts(), vllm_prompt_results[f"{VARIANT_MODEL}/prompt"]
    preps = [PreparedRequest(request_id=f"p{i}", prompt_ids=p,
                             sampling=SamplingParams(max_tokens=1, ignore_eos=True, prompt_logprobs=PROMPT_K))
             for i, p in enumerate(prompts)]
    streams = run_to_end(make_engine(lm, max_batch_tokens=16), preps)
    worst = 0.0
    for i, p in enumerate(prompts):
        ours = next(o.prompt_logprobs for o in streams[f"p{i}"].outs if o.prompt_logprobs is not None)
        want = ref[i]["prompt_logprobs"]
        assert len(ours) == len(want) == len(p) and want[0] is None and ours[0].logprob is None
        for pos, (e, w) in enumerate(zip(ours[1:], want[1:]), start=1):
            lp, rank = w[str(p[pos])]
            assert e.rank == rank, (i, pos, e.rank, rank)
            top = sorted((t for t in w if w[t][1] <= PROMPT_K), key=lambda t: w[t][1])
            assert [str(a.token_id) for a in e.top] == top, (i, pos)
            worst = max([worst, abs(e.logprob - lp)] + [abs(a.logprob - w[str(a.token_id)][0]) for a in e.top])
    print(f"\n[vllm-oracle] prompt logprobs: max |diff| {worst:.2e}", file=sys.stderr)
    assert worst < 1e-3
