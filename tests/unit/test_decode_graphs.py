"""Decode steps from static buffers (``DecodeGraphs``, what a CUDA graph replays) on the CPU:
the same steps through a runner with graphs and one without, both on the ``triton_paged``
backend (its plain-torch reference on the CPU, its kernel under the Triton interpreter), must
give the same logits and leave the same KV in every slot a request owns; padding rows only
ever touch the scratch slot; anything that is not a plain decode step runs eagerly."""

from __future__ import annotations

import random

import pytest
import torch

from llm_svc.engine.decode_graphs import graph_buckets
from llm_svc.engine.model_runner import ModelRunner
from llm_svc.models import build_model
from llm_svc.types.request import ForwardBatch, SeqForward
from tests.unit.test_llm_runner import SlotSim, hf_logits

pytestmark = pytest.mark.unit
ATOL = 2e-4
FULL_SLOTS, SWA_SLOTS = 2048, 512


@pytest.fixture(autouse=True)
def plain_reference(monkeypatch):
    """The backend's plain-torch reference (tests/conftest.py turns the slow interpreter on for
    every test of a machine without CUDA); the last test interprets the kernel itself."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def runners(lm, max_batch: int, max_positions: int = 1024):
    model = build_model(lm.arch, lm.model)
    graphs = ModelRunner(model, FULL_SLOTS, SWA_SLOTS, attention="triton_paged", decode_graphs=max_batch,
                         max_positions=max_positions)
    eager = ModelRunner(model, FULL_SLOTS, SWA_SLOTS, attention="triton_paged")
    return graphs, eager


def test_graph_buckets():
    assert graph_buckets(1) == [1]
    assert graph_buckets(6) == [1, 2, 4, 6]
    assert graph_buckets(8) == [1, 2, 4, 8]
    assert graph_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert graph_buckets(64)[-3:] == [48, 56, 64]


def _steps(lm, graphs, eager, rng: random.Random, n_seqs: int, decodes: int, arrive_late: int = 0):
    """Prefill ``n_seqs - arrive_late`` prompts, then greedy decodes (the late prompts join one a
    step, beside the decodes; sequences stop at different lengths), every step on both runners.
    Returns (graph-runner logits, eager logits, the slot simulator)."""
    sim = SlotSim(FULL_SLOTS, SWA_SLOTS, seed=rng.randint(0, 99))
    prompts = {f"r{i}": [rng.randint(10, lm.vocab_size - 1) for _ in range(rng.randint(5, 70))]
               for i in range(n_seqs)}
    stop = {rid: rng.randint(decodes // 2, decodes) for rid in prompts}
    waiting = list(prompts)
    seqs: dict[str, list[int]] = {}
    got, ref = [], []
    for step in range(decodes + arrive_late + 1):
        batch = [sim.seq(rid, [ids[-1]], len(ids) - 1, True) for rid, ids in seqs.items()
                 if len(ids) - len(prompts[rid]) < stop[rid]]
        joining = waiting[:n_seqs - arrive_late] if step == 0 else waiting[:1]
        for rid in joining:
            waiting.remove(rid)
            seqs[rid] = list(prompts[rid])
            batch.append(sim.seq(rid, seqs[rid], 0, True))
        if not batch:
            break
        fb = ForwardBatch(batch)
        a, b = graphs.run(fb), eager.run(fb)
        for sf in batch:
            got.append(a[sf.req_id])
            ref.append(b[sf.req_id])
            seqs[sf.req_id].append(int(b[sf.req_id].argmax()))
            sim.release(sf.req_id)
    return got, ref, sim


@pytest.mark.parametrize("arch", ["mimo", "gemma3"])
def test_static_decode_steps_equal_the_eager_runner(arch, mimo16, gemma16):
    lm = mimo16 if arch == "mimo" else gemma16
    graphs, eager = runners(lm, max_batch=8)
    got, ref, _ = _steps(lm, graphs, eager, random.Random(1), n_seqs=5, decodes=24, arrive_late=2)
    assert graphs.graphs.replays >= 20
    assert len(got) == len(ref) > 60
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-4)
        assert int(a.argmax()) == int(b.argmax())
    # both runners wrote the same slots with the same K / V: the padding rows only the scratch slot
    for kv_g, kv_e in zip(graphs.kv, eager.kv):
        assert kv_g.num_slots == kv_e.num_slots + 1
        torch.testing.assert_close(kv_g.k[:, :-1], kv_e.k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(kv_g.v[:, :-1], kv_e.v, atol=1e-5, rtol=1e-5)
    assert any(kv.k[:, -1].any() for kv in graphs.kv)  # the padding did write there


def test_static_decode_matches_transformers(mimo16):
    """One sequence decoded through bucket 1 and, beside two others, bucket 4: the logits of
    transformers' full forward at every position."""
    lm = mimo16
    graphs, _ = runners(lm, max_batch=4)
    g = torch.Generator().manual_seed(4)
    ids = {r: torch.randint(10, lm.vocab_size, (n,), generator=g).tolist() for r, n in (("a", 40), ("b", 23), ("c", 61))}
    refs = {r: hf_logits(lm, x) for r, x in ids.items()}
    sim = SlotSim(FULL_SLOTS, SWA_SLOTS, seed=4)
    n0 = {"a": 20, "b": 10, "c": 30}
    graphs.run(ForwardBatch([sim.seq("a", ids["a"][:n0["a"]], 0, True)]))
    for p in range(n0["a"], 30):  # "a" alone: bucket 1
        out = graphs.run(ForwardBatch([sim.seq("a", [ids["a"][p]], p, True)]))
        torch.testing.assert_close(out["a"], refs["a"][p], atol=ATOL, rtol=1e-4)
        sim.release("a")
    graphs.run(ForwardBatch([sim.seq(r, ids[r][:n0[r]], 0, True) for r in ("b", "c")]))
    done = {"a": 30, "b": n0["b"], "c": n0["c"]}
    checked = 0
    while all(done[r] < len(ids[r]) for r in ids):  # three together: bucket 4, one padding row
        batch = [sim.seq(r, [ids[r][done[r]]], done[r], True) for r in ids]
        out = graphs.run(ForwardBatch(batch))
        for r in ids:
            torch.testing.assert_close(out[r], refs[r][done[r]], atol=ATOL, rtol=1e-4)
            done[r] += 1
            sim.release(r)
            checked += 1
    assert graphs.graphs.replays == 10 + checked // 3 and checked >= 30


def test_other_steps_run_eagerly(mimo16):
    lm = mimo16
    graphs, _ = runners(lm, max_batch=2, max_positions=64)
    sim = SlotSim(FULL_SLOTS, SWA_SLOTS)
    gr = graphs.graphs
    pre = ForwardBatch([sim.seq("a", [11] * 30, 0, True), sim.seq("b", [12] * 20, 0, True)])
    assert not gr.accepts(pre)
    graphs.run(pre)
    mixed = ForwardBatch([sim.seq("a", [13], 30, True), sim.seq("c", [14] * 5, 0, True)])
    assert not gr.accepts(mixed)
    graphs.run(mixed)
    assert gr.accepts(ForwardBatch([sim.seq("a", [15], 31, True), sim.seq("b", [16], 20, True)]))
    three = [sim.seq(r, [17], s, True) for r, s in (("x", 0), ("y", 0), ("z", 0))]
    assert not gr.accepts(ForwardBatch(three))  # past the largest bucket
    d = sim.seq("q", [1, 2, 3], 0, True)
    d.num_drafts = 2
    assert not gr.accepts(ForwardBatch([d]))
    late = SeqForward("p", [5], 64, [1], [1], 49, True, reset_full=list(range(64)), reset_swa=list(range(15)))
    assert not gr.accepts(ForwardBatch([late]))  # past max_positions
    assert gr.replays == 0


def test_tables_growing_rebinds_the_buckets(mimo16):
    """Slot tables that outgrow their reservation are reallocated: the buckets' metadata must
    follow them (a recorded graph is dropped and recorded again)."""
    lm = mimo16
    graphs, eager = runners(lm, max_batch=2)
    sim = SlotSim(FULL_SLOTS, SWA_SLOTS, seed=5)
    pre = ForwardBatch([sim.seq("a", list(range(20, 60)), 0, True)])
    graphs.run(pre), eager.run(pre)
    sim.release("a")
    step = ForwardBatch([sim.seq("a", [7], 40, True)])
    torch.testing.assert_close(graphs.run(step)["a"], eager.run(step)["a"], atol=ATOL, rtol=1e-4)
    before = graphs.tables.full
    for i in range(40):  # more live requests than the 16 rows reserved
        graphs.tables._row(f"burst{i}")
    assert graphs.tables.full is not before
    sim.release("a")
    step = ForwardBatch([sim.seq("a", [8], 41, True)])
    torch.testing.assert_close(graphs.run(step)["a"], eager.run(step)["a"], atol=ATOL, rtol=1e-4)
    assert graphs.graphs.replays == 2


def test_interpreted_kernel_under_static_buffers(mimo16, monkeypatch):
    """The Triton kernel itself (interpreted) on the static buffers, padding rows included."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    lm = mimo16
    graphs, eager = runners(lm, max_batch=4)
    got, ref, _ = _steps(lm, graphs, eager, random.Random(7), n_seqs=3, decodes=4)
    assert graphs.graphs.replays >= 3
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-4)


def test_settings_turn_graphs_on_for_cuda_only(mimo16, caplog):
    from llm_svc.core.build import build_engine
    from shared.settings import LLMSettings

    settings = LLMSettings(model_dir=str(mimo16.spec.root), kv_bytes=8 * 1024 * 1024, max_batch_tokens=64,
                           cuda_graphs=True, warmup=False)
    with caplog.at_level("WARNING"):
        engine = build_engine(settings, mimo16)
    assert engine.runner.graphs is None and "runs its decodes eagerly" in caplog.text
    assert engine.runner.attn.name != "triton_paged"  # the CPU keeps its own default backend
    with pytest.raises(ValueError, match="triton_paged"):
        LLMSettings(model_dir=str(mimo16.spec.root), cuda_graphs=True, attention_backend="sdpa")
    assert LLMSettings.model_fields["cuda_graphs"].default is False
