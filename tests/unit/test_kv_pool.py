"""Slot pools, KV geometry and the split of a byte budget into the two pools."""

from __future__ import annotations

import pytest

from llm_svc.kv.budget import KVGeometry, size_pools
from llm_svc.kv.manager import KVManager
from llm_svc.kv.pool import SlotPool
from llm_svc.kv.radix import NO_SLOT

pytestmark = pytest.mark.unit


def test_pool_alloc_free_roundtrip():
    p = SlotPool(10)
    a = p.alloc(4)
    b = p.alloc(6)
    assert sorted(a + b) == list(range(10))
    assert p.alloc(1) is None and p.num_free == 0
    p.free(a)
    assert p.num_free == 4 and p.alloc(5) is None  # all or nothing
    assert p.num_free == 4
    p.check_integrity()


def test_pool_rejects_double_and_foreign_frees():
    p = SlotPool(4)
    s = p.alloc(2)
    p.free(s[:1])
    with pytest.raises(ValueError, match="double free"):
        p.free(s[:1])
    with pytest.raises(ValueError, match="foreign"):
        p.free([7])
    with pytest.raises(ValueError):
        SlotPool(0)
    p.check_integrity()


MIMO_PRO = KVGeometry(full_layers=10, swa_layers=60, window=128, kv_heads=4, qk_head_dim=192, v_head_dim=128)


def test_geometry_bytes_with_different_qk_and_v_dims():
    g = KVGeometry(full_layers=1, swa_layers=6, window=128, kv_heads=2, qk_head_dim=24, v_head_dim=16, dtype_bytes=4)
    assert g.layer_token_bytes == 2 * (24 + 16) * 4
    assert g.full_token_bytes == 320 and g.swa_token_bytes == 6 * 320
    with pytest.raises(ValueError):
        KVGeometry(full_layers=0, swa_layers=6, window=128, kv_heads=2, qk_head_dim=24, v_head_dim=16)
    g2 = KVGeometry(full_layers=1, swa_layers=6, window=128, kv_heads=2, qk_head_dim=24, v_head_dim=16,
                    dtype_bytes=4, swa_kv_heads=4)
    assert g2.full_token_bytes == 320 and g2.swa_token_bytes == 2 * 6 * 320


def test_geometry_from_hf_configs():
    from transformers import Gemma3TextConfig, MiMoV2FlashConfig

    mimo = MiMoV2FlashConfig(
        num_hidden_layers=7, layer_types=["full_attention"] + ["sliding_attention"] * 6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, v_head_dim=16, sliding_window=64,
    )
    g = KVGeometry.from_hf_config(mimo, dtype_bytes=4)
    assert (g.full_layers, g.swa_layers, g.window, g.kv_heads, g.qk_head_dim, g.v_head_dim) == (1, 6, 64, 2, 24, 16)
    assert g.swa_kv_heads == 4  # MiMo-V2's sliding layers: 2x the KV heads
    assert (g.full_token_bytes, g.swa_token_bytes) == (1 * 2 * 40 * 4, 6 * 4 * 40 * 4)
    gem = Gemma3TextConfig(
        num_hidden_layers=6, layer_types=["sliding_attention"] * 5 + ["full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=32,
    )
    g = KVGeometry.from_hf_config(gem)
    assert (g.full_layers, g.swa_layers, g.window, g.qk_head_dim, g.v_head_dim) == (1, 5, 32, 16, 16)


def test_size_pools_with_fraction_fits_budget():
    budget = 1 << 30
    nf, ns = size_pools(budget, MIMO_PRO, swa_fraction=0.25)
    used_full, used_swa = nf * MIMO_PRO.full_token_bytes, ns * MIMO_PRO.swa_token_bytes
    assert used_full + used_swa <= budget
    assert abs(used_swa / budget - 0.25) < 0.01
    with pytest.raises(ValueError):
        size_pools(budget, MIMO_PRO, swa_fraction=1.0)


def test_size_pools_default_rule():
    budget = 8 << 30
    w, chunk, n, e = MIMO_PRO.window, 512, 16, 32768
    nf, ns = size_pools(budget, MIMO_PRO, max_chunk=chunk, expected_seq_len=e, release_interval=n)
    assert nf * MIMO_PRO.full_token_bytes + ns * MIMO_PRO.swa_token_bytes <= budget
    # the SWA pool holds W + N per expected sequence plus one chunk in flight
    expected = nf * (w + n) / e + w + chunk
    assert abs(ns - expected) <= max(2, 0.01 * expected)
    # nearly all of the budget is used
    assert nf * MIMO_PRO.full_token_bytes + ns * MIMO_PRO.swa_token_bytes > 0.99 * budget
    with pytest.raises(ValueError, match="too small"):
        size_pools(1000, MIMO_PRO)


def test_manager_release_window_and_finish_without_cache():
    m = KVManager(50, 20, window=4, enable_prefix_cache=False)
    seq = m.start(list(range(10)))
    assert m.reserve(seq, full_end=10, swa_from=0, swa_end=6)
    assert (m.full_pool.num_free, m.swa_pool.num_free) == (40, 14)
    m.release_window(seq, 2)
    assert seq.swa[:2] == [NO_SLOT, NO_SLOT] and NO_SLOT not in seq.swa[2:6]
    assert m.swa_pool.num_free == 16
    m.check_integrity([seq])
    assert m.finish(seq, list(range(10)), num_computed=6) == 0
    assert (m.full_pool.num_free, m.swa_pool.num_free) == (50, 20)
    m.check_integrity([])


def test_manager_reserve_is_all_or_nothing():
    m = KVManager(30, 8, window=4)
    seq = m.start([1, 2, 3])
    assert not m.reserve(seq, full_end=20, swa_from=0, swa_end=10)  # SWA short
    assert (m.full_pool.num_free, m.swa_pool.num_free) == (30, 8)
    assert not m.reserve(seq, full_end=40, swa_from=0, swa_end=2)  # full short
    assert (m.full_pool.num_free, m.swa_pool.num_free) == (30, 8)
    m.check_integrity([seq])


def test_size_pools_adds_a_window_per_running_request():
    budget = 8 << 30
    nf0, ns0 = size_pools(budget, MIMO_PRO, expected_seq_len=8192)
    nf1, ns1 = size_pools(budget, MIMO_PRO, expected_seq_len=8192, max_running=16)
    assert ns1 > ns0 and nf1 < nf0
    expected_extra = 16 * MIMO_PRO.window
    per_full = (MIMO_PRO.window + 16) / 8192
    assert abs((ns1 - nf1 * per_full) - (ns0 - nf0 * per_full) - expected_extra) <= 2


@pytest.mark.parametrize("arch", ["mimo", "gemma3"])
def test_geometry_from_hf_config_matches_the_runner_kv_tensors(arch, mimo_bundle, gemma3_bundle):
    """Bytes per slot from the HF config equal what the model runner allocates per pool slot."""
    import torch

    from llm_svc.attention import FULL
    from llm_svc.engine.model_runner import ModelRunner
    from llm_svc.loading.loader import load_lm
    from llm_svc.models import build_model

    lm = load_lm(str(mimo_bundle if arch == "mimo" else gemma3_bundle), dtype="float32")
    g = KVGeometry.from_hf_config(lm.model.config, dtype_bytes=4)
    runner = ModelRunner(build_model(lm.arch, lm.model), num_full_slots=3, num_swa_slots=5, dtype=torch.float32)
    per_slot = {True: 0, False: 0}
    for spec, t in zip(runner.model.layers, runner.kv):
        n = 3 if spec.kind == FULL else 5
        assert t.num_slots == t.v.shape[1] == n
        per_slot[spec.kind == FULL] += (t.k.numel() * t.k.element_size() + t.v.numel() * t.v.element_size()) // n
    assert (g.full_token_bytes, g.swa_token_bytes) == (per_slot[True], per_slot[False])
    assert runner.kv_bytes() == 3 * g.full_token_bytes + 5 * g.swa_token_bytes


def test_cache_prefix_of_running_sequences_owns_every_slot_once():
    """Two running sequences computed the same 12 keys; both hand them to the tree: the first's
    slots are adopted, the second's copies freed and its view switched to the tree's. Their
    later tokens continue from the tree-owned prefix, and finishing caches only the rest."""
    w = 4
    kv = KVManager(64, 64, w)
    keys = list(range(1, 13))
    a, b = kv.start([]), kv.start([])
    for s in (a, b):
        assert kv.reserve(s, 12, 0, 12)
    free_full = kv.full_pool.num_free
    assert kv.cache_prefix(a, keys, 12) == 12
    assert kv.full_pool.num_free == free_full  # adopted, nothing freed
    a_full, a_window = list(a.full), a.swa[12 - w:]
    assert kv.cache_prefix(b, keys, 12) == 0
    assert kv.full_pool.num_free == free_full + 12  # b's copies went back
    assert b.full == a_full and b.swa[12 - w:] == a_window and b.cached_len == a.cached_len == 12
    assert b.swa[: 12 - w] == [NO_SLOT] * (12 - w)
    kv.check_integrity([a, b])
    assert kv.tree.evictable_full() == 0 and kv.tree.evictable_swa() == 0  # both lock it
    for s in (a, b):
        assert kv.reserve(s, 14, 12, 14)  # two decode tokens after the cached prefix
    kv.check_integrity([a, b])
    assert kv.finish(a, keys + [20, 21], 14) == 2
    assert kv.finish(b, keys + [30, 31], 14) == 2
    kv.check_integrity([])
    assert kv.full_pool.num_free + kv.tree.full_tokens == 64 and kv.tree.full_tokens == 16
