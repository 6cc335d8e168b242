"""Tensor and expert parallelism on CPU ranks (gloo, world size 2): the engine with its ranks
gives the greedy tokens one rank gives, on published-form tiny MiMo-V2-Flash (split attention,
float32; its full layers have one KV head, replicated to both ranks) and MiMo-V2.5 (fused FP8
``qkv_proj``, sliding layers with their own KV heads), with the prefix cache, tight pools, the
host tier and n-gram speculation on. The engine runs in this process as rank 0 (its
``check_integrity()`` after every step, the other rank's slot tables checked against rank 0's);
rank 1 is the process the engine core would spawn."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import pytest
import torch

from llm_svc.core.build import build_engine
from llm_svc.core.ranks import start_group
from llm_svc.loading.loader import load_lm
from llm_svc.parallel import ParallelConfig
from llm_svc.types.request import PreparedRequest
from mmserve.testing.in_process import InProcessEngine
from mmserve.tiny import mimo_published as mp
from shared.schemas import SamplingParams
from shared.settings import LLMSettings
from tests.conftest import SMALL_W
from tests.integration.test_llm_engine import ListStream

pytestmark = pytest.mark.integration

# drafts every step the lookup finds them (the automatic k follows timing; one rank and two must
# both draft for the test to see speculation under the group)
NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "draft_policy": "fixed"}'
MTP = '{"method": "mtp", "num_speculative_tokens": 3, "draft_policy": "fixed"}'


@dataclass
class Case:
    name: str
    spec: mp.TinyMiMoSpec
    layout: str
    quant: str | None
    dtype: str


CASES = {
    "flash": Case("flash", mp.FLASH, "split", None, "float32"),
    "v25-fp8": Case("v25-fp8", mp.V25, "fused_qkv", "fp8", "float32"),
}


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    return {k: mp.write_mimo_published(root / k, c.spec, sliding_window=SMALL_W, layout=c.layout, quant=c.quant)
            for k, c in CASES.items()}


def settings_for(bundle, case: Case, tp: int = 1, ep: bool = False, host: bool = True,
                 spec: str = NGRAM) -> LLMSettings:
    return LLMSettings(model_dir=str(bundle), dtype=case.dtype, tensor_parallel_size=tp, enable_expert_parallel=ep,
                       kv_bytes=(256 if tp > 1 else 640) * 1024, max_batch_tokens=48, max_running=6, speculative_config=spec,
                       host_kv_full_bytes=8 << 20 if host else 0, host_kv_swa_bytes=2 << 20 if host else 0,
                       warmup=False, max_model_len=1024)


def trace(vocab: int, seed: int = 0) -> list[list[PreparedRequest]]:
    """Rounds of a conversation trace: 3 system prompts x 6 sessions whose turns grow (prompt =
    previous prompt + new text, so later rounds hit the prefix cache), every prompt ending in a
    repeated phrase (n-gram drafts find matches)."""
    rng = random.Random(seed)

    def text(n):
        return [rng.randrange(20, vocab) for _ in range(n)]

    systems = [text(40), text(55), text(30)]
    sessions = [list(systems[i % 3]) for i in range(6)]
    rounds = []
    for r in range(3):
        batch = []
        for i, ids in enumerate(sessions):
            phrase = text(4)
            ids += text(rng.randint(3, 20)) + phrase * 3
            batch.append(PreparedRequest(request_id=f"s{i}-r{r}", prompt_ids=list(ids),
                                         sampling=SamplingParams(max_tokens=rng.randint(6, 12), ignore_eos=True)))
        rounds.append(batch)
    return rounds


def run_trace(engine: InProcessEngine, vocab: int, check_ranks: bool) -> dict[str, list[int]]:
    out = {}
    for batch in trace(vocab):
        streams = {p.request_id: ListStream(p.request_id) for p in batch}
        for p in batch:
            engine.submit(p, streams[p.request_id])
        steps = 0
        while not all(s.done for s in streams.values()):
            engine.step()
            engine.scheduler.check_integrity()
            steps += 1
            assert steps < 3000, "engine did not finish"
            if check_ranks and steps % 7 == 0:
                engine.runner.check_ranks()
        out.update({rid: s.tokens for rid, s in streams.items()})
    return out


def one_rank(bundle, case: Case, spec: str = NGRAM) -> tuple[dict[str, list[int]], dict]:
    s = settings_for(bundle, case, spec=spec)
    lm = load_lm(s.model_dir, dtype=s.dtype)
    engine = InProcessEngine(build_engine(s, lm), lm.tokenizer)
    return run_trace(engine, lm.vocab_size, False), engine.engine.stats()


class RankEngine:
    """Rank 0 of a group of ``settings.tensor_parallel_size``, in this process (not pinned)."""

    def __init__(self, settings: LLMSettings):
        par = ParallelConfig.of(settings)
        self.workers, self.group, device = start_group(settings, par, pin_self=False)
        try:
            self.lm = load_lm(settings.model_dir, device, settings.dtype, parallel=par, group=self.group)
            self.engine = InProcessEngine(build_engine(settings, self.lm, group=self.group), self.lm.tokenizer)
        except BaseException:
            self.close(kill=True)
            raise

    def close(self, kill: bool = False) -> None:
        if not kill:
            self.engine.runner.stop()
        else:
            for p in self.workers.procs:
                p.kill()
        self.workers.stop()
        self.group.close()


@pytest.fixture(scope="module")
def reference(bundles):
    return {k: one_rank(bundles[k], c) for k, c in CASES.items()}


@pytest.mark.parametrize("case, ep", [("flash", False), ("v25-fp8", False), ("v25-fp8", True), ("flash", True)],
                         ids=["flash-tp2", "v25fp8-tp2", "v25fp8-ep2", "flash-ep2"])
def test_two_ranks_give_one_ranks_greedy_tokens(bundles, reference, case, ep):
    c = CASES[case]
    want, ref_stats = reference[case]
    g = RankEngine(settings_for(bundles[case], c, tp=2, ep=ep))
    try:
        e = g.engine
        # each rank holds its share: half the query heads; the sliding layers' KV heads split,
        # the flash full layers' single KV head is replicated (it cannot split)
        model = e.runner.model
        geo = g.lm.model.geometry
        assert geo.sliding.heads * 2 == c.spec.swa_heads and geo.full.heads * 2 == c.spec.heads
        assert geo.full.kv_heads == max(1, c.spec.kv_heads // 2)
        if ep:
            assert geo.expert_range == (0, c.spec.experts // 2)
        got = run_trace(e, g.lm.vocab_size, True)
        e.runner.check_ranks()
        st = e.engine.stats()
        assert sum(len(v) for v in got.values()) > 100
        for rid in want:
            assert got[rid] == want[rid], rid
        # the cache, the host tier and speculation all worked under the group, as with one rank
        assert st["cached_tokens"] > 0 and st["tree_demoted_full"] > 0 and st["tree_loaded_full"] > 0, st
        assert st["spec_num_draft_tokens"] > 0, st
        assert e.engine.tiers.host.bytes_h2d > 0
        u = e.scheduler.stats()
        assert u["running"] == u["waiting"] == 0 and u["full_free"] + u["full_cached"] == u["full_total"]
        assert all(layer.k.shape[0] == spec.kv_heads for layer, spec in zip(e.runner.kv, model.layers))
    finally:
        g.close()
    for p in g.workers.procs:
        assert p.returncode == 0  # told to stop, it stopped


def test_a_layout_that_does_not_split_is_refused_with_the_reason(bundles):
    from llm_svc.models.mimo_tp import MiMoShard
    from llm_svc.models.geometry import mimo_geometry
    import json

    g = mimo_geometry(json.loads((bundles["flash"] / "config.json").read_text()))
    with pytest.raises(ValueError, match="attention heads do not split over 3 ranks"):
        MiMoShard(g, ParallelConfig(3), 0)
    with pytest.raises(ValueError, match="n_routed_experts = 6 does not split evenly over 4"):
        MiMoShard(dataclasses.replace(g, n_experts=6), ParallelConfig(4, enable_expert_parallel=True), 0)
    assert MiMoShard(g, ParallelConfig(4, enable_expert_parallel=True), 3).geometry.expert_range == (6, 8)


def test_logits_agree_within_tolerance(bundles):
    """The first step's logits of TP = 2 and of one rank, on the FP8 V2.5 (float32 compute)."""
    c = CASES["v25-fp8"]
    s1 = settings_for(bundles["v25-fp8"], c, host=False)
    lm = load_lm(s1.model_dir, dtype=s1.dtype)
    from llm_svc.models import build_model
    from llm_svc.engine.model_runner import ModelRunner
    from llm_svc.types.request import ForwardBatch, SeqForward

    n = 40
    batch = ForwardBatch([SeqForward("a", list(range(30, 30 + n)), 0, list(range(n)), list(range(n)), 0, True,
                                     all_logits=True, reset_full=[], reset_swa=[])])
    ref = ModelRunner(build_model(lm.arch, lm.model), 128, 128).run(batch)["a"]
    g = RankEngine(settings_for(bundles["v25-fp8"], c, tp=2, host=False))
    try:
        got = g.engine.runner.run(batch)["a"]
    finally:
        g.close()
    assert got.shape == ref.shape == (n, lm.vocab_size)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def rank_workers() -> list[int]:
    from tests.integration.test_engine_core_process import alive
    import os

    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"llm_svc.core.rank_worker" in f.read() and alive(int(pid)):
                        out.append(int(pid))
            except OSError:
                continue
    return out


def test_the_service_serves_with_two_ranks_and_a_dead_rank_restarts_the_group(bundles):
    """``tensor_parallel_size=2`` through the HTTP front: the same greedy tokens as one rank;
    killing rank 1 fails the in-flight request with an error at once (not a hang), ``/readyz``
    says why while the group restarts, and the new group serves."""
    import os
    import signal
    import threading
    import time

    import httpx

    from tests.integration.test_engine_core_process import gen_body, long_stream, start, wait_ready, alive

    before = set(rank_workers())
    outs = {}
    for tp in (1, 2):
        with start(bundles["flash"], tensor_parallel_size=tp) as svc:
            r = httpx.post(svc.url + "/v1/generate", content=gen_body("a", 16, text="the ranks agree"), timeout=60)
            assert r.status_code == 200, r.text
            outs[tp] = r.json()["token_ids"]
            if tp == 1:
                continue
            (rank1,) = set(rank_workers()) - before
            lines: list = []
            done = threading.Event()
            threading.Thread(target=long_stream, args=(svc.url, "victim", lines, done), daemon=True).start()
            deadline = time.monotonic() + 30
            while len(lines) < 3:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            os.kill(rank1, signal.SIGKILL)
            assert done.wait(30), "the in-flight request hung"
            assert lines[-1]["error"] and "engine core" in lines[-1]["error"], lines[-1]
            wait_ready(svc.url)
            assert svc.state.backend.client.restarts == 1
            (new_rank1,) = set(rank_workers()) - before
            assert new_rank1 != rank1 and not alive(rank1)
            r = httpx.post(svc.url + "/v1/generate", content=gen_body("b", 16, text="the ranks agree"), timeout=60)
            assert r.status_code == 200 and r.json()["token_ids"] == outs[1]
    assert outs[1] == outs[2] and len(outs[1]) == 16
    deadline = time.monotonic() + 10
    while set(rank_workers()) - before:  # the group went with its service
        assert time.monotonic() < deadline, "a rank outlived its service"
        time.sleep(0.1)


def test_mtp_drafts_under_tensor_parallelism(bundles):
    """MTP with TP = 2 (rank 0 holds the three MTP layers whole and drafts; the split model
    verifies): one rank's greedy tokens, drafts made and some accepted."""
    c = CASES["v25-fp8"]
    want, _ = one_rank(bundles["v25-fp8"], c, spec=MTP)
    g = RankEngine(settings_for(bundles["v25-fp8"], c, tp=2, spec=MTP))
    try:
        assert len(g.lm.model.mtp) == 3 and g.lm.model.mtp[0].self_attn.q_proj.out_features == \
            c.spec.swa_heads * c.spec.head_dim  # whole, not split
        got = run_trace(g.engine, g.lm.vocab_size, True)
        st = g.engine.engine.stats()
    finally:
        g.close()
    assert got == want
    assert st["spec_num_draft_tokens"] > 0, st


COLLECTIVES = r"""
import sys, torch
from llm_svc.parallel.comm import init_group
rank, port, shm = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
g = init_group(rank, 2, port, "gloo", shm=shm)
assert (g.shm is not None) == shm
gen = torch.Generator().manual_seed(rank)
out = []
for shape, dtype in [((3, 512), torch.float32), ((64, 512), torch.bfloat16), ((4000, 2100), torch.float32)]:
    t = torch.randn(*shape, generator=gen).to(dtype)  # the last: larger than a slot, by gloo
    g.all_reduce(t)
    out.append(t.float())
objs = [g.broadcast(("step", i, b"x" * (i * 9_000_000)) if rank == 0 else None) for i in range(3)]
assert [(o[1], len(o[2])) for o in objs] == [(i, i * 9_000_000) for i in range(3)]  # 18 MB: by gloo
torch.save(out, sys.argv[4])
g.close()
"""


def test_shared_memory_collectives_match_gloo(tmp_path):
    """The shared-memory all-reduce gives every rank the same sums, equal to gloo's within float
    rounding (bfloat16 summed in float32 and rounded once); broadcasts larger than the segment's
    area go by gloo, in order; nothing is left in /dev/shm."""
    import os
    import socket
    import subprocess
    import sys

    before = {f for f in os.listdir("/dev/shm") if f.startswith("mmserve-tp")}
    res = {}
    for shm in (True, False):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        files = [tmp_path / f"{shm}-{r}.pt" for r in range(2)]
        procs = [subprocess.Popen([sys.executable, "-c", COLLECTIVES, str(r), str(port), "1" if shm else "0",
                                   str(files[r])]) for r in range(2)]
        assert [p.wait(120) for p in procs] == [0, 0]
        res[shm] = [torch.load(f) for f in files]
    for r in range(2):
        for a, b in zip(res[True][r], res[True][0]):
            assert torch.equal(a, b)  # every rank the same, bit for bit
        for a, b in zip(res[True][r], res[False][r]):
            torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)
    assert {f for f in os.listdir("/dev/shm") if f.startswith("mmserve-tp")} == before
