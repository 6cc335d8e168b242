"""The parallel layout's pieces on their own: the config's invariants and refusals, even splits,
CPU and device placement of ranks, a packed weight's column split on its scale blocks, and
which rows / columns / experts each MiMo rank reads."""

from __future__ import annotations

import pytest
import torch

from llm_svc.core.ranks import rank_cpus, rank_device
from llm_svc.models import qweight
from llm_svc.models.geometry import mimo_geometry
from llm_svc.models.mimo_tp import MiMoShard
from llm_svc.parallel import ParallelConfig, even_range
from mmserve.tiny import mimo_published as mp
from shared.settings import LLMSettings


def test_config_invariants_and_names():
    p = ParallelConfig(4, enable_expert_parallel=True)
    assert p.world_size == 4 and p.expert_parallel_size == 4
    assert ParallelConfig(4).expert_parallel_size == 1
    assert p.backend_for("cpu") == "gloo" and p.backend_for("cuda:0") == "nccl"
    assert ParallelConfig(2, backend="gloo").backend_for("cuda") == "gloo"
    with pytest.raises(ValueError, match="data-parallel attention"):
        ParallelConfig(2, 2)
    with pytest.raises(ValueError, match=">= 1"):
        ParallelConfig(0)


@pytest.mark.parametrize("kw, match", [
    ({"kv_l3_url": "redis://127.0.0.1:6379/0", "host_kv_full_bytes": 1 << 20, "host_kv_swa_bytes": 1 << 20},
     "Redis KV tier"),
    ({"backend": "hf"}, "swa backend"),
    ({"cuda_graphs": True}, "cuda_graphs"),
])
def test_settings_refuse_what_the_group_does_not_serve_yet(kw, match):
    with pytest.raises(ValueError, match=match):
        LLMSettings(model_dir="x", tensor_parallel_size=2, **kw)
    LLMSettings(model_dir="x", tensor_parallel_size=1, **kw)  # one rank takes them
    with pytest.raises(ValueError, match="data_parallel_size > 1 .* run one replica per data-parallel rank"):
        LLMSettings(model_dir="x", data_parallel_size=2)


def test_even_range():
    assert [even_range(12, 3, i) for i in range(3)] == [(0, 4), (4, 8), (8, 12)]
    assert even_range(256, 2, 1, unit=128) == (128, 256)
    with pytest.raises(ValueError, match="heads = 6 does not split evenly over 4 ranks"):
        even_range(6, 4, 0, what="heads")
    with pytest.raises(ValueError, match="in multiples of 128"):
        even_range(256, 4, 0, unit=128)


def test_rank_placement():
    assert rank_cpus([0, 1, 2, 3], 2, 1) == [2, 3]
    assert rank_cpus([0, 1], 2, 0) == [0]
    assert rank_cpus([5], 2, 1) == [5]  # fewer CPUs than ranks: they share
    assert rank_device("cpu", 1) == "cpu" and rank_device("cuda", 1) == "cuda:1" and rank_device("cuda:2", 1) == "cuda:3"


def test_a_column_split_is_the_dense_weights_columns():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 512, generator=g)
    fp8 = w.to(torch.float8_e4m3fn)
    scale = torch.rand(1, 4, generator=g) + 0.5  # [ceil(64/128), 512/128]
    whole = qweight.dense(qweight.pack("fp8", fp8, scale))
    part = qweight.pack("fp8", fp8, scale, cols=(128, 384))
    assert (part.n, part.k) == (64, 256)
    torch.testing.assert_close(qweight.dense(part), whole[:, 128:384], rtol=0, atol=0)
    rows = torch.arange(16, 48)
    both = qweight.pack("fp8", fp8, scale, rows=rows, cols=(256, 512))
    torch.testing.assert_close(qweight.dense(both), whole[16:48, 256:512], rtol=0, atol=0)
    bf = w.to(torch.bfloat16)
    torch.testing.assert_close(qweight.dense(qweight.pack("bfloat16", bf, cols=(3, 100))), bf[:, 3:100].float())
    with pytest.raises(ValueError, match="128-column scale blocks"):
        qweight.pack("fp8", fp8, scale, cols=(64, 256))


def _geometry(spec):
    cfg = mp.published_config(spec, 640, 1, 2)
    cfg["attention_projection_layout"] = "split"
    return mimo_geometry(cfg)


def test_mimo_shards_cover_the_model_once():
    """Query heads, sliding KV heads, MLP rows and experts: the ranks' parts tile each tensor;
    the flash full layers' one KV head is read by both ranks (replicated)."""
    g = _geometry(mp.FLASH)
    shards = [MiMoShard(g, ParallelConfig(2), r) for r in range(2)]
    full = g.layer_types.index("full_attention")
    sliding = g.layer_types.index("sliding_attention")
    q = [s.slice(f"model.layers.{sliding}.self_attn.q_proj.weight") for s in shards]
    assert q == [(0, 0, 2 * g.sliding.qk_dim), (0, 2 * g.sliding.qk_dim, 4 * g.sliding.qk_dim)]
    kv = [s.slice(f"model.layers.{sliding}.self_attn.k_proj.weight") for s in shards]
    assert kv == [(0, 0, g.sliding.qk_dim), (0, g.sliding.qk_dim, 2 * g.sliding.qk_dim)]
    assert [s.slice(f"model.layers.{full}.self_attn.v_proj.weight") for s in shards] == [(0, 0, g.full.v_dim)] * 2
    o = [s.slice(f"model.layers.{full}.self_attn.o_proj.weight") for s in shards]
    assert o == [(1, 0, 2 * g.full.v_dim), (1, 2 * g.full.v_dim, 4 * g.full.v_dim)]
    assert shards[1].slice(f"model.layers.{sliding}.self_attn.attention_sink_bias") == (0, 2, 4)
    assert shards[1].slice("model.layers.0.mlp.down_proj.weight") == (1, 128, 256)
    assert shards[1].slice("model.layers.1.mlp.experts.5.up_proj.weight") == (0, 32, 64)
    assert shards[0].slice("model.embed_tokens.weight") is None and shards[0].slice("lm_head.weight") is None
    # the MTP layers whole on rank 0 (it drafts), nowhere else
    assert shards[0].rename("model.mtp.layers.0.eh_proj.weight") == "model.mtp.layers.0.eh_proj.weight"
    assert shards[1].rename("model.mtp.layers.0.eh_proj.weight") is None
    assert shards[0].slice("model.mtp.layers.0.self_attn.q_proj.weight") is None
    ep = [MiMoShard(g, ParallelConfig(2, enable_expert_parallel=True), r) for r in range(2)]
    assert ep[1].rename("model.layers.1.mlp.experts.5.up_proj.weight") == "model.layers.1.mlp.experts.1.up_proj.weight"
    assert ep[0].rename("model.layers.1.mlp.experts.5.up_proj.weight") is None
    assert ep[0].slice("model.layers.1.mlp.experts.1.up_proj.weight") is None  # whole experts
    assert ep[0].slice("model.layers.0.mlp.up_proj.weight") == (0, 0, 128)  # dense layers still split
    assert ep[1].geometry.expert_range == (4, 8) and ep[1].geometry.n_experts == 8  # routing over all
    assert shards[0].geometry.mtp_layers == 0
