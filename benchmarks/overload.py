"""Overload: offered load at 1x, 2x and 4x the stack's capacity, with admission control (ours) and
without it (the same stack with unbounded gateway admission: what a plain queueing server does),
side by side in one run. Each side has a stack of its own (encoder, LLM, gateway, all alive for
the whole run), so neither side's history (its prefix tree, its pools, a backlog still draining)
can weigh on the other's runs. Runs are mirrored in time (1x A B, 2x B A, 4x A B, then the same
backwards), so a drift over the run weighs on every level and side alike.

Per side and level: goodput (200s per second), share of 429s, 5xx count, p50/p99 latency of the
admitted (200) requests, CPU cores used by each process (gateway, encoder, LLM front, engine
core, the load generator), by the other side's whole stack and by the machine, and RSS of
gateway and LLM service at the start and after each run. Capacity is measured first, on the
unbounded side: closed loops of ``--clients``, 2x, 4x, ... concurrent requests (the engine
batches, so a few clients are not the stack's capacity), until throughput stops rising by 10%;
capacity is the best of them, and our admission window (in flight = queue) is the concurrency
that reached it. Mixed traffic: text chats and small-image chats (one in four). Open-loop
Poisson arrivals (the shared driver, ``benchmarks._chat_load.drive``, as are the closed loops)
from a lean keep-alive HTTP client (``benchmarks._lean_client``: httpx itself took 0.85 of the 2
cores at 250 rps), bodies built before the clock starts; a client gives up
after ``--client-timeout`` s (counted as failed, not as goodput). Before each run both stacks
are let settle: nothing in flight in either LLM or gateway, and the machine quiet. The unbounded
side's backlog can take minutes to drain (httpcore's pool matches its queued requests to
connections in O(n^2)): a draining gateway would take the cores of the next run, whichever side
it is, so after 60 s that gateway is restarted. Targets (issue 11): goodput at 4x >= 90% of
goodput at 1x, no 5xx, memory flat. Wall-clock. The last line is a JSON object.

Ours is the gateway with its default admission settings (``--admission defaults``: what a
deployment gets), or with a window sized in the run at the concurrency that reached capacity
(``--admission tuned``: in flight = queue = that concurrency, queue timeout 2 s); the JSON's
``admission`` says which and its values.

    python -m benchmarks.overload --quick      # ~1.5 minutes: one forward pass, 4 s per run, noisy
    python -m benchmarks.overload --seconds 30 # ~12 minutes: mirrored, two runs per side and level
    python -m benchmarks.overload --admission tuned   # the window the README's earlier figures used
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks import _results
from benchmarks._chat_load import closed_loop, drive
from benchmarks._stats import percentile, scaled
from benchmarks._lean_client import LeanClient
from benchmarks._stack_util import image_part, make_png, user
from mmserve.launcher import LocalStack, Service, StackSpec, free_port, wait_ready
from shared.settings import GatewaySettings
from mmserve.tiny_model import write_tiny_model


def rss_mb(pid: int) -> float:
    """RSS of ``pid`` and its children (the LLM front's engine core) in MB."""
    out = subprocess.run(["ps", "-o", "rss=", "--ppid", str(pid), "-p", str(pid)], capture_output=True, text=True)
    return round(sum(int(x) for x in out.stdout.split()) / 1024, 1)


_PNGS = [make_png(seed=k) for k in range(16)]


def body(model: str, i: int, rng: random.Random) -> dict:
    words = " ".join(rng.choice(["red", "blue", "cat", "dog", "sky", "sea", "sun"]) for _ in range(rng.randint(8, 40)))
    parts = [image_part(_PNGS[i % 16])] if i % 4 == 0 else []
    return {"model": model, "max_tokens": 16, "messages": [user(f"{i} {words}", *parts)]}


def encoded(model: str, i: int, rng: random.Random) -> bytes:
    """``body`` as the JSON bytes sent (built before the clock starts: the load generator shares
    the stack's cores, and should spend as little of them as it can)."""
    return json.dumps(body(model, i, rng)).encode()


def machine_busy_s() -> float:
    """CPU seconds all cores spent not idle since boot (``/proc/stat``)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # minus idle and iowait


def cpu_s(pid: int, children: bool = True) -> float:
    """User + system CPU seconds of ``pid`` and (or, ``children="only"``) its children (the LLM
    front's engine core)."""
    total = 0.0
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    kids = [int(x) for x in out.stdout.split()] if children else []
    for p in kids if children == "only" else [pid, *kids]:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


class CpuMeter:
    """CPU cores used by each named process (and this one: the load generator) over a run."""

    def __init__(self, pids: dict[str, int], others: list[int] = ()) -> None:
        self.pids = pids
        self.others = list(others)  # the other side's processes: should stay idle during a run

    def _read(self) -> dict[str, float]:
        out = {k: cpu_s(p) for k, p in self.pids.items()}
        out["other_side"] = sum(cpu_s(p) for p in self.others)
        if "llm" in self.pids:  # the front alone, and its engine core
            out["llm_core"] = cpu_s(self.pids["llm"], children="only")
            out["llm"] -= out["llm_core"]
        out["load_generator"] = sum(os.times()[:2])
        out["machine"] = machine_busy_s()
        return out

    def __enter__(self) -> "CpuMeter":
        self.t0 = time.monotonic()
        self.start = self._read()
        return self

    def __exit__(self, *exc) -> None:
        wall = time.monotonic() - self.t0
        self.cores = {k: round((v - self.start[k]) / wall, 2) for k, v in self._read().items()}


async def closed_loop_rps(url: str, model: str, clients: int, seconds: float) -> float:
    """Requests per second a closed loop of ``clients`` sustains: the stack's capacity
    (``benchmarks._chat_load.closed_loop``; client k sends bodies k, k + clients, ...)."""
    done, stop = 0, time.monotonic() + seconds
    rng = random.Random(1)

    t0 = time.monotonic()
    async with LeanClient(url, timeout=120) as c:
        async def turn(k: int, i: int) -> None:
            nonlocal done
            status, _ = await c.post(encoded(model, k + i * clients, rng))
            done += status == 200

        await closed_loop(clients, turn, lambda: time.monotonic() >= stop)
    return done / (time.monotonic() - t0)


async def open_loop(url: str, model: str, rate: float, seconds: float, timeout: float, seed: int) -> dict:
    """Poisson arrivals at ``rate`` for ``seconds`` (``benchmarks._chat_load.drive``, open loop):
    what came back, and the latency of the 200s."""
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    while t < seconds:
        t += rng.expovariate(rate)
        arrivals.append(t)
    bodies = [encoded(model, i, rng) for i in range(len(arrivals))]

    async with LeanClient(url, timeout=timeout) as c:
        async def one(i: int) -> tuple[str, float | None]:
            """(outcome, latency of a 200)."""
            start = time.monotonic()
            try:
                status, _ = await c.post(bodies[i])
            except TimeoutError:
                return "timeout", None
            except (OSError, asyncio.IncompleteReadError):
                return "conn_error", None
            if status == 200:
                return "ok", time.monotonic() - start
            return "429" if status == 429 else "5xx" if status >= 500 else "other", None

        outcomes, wall = await drive(len(arrivals), one, arrivals=arrivals)
    counts = {k: 0 for k in ("ok", "429", "5xx", "other", "timeout", "conn_error")}
    for outcome, _ in outcomes:
        counts[outcome] += 1
    lat = [x for _, x in outcomes if x is not None]
    n = len(arrivals)
    return {
        "offered_rps": round(rate, 2), "sent": n, "goodput_rps": round(counts["ok"] / wall, 3),
        "share_429": round(counts["429"] / n, 3), "n_5xx": counts["5xx"], "timeouts": counts["timeout"],
        "other": counts["other"], "conn_errors": counts["conn_error"],
        "p50_s": scaled(percentile(lat, 50), 1, 3),
        "p99_s": scaled(percentile(lat, 99), 1, 3),
    }


async def saturation(url: str, model: str, clients: int, seconds: float, max_clients: int = 256) -> tuple[float, int]:
    """(best rps, its concurrency) over closed loops of ``clients``, doubling while rps rises >10%."""
    best, best_c, c = 0.0, clients, clients
    while c <= max_clients:
        rps = await closed_loop_rps(url, model, c, seconds)
        print(f"closed loop, {c} clients: {rps:.2f} rps", flush=True)
        if rps > best:
            best_prev, best, best_c = best, rps, c
        else:
            break
        if best_prev and rps < 1.1 * best_prev:
            break
        c *= 2
    return best, best_c


def _gauges(url: str, names: tuple[str, ...]) -> float:
    """Sum of the named unlabelled gauges on ``url``/metrics (inf when it does not answer)."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return float("inf")
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.split(" ", 1)[0] in names)


def machine_cores(window: float = 1.0) -> float:
    """Cores the whole machine kept busy over the next ``window`` seconds."""
    b0, t0 = machine_busy_s(), time.monotonic()
    time.sleep(window)
    return (machine_busy_s() - b0) / (time.monotonic() - t0)


QUIET_CORES = 0.3  # the machine counts as quiet below this (idle stacks and the OS use ~0.05)


def settle(llm_urls: list[str], gateway_urls: list[str], timeout: float = 300.0, quiet: bool = True) -> float:
    """Wait until nothing is in flight anywhere and (``quiet``) the machine is quiet (work a previous
    run left behind, e.g. the unbounded side's backlog, would otherwise take the next run's cores);
    the seconds waited (``timeout`` or more: it did not settle)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        busy = sum(_gauges(u, ("mmserve_llm_admitted_in_flight", "mmserve_llm_running_requests",
                               "mmserve_llm_waiting_requests")) for u in llm_urls)
        busy += sum(_gauges(u, ("mmserve_gateway_admitted_in_flight", "mmserve_gateway_admission_queued"))
                    for u in gateway_urls)
        if busy == 0 and (not quiet or machine_cores(0.5) < QUIET_CORES):
            return round(time.monotonic() - t0, 2)
        time.sleep(0.25)
    return round(max(timeout, time.monotonic() - t0), 2)


# Mirrored over time (forward, then backward), so each level's two runs of each side sit at the
# same mean position: a drift over the run (the engine's cost grows with its prefix tree) then
# weighs on every level alike, instead of on 4x, which used to run last.
_FORWARD = [(1, "admission"), (1, "unbounded"), (2, "unbounded"), (2, "admission"), (4, "admission"), (4, "unbounded")]
RUN_ORDER = _FORWARD + _FORWARD[::-1]  # --quick runs only the forward half


def bounded_gateway(stack: LocalStack, env: dict[str, str], log_dir: Path, name: str) -> Service:
    """A second gateway on ``stack``'s encoder and LLM, with its own admission settings."""
    port = free_port()
    argv = [sys.executable, "-m", "mmserve.cli", "gateway", "--host", "127.0.0.1", "--port", str(port),
            "--model-name", stack.model_name, "--encoder-urls", ",".join(s.url for s in stack.encoders),
            "--llm-urls", ",".join(s.url for s in stack.llms)]
    genv = {**stack.gateway.env, **{f"MMSERVE_GATEWAY_{k.upper()}": v for k, v in env.items()}}
    return Service(name, f"http://127.0.0.1:{port}", argv, genv, log_dir / f"{name}.log")


UNBOUNDED = {"max_in_flight": "100000", "max_queue": "0"}


def stack_pids(stack: LocalStack, gateway: Service) -> list[int]:
    return [gateway.proc.pid, *(s.proc.pid for s in (*stack.encoders, *stack.llms))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seconds", type=float, default=None, help="per level and side")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--client-timeout", type=float, default=None, help="seconds (default 30; 10 with --quick)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--admission", choices=("defaults", "tuned"), default="defaults",
                    help="ours: the gateway's default admission settings, or a window sized in the run at the "
                         "concurrency that reached capacity (in flight = queue = it, queue timeout 2 s)")
    _results.add_mode_args(ap)
    args = ap.parse_args()
    if args.smoke:  # every level and side once, 1 s runs, one saturation step, short waits
        args.quick, args.seconds, args.client_timeout = True, 2.0, 3.0
    # a smoke run waits for nothing in flight, not for a quiet machine (CI shares it)
    settle_s = 3.0 if args.smoke else 60.0
    seconds = args.seconds or (8.0 if args.quick else 60.0)
    # --quick: the forward half of the mirrored order (one run per side and level, of seconds / 2),
    # short saturation steps, and clients that give up sooner (the unbounded side's backlog, which
    # clients wait out to their timeout, is most of a run's wall time)
    order = _FORWARD if args.quick else RUN_ORDER
    runs_per = len(order) // len(_FORWARD)
    client_timeout = args.client_timeout or (10.0 if args.quick else 30.0)
    sat_seconds = min(seconds, 1.0 if args.smoke else 3.0) if args.quick else seconds
    log_dir = Path(tempfile.mkdtemp(prefix="mmserve-overload-"))
    model = args.model or str(write_tiny_model(log_dir / "tiny-mimo", arch="mimo"))
    result: dict = {"bench": "overload", "quick": args.quick, "seconds_per_level": seconds, "levels": {},
                    "runs_per_side_and_level": runs_per, "client_timeout_s": client_timeout}
    # one stack per side; the unbounded side's own gateway is the baseline, ours is added once
    # the capacity (and so the admission window) is known
    base = LocalStack(StackSpec(model_dir=model, gateway_port=0, gateway_env=UNBOUNDED), log_dir=log_dir / "unbounded")
    mine = LocalStack(StackSpec(model_dir=model, gateway_port=0), log_dir=log_dir / "admission")
    with base, mine:
        base.wait_ready(timeout=300)
        mine.wait_ready(timeout=300)
        other = base.gateway
        cap, window = asyncio.run(saturation(f"{other.url}/v1/chat/completions", base.model_name, args.clients,
                                             sat_seconds, max_clients=args.clients if args.smoke else 256))
        if args.admission == "tuned":  # an admission window sized at the concurrency that reached capacity
            bound = {"max_in_flight": str(window), "max_queue": str(window), "queue_timeout": "2"}
            ours = bounded_gateway(mine, bound, mine.log_dir, name="gateway-admission")
            ours.start()
        else:  # the stack's own gateway, as deployed
            d = GatewaySettings.model_fields
            bound = {k: str(d[k].default) for k in ("max_in_flight", "max_queue", "queue_timeout")}
            ours = mine.gateway
        result["admission"] = {"config": args.admission, **bound}
        try:
            wait_ready([ours], 120)
            stacks = {"admission": (mine, ours), "unbounded": (base, other)}
            llm_urls = [base.llms[0].url, mine.llms[0].url]
            gateway_urls = [ours.url, other.url]
            result["capacity_rps"] = round(cap, 3)
            result["admission_window"] = window
            pids = {side: (g.proc.pid, st.llms[0].proc.pid) for side, (st, g) in stacks.items()}
            result["rss_mb_start"] = {side: {"gateway": rss_mb(g), "llm": rss_mb(llm)} for side, (g, llm) in pids.items()}
            result["levels"] = {f"{lv}x": {"admission": [], "unbounded": []} for lv in (1, 2, 4)}
            for i, (level, side) in enumerate(order):
                waited = settle(llm_urls, gateway_urls, timeout=settle_s, quiet=not args.smoke)
                restarted = waited >= settle_s
                if restarted:  # the unbounded side's backlog (httpcore queues it, O(n^2)) would
                    base.restart(other)  # still be draining into the next run: start that gateway afresh
                    waited += settle(llm_urls, gateway_urls, timeout=5 * settle_s, quiet=not args.smoke)
                st, gw = stacks[side]
                other_side = "unbounded" if side == "admission" else "admission"
                meter = CpuMeter({"gateway": gw.proc.pid, "encoder": st.encoders[0].proc.pid, "llm": st.llms[0].proc.pid},
                                 others=stack_pids(*stacks[other_side]))
                with meter:
                    r = asyncio.run(open_loop(f"{gw.url}/v1/chat/completions", st.model_name,
                                              cap * level, seconds / 2, client_timeout, seed=level * 10 + i))
                r["cpu_cores"] = meter.cores
                r["rss_mb_after"] = {"gateway": rss_mb(gw.proc.pid), "llm": rss_mb(st.llms[0].proc.pid)}
                r["settled_s"] = waited
                r["unbounded_restarted_before"] = restarted
                r["position"] = i
                result["levels"][f"{level}x"][side].append(r)
                print(f"{level}x {side}: {r}", flush=True)
            pids = {side: (g.proc.pid, st.llms[0].proc.pid) for side, (st, g) in stacks.items()}
            result["rss_mb_end"] = {side: {"gateway": rss_mb(g), "llm": rss_mb(llm)} for side, (g, llm) in pids.items()}
        finally:
            if ours is not mine.gateway:
                ours.stop()

    def goodput(side: str, level: str) -> float:
        runs = result["levels"][level][side]
        return sum(r["goodput_rps"] for r in runs) / len(runs)

    result["summary"] = {
        side: {
            "goodput_4x_over_1x": round(goodput(side, "4x") / max(1e-9, goodput(side, "1x")), 3),
            "n_5xx": sum(r["n_5xx"] for lv in result["levels"].values() for r in lv[side]),
            "p99_4x_s": max((r["p99_s"] or 0) for r in result["levels"]["4x"][side]),
            "timeouts_4x": sum(r["timeouts"] for r in result["levels"]["4x"][side]),
        }
        for side in ("admission", "unbounded")
    }
    a, u = result["summary"]["admission"], result["summary"]["unbounded"]
    cfg = result["admission"]
    _results.record("overload", ap, args, result, kind="wall-clock",
                    baseline="the same stack with unbounded gateway admission (max_in_flight 100000, max_queue 0)",
                    summary=f"admission {cfg['config']} (max_in_flight {cfg['max_in_flight']}, max_queue {cfg['max_queue']}, "
                            f"queue_timeout {cfg['queue_timeout']} s), {seconds / 2:g} s per side and level: capacity "
                            f"{result['capacity_rps']:.1f} rps at {result['admission_window']} in flight; "
                            f"**4x/1x {a['goodput_4x_over_1x']} (target 0.9)**, {a['n_5xx']} 5xx, p99 of admitted "
                            f"{a['p99_4x_s']} s at 4x; unbounded: {u['goodput_4x_over_1x']}, p99 {u['p99_4x_s']} s, "
                            f"{u['timeouts_4x']} client timeouts at 4x")


if __name__ == "__main__":
    _results.run(main)
