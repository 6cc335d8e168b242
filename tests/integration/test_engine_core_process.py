"""The engine core in its own process, supervised by the HTTP front: a killed or stalled core
fails its in-flight requests at once with an error body, ``/readyz`` is 503 until a new core
serves, then requests succeed again; a killed front takes its core with it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from shared.schemas import GenerateRequest, PromptMessage, PromptText, SamplingParams
from shared.wire import pack
from tests.integration.test_llm_service import ServerThread

pytestmark = pytest.mark.integration


def core_processes(parent: int | None = None) -> list[int]:
    """Engine-core processes on this machine (of front ``parent``, when given)."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
        except OSError:
            continue
        if b"llm_svc.core.process" in cmd and (parent is None or str(parent).encode() in cmd):
            out.append(int(pid))
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def gen_body(rid: str, max_tokens: int = 8, stream: bool = False, text: str = "hello world") -> bytes:
    req = GenerateRequest(request_id=rid, messages=[PromptMessage(role="user", content=[PromptText(text=text)])],
                          sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True), stream=stream)
    return pack({}, req)


def start(mimo_bundle, **kw) -> ServerThread:
    from llm_svc.front.app import create_app
    from shared.settings import LLMSettings

    settings = LLMSettings(model_dir=str(mimo_bundle), max_model_len=4096, kv_bytes=32 * 1024 * 1024,
                           core_max_backoff=1.0, **kw)
    app = create_app(settings)
    svc = ServerThread(app)
    svc.state = app.state.svc
    return svc


def wait_ready(url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:  # not listening yet
            pass
        time.sleep(0.1)
    raise AssertionError("the service did not become ready again")


def long_stream(url: str, rid: str, lines: list, done: threading.Event) -> None:
    """A streamed request long enough to be in flight when the core dies; records its lines."""
    try:
        with httpx.stream("POST", url + "/v1/generate", content=gen_body(rid, 3000, stream=True), timeout=60) as r:
            lines.append(r.status_code)
            for line in r.iter_lines():
                if line:
                    lines.append(json.loads(line))
    finally:
        done.set()


@pytest.mark.parametrize("how", ["kill", "stall"])
def test_dead_or_stalled_core_fails_in_flight_then_restarts(mimo_bundle, how):
    with start(mimo_bundle, core_stall_timeout=6.0) as svc:
        client = svc.state.backend.client
        pid = client.core_pid
        assert pid in core_processes()
        # a plain request works, and one is in flight when the core goes
        assert httpx.post(svc.url + "/v1/generate", content=gen_body("before"), timeout=60).status_code == 200
        lines: list = []
        done = threading.Event()
        threading.Thread(target=long_stream, args=(svc.url, "victim", lines, done), daemon=True).start()
        deadline = time.monotonic() + 30
        while len(lines) < 3:  # status + two tokens: it is generating
            assert time.monotonic() < deadline
            time.sleep(0.02)
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        try:
            assert done.wait(30), "the in-flight request hung"
            elapsed = time.monotonic() - t0
            last = lines[-1]
            assert last["error"] and "engine core" in last["error"], last
            assert elapsed < 20, elapsed
            r = httpx.get(svc.url + "/readyz", timeout=5)
            if r.status_code == 503:  # the restart may already be done on a fast machine
                assert "engine core" in r.json()["detail"]
                resp = httpx.post(svc.url + "/v1/generate", content=gen_body("during"), timeout=10)
                assert resp.status_code == 503 and resp.json()["error"]["message"]
        finally:
            if how == "stall" and alive(pid):
                os.kill(pid, signal.SIGCONT)
        wait_ready(svc.url)
        assert not alive(pid)  # the old core is gone (killed by the watchdog when it stalled)
        assert client.core_pid != pid and client.core_pid in core_processes()
        r = httpx.post(svc.url + "/v1/generate", content=gen_body("after"), timeout=60)
        assert r.status_code == 200 and len(r.json()["token_ids"]) == 8
        assert client.restarts == 1
        metrics = httpx.get(svc.url + "/metrics", timeout=5).text
        assert "mmserve_llm_engine_core_restarts 1.0" in metrics
        new_pid = client.core_pid
    assert not alive(new_pid), "the core outlived its service"


def start_front(mimo_bundle, **popen) -> tuple[subprocess.Popen, int]:
    """``mmserve llm`` in a subprocess, ready, with exactly one engine core: (front, core pid)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    front = subprocess.Popen([sys.executable, "-m", "mmserve.cli", "llm", "--model", str(mimo_bundle), "--port",
                              str(port)], **popen)
    try:
        wait_ready(f"http://127.0.0.1:{port}")
        cores = core_processes(front.pid)
        assert len(cores) == 1
    except BaseException:
        front.kill()
        raise
    return front, cores[0]


def wait_gone(pid: int, what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while alive(pid):
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_killed_front_takes_its_core_along(mimo_bundle, tmp_path):
    front, core = start_front(mimo_bundle, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        front.kill()
        front.wait(10)
        wait_gone(core, "orphaned engine core")
    finally:
        if front.poll() is None:
            front.kill()


def test_sigterm_to_the_service_group_stops_front_and_core_without_a_restart(mimo_bundle, tmp_path):
    """``kill -- -PGID`` (what ``mmserve up`` and process managers send): the core is in its own
    group, so it does not die first and get restarted mid-shutdown; the front stops it with
    CoreShutdown and exits by the SIGTERM it was sent, with no core left behind."""
    log = tmp_path / "llm.log"
    with open(log, "wb") as out:
        front, core = start_front(mimo_bundle, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        assert os.getpgid(core) != os.getpgid(front.pid)
        os.killpg(front.pid, signal.SIGTERM)
        code = front.wait(60)
        text = log.read_text(errors="replace")
        assert code in (0, -signal.SIGTERM), text[-3000:]
        assert "restarting it" not in text, text[-3000:]
        assert text.count("started engine core") == 1, text[-3000:]
        wait_gone(core, "the core outlived its service")
    finally:
        if front.poll() is None:
            front.kill()


def test_first_core_that_cannot_load_is_reported_not_looped(mimo_bundle, tmp_path):
    """Weights the core cannot load (the front, which reads only the config and tokenizer,
    starts): ``/healthz`` is 500 with the reason, ``/readyz`` 503, and no core is left running."""
    import shutil

    from llm_svc.front.app import create_app
    from shared.settings import LLMSettings

    bad = tmp_path / "bad"
    shutil.copytree(mimo_bundle, bad)
    (bad / "model.safetensors").write_bytes(b"not a safetensors file")
    svc = ServerThread(create_app(LLMSettings(model_dir=str(bad), kv_bytes=32 * 1024 * 1024)))
    svc.thread.start()
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                r = httpx.get(svc.url + "/healthz", timeout=2)
                if r.status_code == 500:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the load failure was never reported"
            time.sleep(0.1)
        assert "engine core" in r.json()["detail"]
        assert httpx.get(svc.url + "/readyz", timeout=2).status_code == 503
        time.sleep(1.5)
        assert not core_processes(os.getpid()), "a core of the failed service is still running"
    finally:
        svc.__exit__()
