"""Run the mmserve topology (encoders, LLM services, one gateway) as local processes.

The same topology ``compose.yaml`` describes, for machines without Docker and for tests.
Each service is ``python -m mmserve.cli <service> ...`` in its own process session; logs go to
one file per service. ``LocalStack`` is a context manager: leaving it stops every process.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import httpx

from mmserve.supervisor import RestartPolicy, supervise
from shared.settings import THIS_MACHINE


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class StackSpec:
    model_dir: str
    host: str = "127.0.0.1"
    gateway_port: int = 8000  # 0: pick a free port
    encoders: int = 1
    llms: int = 1
    # prefill / decode disaggregation (docs/disagg.md): with prefill_llms > 0, the llms run with
    # role decode and these with role prefill, and the gateway pairs them
    prefill_llms: int = 0
    llm_backend: str | None = None
    redis_url: str | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    # gateway options (None / empty: the gateway's own defaults)
    llm_routing: str | None = None  # "cache_aware" | "round_robin"
    api_keys: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ()  # SSRF allow-list (hosts, IPs, CIDRs)
    gateway_env: dict[str, str] = field(default_factory=dict)  # MMSERVE_GATEWAY_<FIELD> by field name
    trust_request_chat_template: bool = False  # gateway and LLMs render a request's own template

    def __post_init__(self) -> None:
        if self.encoders < 0 or self.llms < 1:  # 0 encoders: a text-only LM (no media encoder to run)
            raise ValueError("a stack needs at least one LLM service (and encoders >= 0)")
        if self.prefill_llms < 0:
            raise ValueError("prefill_llms must be >= 0")
        if self.llm_routing not in (None, "cache_aware", "round_robin"):
            raise ValueError(f"llm_routing must be cache_aware or round_robin, not {self.llm_routing!r}")


PEER_KEY_VARS = ("MMSERVE_ENCODER_PEER_KEY", "MMSERVE_LLM_PEER_KEY", "MMSERVE_GATEWAY_PEER_KEY")


def stack_peer_keys(env: dict[str, str]) -> dict[str, str]:
    """Every service's peer key (shared.peer_auth): ``MMSERVE_PEER_KEY`` or a per-service one from
    the environment when set (stacks sharing a Redis share its entries only under one key), else
    a fresh random key for this stack (what an earlier stack left in Redis is then a miss)."""
    import secrets

    key = env.get("MMSERVE_PEER_KEY") or next((env[v] for v in PEER_KEY_VARS if env.get(v)), None)
    key = key or secrets.token_hex(32)
    return {v: env.get(v) or key for v in PEER_KEY_VARS}


@dataclass
class Service:
    name: str
    url: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen | None = None
    _termed: subprocess.Popen | None = field(default=None, repr=False)  # the proc already sent SIGTERM

    def start(self) -> None:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exit_code(self) -> int | None:
        """The return code once exited (negative: killed by that signal), else None."""
        return None if self.proc is None else self.proc.poll()

    def kill(self) -> None:
        """SIGKILL the service's process group (a crash, no graceful shutdown) and reap it."""
        if not self.alive():
            return
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10.0)

    def terminate(self) -> None:
        """SIGTERM the service's process group once (a graceful shutdown; a second SIGTERM would
        make uvicorn skip it); ``stop`` waits for it."""
        if self.alive() and self.proc is not self._termed:
            self._termed = self.proc
            assert self.proc is not None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)

    def stop(self, timeout: float = 10.0) -> None:
        """Terminate, wait up to ``timeout`` s, then SIGKILL the group and reap it."""
        if not self.alive():
            return
        assert self.proc is not None
        self.terminate()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=timeout)

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except FileNotFoundError:
            return ""


def _load_failed(r: httpx.Response) -> bool:
    try:
        return r.status_code >= 500 and r.json().get("status") == "error"
    except ValueError:
        return False


def wait_ready(
    services: list[Service], timeout: float, progress: Callable[[str], None] | None = None
) -> None:
    """Poll every service's /readyz until all answer 200; raise with their logs otherwise.

    ``progress`` gets one line per service as it becomes ready. The polls themselves are not
    logged (httpx logs every request at INFO, which buried the banner under dozens of lines).
    """
    start = time.monotonic()
    deadline = start + timeout
    pending = list(services)
    httpx_log = logging.getLogger("httpx")
    old_level = httpx_log.level
    httpx_log.setLevel(max(old_level, logging.WARNING))
    try:
        with httpx.Client(timeout=2.0) as client:
            while pending:
                for svc in list(pending):
                    if not svc.alive():
                        raise RuntimeError(f"{svc.name} exited early:\n{svc.log_tail()}")
                    try:
                        r = client.get(f"{svc.url}/readyz")
                        if r.status_code == 200:
                            pending.remove(svc)
                            if progress:
                                progress(f"  {svc.name:<12} ready  {time.monotonic() - start:5.1f} s  {svc.url}")
                        elif _load_failed(r):
                            raise RuntimeError(f"{svc.name} failed to load: {r.text}\n{svc.log_tail()}")
                    except httpx.HTTPError:
                        pass
                if pending and time.monotonic() > deadline:
                    names = ", ".join(s.name for s in pending)
                    logs = "\n".join(f"--- {s.name}\n{s.log_tail()}" for s in pending)
                    raise TimeoutError(f"not ready after {timeout}s: {names}\n{logs}")
                if pending:
                    time.sleep(0.3)
    finally:
        httpx_log.setLevel(old_level)


def sample_png_data_url(size: int = 32) -> str:
    """A small real PNG (a red/blue gradient) as a data URL, for the banner's curl."""
    from PIL import Image

    img = Image.new("RGB", (size, size))
    img.putdata([(255 * x // size, 64, 255 * y // size) for y in range(size) for x in range(size)])
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


class LocalStack:
    """Start encoders, LLM services and a gateway as child processes (see module doc)."""

    def __init__(self, spec: StackSpec, log_dir: str | Path | None = None):
        self.spec = spec
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="mmserve-logs-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        h = spec.host
        py = [sys.executable, "-m", "mmserve.cli"]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **spec.extra_env}
        if spec.redis_url:  # one HMAC key for what this stack's services read back from Redis
            env.update(stack_peer_keys(env))
        self.encoders: list[Service] = []
        for i in range(spec.encoders):
            port = free_port(h)
            argv = py + ["encoder", "--model", spec.model_dir, "--host", h, "--port", str(port)]
            if spec.redis_url:
                argv += ["--redis-url", spec.redis_url]
            self.encoders.append(self._svc(f"encoder-{i}", h, port, argv, env))
        self.llms: list[Service] = []
        # the LLMs fetch embeddings sent by reference from these encoders only (and send them alone
        # their service token): each encoder's host:port, not every port of the host
        allow = ",".join(s.url.removeprefix("http://") for s in self.encoders) or h
        llm_env = {"MMSERVE_LLM_MEDIA_FETCH_ALLOW": allow, **env}
        if spec.prefill_llms:  # the replicas a hand-over may name: this host's (all run here)
            llm_env = {"MMSERVE_LLM_KV_PEER_ALLOW": ",".join(dict.fromkeys([h, *THIS_MACHINE])),
                       **llm_env}
        self.prefill_llms: list[Service] = []
        for i in range(spec.llms + spec.prefill_llms):
            port = free_port(h)
            argv = py + ["llm", "--model", spec.model_dir, "--host", h, "--port", str(port)]
            if spec.prefill_llms:
                argv += ["--role", "decode" if i < spec.llms else "prefill"]
                if i < spec.llms:  # where the prefill replicas send this replica's hand-overs
                    argv += ["--handover-host", h, "--handover-port", str(free_port(h))]
            if spec.llm_backend:
                argv += ["--backend", spec.llm_backend]
            if spec.trust_request_chat_template:
                argv += ["--trust-request-chat-template"]
            if spec.redis_url:  # the LLMs' L3 KV tier, and the encoders' embeddings sent by reference
                argv += ["--kv-l3-url", spec.redis_url, "--media-redis-url", spec.redis_url,
                         "--kv-events-url", spec.redis_url]
            if i < spec.llms:
                self.llms.append(self._svc(f"llm-{i}", h, port, argv, llm_env))
            else:
                self.prefill_llms.append(self._svc(f"llm-prefill-{i - spec.llms}", h, port, argv, llm_env))
        gport = spec.gateway_port or free_port(h)
        argv = py + [
            "gateway",
            "--host", h,
            "--port", str(gport),
            "--model-name", Path(spec.model_dir).name,
            "--encoder-urls", ",".join(s.url for s in self.encoders),
            "--llm-urls", ",".join(s.url for s in self.llms),
        ]  # fmt: skip
        if self.prefill_llms:
            argv += ["--prefill-urls", ",".join(s.url for s in self.prefill_llms)]
        if spec.llm_routing:
            argv += ["--llm-routing", spec.llm_routing]
        if spec.redis_url:  # route on the LLMs' KV events
            argv += ["--kv-events-url", spec.redis_url]
        if spec.api_keys:
            argv += ["--api-keys", ",".join(spec.api_keys)]
        if spec.allowed_hosts:
            argv += ["--allowed-hosts", ",".join(spec.allowed_hosts)]
        if spec.trust_request_chat_template:
            argv += ["--trust-request-chat-template"]
        genv = {**env, **{f"MMSERVE_GATEWAY_{k.upper()}": str(v) for k, v in spec.gateway_env.items()}}
        self.gateway = self._svc("gateway", h, gport, argv, genv)

    def _svc(self, name: str, host: str, port: int, argv: list[str], env: dict) -> Service:
        return Service(name, f"http://{host}:{port}", argv, dict(env), self.log_dir / f"{name}.log")

    @property
    def services(self) -> list[Service]:
        return [*self.encoders, *self.prefill_llms, *self.llms, self.gateway]

    @property
    def url(self) -> str:
        return self.gateway.url

    @property
    def model_name(self) -> str:
        return Path(self.spec.model_dir).name

    def __enter__(self) -> "LocalStack":
        for svc in self.services:
            svc.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop every service at once (the slowest, not the sum, bounds the wait): all get
        SIGTERM together, then each is waited for until one shared deadline and SIGKILLed past it."""
        for svc in reversed(self.services):
            svc.terminate()
        deadline = time.monotonic() + timeout
        for svc in reversed(self.services):
            svc.stop(timeout=max(0.1, deadline - time.monotonic()))

    def wait_ready(self, timeout: float = 300.0, progress: Callable[[str], None] | None = None) -> None:
        wait_ready(self.services, timeout, progress)

    def restart(self, service: Service, timeout: float = 120.0) -> None:
        """Stop ``service`` if it runs, start it again with the same command and port, and wait
        until it answers /readyz (the gateway's prober then takes it back)."""
        service.stop()
        service.start()
        wait_ready([service], timeout)

    def wait(self, policy: RestartPolicy | None = None) -> int:
        """Supervise until the user interrupts (0) or a service keeps crashing (1): an exited
        service is restarted with backoff while the rest keeps serving (``mmserve.supervisor``)."""
        try:
            return supervise(self.services, policy or RestartPolicy())
        except KeyboardInterrupt:
            return 0

    def banner(self) -> str:
        body = {
            "model": self.model_name,
            "max_tokens": 32,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is in this image?"},
                        {"type": "image_url", "image_url": {"url": sample_png_data_url()}},
                    ],
                }
            ],
        }
        lines = [
            f"mmserve is up: {self.url}  (OpenAI API at {self.url}/v1)",
            "services: " + ", ".join(f"{s.name}={s.url}" for s in self.services),
            f"logs: {self.log_dir}",
            "try:",
            f"curl -s {self.url}/v1/chat/completions -H 'Content-Type: application/json' "
            f"-d '{json.dumps(body)}'",
            "Ctrl-C stops the stack.",
        ]
        return "\n".join(lines)
