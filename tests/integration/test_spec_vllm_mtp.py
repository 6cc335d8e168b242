"""vLLM 0.32 (CPU) as the oracle of MiMo MTP speculative decoding with one MTP layer and k = 1
(vLLM's setting: its ``mimo_v2_mtp`` runs only ``model.mtp.layers.0``): on the same prompts,
greedy, float32, the same tokens as vLLM's and as ours with speculation off, and per request
the same drafts verified and accepted, step by step.

vLLM runs in its venv (a subprocess: ``LLM(..., speculative_config={"method": "mtp",
"num_speculative_tokens": 1}, per_request_spec_decode_metrics="detailed")``), which gives each
request's ordered per-step drafted / accepted counts (``CompletionOutput.spec_decode_metrics``),
and its ``vllm:spec_decode_*`` counters (``LLM.get_metrics()``), which must add up to them. Ours
is the service's engine (``build_engine`` with ``speculative_config`` ``{"method": "mtp",
"num_speculative_tokens": 1}``, which drafts with MTP layer 0 of the checkpoint's 3) on all the
prompts in one batch, each request's drafts read before every step and its tokens after it, the
sums checked against its ``SpecStats`` step by step.

One documented difference: vLLM drafts at every step, also at the step that can emit only the
last token of ``max_tokens`` (an accepted draft there is cut from the output), where ours does
not draft (``Speculator.room``: never past ``max_tokens``). Such a step (at most one per request,
its last) is left out of vLLM's list before comparing; everything else is equal.

The checkpoint: MiMo-V2-Flash's published layout (``mmserve.tiny.mimo_published``) with qk head
dim = v head dim (vLLM's CPU build has no attention for qk != v: its diff-kv backends are
Triton-only), window 32 (the longest prompt and its output span several windows), 3 MTP layers.
Random MTP weights draft almost nothing the target accepts, so layer 0 is made to draft: the
embeddings are scaled up (the LM's residual stream is then led by its input token, a near-bigram
model) and layer 0's ``eh_proj`` passes the token embedding through (plus a random part over
both halves), its attention and MLP outputs halved: it predicts roughly the LM's next token after
its input token. About a quarter of the drafts are accepted (27 of 105); both outcomes are asserted."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from llm_svc.core.build import build_engine
from mmserve.testing.in_process import InProcessEngine
from llm_svc.loading.loader import load_lm
from llm_svc.types.request import PreparedRequest
from mmserve.cli import CACHE_DIR
from shared.schemas import SamplingParams
from shared.settings import LLMSettings
from mmserve.tiny import mimo_published as mp
from tests.integration.test_llm_engine import ListStream, run_to_end
from tests.integration.test_vllm_oracle import vllm_python  # noqa: F401  (the venv fixture)

pytestmark = [pytest.mark.integration, pytest.mark.vllm]
VLLM_MTP1 = {"method": "mtp", "num_speculative_tokens": 1}  # vLLM drafts every step
MTP1 = {**VLLM_MTP1, "draft_policy": "fixed"}  # ours too (the key is ours; vLLM refuses it)
WINDOW = 32
MAX_TOKENS = 24
PROMPT_LENS = (5, 17, 40, 64, 9, 30)
EMBED_SCALE, EH_NOISE, BLOCK_SCALE = 6.0, 0.5, 0.5

VLLM_SIDE = r"""
import json, os, sys

def main():
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    job = json.load(sys.stdin)
    llm = LLM(model=job["model"], dtype="float32", max_model_len=256, enforce_eager=True, seed=0, max_num_seqs=8,
              speculative_config=job["speculative_config"], per_request_spec_decode_metrics="detailed",
              disable_log_stats=False)
    sp = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]], sp, use_tqdm=False)
    res = {"requests": [], "metrics": {}}
    for o in outs:
        c = o.outputs[0]
        m = c.spec_decode_metrics
        res["requests"].append({"tokens": list(c.token_ids), "drafted": list(m.per_step_drafted),
                                "accepted": list(m.per_step_accepted)})
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            res["metrics"][m.name] = list(m.values) if hasattr(m, "values") else m.value
    print("\n" + json.dumps(res))

if __name__ == "__main__":
    main()
"""


def write_checkpoint(out: Path) -> Path:
    """The tiny MiMo-V2-Flash (qk = v = 32, window 32, 3 MTP layers) whose MTP layer 0 drafts
    tokens the target sometimes accepts (see the module doc). Seeded: identical on every run."""
    from safetensors.torch import load_file, save_file

    d = mp.write_mimo_published(out, replace(mp.FLASH, v_head_dim=32), sliding_window=WINDOW)
    st = load_file(str(d / "model.safetensors"))
    h = st["model.embed_tokens.weight"].shape[1]
    g = torch.Generator().manual_seed(1)
    st["model.embed_tokens.weight"] *= EMBED_SCALE
    p = "model.mtp.layers.0."
    eh = EH_NOISE * torch.randn(h, 2 * h, generator=g) / (2 * h) ** 0.5
    eh[:, :h] += torch.eye(h)  # cat(enorm(embed), hnorm(hidden)): the embedding half passes through
    st[p + "eh_proj.weight"] = eh.contiguous()
    st[p + "self_attn.o_proj.weight"] *= BLOCK_SCALE
    st[p + "mlp.down_proj.weight"] *= BLOCK_SCALE
    save_file(st, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(10, 600, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("mtp-oracle") / "flash-qk-v")


def _key(vllm_python: str, d: Path, job: dict, side: str = VLLM_SIDE) -> str:
    """Hash of what vLLM's answer depends on: the checkpoint's bytes, the job, the side's script
    and the venv's vLLM version stamp."""
    h = hashlib.sha256(json.dumps({k: v for k, v in job.items() if k != "model"}, sort_keys=True).encode())
    h.update(side.encode())
    h.update(" ".join(sorted(p.name for p in Path(vllm_python).parents[1].glob(".mmserve-vllm-*"))).encode())
    for f in sorted(d.iterdir()):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:24]


@pytest.fixture(scope="module")
def vllm_mtp(vllm_python, checkpoint) -> dict:  # noqa: F811
    """vLLM's tokens and per-step counts; kept under ~/.cache/mmserve/vllm-oracle keyed by all its
    inputs (a change to the checkpoint writer, prompts, script or vLLM reruns it)."""
    job = {"model": str(checkpoint), "prompts": prompts(), "max_tokens": MAX_TOKENS, "speculative_config": VLLM_MTP1}
    return run_vllm_job(vllm_python, VLLM_SIDE, job, checkpoint, "mtp", timeout=600)


def run_vllm_job(vllm_python: str, side: str, job: dict, model_dir: Path, name: str, timeout: int):
    """``side`` (a script reading ``job`` as JSON on stdin, its answer as JSON on its last line)
    run in vLLM's venv; the answer kept under ~/.cache/mmserve/vllm-oracle as ``name-<key>``."""
    cached = CACHE_DIR / "vllm-oracle" / f"{name}-{_key(vllm_python, model_dir, job, side)}.json"
    if cached.exists():
        return json.loads(cached.read_text())
    proc = subprocess.run([vllm_python, "-c", side], input=json.dumps(job), capture_output=True, text=True,
                          timeout=timeout, env={"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "HF_HUB_OFFLINE": "1",
                                                "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false",
                                                "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    if proc.returncode != 0:
        pytest.fail(f"vLLM failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_text(json.dumps(res))
    return res


def _engine(lm, d: Path, spec: dict | None) -> InProcessEngine:
    settings = LLMSettings(model_dir=str(d), kv_bytes=4 << 20, max_batch_tokens=256,
                           speculative_config=json.dumps(spec) if spec else "")
    return InProcessEngine(build_engine(settings, lm), lm.tokenizer)


def _preps(ps: list[list[int]]) -> list[PreparedRequest]:
    return [PreparedRequest(request_id=f"p{i}", prompt_ids=p, sampling=SamplingParams(max_tokens=MAX_TOKENS,
                                                                                      ignore_eos=True))
            for i, p in enumerate(ps)]


def _vllm_steps_ours_would_draft(req: dict, max_tokens: int = MAX_TOKENS) -> list[tuple[int, int]]:
    """vLLM's (drafted, accepted) per verify step, less a step that began with ``max_tokens - 1``
    output tokens (it can emit only the last one: ours does not draft there)."""
    out, n = [], 1  # the prefill step emits the first token (no draft verified)
    for i, (d, a) in enumerate(zip(req["drafted"], req["accepted"])):
        if n == max_tokens - 1:
            assert i == len(req["drafted"]) - 1, req  # only ever the request's last step
        else:
            out.append((d, a))
        n += 1 + a
    assert n >= max_tokens, req
    return out


def _run_recording(eng: InProcessEngine, preps: list[PreparedRequest]) -> tuple[dict, dict]:
    """Run ``preps`` together to the end -> (streams, per request its (drafted, accepted) per step
    that verified drafts): drafted = the drafts it held going into the step, accepted = the
    tokens the step emitted for it less one; each step's sums are checked against the engine's
    ``SpecStats`` deltas (what its ``/metrics`` counters report)."""
    streams = {p.request_id: ListStream(p.request_id) for p in preps}
    for p in preps:
        eng.submit(p, streams[p.request_id])
    stats = eng.engine.speculator.stats
    steps: dict[str, list[tuple[int, int]]] = {p.request_id: [] for p in preps}
    for _ in range(1000):
        if all(s.done for s in streams.values()):
            break
        held = {rid: len(r.spec_tokens) for rid, r in eng.scheduler.requests.items() if r.spec_tokens}
        before = {rid: len(s.tokens) for rid, s in streams.items()}
        totals = stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens
        eng.step()
        eng.scheduler.check_integrity()
        step = {rid: (d, len(streams[rid].tokens) - before[rid] - 1) for rid, d in held.items()}
        for rid, da in step.items():
            steps[rid].append(da)
        delta = (stats.num_drafts - totals[0], stats.num_draft_tokens - totals[1], stats.num_accepted_tokens - totals[2])
        assert delta == (len(step), sum(d for d, _ in step.values()), sum(a for _, a in step.values())), step
    assert all(s.done for s in streams.values()), "engine did not finish"
    return streams, steps


@pytest.mark.timeout(900)  # the first run also builds the vLLM venv and runs vLLM (about a minute)
def test_mtp_k1_tokens_and_per_step_acceptance_equal_vllms(checkpoint, vllm_mtp):
    lm = load_lm(str(checkpoint))
    assert len(lm.model.mtp) == 3
    ps = prompts()
    ref = vllm_mtp["requests"]
    assert len(ref) == len(ps)

    off = run_to_end(_engine(lm, checkpoint, None), _preps(ps))
    eng = _engine(lm, checkpoint, MTP1)
    sp = eng.engine.speculator
    # k = 1 drafts with the checkpoint's first MTP layer only, as vLLM's mimo_v2_mtp
    assert sp is not None and sp.mtp is not None and sp.mtp.k == 1 and sp.mtp.layers[0] is lm.model.mtp[0]
    on, ours = _run_recording(eng, _preps(ps))
    for i in range(len(ps)):
        assert on[f"p{i}"].tokens == off[f"p{i}"].tokens == ref[i]["tokens"], (i, on[f"p{i}"].tokens, ref[i]["tokens"])

    # per request, step by step: the same drafts verified and the same ones accepted
    total = {"drafts": 0, "accepted": 0, "vllm_last_step_drafts": 0}
    for i in range(len(ps)):
        want = _vllm_steps_ours_would_draft(ref[i])
        assert ours[f"p{i}"] == want, (i, ours[f"p{i}"], want)
        total["drafts"] += len(want)
        total["accepted"] += sum(a for _, a in want)
        total["vllm_last_step_drafts"] += len(ref[i]["drafted"]) - len(want)
    st = sp.stats
    assert (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens, st.accepted_per_pos) == (
        total["drafts"], total["drafts"], total["accepted"], [total["accepted"]])
    print(f"\n[vllm-mtp] k=1: {total['drafts']} drafts, {total['accepted']} accepted, equal per step on "
          f"{len(ps)} prompts ({total['vllm_last_step_drafts']} last-step drafts vLLM verified and ours does not)",
          file=sys.stderr)
    # both outcomes occur often, or equal counts would say little
    assert 10 <= total["accepted"] <= total["drafts"] - 10, total

    # vLLM's own counters add up to its per-request lists
    m = vllm_mtp["metrics"]
    assert m["vllm:spec_decode_num_drafts"] == sum(len(r["drafted"]) for r in ref)
    assert m["vllm:spec_decode_num_draft_tokens"] == sum(sum(r["drafted"]) for r in ref)
    assert m["vllm:spec_decode_num_accepted_tokens"] == sum(sum(r["accepted"]) for r in ref)
    assert m["vllm:spec_decode_num_accepted_tokens_per_pos"] == [sum(sum(r["accepted"]) for r in ref)]
