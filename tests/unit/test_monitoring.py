"""compose's monitoring profile: Prometheus scrapes every service on its real port, and every
Grafana query names a series the services export (renaming a metric breaks this test)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from encoder_svc.metrics import EncoderMetrics
from gateway.metrics import GatewayMetrics
from llm_svc.front.metrics import LLMMetrics
from llm_svc.types.request import BackendStats

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
PROMQL_WORDS = {"sum", "by", "rate", "increase", "histogram_quantile", "le", "instance", "status", "route",
                "result", "pool", "hit"}


def exported_series() -> set[str]:
    enc = EncoderMetrics()
    enc.cache_lookups.labels("memory", "image", "hit").inc()
    enc.batch_size.labels("vision").observe(1)
    enc.queue_wait.labels("vision").observe(0.01)
    enc.forwards.labels("vision").inc()
    enc.forward_items.labels("vision").inc()
    gw = GatewayMetrics()
    gw.requests.labels("/v1/chat/completions", "200").inc()
    texts = [LLMMetrics().render(BackendStats()).decode(), enc.render().decode(), gw.render().decode()]
    return {s.name for t in texts for f in text_string_to_metric_families(t) for s in f.samples}


def test_monitoring_profile_scrapes_every_service_port():
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    svcs = compose["services"]
    mon = {n for n, s in svcs.items() if "monitoring" in (s.get("profiles") or [])}
    assert mon == {"prometheus", "grafana"}
    for n in mon:
        for vol in svcs[n]["volumes"]:
            assert (ROOT / vol.split(":")[0]).exists(), vol
    prom = yaml.safe_load((ROOT / "monitoring" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    assert set(jobs) == {"gateway", "encoder", "llm"}
    for name in ("encoder", "llm"):
        (sd,) = jobs[name]["dns_sd_configs"]  # one target per replica, not one per service
        assert sd["names"] == [name]
        assert str(sd["port"]) == svcs[name]["environment"][f"MMSERVE_{name.upper()}_PORT"]
    assert jobs["gateway"]["static_configs"][0]["targets"] == [
        f"gateway:{svcs['gateway']['environment']['MMSERVE_GATEWAY_PORT']}"]


def test_every_grafana_query_names_an_exported_series():
    dash = json.loads((ROOT / "monitoring" / "grafana" / "dashboards" / "mmserve.json").read_text())
    exported = exported_series()
    used = set()
    for panel in dash["panels"]:
        for t in panel["targets"]:
            expr = re.sub(r'\{[^}]*\}|"[^"]*"|\[[^\]]*\]', "", t["expr"])
            used |= {w for w in re.findall(r"[a-zA-Z_][a-zA-Z0-9_]*", expr) if w not in PROMQL_WORDS}
    assert used and used <= exported, sorted(used - exported)
    titles = " ".join(p["title"] for p in dash["panels"]).lower()
    for topic in ("kv pool", "prefix hit", "encoder cache hit", "batch size", "queue depth", "ttft", "inter-token"):
        assert topic in titles, topic
