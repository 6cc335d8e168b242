"""``mmserve plan``: the deployment table of a MiMo-V2 config (the arithmetic is ``mmserve.plan``).

    mmserve plan --model DIR_OR_CONFIG --gpus N [--gpu h100|h200] [--kv-dtype bf16|fp8]
                 [--weights auto|fp8|bf16] [--gpu-memory-utilization 0.9] [--reserve-gib 4] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from mmserve import plan as P

CONTEXTS = (32768, 262144)


def add_parser(sub) -> None:
    """Registers ``plan`` on the ``mmserve`` subcommand parser ``sub``."""
    p = sub.add_parser("plan", help="weights, KV, requests that fit and the decode bandwidth bound per TP/EP/DP layout",
                       description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a bundle directory (its config.json) or a config.json file")
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--gpu", default="h200", choices=sorted(P.GPUS))
    p.add_argument("--kv-dtype", default="bf16", choices=["bf16", "fp8"])
    p.add_argument("--weights", default="auto", choices=["auto", "fp8", "bf16"],
                   help="auto: FP8 when the config's quantization_config says so")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of HBM the server may use (vLLM's flag and default)")
    p.add_argument("--reserve-gib", type=float, default=4.0,
                   help="per rank, inside that share: activations, CUDA graphs, NCCL buffers (an assumption)")
    p.add_argument("--no-mtp", action="store_true", help="leave the MTP draft layers out of the weights")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_plan)


def build(args: argparse.Namespace) -> dict:
    """The plan of ``args`` as a JSON-ready dict."""
    g, cfg = P.read_config(args.model)
    prec = P.precision_for(cfg, args.weights, args.kv_dtype)
    gpu = P.GPUS[args.gpu]
    reserve = int(args.reserve_gib * P.GIB)
    plans = [P.plan_layout(g, lay, prec, gpu, CONTEXTS, reserve, args.gpu_memory_utilization,
                           bool(cfg.get("tie_word_embeddings")), not args.no_mtp) for lay in P.layouts_for(args.gpus)]
    n_full, n_swa = P.layer_counts(g)
    return {
        "model": str(args.model), "architecture": (cfg.get("architectures") or ["?"])[0],
        "gpus": args.gpus, "gpu": gpu.name, "hbm_bytes": gpu.hbm_bytes, "hbm_bandwidth_bytes_per_s": gpu.bandwidth,
        "gpu_memory_utilization": args.gpu_memory_utilization, "reserve_bytes_per_rank": reserve,
        "weights": "fp8" if prec.fp8 else "bf16", "kv_dtype": args.kv_dtype, "mtp_weights": not args.no_mtp,
        "layers": {"full": n_full, "sliding": n_swa, "window": g.window},
        "attention_projection_layout": g.layout, "contexts": list(CONTEXTS),
        "layouts": [_layout_json(pl) for pl in plans],
    }


def _layout_json(pl: P.LayoutPlan) -> dict:
    lay, w = pl.layout, pl.weights
    return {
        "layout": lay.name, "tp": lay.tp, "dp": lay.dp, "ep": lay.ep_size if lay.ep else None,
        "status": pl.status, "problems": list(pl.problems),
        "weight_bytes_per_rank": w.total,
        "weight_bytes_per_rank_by_part": asdict(w),
        "kv_bytes_per_token_per_rank": {"full_layers": pl.kv_full_per_token, "sliding_layers": pl.kv_swa_per_token},
        "kv_budget_bytes_per_rank": pl.kv_budget,
        "requests_that_fit": {str(c): n for c, n in pl.fits.items()},
        "decode_batch1": {"bytes_per_rank": round(pl.step_bytes_b1), "step_ms": round(pl.step_s_b1 * 1e3, 3),
                          "tokens_per_s": round(1 / pl.step_s_b1, 1)},
        "decode_batch_fit": {"requests": pl.batch, "bytes_per_rank": round(pl.step_bytes_batch),
                             "step_ms": round(pl.step_s_batch * 1e3, 3),
                             "tokens_per_s": round(pl.batch / pl.step_s_batch, 1) if pl.batch else 0.0},
    }


def _gib(b: float) -> str:
    return f"{b / P.GIB:.1f}"


def format_table(d: dict) -> str:
    """The plan dict as a readable table (numbers per rank unless they say otherwise)."""
    c0, c1 = d["contexts"]
    head = (f"{d['architecture']} ({d['model']}) on {d['gpus']} x {d['gpu']}: weights {d['weights']}, "
            f"KV {d['kv_dtype']}, {d['layers']['full']} full + {d['layers']['sliding']} sliding layers "
            f"(window {d['layers']['window']}), {d['attention_projection_layout']} attention projection\n"
            f"HBM for KV per rank = {d['gpu_memory_utilization']} x {_gib(d['hbm_bytes'])} GiB - weights - "
            f"{_gib(d['reserve_bytes_per_rank'])} GiB reserve; decode bound = bytes read per step / "
            f"{d['hbm_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s (arithmetic, not a measurement)\n")
    cols = ["layout", "status", "weights GiB/rank", "KV KiB/tok full", "KV KiB/tok SWA", "KV GiB/rank",
            f"{c0 // 1024}K reqs", f"{c1 // 1024}K reqs", "b=1 ms", "b=1 tok/s", f"batch@{c0 // 1024}K",
            "batch ms", "batch tok/s"]
    rows = []
    for lay in d["layouts"]:
        b1, bf = lay["decode_batch1"], lay["decode_batch_fit"]
        rows.append([lay["layout"], lay["status"], _gib(lay["weight_bytes_per_rank"]),
                     f"{lay['kv_bytes_per_token_per_rank']['full_layers'] / 1024:.1f}",
                     f"{lay['kv_bytes_per_token_per_rank']['sliding_layers'] / 1024:.1f}",
                     _gib(max(0, lay["kv_budget_bytes_per_rank"])),
                     str(lay["requests_that_fit"][str(c0)]), str(lay["requests_that_fit"][str(c1)]),
                     f"{b1['step_ms']:.2f}", f"{b1['tokens_per_s']:.0f}", str(bf["requests"]),
                     f"{bf['step_ms']:.2f}" if bf["requests"] else "-",
                     f"{bf['tokens_per_s']:.0f}" if bf["requests"] else "-"])
    widths = [max(len(r[i]) for r in rows + [cols]) for i in range(len(cols))]
    line = lambda r: "| " + " | ".join(v.ljust(widths[i]) for i, v in enumerate(r)) + " |"
    out = [line(cols), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows]
    notes = [f"- {lay['layout']}: {p}" for lay in d["layouts"] for p in lay["problems"]]
    return head + "\n".join(out) + ("\n" + "\n".join(notes) if notes else "") + "\n"


def cmd_plan(args: argparse.Namespace) -> int:
    from shared.bundle import CheckpointError

    try:
        d = build(args)
    except (OSError, ValueError, CheckpointError) as e:
        print(f"mmserve plan: {e}", file=sys.stderr)
        return 2
    print(json.dumps(d, indent=2) if args.json else format_table(d), end="" if not args.json else "\n")
    return 0
