"""Hand-over transports side by side: our TCP stream against NVIDIA NIXL (UCX) between two processes.

Both sides move the same bytes from one process to another over loopback: a MiMo-V2.5-Pro
hand-over's size (``handover``'s geometry: 1,024 / 4,096 / 32,768-token prompts; ``--quick``:
4,096), each size's sides alternated (ours, NIXL, NIXL, ours), the median of the transfers:

* ``tcp`` (ours, what runs today): ``TcpSender`` -> ``TcpReceiver``
  (``llm_svc/disagg/transport.py``), one hand-over of one page of that size, connected and past
  the token challenge before the clock starts; timed from the sender's go to the receiver
  holding every byte.
* ``nixl``: one NIXL agent per process (UCX backend, DRAM); the decode process registers its
  buffer and sends its metadata and descriptors ahead (a transport would keep the KV pools
  registered); timed from the prefill process's ``initialize_xfer`` (a WRITE with a
  notification) to its state ``DONE``. It runs in the venv ``scripts/nixl_venv.sh`` builds
  (NIXL is not a dependency); without that venv the side is skipped and said so.

No model runs: this compares the byte movers. The figure is NIXL's rate over ours; the last line
is JSON.

    bash scripts/nixl_venv.sh && python -m benchmarks.transfer_libs [--quick]
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

NIXL_PY = Path(os.environ.get("MMSERVE_CACHE_DIR", Path.home() / ".cache" / "mmserve")) / "nixl-venv" / "bin" / "python"


# ---------------------------------------------------------------- ours: the TCP transport
def _tcp_sender(port: int, nbytes: int, reps: int, go) -> None:
    from benchmarks.handover import send_on_go
    from llm_svc.disagg.messages import FULL_PAGE, Handover, KVPage

    send_on_go(port, Handover("r", [0], 1, "bench", 1, 1, [KVPage.of(FULL_PAGE, 0, 1, os.urandom(nbytes))]), reps, go)


async def _tcp_run(nbytes: int, reps: int) -> list[float]:
    from benchmarks.handover import timed_receives

    def whole(h) -> None:
        assert len(h.pages[0].data) == nbytes

    # the sender starts, builds its page and connects before the first go
    times, _ = await timed_receives(_tcp_sender, (nbytes, reps), reps, settle_s=2.0 + nbytes / 2**29, check=whole)
    return times


# ---------------------------------------------------------------- NIXL (in its own venv)
def _nixl_decode(q_out, nbytes: int, reps: int) -> None:
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    b = nixl_agent("decode", nixl_agent_config(backends=["UCX"]))
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    b.register_memory(buf)
    q_out.put((b.get_agent_metadata(), b.get_serialized_descs(b.get_xfer_descs(buf))))
    got = 0
    while got < reps:  # every transfer's notification
        got += sum(len(v) for v in b.get_new_notifs().values())
    q_out.put(int(buf[::4096].sum()))


def nixl_worker(nbytes: int, reps: int) -> None:
    """In the NIXL venv: ``reps`` WRITEs of ``nbytes`` to another process; prints their seconds."""
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

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
    r = subprocess.run([str(NIXL_PY), "-m", "benchmarks.transfer_libs", "--nixl-worker", str(nbytes), str(reps)],
                       capture_output=True, text=True, timeout=900, cwd=Path(__file__).resolve().parents[1])
    if r.returncode != 0:
        raise RuntimeError(f"the NIXL side failed: {r.stderr[-2000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    return out["times"], out["bytes_equal"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the 4,096-token hand-over's size only, 3 transfers a run")
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

    g = geometry_from_config(CONFIG)
    lengths = args.lengths or ([64] if args.smoke else [4096] if args.quick else [1024, 4096, 32768])
    reps = args.reps or (1 if args.smoke else 3 if args.quick else 5)
    have_nixl = NIXL_PY.exists()
    skipped = [] if have_nixl else [f"nixl: no venv at {NIXL_PY} (bash scripts/nixl_venv.sh)"]
    rows = []
    for n in lengths:
        nbytes = handover_bytes(n, g.full_token_bytes, g.swa_token_bytes, g.window)
        tcp: list[float] = []
        nixl: list[float] = []
        equal = True
        for side in ("tcp", "nixl", "nixl", "tcp"):  # alternated: this machine is noisy
            if side == "tcp":
                tcp += asyncio.run(_tcp_run(nbytes, reps))
            elif have_nixl:
                t, same = _nixl_run(nbytes, reps)
                nixl += t
                equal = equal and same
        row = {"prompt_tokens": n, "bytes": nbytes, "tcp_ms": [round(t * 1e3, 1) for t in tcp],
               "tcp_gib_per_s": round(nbytes / statistics.median(tcp) / 2**30, 3)}
        if nixl:
            row.update({"nixl_ms": [round(t * 1e3, 1) for t in nixl], "nixl_bytes_equal": equal,
                        "nixl_gib_per_s": round(nbytes / statistics.median(nixl) / 2**30, 3)})
            row["nixl_over_tcp"] = round(row["nixl_gib_per_s"] / row["tcp_gib_per_s"], 3)
        rows.append(row)
        print(f"{n:>6} tokens, {nbytes / 2**20:8.1f} MiB: tcp {row['tcp_gib_per_s']:.2f} GiB/s"
              + (f", nixl {row['nixl_gib_per_s']:.2f} GiB/s ({row['nixl_over_tcp']:.2f}x), bytes equal {equal}"
                 if nixl else ", nixl skipped"), flush=True)
    at = next((r for r in rows if r["prompt_tokens"] == 4096), rows[0])
    figures = {"config": CONFIG.name, "at_prompt_tokens": at["prompt_tokens"],
               "nixl_over_tcp": at.get("nixl_over_tcp"), "nixl": "nixl 1.5.1 / nixl-cu13, UCX backend, DRAM",
               "lengths": rows}
    summary = (f"{at['prompt_tokens']}-token hand-over's bytes, NIXL (UCX) over our TCP stream: "
               f"{at['nixl_over_tcp']}x ({at.get('nixl_gib_per_s')} vs {at['tcp_gib_per_s']} GiB/s)"
               if "nixl_over_tcp" in at else f"our TCP stream {at['tcp_gib_per_s']} GiB/s; NIXL not run")
    _results.record("transfer_libs", ap, args, figures, kind="wall-clock",
                    baseline="our TCP hand-over transport (what runs today)", summary=summary, skipped=skipped)


if __name__ == "__main__":
    if "--nixl-worker" in sys.argv:
        main()
    else:
        _results.run(main)
