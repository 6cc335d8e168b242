"""Issue 11 item 7: what grows while a service serves stops growing at its bound. Counted, never
timed or measured as RSS: the prefix tree (nodes, tokens, live ``Node`` objects) of the real
engine under a stream of unique prompts, with the host tier off and on, plateaus once its pools
are full, and no per-request state survives a finished request; the gateway's routing index,
over real HTTP, stops at ``router_index_blocks``."""

from __future__ import annotations

import gc
import random

import httpx
import pytest

from gateway.app import create_app
from mmserve.testing.fake_services import ServerThread, fake_encoder_app, fake_llm_app
from mmserve.testing.in_process import InProcessEngine
from llm_svc.engine.engine import Engine
from llm_svc.engine.model_runner import ModelRunner
from llm_svc.engine.scheduler import Scheduler, SchedulerConfig
from llm_svc.kv.radix_node import Node
from llm_svc.models import build_model
from llm_svc.offload.host_kv import HostKV
from llm_svc.offload.tiers import KVTiers
from llm_svc.types.request import PreparedRequest
from shared.schemas import SamplingParams
from shared.settings import GatewaySettings
from tests.conftest import SMALL_W
from tests.integration.test_llm_engine import run_to_end

pytestmark = pytest.mark.integration
NUM_FULL = 400
HOST_FULL = 600


def small_engine(lm, host: bool) -> InProcessEngine:
    cfg = SchedulerConfig(window=SMALL_W, max_batch_tokens=48, max_running=4)
    num_swa = cfg.min_swa_slots() + 24
    host_full, host_swa = (HOST_FULL, num_swa) if host else (0, 0)
    model = build_model(lm.arch, lm.model)
    sched = Scheduler(cfg, NUM_FULL, num_swa, num_host_full=host_full, num_host_swa=host_swa)
    runner = ModelRunner(model, NUM_FULL, num_swa)
    tiers = None
    if host:
        hkv = HostKV(runner.kv, [s.kind for s in model.layers], host_full, host_swa)
        tiers = KVTiers(sched.kv, hkv, None)
    return InProcessEngine(Engine(runner, sched, lm.eos_token_ids, tiers=tiers), lm.tokenizer)


def unique_prompts(lm, start: int, n: int, rng: random.Random) -> list[PreparedRequest]:
    """Prompts that share nothing but a 4-token head (every one is new to the tree)."""
    head = [21, 22, 23, 24]
    return [PreparedRequest(request_id=f"r{start + i}",
                            prompt_ids=head + [rng.randrange(30, lm.vocab_size) for _ in range(rng.randint(8, 40))],
                            sampling=SamplingParams(max_tokens=rng.randint(2, 8), ignore_eos=True))
            for i in range(n)]


def live_nodes() -> int:
    gc.collect()
    return sum(type(o) is Node for o in gc.get_objects())


@pytest.mark.parametrize("host", [False, True], ids=["device-only", "host-tier"])
def test_prefix_tree_plateaus_at_its_pools_and_nothing_per_request_survives(mimo16, host):
    eng = small_engine(mimo16, host)
    tree, kv = eng.scheduler.kv.tree, eng.scheduler.kv
    bound = NUM_FULL + (HOST_FULL if host else 0)  # tokens the tree can hold, every node >= 1
    rng = random.Random(0)
    counts = []
    for r in range(12):
        run_to_end(eng, unique_prompts(mimo16, 8 * r, 8, rng))
        counts.append((tree.num_nodes, tree.full_tokens + tree.host_full_tokens, live_nodes()))
        eng.scheduler.check_integrity()
        tree.check_integrity()
        # no per-request state outlives its request
        assert not eng.engine._live and not eng.scheduler.requests and len(eng.outputs) == 0
        assert not eng.scheduler.running and not eng.scheduler.waiting and not kv.l3_notes and not kv.hits
        # the runner frees a finished request's table row with the next batch: at most a batch's worth wait
        assert len(eng.runner.tables.row_of) <= 4 and len(eng.scheduler._dropped) <= 4
    # the pools fill within the first rounds (8 prompts of ~30 tokens a round) ...
    assert kv.full_pool.num_free <= NUM_FULL // 10
    if host:
        assert kv.host_full_pool.num_free <= HOST_FULL // 10 and tree.stats["demoted_full"] > 0
    assert tree.stats["node_evictions"] + tree.stats.get("host_evictions", 0) > 0
    # ... and from then on the tree's size is the pools' bound, not the requests' count
    for nodes, tokens, objs in counts:
        assert tokens <= bound and nodes <= bound
        assert objs <= nodes + 8  # live Node objects: the tree's (and the root), no stragglers
    late = [c[0] for c in counts[6:]]
    assert max(late) <= 2 * min(late), f"tree nodes keep growing after the pools filled: {counts}"


def test_gateway_routing_index_stops_at_its_bound():
    enc, llm = ServerThread(fake_encoder_app("e0")).start(), ServerThread(fake_llm_app("l0")).start()
    settings = GatewaySettings(model_name="m", encoder_urls=[enc.url], llm_urls=[llm.url], dns_interval=0,
                               health_interval=0, router_index_blocks=64)
    app = create_app(settings)
    try:
        with ServerThread(app).start() as gw, httpx.Client(base_url=gw.url, timeout=30) as c:
            sizes = []
            for i in range(60):  # each prompt is 2-3 blocks of 64 chars, all new
                text = f"{i} " + "unique words for the routing index " * 4
                r = c.post("/v1/chat/completions", json={"model": "m", "max_tokens": 4,
                                                         "messages": [{"role": "user", "content": text}]})
                assert r.status_code == 200, r.text
                sizes.append(app.state.gateway.llms.router.index_blocks())
            assert sizes[5] < 64 and sizes[-1] == 64 and max(sizes) == 64, sizes
            metrics = c.get("/metrics").text
            assert "mmserve_gateway_router_index_blocks 64.0" in metrics
            llm.server.config.app.state.requests.clear()
    finally:
        enc.stop()
        llm.stop()
