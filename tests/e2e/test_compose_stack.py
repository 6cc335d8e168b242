"""compose.yaml for real: the image built offline (cached between runs), the stack started on a
Docker engine with 2 encoders and 2 LLM replicas on the tiny model, driven through the gateway's
published port with the openai client, one LLM container killed mid-stream, scaled, taken down.

Select it alone with ``-m compose``. It needs root and a Docker engine (started when missing:
scripts/docker_engine.sh); where neither can be had it fails, it never skips.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time

import httpx
import openai
import pytest

from benchmarks._compose_util import ComposeProject, build_image, readable_bundle
from benchmarks._stack_util import audio_part, image_part, make_mp4, make_png, make_wav, user, video_part
from tests.e2e.conftest import stream_chat

# a cold image build (no layer cached) takes minutes before the first test: the module gets 40
pytestmark = [pytest.mark.e2e, pytest.mark.compose, pytest.mark.timeout(2400)]

ENCODERS, LLMS = 2, 2
LLM_PORT, ENCODER_PORT = 8200, 8100


@pytest.fixture(scope="module")
def project(mimo_bundle):
    build = build_image("mmserve:latest")
    print(f"\n[compose] image build: {build}")
    p = ComposeProject(readable_bundle(mimo_bundle), image=build["image"], redis_image=build["redis_image"])
    try:
        ready_s = p.up(ENCODERS, LLMS)
        print(f"[compose] {p.name}: up with {ENCODERS} encoders, {LLMS} LLMs, ready in {ready_s:.1f} s")
        yield p
    finally:
        p.down()


@pytest.fixture(scope="module")
def client(project):
    return openai.OpenAI(base_url=f"{project.url}/v1", api_key="unused", max_retries=0, timeout=180)


def _model(client) -> str:
    return client.models.list().data[0].id


def _metric(text: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    want = set(labels.items())
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and want <= set(s.labels.items()))


def test_containers_are_hardened_and_only_the_gateway_is_published(project):
    assert len(project.containers("encoder")) == ENCODERS and len(project.containers("llm")) == LLMS
    for service in ("redis", "encoder", "llm", "gateway"):
        for cid in project.containers(service):
            info = project.inspect(cid)
            host = info["HostConfig"]
            assert host["ReadonlyRootfs"] is True, service
            assert host["CapDrop"] == ["ALL"], service
            assert host["RestartPolicy"]["Name"] == "unless-stopped", service
            assert host["Memory"] > 0, service
            published = {p: b for p, b in (info["NetworkSettings"]["Ports"] or {}).items() if b}
            if service == "gateway":
                assert published == {"8000/tcp": [{"HostIp": "127.0.0.1", "HostPort": str(project.port)}]}
            else:
                assert published == {}, service
            if service != "redis":
                assert info["Config"]["User"] == "10001:10001", service


def test_text_chat(client):
    r = client.chat.completions.create(model=_model(client), max_tokens=8, temperature=0,
                                       messages=[{"role": "user", "content": "Say hi"}])
    assert r.object == "chat.completion" and r.usage.completion_tokens >= 1
    assert r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("part", ["image", "video", "audio"])
def test_media_chat(client, part):
    media = {"image": lambda: image_part(make_png(seed=11)), "video": lambda: video_part(make_mp4(seconds=1.0)),
             "audio": lambda: audio_part(make_wav(seconds=1.0))}[part]()
    ask = lambda *parts: client.chat.completions.create(model=_model(client), max_tokens=6, temperature=0,  # noqa: E731
                                                        messages=[user("What is this?", *parts)])
    r = ask(media)
    assert r.usage.completion_tokens >= 1
    assert r.usage.prompt_tokens > ask().usage.prompt_tokens, r.usage  # the media's tokens are in the prompt


def test_streamed_chat(client):
    text, finish, usage = stream_chat(client, _model(client), [{"role": "user", "content": "Count to five"}], 12)
    assert finish in ("stop", "length") and usage.completion_tokens >= 1
    assert text or usage.completion_tokens >= 1


def test_tools_and_json_schema(client):
    """A forced tool call follows its schema (a random model may run to max_tokens: seeds are tried
    until one ends by itself), and a json_schema answer parses into the schema."""
    model = _model(client)
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]}}, "required": ["city"],
        "additionalProperties": False}}}
    for seed in range(8):
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                           tools=[weather], tool_choice="required", parallel_tool_calls=False,
                                           max_tokens=200, temperature=1.0, seed=seed)
        if r.choices[0].finish_reason == "tool_calls":
            break
    else:
        pytest.fail("no seed ended its tool call within max_tokens")
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Oslo", "Lima")
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green"]}}, "required": ["color"],
              "additionalProperties": False}
    for seed in range(8):  # the grammar allows whitespace, which a random model may pile up
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "A color as JSON"}], max_tokens=100, temperature=1.0,
            seed=seed, response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}})
        if r.choices[0].finish_reason == "stop":
            break
    else:
        pytest.fail("no seed ended its JSON within max_tokens")
    assert json.loads(r.choices[0].message.content)["color"] in ("red", "green")


def test_the_same_image_twice_is_an_encoder_cache_hit(client, project):
    def lookups(result: str) -> float:
        return sum(_metric(project.http_in(cid, ENCODER_PORT, "/metrics"), "encoder_cache_lookups_total",
                           modality="image", result=result) for cid in project.containers("encoder"))

    png = make_png(seed=4242, width=64, height=48)
    before = lookups("hit")
    for i in range(2):  # another question each time: the LLM's prefix cache does not answer for it
        client.chat.completions.create(model=_model(client), max_tokens=4, temperature=0,
                                       messages=[user(f"Question {i}: what is this?", image_part(png))])
    assert lookups("hit") >= before + 1


def test_every_llm_container_loads_every_c_kernel(project):
    for cid in project.containers("llm"):
        deadline = time.monotonic() + 120
        while (kernels := json.loads(project.http_in(cid, LLM_PORT, "/readyz"))["kernels"]) is None:
            assert time.monotonic() < deadline, "no kernel report"
            time.sleep(1)
        assert kernels["fallback"] == {}, kernels
        assert len(kernels["loaded"]) >= 19, kernels
        builds = set(kernels["loaded"].values())
        assert len(builds) == 1 and builds.pop().endswith("(prebuilt)"), kernels  # no compiler in the image
        assert "no C compiler" in kernels["native_unavailable"]
        metrics = project.http_in(cid, LLM_PORT, "/metrics")
        assert _metric(metrics, "mmserve_llm_kernel_loaded") == len(kernels["loaded"])


def _sse_events(project, body: dict, on_first) -> list[dict | str]:
    """A streamed chat read raw: every SSE data payload (JSON, or the literal [DONE])."""
    events: list[dict | str] = []
    with httpx.stream("POST", f"{project.url}/v1/chat/completions", json=body, timeout=180) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            events.append(data if data == "[DONE]" else json.loads(data))
            if len(events) == 3:
                on_first()
    return events


def _running(project, cid: str) -> float:
    return _metric(project.http_in(cid, LLM_PORT, "/metrics"), "mmserve_llm_running_requests")


def test_a_killed_llm_container_ends_its_stream_with_an_error_and_restarts(client, project):
    """SIGKILL to the serving LLM container's main process mid-stream, from the host: what an OOM
    kill or a crash does. (``docker kill`` sends the same signal, but Docker counts it as an
    operator's stop: no restart policy restarts it, checked on Docker 20.10 for always,
    unless-stopped and on-failure; docs/deployment.md.)"""
    model = _model(client)
    llms = project.containers("llm")
    body = {"model": model, "stream": True, "max_tokens": 4000, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Write a very long story."}]}
    killed: list[str] = []

    def kill_the_serving_replica() -> None:
        (serving,) = [cid for cid in llms if _running(project, cid) >= 1]
        killed.append(serving)
        restarts = project.inspect(serving)["RestartCount"]
        killed.append(restarts)
        subprocess.run(["kill", "-KILL", str(project.inspect(serving)["State"]["Pid"])], check=True)

    events = _sse_events(project, body, kill_the_serving_replica)
    victim, restarts_before = killed
    # the gateway's convention (tests/integration/test_gateway_chat.py): an error event, then [DONE];
    # no chunk claims a finish
    assert events[-1] == "[DONE]" and "error" in events[-2], events[-3:]
    assert not any(c.get("finish_reason") for e in events[:-1] for c in e.get("choices", [])), events[-3:]
    assert len(events) < 4000, "the stream ran to its end: the kill did not hit it"

    # the next requests succeed on the other replica, the gateway stays ready
    for i in range(3):
        r = client.chat.completions.create(model=model, max_tokens=4, temperature=0,
                                           messages=[{"role": "user", "content": f"After the kill {i}"}])
        assert r.usage.completion_tokens >= 1
    assert httpx.get(f"{project.url}/readyz", timeout=10).status_code == 200

    # the restart policy brings the killed container back, healthy
    deadline = time.monotonic() + 240
    while True:
        st = project.inspect(victim)
        if st["RestartCount"] > restarts_before and st["State"].get("Health", {}).get("Status") == "healthy":
            break
        assert time.monotonic() < deadline, st["State"]
        time.sleep(2)


def test_scaling_llm_up_under_load_loses_nothing(client, project):
    model = _model(client)
    results: list[str] = []
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            try:
                r = client.chat.completions.create(model=model, max_tokens=4, temperature=0,
                                                   messages=[{"role": "user", "content": f"load {len(results)}"}])
                results.append("ok" if r.usage.completion_tokens >= 1 else "empty")
            except openai.APIError as e:
                results.append(repr(e))

    threads = [threading.Thread(target=load) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        project.scale("llm", LLMS + 1)
        new = project.containers("llm")[-1]
        deadline = time.monotonic() + 300
        while project.inspect(new)["State"].get("Health", {}).get("Status") != "healthy":
            assert time.monotonic() < deadline, "the third LLM replica never became healthy"
            time.sleep(2)
        # the gateway re-resolves `llm` and sends the new replica requests
        deadline = time.monotonic() + 120
        while _metric(project.http_in(new, LLM_PORT, "/metrics"), "mmserve_llm_requests_total") < 1:
            assert time.monotonic() < deadline, "the gateway never routed to the new replica"
            time.sleep(1)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert len(results) >= 4 and all(r == "ok" for r in results), results[:5]


def test_down_leaves_no_container_network_or_volume(project):
    assert project.leftovers()["containers"]
    project.down()
    assert project.leftovers() == {"containers": [], "networks": [], "volumes": []}
