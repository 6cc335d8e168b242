"""Run ``compose.yaml``'s services as local processes (no Docker engine needed).

Each service's exec-form ``command`` and ``environment`` are used as written, after Compose's
``${VAR:-default}`` interpolation, with three local mappings:

* service host names (``redis``, ``encoder``, ...; in URLs and ``host[:port]`` lists) -> 127.0.0.1,
* container ports -> free local ports (``port_map``), so tests never collide with a running stack,
* bind-mount targets (``/models/bundle``) -> their host sources.

``mmserve`` in a command runs as ``python -m mmserve.cli`` from this interpreter. A service whose
image is a third-party one (redis) is not started when its port already answers locally.
"""

from __future__ import annotations

import os
import re
import socket
import sys
from pathlib import Path

import yaml

from mmserve.launcher import Service, free_port

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?([-?])([^}]*))?\}")


class MissingVariable(ValueError):
    """A ``${VAR:?message}`` whose variable is unset or empty (Compose refuses to start)."""


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose-style ``${VAR}`` / ``${VAR:-default}`` substitution; ``${VAR:?message}`` raises
    ``MissingVariable`` (naming VAR) when VAR is unset or empty, as Compose refuses to start."""

    def sub(m: re.Match) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3) or ""
        if env.get(name):
            return env[name]
        if op == "?":
            raise MissingVariable(f"required variable {name} is missing a value: {arg}")
        return arg

    return _VAR.sub(sub, value)


def _interp_tree(node, env: dict[str, str]):
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [_interp_tree(n, env) for n in node]
    if isinstance(node, dict):
        return {k: _interp_tree(v, env) for k, v in node.items()}
    return node


def merge(base: dict, override: dict) -> dict:
    """``override`` over ``base`` as ``docker compose -f base -f override`` merges them: mappings
    (services, environment, depends_on, ...) merge key by key, anything else is replaced."""
    out = dict(base)
    for k, v in override.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_compose(path: str | Path | list, env: dict[str, str] | None = None) -> dict:
    """Parse and interpolate a compose file, or several merged in order as ``-f a -f b`` does
    (YAML anchors and merge keys resolved within each file)."""
    merged: dict = {}
    for p in path if isinstance(path, list) else [path]:
        merged = merge(merged, yaml.safe_load(Path(p).read_text()))
    return _interp_tree(merged, dict(os.environ if env is None else env))


def _port_open(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def _container_port(svc: dict) -> int | None:
    env = svc.get("environment") or {}
    for k, v in env.items():
        if k.endswith("_PORT") and str(v).isdigit():
            return int(v)
    cmd = svc.get("command") or []
    if "--port" in cmd:
        return int(cmd[cmd.index("--port") + 1])
    return None


def local_services(compose: dict, base_dir: Path, log_dir: Path, order: list[str]) -> list[Service]:
    """Services of ``compose`` (in ``order``) as local ``Service`` objects, not yet started."""
    specs = compose["services"]
    names = list(specs)
    ports = {n: _container_port(specs[n]) for n in names}
    port_map = {p: (p if specs[n].get("image", "").startswith("redis") else free_port()) for n, p in ports.items() if p}
    out: list[Service] = []
    for name in order:
        svc = specs[name]
        env = {str(k): str(v) for k, v in (svc.get("environment") or {}).items()}
        mounts = {}
        for vol in svc.get("volumes") or []:
            if isinstance(vol, dict) and vol.get("type") == "bind":
                mounts[vol["target"]] = str((base_dir / vol["source"]).resolve())

        def localize(s: str) -> str:
            for target, source in mounts.items():
                s = s.replace(target, source)
            for n in names:  # in URLs (//name:port, user:pass@name:port) and host:port lists, not as a word
                s = re.sub(rf"(//|@){re.escape(n)}(?=[:/]|$)", r"\g<1>127.0.0.1", s)
                s = re.sub(rf"(^|,){re.escape(n)}(?=:\d)", r"\g<1>127.0.0.1", s)
            for cport, lport in port_map.items():
                s = re.sub(rf":{cport}\b", f":{lport}", s)
                if s == str(cport):
                    s = str(lport)
            return s.replace("0.0.0.0", "127.0.0.1")

        env = {k: localize(v) for k, v in env.items()}
        if env.get("MMSERVE_LLM_HANDOVER_HOST") == "auto":  # one host here: the hand-over stays on loopback
            env["MMSERVE_LLM_HANDOVER_HOST"] = "127.0.0.1"
        argv = [localize(str(a)) for a in svc.get("command") or []]
        if argv and argv[0] == "mmserve":
            argv = [sys.executable, "-m", "mmserve.cli", *argv[1:]]
        port = port_map.get(ports[name]) if ports[name] else None
        full_env = {**os.environ, **env}
        out.append(Service(name, f"http://127.0.0.1:{port}", argv, full_env, log_dir / f"{name}.log"))
    return out


def redis_already_running(compose: dict) -> bool:
    port = _container_port(compose["services"].get("redis", {})) or 6379
    return _port_open("127.0.0.1", port)
