"""The suite across real hosts: Linux network namespaces on a bridge, one per host, each with its
own address, names from a hosts file (``benchmarks.multi_host``): 2 gateways, 2 encoders, 3 LLM
replicas and Redis, under a bounded load of streamed chats. One LLM host is cut off (link down),
a new one comes up under the same name with a new address, and the encoders scale 2 -> 3 -> 1.

The scenario runs once; each test reads what it saw. Timings are reported by the benchmark, not
asserted here (beyond the client's own timeout, which is what "never a hang" means)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks._netns import unavailable
from benchmarks.multi_host import CLIENT_TIMEOUT_S, Plan, run_scenario, summarize
from gateway.upstream import LOST_MID_GENERATION

pytestmark = pytest.mark.e2e

WHY_NOT = unavailable()


@pytest.fixture(scope="module")
def seen(mimo_bundle, tmp_path_factory):
    if WHY_NOT:
        pytest.skip(f"network namespaces cannot be created here: {WHY_NOT}")
    log_dir = Path(tmp_path_factory.mktemp("multi-host-logs"))
    rec = run_scenario(str(mimo_bundle), log_dir, Plan(warm_s=3.0, after_s=2.0), progress=lambda m: None)
    return rec, summarize(rec)


def test_no_request_hangs_and_only_the_cut_hosts_streams_fail(seen):
    rec, s = seen
    assert s["requests"] > 50, s
    assert s["hangs"] == 0, s  # every request was answered within the client's timeout
    assert s["errors_beyond_in_flight"] == 0, (s, rec.logs)
    # the cut host had work in hand: each request it had not answered went to another replica,
    # each of its streams under way ended with an error event; none hung
    assert s["cut_host_admitted"] >= 1, s
    assert sum(s["lost_mid_answer"]) + sum(s["lost_before_answer_retried"]) >= 1, s
    assert s["errors"] == sum(s["lost_mid_answer"]), s
    for o in rec.outcomes:
        if not o.ok:
            assert o.status == 200 and LOST_MID_GENERATION in (o.error or ""), o
            assert o.end - o.start < CLIENT_TIMEOUT_S, o


def test_both_gateways_take_the_cut_host_out_of_rotation(seen):
    rec, s = seen
    assert len(s["detect_s"]) == 2 and all(d is not None for d in s["detect_s"]), s


def test_a_new_replica_under_the_same_name_takes_traffic(seen):
    rec, s = seen
    assert s["new_llm_traffic_s"] is not None, s
    assert s["llm_requests"]["llm4"] > 0 and s["llm_requests"]["llm1"] > 0 and s["llm_requests"]["llm2"] > 0, s


def test_encoders_scale_up_and_down_without_errors(seen):
    rec, s = seen
    assert s["new_encoder_traffic_s"] is not None and s["encoder_image_requests"]["enc3"] > 0, s
    assert s["errors_during_encoder_scaling"] == 0, s
    # after 3 -> 1 only enc1 serves, and it kept serving
    late = [o for o in rec.outcomes if o.image and o.start > rec.events["encoders_1_stopped"]]
    assert late and all(o.ok for o in late), late[:3]
