"""vLLM 0.32 (CPU) against our engine on the committed *trained* tiny MiMo with qk head dim = v
head dim (``mmserve/tiny/trained_mimo_qkv``, ``--arch mimo-trained-qkv``): on text prompts (Python
source, the kind of text it was trained on), greedy, float32 from its bfloat16 weights,
``ignore_eos``:

* speculation off on both: the same tokens, prompt by prompt;
* vLLM's MTP (``{"method": "mtp", "num_speculative_tokens": 1}``: its ``mimo_v2_mtp`` drafts with
  MTP layer 0 only) against ours with the same config and a fixed k: the same tokens, and per
  request the same drafts verified and accepted, step by step (the one documented difference,
  vLLM's draft at a request's last step, is left out as in ``test_spec_vllm_mtp``); a trained MTP
  layer's drafts are mostly accepted;
* ours with all three MTP layers and the automatic draft length: the same tokens again.

The other trained checkpoint (``mmserve/tiny/trained_mimo``, qk 32 != v 16 as MiMo-V2-Flash's
192 / 128) is not served by vLLM's CPU build: ``mimo_v2.py`` picks ``TRITON_ATTN_DIFFKV`` for
unequal dims, and with no Triton CPU backend the first forward fails (``module 'triton' has no
attribute 'next_power_of_2'``). vLLM runs in its venv in a subprocess; its answers are cached
under ``~/.cache/mmserve/vllm-oracle`` keyed by every input."""

from __future__ import annotations

import json
import sys

import pytest

from llm_svc.loading.loader import load_lm
from llm_svc.types.request import PreparedRequest
from mmserve.tiny_model import TRAINED_MIMO_QKV
from shared.schemas import SamplingParams
from tests.integration.test_llm_engine import run_to_end
from tests.integration.test_spec_vllm_mtp import _engine, _run_recording, _vllm_steps_ours_would_draft, run_vllm_job
from tests.integration.test_vllm_oracle import vllm_python  # noqa: F401  (the venv fixture)

pytestmark = [pytest.mark.integration, pytest.mark.vllm]
MAX_TOKENS = 32
VLLM_MTP1 = {"method": "mtp", "num_speculative_tokens": 1}
# Python source of several lengths; the last one is longer than the sliding window (128 tokens)
PROMPTS = (
    "def __init__(self, name, value=None):\n        self.",
    "import os\nimport sys\n\n\ndef main(argv):\n    ",
    "class Queue:\n    \"\"\"A FIFO queue.\"\"\"\n\n    def __init__(self, maxsize=0):\n"
    "        self.maxsize = maxsize\n"
    "        self._init(maxsize)\n\n    def put(self, item, block=True, timeout=None):\n        ",
    "    def __repr__(self):\n        return '%s(%r)' % (self.__class__.__name__, ",
    "\n".join(f"    def get_{n}(self):\n        \"\"\"Return the {n}.\"\"\"\n        return self._{n}\n"
              for n in ("name", "value", "size", "mode", "path", "owner")) + "\n    def ",
)

VLLM_SIDE = r"""
import json, os, sys

def main():
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    job = json.load(sys.stdin)
    spec = job["speculative_config"]
    extra = {"speculative_config": spec, "per_request_spec_decode_metrics": "detailed"} if spec else {}
    llm = LLM(model=job["model"], dtype="float32", max_model_len=512, enforce_eager=True, seed=0, max_num_seqs=8,
              **extra)
    sp = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]], sp, use_tqdm=False)
    res = []
    for o in outs:
        c = o.outputs[0]
        m = c.spec_decode_metrics if spec else None
        res.append({"tokens": list(c.token_ids), "drafted": list(m.per_step_drafted) if m else None,
                    "accepted": list(m.per_step_accepted) if m else None})
    print("\n" + json.dumps(res))

if __name__ == "__main__":
    main()
"""


@pytest.fixture(scope="module")
def lm():
    return load_lm(str(TRAINED_MIMO_QKV))


@pytest.fixture(scope="module")
def prompts(lm) -> list[list[int]]:
    return [lm.tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]


def run_vllm(vllm_python: str, prompts: list[list[int]], spec: dict | None) -> list[dict]:  # noqa: F811
    """vLLM's tokens (and per-step drafted / accepted counts with ``spec``) on ``prompts``."""
    job = {"model": str(TRAINED_MIMO_QKV), "prompts": prompts, "max_tokens": MAX_TOKENS, "speculative_config": spec}
    return run_vllm_job(vllm_python, VLLM_SIDE, job, TRAINED_MIMO_QKV, "trained-qkv", timeout=900)


def _preps(ps: list[list[int]]) -> list[PreparedRequest]:
    return [PreparedRequest(request_id=f"p{i}", prompt_ids=p,
                            sampling=SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)) for i, p in enumerate(ps)]


@pytest.fixture(scope="module")
def ours_off(lm, prompts) -> list[list[int]]:
    streams = run_to_end(_engine(lm, TRAINED_MIMO_QKV, None), _preps(prompts))
    return [streams[f"p{i}"].tokens for i in range(len(prompts))]


@pytest.mark.timeout(1200)  # the first run also builds the vLLM venv and starts vLLM (a minute or two)
def test_greedy_spec_off_equals_vllms(vllm_python, lm, prompts, ours_off):  # noqa: F811
    cfg = json.loads((TRAINED_MIMO_QKV / "config.json").read_text())
    assert cfg["head_dim"] == cfg["v_head_dim"] and cfg["num_nextn_predict_layers"] >= 1
    ref = run_vllm(vllm_python, prompts, None)
    assert max(len(p) for p in prompts) > cfg["sliding_window_size"]  # one prompt spans the window
    for i in range(len(prompts)):
        assert ours_off[i] == ref[i]["tokens"], (i, lm.tokenizer.decode(ours_off[i]),
                                                 lm.tokenizer.decode(ref[i]["tokens"]))
    text = lm.tokenizer.decode(ours_off[0])
    assert text.isascii() and len(set(sum(ours_off, []))) > 8, text  # trained: text-like, not one repeated token


@pytest.mark.timeout(1200)
def test_mtp_k1_tokens_and_per_step_acceptance_equal_vllms(vllm_python, lm, prompts, ours_off):  # noqa: F811
    ref = run_vllm(vllm_python, prompts, VLLM_MTP1)
    eng = _engine(lm, TRAINED_MIMO_QKV, {**VLLM_MTP1, "draft_policy": "fixed"})  # ours drafts every step too
    sp = eng.engine.speculator
    assert sp is not None and sp.mtp is not None and sp.mtp.k == 1 and sp.mtp.layers[0] is lm.model.mtp[0]
    on, ours = _run_recording(eng, _preps(prompts))
    drafts = accepted = 0
    for i in range(len(prompts)):
        assert on[f"p{i}"].tokens == ours_off[i] == ref[i]["tokens"], i
        want = _vllm_steps_ours_would_draft(ref[i], MAX_TOKENS)
        assert ours[f"p{i}"] == want, (i, ours[f"p{i}"], want)
        drafts += len(want)
        accepted += sum(a for _, a in want)
    print(f"\n[vllm-mtp trained qk=v] k=1: {accepted}/{drafts} drafts accepted, equal per step on {len(prompts)} "
          f"prompts", file=sys.stderr)
    assert accepted >= 0.5 * drafts and accepted < drafts, (accepted, drafts)  # trained: mostly right, not always


def test_all_mtp_layers_with_the_automatic_k_keep_the_greedy_tokens(lm, prompts, ours_off):
    eng = _engine(lm, TRAINED_MIMO_QKV, {"method": "mtp"})
    assert eng.engine.speculator.mtp.k == len(lm.model.mtp) == 3
    streams = run_to_end(eng, _preps(prompts))
    assert [streams[f"p{i}"].tokens for i in range(len(prompts))] == ours_off
