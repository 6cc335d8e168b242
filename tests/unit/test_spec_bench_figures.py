"""``benchmarks.spec_decode``'s headline figures from known cells, and which checkpoints get vLLM
sides (vLLM 0.32's CPU build has no attention for qk head dim != v head dim)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from benchmarks import _spec_sides as sides
from benchmarks.spec_decode import min_auto_over_off, min_ours_spec_over_vllm_spec, targets
from mmserve.tiny_model import TRAINED_MIMO, TRAINED_MIMO_QKV


def _cell(**ratios) -> dict:
    return {"ratios": ratios}


RESULTS = {
    "chat": {"1": _cell(**{"ours-mtp_over_ours-off": 1.9, "ours_best_spec_over_vllm_best_spec": 1.5}),
             "16": _cell(**{"ours-mtp_over_ours-off": 0.95, "ours_best_spec_over_vllm_best_spec": 1.1})},
    "agent": {"1": _cell(**{"ours-ngram4_over_ours-off": 1.4, "ours-ngram4-fixed_over_ours-off": 0.5,
                            "ours_best_spec_over_vllm_best_spec": 1.3})},
}


def test_minimum_figures_over_traces_and_concurrencies():
    # the agent cell has no MTP side: its automatic n-gram counts, the fixed-k one does not
    assert min_auto_over_off(RESULTS) == 0.95
    assert min_ours_spec_over_vllm_spec(RESULTS) == 1.1
    t = targets(RESULTS, {})
    assert t["ours_spec_over_vllm_spec_ge_1.2"] == {"min": 1.1, "met": False}
    assert t["auto_over_off_ge_0.97"] == {"min": 0.95, "met": False}


def test_without_vllm_the_vllm_figure_is_none():
    no_vllm = {"chat": {"1": _cell(**{"ours-mtp_over_ours-off": 1.2, "ours_best_spec_over_vllm_best_spec": None})}}
    assert min_ours_spec_over_vllm_spec(no_vllm) is None


def test_vllm_sides_only_for_checkpoints_vllms_cpu_build_serves(tmp_path):
    args = SimpleNamespace(ngram_min=1, ngram_max=3, ngram_k=[4], vllm_ngram_k=[4], mtp=True, vllm=True)
    qkv = {s.name: s.skip for s in sides.side_list(args, TRAINED_MIMO_QKV) if s.engine == "vllm"}
    assert qkv == {"vllm-off": None, "vllm-ngram4": None, "vllm-mtp1": None}
    skipped = {s.name: s.skip for s in sides.side_list(args, TRAINED_MIMO) if s.engine == "vllm"}
    assert sorted(skipped) == ["vllm-mtp1", "vllm-ngram4", "vllm-off"]
    assert all("qk head dim != v head dim" in why for why in skipped.values())
    cfg = json.loads((TRAINED_MIMO_QKV / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "swa_v_head_dim": 16}))  # sliding layers' dims too
    assert sides.vllm_cpu_refusal(tmp_path) is not None
