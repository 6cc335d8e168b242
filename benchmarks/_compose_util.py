"""compose.yaml on a real Docker engine: build the image offline, bring a project up, look inside
its containers, take it down. Used by tests/e2e/test_compose_stack.py and benchmarks/compose_stack.py.

Commands are Compose v1's (``docker-compose``, Debian's 1.29); ``MMSERVE_COMPOSE`` picks another
(``"docker compose"`` for v2). Every project gets its own name, so a run never touches another's
containers, and ``down()`` removes its containers, network and volumes.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
PROJECT_LABEL = "com.docker.compose.project"


def compose_cmd() -> list[str]:
    return shlex.split(os.environ.get("MMSERVE_COMPOSE", "docker-compose"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_engine() -> None:
    """A Docker engine answering, installed and started when missing (scripts/docker_engine.sh)."""
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        subprocess.run(["bash", str(ROOT / "scripts" / "docker_engine.sh")], check=True)


def build_image(tag: str = "mmserve:latest", no_cache: bool = False) -> dict:
    """scripts/docker_build.sh: base images, wheelhouse, ``docker build`` (``no_cache``: every
    layer rebuilt); its JSON line (``build_s``, ``image``, ``base``, ``redis_image``)."""
    ensure_engine()
    env = {**os.environ, "NO_CACHE": "1" if no_cache else ""}
    out = subprocess.run(["bash", str(ROOT / "scripts" / "docker_build.sh"), tag], check=True, env=env,
                         capture_output=True, text=True, timeout=3600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def readable_bundle(path: Path) -> Path:
    """The image's user (uid 10001) reads the bind-mounted bundle: files a+r, folders a+rx."""
    for p in [path, *path.rglob("*")]:
        p.chmod(p.stat().st_mode | (0o555 if p.is_dir() else 0o444))
    return path


@dataclass
class ComposeProject:
    """One ``compose.yaml`` project: its name, environment (secrets, images, the model, the port)."""

    model_dir: Path
    image: str = "mmserve:latest"
    redis_image: str = "mmserve-redis:bookworm"
    name: str = field(default_factory=lambda: f"mmserve-e2e-{secrets.token_hex(3)}")
    port: int = field(default_factory=free_port)
    extra_env: dict[str, str] = field(default_factory=dict)
    files: tuple[str, ...] = ("compose.yaml",)  # merged in order, as `-f a -f b` (e.g. compose.disagg.yaml)

    def __post_init__(self) -> None:
        self.env = {
            **os.environ,
            "MMSERVE_REDIS_PASSWORD": secrets.token_hex(32), "MMSERVE_PEER_KEY": secrets.token_hex(32),
            "MMSERVE_SERVICE_TOKEN": secrets.token_hex(32), "MMSERVE_MODEL_DIR": str(self.model_dir),
            "MMSERVE_IMAGE": self.image, "MMSERVE_REDIS_IMAGE": self.redis_image,
            "MMSERVE_PORT": str(self.port), "MMSERVE_BIND": "127.0.0.1", **self.extra_env,
        }
        self.url = f"http://127.0.0.1:{self.port}"

    def compose(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        files = [a for f in self.files for a in ("-f", str(ROOT / f))]
        cmd = [*compose_cmd(), "-p", self.name, *files, "--project-directory", str(ROOT), *args]
        return subprocess.run(cmd, env=self.env, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                              check=check)

    def up(self, encoders: int, llms: int, timeout: float = 600, **more: int) -> float:
        """``up -d`` with the replicas scaled (``more``: other services', e.g. ``llm_prefill=1``
        for ``llm-prefill``); returns seconds until the gateway's /readyz is 200."""
        t0 = time.monotonic()
        self.scales = {"encoder": encoders, "llm": llms, **{k.replace("_", "-"): n for k, n in more.items()}}
        r = self.compose("up", "-d", "--no-build", *self._scale_args(), timeout=timeout, check=False)
        if r.returncode != 0:
            raise RuntimeError(f"compose up failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}\n{self.logs()}")
        self.wait_ready(timeout - (time.monotonic() - t0))
        return time.monotonic() - t0

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(f"{self.url}/readyz", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"gateway not ready in {timeout:.0f} s:\n{self.logs()}")
            time.sleep(1)

    def _scale_args(self) -> list[str]:
        return [a for svc, n in self.scales.items() for a in ("--scale", f"{svc}={n}")]

    def scale(self, service: str, n: int, timeout: float = 600) -> None:
        """One service to ``n`` replicas, the others kept as they are (Compose would reset them to
        their ``deploy.replicas``), no container recreated."""
        self.scales[service] = n
        self.compose("up", "-d", "--no-build", "--no-recreate", *self._scale_args(), timeout=timeout)

    def containers(self, service: str | None = None, all_states: bool = False) -> list[str]:
        """Container ids of this project (one service's), oldest first."""
        flt = ["--filter", f"label={PROJECT_LABEL}={self.name}"]
        if service:
            flt += ["--filter", f"label=com.docker.compose.service={service}"]
        out = subprocess.run(["docker", "ps", "-q", *(["-a"] if all_states else []), *flt, "--format",
                              "{{.ID}} {{.Label \"com.docker.compose.container-number\"}}"],
                             capture_output=True, text=True, check=True).stdout.split("\n")
        rows = [line.split() for line in out if line.strip()]
        return [cid for cid, *_ in sorted(rows, key=lambda r: int(r[1]) if len(r) > 1 else 0)]

    def inspect(self, cid: str) -> dict:
        return json.loads(subprocess.run(["docker", "inspect", cid], capture_output=True, text=True,
                                         check=True).stdout)[0]

    def http_in(self, cid: str, port: int, path: str, timeout: float = 20) -> str:
        """GET http://127.0.0.1:{port}{path} from inside a container (its ports are not published)."""
        code = ("import sys, urllib.request; sys.stdout.write(urllib.request.urlopen("
                f"'http://127.0.0.1:{port}{path}', timeout=10).read().decode())")
        return subprocess.run(["docker", "exec", cid, "python", "-c", code], capture_output=True, text=True,
                              check=True, timeout=timeout).stdout

    def logs(self, tail: int = 60) -> str:
        r = self.compose("logs", "--no-color", "--tail", str(tail), check=False, timeout=60)
        return r.stdout[-8000:]

    def leftovers(self) -> dict[str, list[str]]:
        """This project's containers, networks and volumes still on the engine."""
        flt = ["--filter", f"label={PROJECT_LABEL}={self.name}"]
        q = lambda *a: [x for x in subprocess.run(["docker", *a, *flt], capture_output=True, text=True,  # noqa: E731
                                                   check=True).stdout.split() if x]
        return {"containers": q("ps", "-aq"), "networks": q("network", "ls", "-q"), "volumes": q("volume", "ls", "-q")}

    def down(self) -> None:
        self.compose("down", "-v", "--remove-orphans", "--timeout", "10", check=False, timeout=300)
