"""Hand-over transports side by side: our transport with the pages on its TCP stream, the same
transport with the pages by NVIDIA NIXL, and bare NIXL, between two processes.

Every side moves a MiMo-V2.5-Pro hand-over's bytes from one process to another over loopback
(``handover``'s geometry: 1,024 / 4,096 / 32,768-token prompts; ``--quick``: 4,096), the sides of
each size alternated (tcp, bare, nixl, nixl, bare, tcp), the median of the transfers after the
first two of each run (warm; the first two, cold, are reported apart):

* ``tcp`` (``kv_transport=tcp``): ``TcpSender`` -> ``TcpReceiver`` (``llm_svc/disagg/transport.py``),
  the hand-over in its real page layout (full-layer pages of 32 tokens, one window page; every
  transfer's pages in new memory, as a prefill replica exports each hand-over anew), connected
  and past the token challenge before the clock starts; timed from the sender's go to the
  receiver holding every page.
* ``nixl`` (``kv_transport=nixl``, what a user gets where NIXL is installed): the same, its
  pages by NIXL (mode ``N``): per hand-over the receiver registers a buffer and answers the head
  with its metadata and descriptors, the sender registers its pages and WRITEs them, the
  receiver waits for NIXL's notification; timed the same way.
* ``bare``: NIXL alone, one agent per process (UCX backend, DRAM), one buffer registered
  ahead on both sides, metadata and descriptors sent ahead; timed from the prefill process's
  ``initialize_xfer`` (a WRITE with a notification) to its state ``DONE``: what the byte mover
  can do with nothing around it.

No model runs: this compares the byte movers. The figure is ``nixl``'s rate over ``tcp``'s; the
last line is JSON. NIXL comes with ``bash scripts/setup.sh --test`` (``nixl-cu13``; the project's
``nixl`` extra); without it the NIXL sides are skipped and said so.

    python -m benchmarks.transfer_libs [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import _results

PAGE_TOKENS = 32
# the first transfers of each run (a fresh pair of processes) are reported apart, as cold: over
# NIXL each new receive buffer's first WRITE from another process costs 0.5-0.7 s here (UCX
# setting up its access to that memory), and the decode replica's buffer pool makes them rare
COLD = 2


# ---------------------------------------------------------------- ours: the hand-over transport
def _ours_sender(port: int, n: int, reps: int, nixl: bool, go, ready) -> None:
    from benchmarks.handover import build, send_on_go
    from benchmarks.kv_capacity import CONFIG, geometry_from_config

    g = geometry_from_config(CONFIG)
    f, s = g.full_token_bytes, g.swa_token_bytes
    send_on_go(port, build(n, PAGE_TOKENS, g.window, f, s, os.urandom(max(PAGE_TOKENS * f, g.window * s))),
               reps, go, ready, nixl=nixl, fresh=True)


async def _ours_run(n: int, nbytes: int, reps: int, nixl: bool) -> list[float]:
    from benchmarks.handover import timed_receives

    def whole(h) -> None:  # off the clock: every page arrived as it left
        assert h.kv_bytes == nbytes and all(p.intact() for p in h.pages)

    # the sender starts, builds its pages and connects before the first go
    times, _ = await timed_receives(_ours_sender, (n, reps, nixl), reps, settle_s=2.0 + nbytes / 2**29,
                                    check=whole, nixl=nixl)
    return times


# ---------------------------------------------------------------- bare NIXL (a process of its own)
def _nixl_decode(q_out, nbytes: int, reps: int) -> None:
    import torch
    from llm_svc.disagg.nixl_agent import load_nixl

    api = load_nixl()
    nixl_agent, nixl_agent_config = api.nixl_agent, api.nixl_agent_config

    b = nixl_agent("decode", nixl_agent_config(backends=["UCX"]))
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    b.register_memory(buf)
    q_out.put((b.get_agent_metadata(), b.get_serialized_descs(b.get_xfer_descs(buf))))
    got = 0
    while got < reps:  # every transfer's notification
        got += sum(len(v) for v in b.get_new_notifs().values())
    q_out.put(int(buf[::4096].sum()))


def nixl_worker(nbytes: int, reps: int) -> None:
    """``reps`` WRITEs of ``nbytes`` to another process; prints their seconds."""
    import torch
    from llm_svc.disagg.nixl_agent import load_nixl

    api = load_nixl()
    nixl_agent, nixl_agent_config = api.nixl_agent, api.nixl_agent_config

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_nixl_decode, args=(q, nbytes, reps))
    p.start()
    a = nixl_agent("prefill", nixl_agent_config(backends=["UCX"]))
    meta, descs = q.get(timeout=300)
    peer = a.add_remote_agent(meta)
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    a.register_memory(src)
    local, remote = a.get_xfer_descs(src), a.deserialize_descs(descs)
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        h = a.initialize_xfer("WRITE", local, remote, peer, f"x{i}".encode())
        a.transfer(h)
        while (state := a.check_xfer_state(h)) not in ("DONE", "ERR"):
            pass
        times.append(time.perf_counter() - t0)
        assert state == "DONE", state
        a.release_xfer_handle(h)
    same = q.get(timeout=300) == int(src[::4096].sum())
    p.join(60)
    print(json.dumps({"times": times, "bytes_equal": same}), flush=True)


def _nixl_run(nbytes: int, reps: int) -> tuple[list[float], bool]:
    r = subprocess.run([sys.executable, "-m", "benchmarks.transfer_libs", "--nixl-worker", str(nbytes), str(reps)],
                       capture_output=True, text=True, timeout=900, cwd=Path(__file__).resolve().parents[1])
    if r.returncode != 0:
        raise RuntimeError(f"the NIXL side failed: {r.stderr[-2000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    return out["times"], out["bytes_equal"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the 4,096-token hand-over's size only, 5 transfers a run (2 cold)")
    ap.add_argument("--lengths", type=int, nargs="+", default=None, help="prompt lengths (tokens) whose sizes move")
    ap.add_argument("--reps", type=int, default=None, help="transfers per run (each side runs twice a size)")
    ap.add_argument("--nixl-worker", nargs=2, type=int, default=None, metavar=("BYTES", "REPS"),
                    help=argparse.SUPPRESS)
    _results.add_mode_args(ap)
    args = ap.parse_args()
    if args.nixl_worker:
        nixl_worker(*args.nixl_worker)
        return
    from benchmarks.kv_capacity import CONFIG, geometry_from_config
    from llm_svc.disagg.messages import handover_bytes
    from llm_svc.disagg.nixl_agent import nixl_available

    g = geometry_from_config(CONFIG)
    lengths = args.lengths or ([64] if args.smoke else [4096] if args.quick else [1024, 4096, 32768])
    reps = args.reps or (COLD + 1 if args.smoke else COLD + 3 if args.quick else COLD + 5)

    have_nixl = nixl_available()
    skipped = [] if have_nixl else ["nixl, bare: NIXL is not installed (bash scripts/setup.sh --test installs nixl-cu13)"]
    rows = []
    for n in lengths:
        nbytes = handover_bytes(n, g.full_token_bytes, g.swa_token_bytes, g.window)
        times: dict[str, list[float]] = {"tcp": [], "bare": [], "nixl": []}
        cold: dict[str, list[float]] = {"tcp": [], "bare": [], "nixl": []}
        equal = True
        for side in ("tcp", "bare", "nixl", "nixl", "bare", "tcp"):  # alternated: this machine is noisy
            if side == "tcp" or (side == "nixl" and have_nixl):
                t = asyncio.run(_ours_run(n, nbytes, reps, nixl=side == "nixl"))
                cold[side] += t[:COLD]
                times[side] += t[COLD:]
            elif have_nixl:
                t, same = _nixl_run(nbytes, reps)
                cold["bare"] += t[:COLD]
                times["bare"] += t[COLD:]
                equal = equal and same
        row = {"prompt_tokens": n, "bytes": nbytes}
        for side, ts in times.items():
            if ts:
                row[f"{side}_ms"] = [round(t * 1e3, 1) for t in ts]
                row[f"{side}_gib_per_s"] = round(nbytes / statistics.median(ts) / 2**30, 3)
                row[f"{side}_cold_ms"] = [round(t * 1e3, 1) for t in cold[side]]
                row[f"{side}_cold_ms_median"] = round(statistics.median(cold[side]) * 1e3, 1)
        if have_nixl:
            row["bare_bytes_equal"] = equal
            row["nixl_over_tcp"] = round(row["nixl_gib_per_s"] / row["tcp_gib_per_s"], 3)
            row["bare_over_tcp"] = round(row["bare_gib_per_s"] / row["tcp_gib_per_s"], 3)
        rows.append(row)
        print(f"{n:>6} tokens, {nbytes / 2**20:8.1f} MiB, warm: tcp {row['tcp_gib_per_s']:.2f} GiB/s"
              + (f", nixl (our transport) {row['nixl_gib_per_s']:.2f} GiB/s ({row['nixl_over_tcp']:.2f}x), "
                 f"bare NIXL {row['bare_gib_per_s']:.2f} GiB/s ({row['bare_over_tcp']:.2f}x, bytes equal {equal})"
                 if have_nixl else ", NIXL sides skipped")
              + "; cold (first " + str(COLD) + " of a run) median ms: "
              + ", ".join(f"{k} {row[f'{k}_cold_ms_median']:.0f}" for k in times if f"{k}_cold_ms_median" in row),
              flush=True)
    at = next((r for r in rows if r["prompt_tokens"] == 4096), rows[0])
    figures = {"config": CONFIG.name, "at_prompt_tokens": at["prompt_tokens"], "page_tokens": PAGE_TOKENS,
               "cold_transfers_per_run": COLD,
               "nixl_over_tcp": at.get("nixl_over_tcp"), "bare_over_tcp": at.get("bare_over_tcp"),
               "nixl": "nixl-cu13 1.5.1, UCX backend, DRAM", "lengths": rows}
    summary = (f"{at['prompt_tokens']}-token hand-over, warm, our transport with NIXL over it with the TCP stream: "
               f"{at['nixl_over_tcp']}x ({at['nixl_gib_per_s']} vs {at['tcp_gib_per_s']} GiB/s; bare NIXL "
               f"{at['bare_gib_per_s']} GiB/s; cold: {at['nixl_cold_ms_median']:.0f} vs {at['tcp_cold_ms_median']:.0f} ms)"
               if have_nixl else f"our TCP stream {at['tcp_gib_per_s']} GiB/s; NIXL not run")
    _results.record("transfer_libs", ap, args, figures, kind="wall-clock",
                    baseline="our hand-over transport with the pages on its TCP stream (kv_transport=tcp)",
                    summary=summary, skipped=skipped)


if __name__ == "__main__":
    if "--nixl-worker" in sys.argv:
        main()
    else:
        _results.run(main)
