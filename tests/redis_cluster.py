"""A real Redis Cluster for tests: three primaries (``redis-server --cluster-enabled yes``) on free
loopback ports in a temporary directory, joined by ``redis-cli --cluster create``; stopped and
removed on exit. The ``redis_cluster`` fixture (tests/conftest.py) starts one per session."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import redis

PRIMARIES = 3


@dataclass(frozen=True)
class RedisClusterInfo:
    ports: tuple[int, ...]

    @property
    def url(self) -> str:
        """The services' form: ``redis+cluster://`` with every node as a seed."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def node(self, port: int) -> redis.Redis:
        """A plain client of one node (what it holds itself, no redirections)."""
        return redis.Redis(port=port)

    def node_of(self, key: str | bytes) -> int:
        """The port of the primary owning ``key``'s slot."""
        with self.node(self.ports[0]) as r:
            slot = r.execute_command("CLUSTER", "KEYSLOT", key)
            for start, end, primary, *_ in r.execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    return int(primary[1])
        raise AssertionError(f"slot {slot} of {key!r} is not served")

    def keys_by_node(self, match: str) -> dict[int, list[bytes]]:
        """Every node's own keys matching ``match`` (a SCAN of each node, as a cluster client's)."""
        out = {}
        for p in self.ports:
            with self.node(p) as r:
                out[p] = list(r.scan_iter(match=match, count=1000))
        return out


def _free_ports(n: int) -> list[int]:
    # a node also listens on port + 10000 (the cluster bus): both must be free
    ports: list[int] = []
    while len(ports) < n:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p + 10000 > 65535 or p in ports:
            continue
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", p + 10000)) == 0:
                continue
        ports.append(p)
    return ports


def _wait(cond, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(redis.RedisError, OSError):
            if cond():
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"Redis Cluster: timed out waiting for {what}")
        time.sleep(0.05)


@contextlib.contextmanager
def running_cluster(primaries: int = PRIMARIES) -> Iterator[RedisClusterInfo]:
    exe = shutil.which("redis-server")
    if exe is None or shutil.which("redis-cli") is None:
        raise RuntimeError("redis-server / redis-cli are not installed (scripts/setup.sh --test installs them)")
    tmp = Path(tempfile.mkdtemp(prefix="mmserve-redis-cluster-"))
    procs: list[subprocess.Popen] = []
    try:
        for _attempt in range(3):  # a port taken between picking it and binding it: pick again
            ports = _free_ports(primaries)
            for p in ports:
                d = tmp / str(p)
                d.mkdir()
                procs.append(subprocess.Popen(
                    [exe, "--port", str(p), "--bind", "127.0.0.1", "--dir", str(d), "--cluster-enabled", "yes",
                     "--cluster-config-file", str(d / "nodes.conf"), "--cluster-node-timeout", "2000",
                     "--save", "", "--appendonly", "no", "--logfile", str(d / "redis.log")],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            try:
                for p in ports:
                    _wait(lambda p=p: _node_call(p, "PING"), f"node {p}", timeout=10)
                break
            except RuntimeError:
                _stop(procs)
                procs.clear()
        else:
            raise RuntimeError("Redis Cluster: its nodes did not start")
        subprocess.run(["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports),
                       "--cluster-replicas", "0", "--cluster-yes"],
                       check=True, capture_output=True, timeout=60)
        info = RedisClusterInfo(tuple(ports))

        def ok() -> bool:  # every node agrees: all slots served, every node known
            for p in ports:
                text = _node_call(p, "CLUSTER", "INFO")
                text = text.decode() if isinstance(text, bytes) else str(text)
                if "cluster_state:ok" not in text or f"cluster_known_nodes:{primaries}" not in text:
                    return False
            return True

        _wait(ok, "cluster_state:ok")
        yield info
    finally:
        _stop(procs)
        shutil.rmtree(tmp, ignore_errors=True)


def _node_call(port: int, *args):
    with redis.Redis(port=port, socket_timeout=1) as r:
        return r.execute_command(*args)


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
