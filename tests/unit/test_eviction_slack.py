"""Once the KV pools are full every decode step asks eviction for a slot per sequence; each ask
used to scan every tree node. Eviction now frees ``EVICT_SLACK`` of the pool beyond the ask, so
scans are rare: counted here (no timings) on a scheduler run that fills and churns its pools."""

from __future__ import annotations

import pytest

import llm_svc.kv.radix_evict as radix_evict
from mmserve.testing.sched_sim import SimRunner
from llm_svc.engine.scheduler import Scheduler, SchedulerConfig
from llm_svc.types.request import Request
from shared.schemas import SamplingParams

pytestmark = pytest.mark.unit


def churn(n_requests: int = 1200) -> tuple[dict, list]:
    """Unique prompts through pools that fill after a few dozen requests; (tree stats, outputs)."""
    cfg = SchedulerConfig(max_batch_tokens=256, window=16, max_running=16)
    sched = Scheduler(cfg, 16384, 8192)
    runner = SimRunner(lambda rid: sched.requests[rid], cfg.window)
    for i in range(n_requests):
        prompt = [1 + (i * 7919 + k * 31) % 5000 for k in range(48)]
        sched.add(Request(f"r{i}", prompt, SamplingParams(max_tokens=12, ignore_eos=True)))
    outs = []
    while (batch := sched.schedule()) is not None:
        outs += [(o.req_id, o.token_id) for o in sched.postprocess(batch, runner.run(batch))]
    sched.check_integrity()
    assert not sched.has_unfinished()
    return dict(sched.kv.tree.stats), outs


def test_full_pools_scan_the_tree_rarely(monkeypatch):
    with_slack, outs = churn()
    monkeypatch.setattr(radix_evict, "EVICT_SLACK", 0.0)
    monkeypatch.setattr(radix_evict, "SWA_EVICT_SLACK", 0.0)
    without, outs_without = churn()
    assert without["node_evictions"] > 100  # the pools did fill and churn
    assert outs == outs_without  # eviction is bookkeeping: the same tokens either way
    assert with_slack["eviction_scans"] * 5 < without["eviction_scans"], (with_slack, without)


def test_slack_never_exceeds_what_is_evictable():
    assert radix_evict.with_slack(0, 6400, 6400) == 0
    assert radix_evict.with_slack(3, 6400, 6400) == 100
    assert radix_evict.with_slack(3, 6400, 40) == 40
    assert radix_evict.with_slack(300, 6400, 6400) == 300
    assert radix_evict.with_slack(3, 6400, 6400, slack=1 / 16) == 400


def test_eviction_looks_only_at_indexed_candidates():
    """Every eviction picks among an index, not every node: device SWA and host SWA among the
    nodes holding SWA, device full among the device leaves, host full among the nodes with a
    host copy. ``check_integrity`` (run all along, with a host tier) proves the indexes exact;
    each is a part of the tree (windows mostly gone, most nodes inner or host-only)."""
    cfg = SchedulerConfig(max_batch_tokens=256, window=16, max_running=16)
    sched = Scheduler(cfg, 8192, 2048, num_host_full=16384, num_host_swa=4096)
    runner = SimRunner(lambda rid: sched.requests[rid], cfg.window)
    for i in range(600):
        prompt = [1 + (i * 7919 + k * 31) % 5000 for k in range(48)]
        sched.add(Request(f"r{i}", prompt, SamplingParams(max_tokens=12, ignore_eos=True)))
    steps = 0
    while (batch := sched.schedule()) is not None:
        sched.postprocess(batch, runner.run(batch))
        steps += 1
        if steps % 25 == 0:
            sched.check_integrity()
    sched.check_integrity()
    tree = sched.kv.tree
    assert tree.stats["swa_evictions"] > 100 and tree.stats["host_swa_evictions"] > 100, tree.stats
    assert tree.stats["demoted_full"] > 1000 and tree.stats["host_evictions"] > 100, tree.stats
    assert 0 < len(tree.device.leaves) * 4 < tree.num_nodes, (len(tree.device.leaves), tree.num_nodes)
    assert 0 < len(tree.host.full_nodes) < tree.num_nodes
    assert 0 < len(tree.device.swa_nodes) and len(tree.device.swa_nodes) * 4 < tree.num_nodes, (len(tree.device.swa_nodes), tree.num_nodes)
    assert 0 < len(tree.host.swa_nodes) < tree.num_nodes
