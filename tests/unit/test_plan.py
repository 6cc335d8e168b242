"""``mmserve plan``: the byte formulas against hand-computed values on a tiny published-dialect
config, full vs sliding KV per token, layouts whose shapes do not divide, and the command on the
three published MiMo configs (table and ``--json`` agree)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mmserve import plan as P
from mmserve.cli import main

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = [ROOT / "benchmarks" / "configs" / f"{m}.config.json"
           for m in ("mimo-v2-flash", "mimo-v2.5", "mimo-v2.5-pro")]

# 1 full + 3 sliding layers; full: 4 heads / 2 KV heads, sliding: 4 / 4; dims 128 / 128; window 64;
# layer 0 dense (512), 3 MoE layers of 8 experts (256 wide), top-2; FP8 128x128; bf16 router
TINY = {
    "architectures": ["MiMoV2ForCausalLM"], "model_type": "mimo_v2", "vocab_size": 1024, "hidden_size": 256,
    "intermediate_size": 512, "moe_intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 128, "v_head_dim": 128, "swa_num_attention_heads": 4,
    "swa_num_key_value_heads": 4, "swa_head_dim": 128, "swa_v_head_dim": 128, "partial_rotary_factor": 0.5,
    "rope_theta": 10000, "swa_rope_theta": 10000, "sliding_window_size": 64, "hybrid_layer_pattern": [0, 1, 1, 1],
    "moe_layer_freq": [0, 1, 1, 1], "n_routed_experts": 8, "num_experts_per_tok": 2, "scoring_func": "sigmoid",
    "topk_method": "noaux_tc", "moe_router_dtype": "bfloat16", "add_full_attention_sink_bias": False,
    "add_swa_attention_sink_bias": True, "layernorm_epsilon": 1e-5, "num_nextn_predict_layers": 0,
    "tie_word_embeddings": False,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128]},
}


def _tiny(tmp_path: Path, **over) -> Path:
    p = tmp_path / "config.json"
    p.write_text(json.dumps({**TINY, **over}))
    return p


@pytest.fixture
def tiny(tmp_path):
    g, cfg = P.read_config(_tiny(tmp_path))
    return g, P.precision_for(cfg)


# by hand, TP 2, FP8 (e4m3 byte + a float32 scale per 128x128 block), bf16 elsewhere:
# full attention: qkv [2*128 + 1*(128+128), 256] = 512*256 + 4*2*4; o [256, 2*128] bf16
FULL_ATTN = 512 * 256 + 4 * 2 * 4 + 256 * 256 * 2
# sliding: qkv [2*128 + 2*256, 256] = 768*256 + 6*2*4; o as above; sinks 2 heads bf16
SWA_ATTN = 768 * 256 + 6 * 2 * 4 + 256 * 256 * 2 + 2 * 2
DENSE = 3 * (256 * 256 + 2 * 2 * 4)  # gate, up [256, 256]; down [256, 256]
EXPERT_SHARD = 2 * (128 * 256 + 1 * 2 * 4) + (256 * 128 + 2 * 1 * 4)  # gate, up [128, 256]; down [256, 128]
EXPERT_WHOLE = 3 * (256 * 256 + 2 * 2 * 4)
ROUTER = 3 * (8 * 256 + 8) * 2
EMBED = 512 * 256 * 2  # vocab 1024 / TP 2
NORMS = (2 * 4 + 1) * 256 * 2


def test_linear_bytes_fp8_counts_block_scales():
    fp8, bf16 = P.Precision(fp8=True), P.Precision(fp8=False)
    assert P.linear_bytes(1856, 4096, fp8) == 1856 * 4096 + 15 * 32 * 4  # 14.5 row blocks round up
    assert P.linear_bytes(1856, 4096, fp8, quantized=False) == 1856 * 4096 * 2
    assert P.linear_bytes(1856, 4096, bf16) == 1856 * 4096 * 2


def test_weights_per_rank_by_hand(tiny):
    g, p = tiny
    w = P.rank_weights(g, P.Layout(2), p)
    assert (w.embed, w.lm_head, w.norms, w.router, w.mtp) == (EMBED, EMBED, NORMS, ROUTER, 0)
    assert w.attention == FULL_ATTN + 3 * SWA_ATTN
    assert w.dense_mlp == DENSE
    assert w.experts == 3 * 8 * EXPERT_SHARD  # every expert, its half
    ep = P.rank_weights(g, P.Layout(2, ep=True), p)
    assert ep.experts == 3 * 4 * EXPERT_WHOLE  # half the experts, whole
    dp = P.rank_weights(g, P.Layout(1, 2, ep=True), p)  # attention replicated, experts still halved
    assert dp.experts == ep.experts and dp.embed == 2 * EMBED and dp.attention > w.attention
    assert w.total == 2 * EMBED + NORMS + ROUTER + FULL_ATTN + 3 * SWA_ATTN + DENSE + 3 * 8 * EXPERT_SHARD


def test_kv_per_token_full_vs_sliding(tiny):
    g, p = tiny
    assert P.kv_bytes_per_token(g.full, 2, p) == 1 * 256 * 2  # 2 KV heads over TP 2
    assert P.kv_bytes_per_token(g.sliding, 2, p) == 2 * 256 * 2  # sliding layers' own 4 KV heads
    assert P.kv_bytes_per_token(g.full, 4, p) == 1 * 256 * 2  # TP 4 > 2 KV heads: one replicated
    assert P.kv_bytes_per_token(g.sliding, 4, p) == 1 * 256 * 2
    # full layers hold every token, sliding layers at most the window (64)
    assert P.request_kv_bytes(g, 2, p, 1000) == 1000 * 512 + 3 * 64 * 1024
    assert P.request_kv_bytes(g, 2, p, 10) == 10 * 512 + 3 * 10 * 1024
    fp8_kv = P.Precision(fp8=True, kv_bytes=1)
    assert P.request_kv_bytes(g, 2, fp8_kv, 1000) * 2 == P.request_kv_bytes(g, 2, p, 1000)


def test_requests_and_decode_bound_by_hand(tiny):
    g, p = tiny
    assert P.requests_that_fit(10 * 708608 + 5, 708608) == 10 and P.requests_that_fit(-1, 5) == 0
    assert P.expected_active_experts(8, 2, 1) == pytest.approx(2.0)
    assert P.expected_active_experts(8, 2, 10**6) == pytest.approx(8.0)
    lay = P.Layout(2)
    w = P.rank_weights(g, lay, p)
    static = EMBED + FULL_ATTN + 3 * SWA_ATTN + DENSE + ROUTER + NORMS  # lm_head, not the embedding table
    got = P.decode_step_bytes(g, lay, p, w, requests=1, tokens=1, context=1000)
    assert got == pytest.approx(static + 3 * 2 * EXPERT_SHARD + 708608)
    ep = P.Layout(2, ep=True)  # 2 active experts of 8, a rank holds 4 of them: 1 expected
    w_ep = P.rank_weights(g, ep, p)
    assert P.decode_step_bytes(g, ep, p, w_ep, 1, 1, 1000) == pytest.approx(static + 3 * 1 * EXPERT_WHOLE + 708608)

    gpu = P.GPU("test", 100 * 2**20, 1e9)
    plan = P.plan_layout(g, lay, p, gpu, (1000,), reserve=2**20, utilization=0.5)
    budget = int(0.5 * 100 * 2**20) - w.total - 2**20
    assert plan.kv_budget == budget and plan.fits == {1000: budget // 708608} and plan.batch == budget // 708608
    assert plan.step_s_b1 == pytest.approx(got / 1e9)
    assert plan.kv_full_per_token == 512 and plan.kv_swa_per_token == 3 * 1024


def test_layouts_for_eight_gpus():
    assert [lay.name for lay in P.layouts_for(8)] == ["TP8", "TP8 EP8", "DP2 TP4 EP8", "DP4 TP2 EP8", "DP8 TP1 EP8"]
    assert [lay.name for lay in P.layouts_for(1)] == ["TP1"]
    assert all(lay.ep_size in (1, 8) and lay.ranks == 8 for lay in P.layouts_for(8))


def test_layouts_that_do_not_divide_are_flagged(tmp_path):
    g, cfg = P.read_config(_tiny(tmp_path))
    p = P.precision_for(cfg)
    assert P.shape_problems(g, P.Layout(2), p) == []
    assert any("query heads" in s for s in P.shape_problems(g, P.Layout(8, ep=True), p))
    # TP 4 splits each 256-wide expert into 64 rows, half an FP8 block; whole experts under EP do not
    assert any("expert width" in s for s in P.shape_problems(g, P.Layout(4), p))
    assert P.shape_problems(g, P.Layout(4, ep=True), p) == []
    assert any("experts do not divide" in s for s in P.shape_problems(g, P.Layout(3, ep=True), p))
    # fused qkv_proj stored in num_key_value_heads = 2 chunks: TP 4 cannot split them
    gf, cf = P.read_config(_tiny(tmp_path, attention_projection_layout="fused_qkv"))
    assert any("fused qkv_proj" in s for s in P.shape_problems(gf, P.Layout(4, ep=True), P.precision_for(cf)))
    assert P.shape_problems(gf, P.Layout(2), P.precision_for(cf)) == []


def test_v25_tp8_is_flagged_as_vllm_finds_it():
    g, cfg = P.read_config(CONFIGS[1])
    p = P.precision_for(cfg)
    assert any("fused qkv_proj" in s for s in P.shape_problems(g, P.Layout(8), p))
    assert P.shape_problems(g, P.Layout(4, 2, ep=True), p) == []


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_cli_prints_every_layout_and_json_agrees(config, capsys):
    args = ["plan", "--model", str(config), "--gpus", "8", "--gpu", "h200", "--weights", "fp8"]
    assert main(args) == 0
    table = capsys.readouterr().out
    assert main(args + ["--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    names = [lay.name for lay in P.layouts_for(8)]
    assert [lay["layout"] for lay in d["layouts"]] == names
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in table.splitlines() if line.startswith("| ") and not line.startswith("| layout")}
    assert list(rows) == names
    for lay in d["layouts"]:
        row = rows[lay["layout"]]
        assert row[0] == lay["status"]
        assert row[1] == f"{lay['weight_bytes_per_rank'] / 2**30:.1f}"
        assert row[2] == f"{lay['kv_bytes_per_token_per_rank']['full_layers'] / 1024:.1f}"
        assert row[3] == f"{lay['kv_bytes_per_token_per_rank']['sliding_layers'] / 1024:.1f}"
        assert row[5:7] == [str(lay["requests_that_fit"]["32768"]), str(lay["requests_that_fit"]["262144"])]
        assert row[7] == f"{lay['decode_batch1']['step_ms']:.2f}"
        assert row[9] == str(lay["decode_batch_fit"]["requests"])
        assert lay["requests_that_fit"]["32768"] >= lay["requests_that_fit"]["262144"]


def test_cli_on_a_bundle_dir_and_bad_input(tmp_path, capsys):
    _tiny(tmp_path)
    assert main(["plan", "--model", str(tmp_path), "--gpus", "2", "--gpu", "h100"]) == 0
    assert "DP2 TP1 EP2" in capsys.readouterr().out
    assert main(["plan", "--model", str(tmp_path / "missing"), "--gpus", "2"]) == 2


def test_module_entry_point_runs():
    out = subprocess.run([sys.executable, "-m", "mmserve.cli", "plan", "--model", str(CONFIGS[0]), "--gpus", "4",
                          "--gpu", "h100", "--json"], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert [lay["layout"] for lay in json.loads(out)["layouts"]] == ["TP4", "TP4 EP4", "DP2 TP2 EP4", "DP4 TP1 EP4"]


def test_docs_tables_are_the_commands_output(capsys):
    """docs/plan.md's tables are what its commands print now."""
    doc = (ROOT / "docs" / "plan.md").read_text()
    region = doc[doc.index("### 8 x H200"):doc.index("What the tables say")]
    chunks = region.split("$ mmserve ")[1:]
    assert len(chunks) == 6
    for chunk in chunks:
        cmd, *rest = chunk.splitlines()
        expected = [line for line in rest if line.strip() and not line.startswith(("```", "###"))]
        assert main(cmd.split()) == 0
        assert capsys.readouterr().out.splitlines() == expected, cmd


def test_the_cli_imports_no_torch():
    """``mmserve.cli`` (every service's entry point, the gateway's too) registers ``plan`` without
    importing torch: the geometry reader it needs loads only when a plan is made."""
    import subprocess
    import sys

    code = "import sys, mmserve.cli; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
