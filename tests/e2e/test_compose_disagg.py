"""compose.yaml + compose.disagg.yaml for real on the Docker engine (the image the compose test
builds, cached): one encoder, one decode `llm` and one `llm-prefill` container behind the
gateway; a long chat is prefilled in the prefill container and handed over, over the compose
network, to the decode container at the address it advertises (``handover_host auto``).

Select it with ``-m compose``; like the compose test it needs root and a Docker engine and fails,
never skips, without them."""

from __future__ import annotations

import json

import openai
import pytest

from benchmarks._compose_util import ComposeProject, build_image, readable_bundle

pytestmark = [pytest.mark.e2e, pytest.mark.compose, pytest.mark.timeout(2400)]

LONG = "Read these notes closely. " + " ".join(f"note {i}: the tide turned at dawn." for i in range(150))


@pytest.fixture(scope="module")
def project(mimo_bundle):
    build = build_image("mmserve:latest")
    p = ComposeProject(readable_bundle(mimo_bundle), image=build["image"], redis_image=build["redis_image"],
                       files=("compose.yaml", "compose.disagg.yaml"))
    try:
        p.up(1, 1, llm_prefill=1)
        yield p
    finally:
        p.down()


def _metric(text: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    want = set(labels.items())
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and want <= set(s.labels.items()))


def test_a_long_chat_is_prefilled_in_one_container_and_decoded_in_the_other(project):
    (decode,), (prefill,) = project.containers("llm"), project.containers("llm-prefill")
    ready = json.loads(project.http_in(decode, 8200, "/readyz"))
    ip = project.inspect(decode)["NetworkSettings"]["Networks"]
    assert ready["role"] == "decode" and ready["handover"]["host"] in {n["IPAddress"] for n in ip.values()}
    assert json.loads(project.http_in(prefill, 8210, "/readyz"))["role"] == "prefill"
    client = openai.OpenAI(base_url=f"{project.url}/v1", api_key="unused", max_retries=0, timeout=180)
    model = client.models.list().data[0].id
    r = client.chat.completions.create(model=model, max_tokens=8, temperature=0,
                                       messages=[{"role": "user", "content": LONG}])
    assert r.usage.completion_tokens >= 1
    d, p = project.http_in(decode, 8200, "/metrics"), project.http_in(prefill, 8210, "/metrics")
    assert _metric(d, "mmserve_llm_handover", event="adopted") == 1
    assert _metric(d, "mmserve_llm_remote_prefill_total", outcome="handed_over") == 1
    assert _metric(p, "mmserve_llm_handover", event="sent") == 1
