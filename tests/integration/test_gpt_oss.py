"""gpt-oss in our engine against transformers' GptOssForCausalLM (same checkpoint), and an
unknown quantization refused at startup with a message (MXFP4: test_quantized_checkpoints.py)."""

from __future__ import annotations

import json
import sys
import shutil

import pytest
import torch

from llm_svc.loading.loader import load_lm
from llm_svc.models import build_model
from llm_svc.types.request import PreparedRequest
from shared.bundle import CheckpointError
from shared.schemas import SamplingParams
from mmserve.tiny.gpt_oss import write_gpt_oss
from tests.conftest import SMALL_W
from tests.integration.test_llm_engine import make_engine, run_to_end
from tests.unit.test_llm_runner import SlotSim, hf_logits, make_runner, run_chunked

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def oss_dir(tmp_path_factory):
    return write_gpt_oss(tmp_path_factory.mktemp("oss") / "gpt-oss", sliding_window=SMALL_W)


@pytest.fixture(scope="module")
def oss(oss_dir):
    return load_lm(str(oss_dir))


def test_published_config_keys_and_layer_geometry(oss_dir, oss):
    cfg = json.loads((oss_dir / "config.json").read_text())
    assert cfg["rope_scaling"]["rope_type"] == "yarn" and "rope_parameters" not in cfg
    assert cfg["experts_per_token"] == cfg["num_experts_per_tok"] and cfg["swiglu_limit"] == 7.0
    m = build_model(oss.arch, oss.model)
    assert [s.kind for s in m.layers] == ["sliding", "full"] * 3
    assert all(p.sinks is not None for p in m.params)  # sinks on every layer, full ones too


@pytest.mark.parametrize("chunk", [13])
def test_logits_match_transformers(oss, chunk):
    ids = torch.randint(10, 600, (90 + 8,), generator=torch.Generator().manual_seed(3)).tolist()
    ref = hf_logits(oss, ids)
    got = run_chunked(make_runner(oss), SlotSim(2048, 256, seed=chunk), "a", ids, chunk, 90)
    worst = max(float((logits - ref[p]).abs().max()) for p, logits in got.items())
    print(f"\n[transformers-oracle] gpt-oss: max |logit diff| {worst:.2e} over {len(got)} positions", file=sys.stderr)
    assert worst < 2e-4, worst


def test_greedy_matches_transformers(oss):
    g = torch.Generator().manual_seed(5)
    preps = [PreparedRequest(request_id=f"r{i}", prompt_ids=torch.randint(10, 600, (n,), generator=g).tolist(),
                             sampling=SamplingParams(max_tokens=12, ignore_eos=True))
             for i, n in enumerate((5, 40, 100))]
    streams = run_to_end(make_engine(oss), preps)
    distinct = set()
    for p in preps:
        with torch.no_grad():
            ref = oss.model.generate(torch.tensor([p.prompt_ids]), max_new_tokens=12, do_sample=False,
                                     pad_token_id=0)[0, len(p.prompt_ids):].tolist()
        assert streams[p.request_id].tokens == ref, p.request_id
        distinct |= set(ref)
    print(f"\n[transformers-oracle] gpt-oss: greedy equal {len(preps)}/{len(preps)}, {len(distinct)} distinct tokens",
          file=sys.stderr)
    assert len(distinct) > 8


def test_unknown_quantization_is_refused_with_a_message(oss_dir, tmp_path):
    """MXFP4 is served (tests/integration/test_quantized_checkpoints.py); other methods are refused."""
    d = shutil.copytree(oss_dir, tmp_path / "awq")
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"awq/config.json: field 'quantization_config.quant_method' = 'awq' "
                                              r"is not supported for this model \(supported: \['mxfp4'\]\)"):
        load_lm(str(d))
