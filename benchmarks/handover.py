"""Prefill -> decode hand-over: what it moves and how long the plain TCP transport takes.

Geometry from a published-format MiMo-V2.5-Pro ``config.json`` (``kv_capacity``'s: 10 full + 60
sliding layers, W = 128, bf16 KV). For each prompt length a hand-over of that geometry is built
(random KV bytes in the real page layout: full-layer pages of ``--page-tokens``, one sliding
window page, an XXH3-128 digest each), sent by ``TcpSender`` from another process to a
``TcpReceiver`` over loopback, and checked as the decode side checks it (lengths, digests).
Figures per length: KV bytes against a full-attention transfer (every layer, every token),
the digests' time on the sender, the transfer's median time and rate, the check's time.
No model runs here: the engine-side export and import are in ``tests/integration/test_disagg.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import time

import msgspec

from benchmarks import _results
from benchmarks.kv_capacity import CONFIG, geometry_from_config
from llm_svc.disagg.decode import check
from llm_svc.disagg.messages import FULL_PAGE, WINDOW_PAGE, Handover, KVPage, full_attention_bytes, handover_bytes
from llm_svc.disagg.transport import TcpReceiver, TcpSender
from llm_svc.types.request import Request

FP = "bench"


def build(n: int, page: int, window: int, f: int, s: int, blob: bytes) -> Handover:
    pages = [KVPage.of(FULL_PAGE, a, min(page, n - a), blob[:min(page, n - a) * f]) for a in range(0, n, page)]
    w0 = max(0, n - window)
    pages.append(KVPage.of(WINDOW_PAGE, w0, n - w0, blob[:(n - w0) * s]))
    return Handover("r", list(range(n)), 1, FP, page, window, pages)


def _sender(port: int, n: int, page: int, window: int, f: int, s: int, reps: int, go, ready) -> None:
    send_on_go(port, build(n, page, window, f, s, os.urandom(max(page * f, window * s))), reps, go, ready)


def send_on_go(port: int, h: Handover, reps: int, go, ready, nixl: bool = False, fresh: bool = False) -> None:
    """Connect to the receiver at ``port``, then send ``h`` each time ``go`` is set, ``reps`` times,
    setting ``ready`` before each wait (a sender process of its own: the receiver's clock starts
    as it sets ``go``, once the sender is ready); ``nixl``: the pages by NIXL (the transport's
    mode ``N``); ``fresh``: each time with its pages' bytes copied to new memory first, off the clock (as a prefill replica exports every hand-over anew: a
    transfer library finds no registration cached)."""
    from llm_svc.disagg.nixl_agent import NixlEndpoint

    async def run() -> None:
        tx = await TcpSender.connect("127.0.0.1", port, nixl=NixlEndpoint() if nixl else None)
        assert (tx.mode == b"N") == nixl
        for _ in range(reps):
            out = h if not fresh else msgspec.structs.replace(
                h, pages=[msgspec.structs.replace(p, data=bytes(bytearray(p.data))) for p in h.pages])
            ready.set()
            go.wait()
            go.clear()
            await tx.send(out)
        await tx.close()

    asyncio.run(run())


async def _transfer(n: int, page: int, window: int, f: int, s: int, reps: int) -> tuple[list[float], Handover]:
    # the sender builds its hand-over and connects before the first go
    return await timed_receives(_sender, (n, page, window, f, s, reps), reps, settle_s=1.0 + n / 4096)


async def timed_receives(sender, args: tuple, reps: int, settle_s: float,
                         check=None, nixl: bool = False) -> tuple[list[float], Handover]:
    """``sender(port, *args, go, ready)`` in a process of its own against a ``TcpReceiver`` here
    (one ``send_on_go`` loop); after ``settle_s``, ``reps`` times: once the sender set ``ready``,
    set ``go`` and time until the hand-over is received (then ``check(it)``, off the clock). The
    seconds of each, and the last hand-over. ``nixl``: the receiver offers NIXL (mode ``N``)."""
    from llm_svc.disagg.nixl_agent import NixlEndpoint

    rx = await TcpReceiver.listen("127.0.0.1", 0, nixl=NixlEndpoint() if nixl else None)
    # spawned, not forked: a forked child would share this process's NIXL agent (UCX's sockets)
    # and, exiting, tear its connections down under it
    ctx = mp.get_context("spawn")
    go, ready = ctx.Event(), ctx.Event()
    p = ctx.Process(target=sender, args=(rx.port, *args, go, ready))
    p.start()
    await asyncio.sleep(settle_s)
    times, h = [], None
    for _ in range(reps):
        while not ready.is_set():
            await asyncio.sleep(0.01)
        ready.clear()
        t0 = time.perf_counter()
        go.set()
        h = await asyncio.wait_for(rx.receive(), 600)
        times.append(time.perf_counter() - t0)
        if check is not None:
            check(h)
    p.join(60)
    await rx.close()
    return times, h


def measure(n: int, page: int, window: int, f: int, s: int, reps: int) -> dict:
    blob = os.urandom(max(page * f, window * s))
    t0 = time.perf_counter()
    build(n, page, window, f, s, blob)
    build_s = time.perf_counter() - t0
    times, h = asyncio.run(_transfer(n, page, window, f, s, reps))
    t0 = time.perf_counter()
    reason = check(h, Request("r", list(range(n))), FP, window, f, s)
    check_s = time.perf_counter() - t0
    assert reason is None, reason
    kv, full = handover_bytes(n, f, s, window), full_attention_bytes(n, f, s)
    assert h.kv_bytes == kv
    med = statistics.median(times)
    return {"prompt_tokens": n, "kv_bytes": kv, "full_attention_bytes": full, "ratio": round(kv / full, 4),
            "pages": len(h.pages), "build_and_digest_ms": round(build_s * 1e3, 1),
            "transfer_ms": [round(t * 1e3, 1) for t in times], "transfer_ms_median": round(med * 1e3, 1),
            "gib_per_s": round(kv / med / 2**30, 3), "check_ms": round(check_s * 1e3, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a 4,096-token prompt, 3 transfers")
    ap.add_argument("--lengths", type=int, nargs="+", default=None, help="prompt lengths in tokens")
    ap.add_argument("--reps", type=int, default=None, help="transfers per length")
    ap.add_argument("--page-tokens", type=int, default=32, help="full-layer KV per page (the Redis tier's default)")
    _results.add_mode_args(ap)
    args = ap.parse_args()
    lengths = args.lengths or ([256] if args.smoke else [4096] if args.quick else [1024, 4096, 32768])
    reps = args.reps or (1 if args.smoke else 3 if args.quick else 5)
    g = geometry_from_config(CONFIG)
    f, s = g.full_token_bytes, g.swa_token_bytes
    print(f"geometry ({CONFIG.name}): {g.full_layers} full + {g.swa_layers} sliding layers, W={g.window}, "
          f"{f} B full / {s} B sliding per token (bf16)")
    rows = []
    for n in lengths:
        r = measure(n, args.page_tokens, g.window, f, s, reps)
        rows.append(r)
        print(f"{n:>6} tokens: {r['kv_bytes'] / 2**20:8.1f} MiB of {r['full_attention_bytes'] / 2**20:8.1f} MiB "
              f"({r['ratio']:.3f}x); build+digest {r['build_and_digest_ms']:.0f} ms, transfer "
              f"{r['transfer_ms_median']:.0f} ms ({r['gib_per_s']:.2f} GiB/s), check {r['check_ms']:.0f} ms")
    at = next((r for r in rows if r["prompt_tokens"] == 4096), rows[0])
    figures = {"config": CONFIG.name, "page_tokens": args.page_tokens, "window": g.window,
               "transfer_bytes_over_full_attention": at["ratio"], "at_prompt_tokens": at["prompt_tokens"],
               "limit": round(f / (f + s), 4), "transport": "tcp (loopback, sender in another process)",
               "lengths": rows}
    _results.record("handover", ap, args, figures, kind="wall-clock",
                    baseline="a full-attention transfer (every layer's KV of every token)",
                    summary=f"{at['prompt_tokens']}-token hand-over {at['ratio']:.3f}x a full-attention transfer, "
                            f"{at['transfer_ms_median']:.0f} ms over loopback TCP ({at['gib_per_s']:.2f} GiB/s)")


if __name__ == "__main__":
    _results.run(main)
