"""The suite across hosts: 2 gateways, 2 encoders, 3 LLM replicas and Redis, each on its own
host (a Linux network namespace with its own address, ``benchmarks._netns``), names resolved
from a hosts file, under a bounded load of streamed chats (text, and images every few).

Then, load still running:
1. one LLM host is cut off the network (link down: no reset, packets vanish);
2. a new LLM host comes up under the same name with a new address (the name now lists it
   instead of the cut one);
3. the encoders scale 2 -> 3 (a new host under the name ``encoder``) -> 1 (two removed from the
   name, then stopped).

Figures: requests lost while the host is cut off (every error must be one that was in flight
when the link went down, answered as an error, never a hang), seconds until each gateway takes
the cut host out of rotation, seconds until the new LLM replica and the new encoder take
traffic, errors during the encoder scaling. Wall-clock; the gateways run with
``health_interval`` / ``health_fail_threshold`` / ``dns_interval`` as printed (a lost host is
out after about threshold x interval + the probe timeout; a new address is in after the next
DNS refresh).

    python -m benchmarks.multi_host [--quick] [--clients N]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from benchmarks import _results
from benchmarks._netns import Fabric, Host, unavailable
from benchmarks._stack_util import image_part, make_png, scrape, total, user

GATEWAY_PORT, ENCODER_PORT, LLM_PORT, REDIS_PORT = 8000, 8100, 8200, 6379
CLIENT_TIMEOUT_S = 60.0  # a request not answered by then counts as a hang


@dataclass(frozen=True)
class Plan:
    clients: int = 4  # concurrent streamed chats (the bounded load)
    max_tokens: int = 16
    image_every: int = 4  # every n-th request carries an image
    health_interval: float = 1.0
    fail_threshold: int = 2
    dns_interval: float = 2.0
    warm_s: float = 6.0  # load before the cut, once every replica took traffic
    after_s: float = 4.0  # load after each change is seen
    scale_encoders: bool = True
    gateways: int = 2
    encoders: int = 2
    llms: int = 3  # the last one is cut off

    def __post_init__(self) -> None:
        if self.llms < 2 or self.gateways < 1 or self.encoders < 1:
            raise ValueError("the scenario needs >= 2 LLMs (one is cut), >= 1 gateway and >= 1 encoder")


@dataclass
class Outcome:
    start: float
    end: float
    ok: bool
    gateway: int
    image: bool
    status: int | None = None
    error: str | None = None
    hang: bool = False


@dataclass
class Record:
    """What a run saw: every request, and when each event happened (monotonic seconds)."""

    outcomes: list[Outcome] = field(default_factory=list)
    events: dict[str, float] = field(default_factory=dict)
    detect_s: list[float | None] = field(default_factory=list)  # per gateway: cut -> out of rotation
    lost_mid_answer: list[float] = field(default_factory=list)  # per gateway: LLM streams cut off mid-answer
    lost_before_answer: list[float] = field(default_factory=list)  # per gateway: LLM requests retried elsewhere
    cut_admitted: float = 0.0  # requests the cut host held just before the cut
    llm_requests: dict[str, float] = field(default_factory=dict)  # replica host -> finished requests
    encoder_requests: dict[str, float] = field(default_factory=dict)
    new_llm_traffic_s: float | None = None  # its name updated -> first request it served
    new_encoder_traffic_s: float | None = None
    logs: str = ""


def _py() -> list[str]:
    return [sys.executable, "-m", "mmserve.cli"]


class Cluster:
    """The hosts and services of one run (``Fabric`` owns the namespaces and processes)."""

    def __init__(self, fabric: Fabric, model_dir: str, log_dir: Path, plan: Plan) -> None:
        self.f, self.model_dir, self.log_dir, self.plan = fabric, model_dir, log_dir, plan
        # one peer key for every service (their Redis is on another host), and the LLMs fetch
        # embeddings from the encoders' subnet only
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                    "PYTHONPATH": str(_results.REPO), "OMP_NUM_THREADS": "1",
                    "MMSERVE_LLM_MEDIA_FETCH_ALLOW": f"{fabric.subnet}.0/24"}
        peer = secrets.token_hex(32)
        for service in ("GATEWAY", "ENCODER", "LLM"):
            self.env[f"MMSERVE_{service}_PEER_KEY"] = peer
        self.redis = fabric.add_host("redis")
        fabric.set_name("redis", [self.redis.ip])
        self.gateways: list[Host] = []
        self.encoders: list[Host] = []
        self.llms: list[Host] = []

    def url(self, host: Host, port: int) -> str:
        return f"http://{host.ip}:{port}"

    def start_redis(self) -> None:
        self.f.run(self.redis, ["redis-server", "--bind", "0.0.0.0", "--port", str(REDIS_PORT), "--save", "",
                                "--appendonly", "no", "--protected-mode", "no"], self.env, self.log_dir / "redis.log")

    def start_encoder(self, name: str) -> Host:
        h = self.f.add_host(name)
        argv = _py() + ["encoder", "--model", self.model_dir, "--host", "0.0.0.0", "--port", str(ENCODER_PORT),
                        "--redis-url", f"redis://redis:{REDIS_PORT}/0"]
        self.f.run(h, argv, self.env, self.log_dir / f"{name}.log")
        self.encoders.append(h)
        return h

    def start_llm(self, name: str) -> Host:
        h = self.f.add_host(name)
        redis = f"redis://redis:{REDIS_PORT}/0"
        argv = _py() + ["llm", "--model", self.model_dir, "--host", "0.0.0.0", "--port", str(LLM_PORT),
                        "--backend", "swa", "--kv-l3-url", redis, "--media-redis-url", redis, "--kv-events-url", redis]
        self.f.run(h, argv, self.env, self.log_dir / f"{name}.log")
        self.llms.append(h)
        return h

    def start_gateway(self, name: str) -> Host:
        h = self.f.add_host(name)
        p = self.plan
        argv = _py() + ["gateway", "--host", "0.0.0.0", "--port", str(GATEWAY_PORT),
                        "--model-name", Path(self.model_dir).name,
                        "--encoder-urls", f"http://encoder:{ENCODER_PORT}", "--llm-urls", f"http://llm:{LLM_PORT}",
                        "--kv-events-url", f"redis://redis:{REDIS_PORT}/0"]
        env = {**self.env, "MMSERVE_GATEWAY_HEALTH_INTERVAL": str(p.health_interval),
               "MMSERVE_GATEWAY_HEALTH_FAIL_THRESHOLD": str(p.fail_threshold),
               "MMSERVE_GATEWAY_DNS_INTERVAL": str(p.dns_interval)}
        self.f.run(h, argv, env, self.log_dir / f"{name}.log")
        self.gateways.append(h)
        return h

    def wait_ready(self, hosts: list[Host], port: int, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        pending = list(hosts)
        while pending:
            for h in list(pending):
                try:
                    if httpx.get(f"{self.url(h, port)}/readyz", timeout=2.0).status_code == 200:
                        pending.remove(h)
                except httpx.HTTPError:
                    pass
                if any(p.poll() is not None for p in h.procs):
                    raise RuntimeError(f"{h.name} exited while starting:\n{self.log_tail(h.name)}")
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"not ready after {timeout:g}s: {[h.name for h in pending]}")
            time.sleep(0.5)

    def log_tail(self, name: str, n: int = 3000) -> str:
        try:
            return (self.log_dir / f"{name}.log").read_bytes()[-n:].decode(errors="replace")
        except FileNotFoundError:
            return ""

    def counter(self, host: Host, port: int, name: str, **labels: str) -> float | None:
        try:
            return total(scrape(self.url(host, port), timeout=2.0), name, **labels)
        except (httpx.HTTPError, OSError):
            return None

    def replica_up(self, gw: Host, service: str, replica: str) -> bool | None:
        """Is ``replica`` in the gateway's rotation (None: the gateway does not list it)."""
        s = scrape(self.url(gw, GATEWAY_PORT), timeout=5.0)
        for (n, labels), v in s.items():
            if n == "mmserve_gateway_replica_up" and dict(labels) == {"service": service, "replica": replica}:
                return v == 1.0
        return None


class Load:
    """``clients`` threads, each sending streamed chats to the gateways in turn until stopped."""

    def __init__(self, gateways: list[str], model: str, plan: Plan) -> None:
        self.gateways, self.model, self.plan = gateways, model, plan
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._n = 0
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(plan.clients)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> list[Outcome]:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=CLIENT_TIMEOUT_S + 10)
        return self.outcomes

    def _next(self) -> int:
        with self._lock:
            self._n += 1
            return self._n

    def _run(self, worker: int) -> None:
        rng = random.Random(worker)
        with httpx.Client(timeout=httpx.Timeout(CLIENT_TIMEOUT_S, connect=5.0)) as http:
            while not self._stop.is_set():
                n = self._next()
                gw = n % len(self.gateways)
                image = n % self.plan.image_every == 0
                words = " ".join(rng.choice(("alpha", "beta", "gamma", "delta", "omega", "sigma")) for _ in range(12))
                parts = [image_part(make_png(seed=n))] if image else []
                long = worker == 0  # one client's answers last seconds: streams in flight at any moment
                body = {"model": self.model, "messages": [user(f"request {n}: {words}", *parts)],
                        "max_tokens": self.plan.max_tokens * (16 if long else 1), "temperature": 0, "stream": True,
                        "ignore_eos": long}
                out = Outcome(time.monotonic(), 0.0, False, gw, image)
                try:
                    with http.stream("POST", f"{self.gateways[gw]}/v1/chat/completions", json=body) as r:
                        out.status = r.status_code
                        if r.status_code != 200:
                            r.read()
                            out.error = f"HTTP {r.status_code}: {r.text[:300]}"
                        else:
                            out.ok, out.error = _read_sse(r)
                except httpx.TimeoutException as e:
                    out.hang, out.error = True, f"client timeout: {type(e).__name__}"
                except httpx.HTTPError as e:
                    out.error = f"{type(e).__name__}: {e}"
                out.end = time.monotonic()
                with self._lock:
                    self.outcomes.append(out)


def _read_sse(r: httpx.Response) -> tuple[bool, str | None]:
    """(ok, error): ok when the stream ends with a finish reason and ``[DONE]``, no error event."""
    finished = done = False
    for line in r.iter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            continue
        ev = json.loads(data)
        if "error" in ev:
            return False, f"error event: {ev['error'].get('message', ev['error'])}"
        for c in ev.get("choices", ()):
            if c.get("finish_reason"):
                finished = True
    if finished and done:
        return True, None
    return False, f"stream ended early (finish reason seen: {finished}, [DONE]: {done})"


def _wait_until(pred, timeout: float, step: float = 0.2) -> float | None:
    """Seconds until ``pred()`` held (None: it never did within ``timeout``)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pred():
            return time.monotonic() - t0
        time.sleep(step)
    return None


def run_scenario(model_dir: str, log_dir: Path, plan: Plan, progress=print) -> Record:
    """Build the hosts, run the load through the cut, the new replica and the encoder scaling."""
    rec = Record()
    with Fabric() as f:
        c = Cluster(f, model_dir, log_dir, plan)
        c.start_redis()
        for i in range(1, plan.encoders + 1):
            c.start_encoder(f"enc{i}")
        for i in range(1, plan.llms + 1):
            c.start_llm(f"llm{i}")
        f.set_name("encoder", [h.ip for h in c.encoders])
        f.set_name("llm", [h.ip for h in c.llms])
        for i in range(1, plan.gateways + 1):
            c.start_gateway(f"gw{i}")
        t0 = time.monotonic()
        c.wait_ready(c.encoders, ENCODER_PORT)
        c.wait_ready(c.llms, LLM_PORT)
        c.wait_ready(c.gateways, GATEWAY_PORT)
        progress(f"{len(f.hosts)} hosts on {f.subnet}.0/24 ready in {time.monotonic() - t0:.1f}s; logs in {log_dir}")
        gws = [c.url(g, GATEWAY_PORT) for g in c.gateways]
        load = Load(gws, Path(model_dir).name, plan)
        load.start()
        try:
            _phases(c, plan, rec, progress)
        finally:
            rec.outcomes = load.stop()
            rec.logs = "\n".join(f"--- {n} ---\n{c.log_tail(n, 1500)}" for n in f.hosts)
    return rec


def _llm_served(c: Cluster, h: Host) -> float | None:
    return c.counter(h, LLM_PORT, "mmserve_llm_requests_total")


def _phases(c: Cluster, plan: Plan, rec: Record, progress) -> None:
    f = c.f
    ev = rec.events
    # 1. every LLM replica takes traffic
    took = _wait_until(lambda: all((_llm_served(c, h) or 0) > 0 for h in c.llms), 120, 0.5)
    if took is None:
        raise RuntimeError(f"not every LLM replica took traffic: {[_llm_served(c, h) for h in c.llms]}")
    time.sleep(plan.warm_s)
    # 2. cut one LLM host
    cut = c.llms[-1]
    cut_url = c.url(cut, LLM_PORT)
    served_at_cut = _llm_served(c, cut) or 0.0

    def admitted() -> float:
        # the reading the wait stopped on: a second scrape could miss short requests since done
        rec.cut_admitted = c.counter(cut, LLM_PORT, "mmserve_llm_admitted_in_flight") or 0.0
        return rec.cut_admitted

    _wait_until(lambda: admitted() >= 1, 30, 0.02)  # cut it with work in hand
    ev["cut"] = time.monotonic()
    f.cut(cut)
    # the cut takes a few commands: a request that starts in between may still reach the host
    # and be lost with it, so it counts as in flight at the cut too
    ev["cut_done"] = time.monotonic()
    progress(f"cut {cut.name} ({cut.ip}) off the network")
    for gw in c.gateways:
        s = _wait_until(lambda gw=gw: c.replica_up(gw, "llm", cut_url) is False, 60, 0.1)
        rec.detect_s.append(None if s is None else round(time.monotonic() - ev["cut"], 2))
    ev["detected"] = time.monotonic()
    progress(f"gateways took it out of rotation after {rec.detect_s} s")
    time.sleep(plan.after_s)
    # 3. a new LLM host under the same name, new address; the cut host leaves the name
    new = c.start_llm(f"llm{len(c.llms) + 1}")
    c.wait_ready([new], LLM_PORT)
    f.set_name("llm", [h.ip for h in c.llms if h is not cut])
    ev["new_llm_named"] = time.monotonic()
    s = _wait_until(lambda: (_llm_served(c, new) or 0) > 0, 60, 0.1)
    rec.new_llm_traffic_s = None if s is None else round(s, 2)
    progress(f"{new.name} ({new.ip}) took traffic {rec.new_llm_traffic_s} s after its name was updated")
    time.sleep(plan.after_s)
    for when, out in (("mid_answer", rec.lost_mid_answer), ("before_answer", rec.lost_before_answer)):
        out.extend(c.counter(gw, GATEWAY_PORT, "mmserve_gateway_upstream_lost_total", service="llm", when=when) or 0.0
                   for gw in c.gateways)
    # the cut host's own count cannot be read any more; the others tell who served after detection
    if plan.scale_encoders:
        _scale_encoders(c, plan, rec, progress)
    ev["end"] = time.monotonic()
    for h in c.llms:
        if h is not cut:
            rec.llm_requests[h.name] = _llm_served(c, h) or 0.0
    rec.llm_requests[cut.name] = served_at_cut
    for h in c.encoders:
        if h.name not in rec.encoder_requests:  # the stopped ones were read before they stopped
            rec.encoder_requests[h.name] = c.counter(h, ENCODER_PORT, "encoder_requests_total", modality="image") or 0.0


def _scale_encoders(c: Cluster, plan: Plan, rec: Record, progress) -> None:
    f, ev = c.f, rec.events

    def images(h: Host) -> float:
        return c.counter(h, ENCODER_PORT, "encoder_requests_total", modality="image") or 0.0

    third = c.start_encoder(f"enc{len(c.encoders) + 1}")
    c.wait_ready([third], ENCODER_PORT)
    f.set_name("encoder", [h.ip for h in c.encoders])
    ev["encoders_3"] = time.monotonic()
    s = _wait_until(lambda: images(third) > 0, 60, 0.1)
    rec.new_encoder_traffic_s = None if s is None else round(s, 2)
    progress(f"encoders 2 -> 3: {third.name} took traffic after {rec.new_encoder_traffic_s} s")
    time.sleep(plan.after_s)
    keep, gone = c.encoders[0], c.encoders[1:]  # -> 1
    for h in gone:
        rec.encoder_requests[h.name] = images(h)
    f.set_name("encoder", [keep.ip])
    ev["encoders_1"] = time.monotonic()
    for gw in c.gateways:  # drained from every gateway's ring before they stop (a preStop hook's job)
        for h in gone:
            _wait_until(lambda gw=gw, h=h: c.replica_up(gw, "encoder", c.url(h, ENCODER_PORT)) is None, 60, 0.1)
    for h in gone:
        for p in h.procs:
            Fabric.stop(p)
    ev["encoders_1_stopped"] = time.monotonic()
    before = images(keep)
    _wait_until(lambda: images(keep) > before, 30, 0.2)
    time.sleep(plan.after_s)
    progress("encoders 3 -> 1: two removed from the name, drained and stopped")


def summarize(rec: Record) -> dict:
    ev = rec.events
    cut, cut_done = ev["cut"], ev.get("cut_done", ev["cut"])

    def at_cut(o) -> bool:  # in flight at some moment while the host was being cut
        return o.start < cut_done and o.end > cut

    in_flight_at_cut = [o for o in rec.outcomes if at_cut(o)]
    errors = [o for o in rec.outcomes if not o.ok]
    beyond = [o for o in errors if not at_cut(o)]
    enc_errors = [o for o in errors if "encoders_3" in ev and o.end > ev["encoders_3"]]
    return {
        "requests": len(rec.outcomes),
        "errors": len(errors),
        "hangs": sum(o.hang for o in rec.outcomes),
        "in_flight_at_cut": len(in_flight_at_cut),
        "errors_in_flight_at_cut": len(errors) - len(beyond),
        "errors_beyond_in_flight": len(beyond),
        "cut_host_admitted": rec.cut_admitted,
        "lost_mid_answer": rec.lost_mid_answer,
        "lost_before_answer_retried": rec.lost_before_answer,
        "detect_s": rec.detect_s,
        "new_llm_traffic_s": rec.new_llm_traffic_s,
        "new_encoder_traffic_s": rec.new_encoder_traffic_s,
        "errors_during_encoder_scaling": len(enc_errors),
        "llm_requests": rec.llm_requests,
        "encoder_image_requests": rec.encoder_requests,
        "error_samples": sorted({o.error or "" for o in errors})[:5],
        "slowest_error_s": round(max((o.end - o.start for o in errors), default=0.0), 2),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the same scenario (it is about a minute long already)")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--model", default=None, help="bundle dir (default: the tiny mimo bundle)")
    _results.add_mode_args(ap)
    args = ap.parse_args()
    why = unavailable()
    if why:
        print(f"cannot run: {why}", file=sys.stderr)
        return 2
    from mmserve.cli import ensure_default_model

    model_dir = ensure_default_model(args.model)
    if args.smoke:  # the cut and the new replica only, on the fewest hosts
        plan = Plan(clients=args.clients, warm_s=1.0, after_s=1.0, scale_encoders=False, gateways=1, encoders=1, llms=2)
    else:
        plan = Plan(clients=args.clients)
    log_dir = Path(tempfile.mkdtemp(prefix="mmserve-multi-host-"))
    rec = run_scenario(model_dir, log_dir, plan, progress=lambda m: print(m, flush=True))
    figs = summarize(rec)
    print(json.dumps({k: v for k, v in figs.items() if k != "error_samples"}), flush=True)
    figures = {"quick": args.quick, "plan": asdict(plan), **figs}
    summary = (f"{figs['requests']} requests, {figs['errors']} errors (all in flight on the cut host: "
               f"{figs['errors_beyond_in_flight'] == 0}), {figs['hangs']} hangs; out of rotation after "
               f"{figs['detect_s']} s; new LLM took traffic after {figs['new_llm_traffic_s']} s")
    _results.record("multi_host", ap, args, figures, kind="wall-clock", baseline="none (behaviour under faults)",
                    summary=summary)
    return 0 if figs["hangs"] == 0 and figs["errors_beyond_in_flight"] == 0 else 1


if __name__ == "__main__":
    _results.run(main)
