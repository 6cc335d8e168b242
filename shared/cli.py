"""The ``mmserve`` console script.

    mmserve tiny-model --out DIR [--arch mimo|gemma3|mimo-v2-flash|...] [--sliding-window W] [--layout L] [--quant Q]
    mmserve encoder  --model DIR [--port 8100] [...]        one encoder service
    mmserve llm      --model DIR [--port 8200] [--backend hf|swa] [...]
    mmserve gateway  [--port 8000] [--encoder-urls URL,...] [--llm-urls URL,...]
    mmserve up       [--model DIR] [--encoders N] [--llms M]   the whole stack as local processes

Every service flag also has an environment variable (``MMSERVE_<SERVICE>_<FLAG>``); flags win.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

CACHE_DIR = Path(os.environ.get("MMSERVE_CACHE_DIR", Path.home() / ".cache" / "mmserve"))
DEFAULT_MODEL_DIR = CACHE_DIR / "tiny-mimo"


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--log-level", default=None)


def _overrides(args: argparse.Namespace, names: list[str]) -> dict:
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def _serve(app, settings) -> None:
    import uvicorn

    # a bounded graceful shutdown (as the gateway's): an open stream must not hold SIGTERM forever
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                timeout_keep_alive=settings.keep_alive_timeout, timeout_graceful_shutdown=5)


def cmd_tiny_model(args: argparse.Namespace) -> int:
    from shared.tiny_model import write_tiny_model

    try:
        out = write_tiny_model(args.out, arch=args.arch, sliding_window=args.sliding_window, seed=args.seed,
                               layout=args.layout, quant=args.quant)
    except ValueError as e:  # an option the arch has not: say so, no traceback
        print(f"mmserve tiny-model: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.arch} bundle to {out}")
    return 0


def ensure_default_model(model_dir: str | None) -> str:
    """The bundle to serve: the given one, or the default tiny bundle (written on first use)."""
    if model_dir:
        return model_dir
    if not (DEFAULT_MODEL_DIR / "config.json").exists():
        from shared.tiny_model import write_tiny_model

        print(f"writing the default tiny model to {DEFAULT_MODEL_DIR} ...", flush=True)
        write_tiny_model(DEFAULT_MODEL_DIR)
    return str(DEFAULT_MODEL_DIR)


def _run_model_service(args: argparse.Namespace, app_module: str, settings_cls, flags: list[str]) -> int:
    import importlib

    kw = _overrides(args, ["host", "port", "log_level", "device", *flags])
    kw["model_dir"] = ensure_default_model(args.model)
    settings = settings_cls(**kw)
    _serve(importlib.import_module(app_module).create_app(settings), settings)
    return 0


def cmd_encoder(args: argparse.Namespace) -> int:
    from shared.settings import EncoderSettings

    return _run_model_service(args, "encoder_svc.app", EncoderSettings, ["redis_url", "max_batch_size"])


def cmd_llm(args: argparse.Namespace) -> int:
    from shared.settings import LLMSettings

    return _run_model_service(args, "llm_svc.app", LLMSettings, ["backend", "kv_bytes", "kv_l3_url", "media_redis_url"])


def cmd_gateway(args: argparse.Namespace) -> int:
    from gateway.app import create_app
    from shared.settings import GatewaySettings

    kw = _overrides(args, ["host", "port", "log_level", "model_name", "llm_routing"])
    for name in ("encoder_urls", "llm_urls", "api_keys", "allowed_hosts"):
        # an explicit empty --encoder-urls "": a text-only model, served without encoders
        if getattr(args, name, None) or (name == "encoder_urls" and getattr(args, name, None) == ""):
            kw[name] = [s.strip() for s in getattr(args, name).split(",") if s.strip()]
    settings = GatewaySettings(**kw)
    _serve(create_app(settings), settings)
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from shared.bundle import load_bundle_spec
    from shared.launcher import LocalStack, StackSpec

    model_dir = ensure_default_model(args.model)
    spec = StackSpec(
        model_dir=model_dir,
        host=args.host or "127.0.0.1",
        gateway_port=args.port or 8000,
        encoders=args.encoders if load_bundle_spec(model_dir).modalities() else 0,  # text-only LM: no encoder
        llms=args.llms,
        llm_backend=args.backend,
        redis_url=args.redis_url,
    )
    def _sigterm(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _sigterm)  # stop children on `kill` too, not only Ctrl-C
    with LocalStack(spec) as stack:
        print(f"starting {len(stack.services)} services (logs: {stack.log_dir}) ...", flush=True)
        stack.wait_ready(timeout=args.ready_timeout, progress=lambda line: print(line, flush=True))
        print(stack.banner(), flush=True)
        code = stack.wait()  # restarts crashed services; non-zero once it gives up
    return code


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mmserve", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("tiny-model", help="write a tiny random-weight model bundle")
    p.add_argument("--out", required=True)
    from shared.tiny_model import ARCHS

    p.add_argument("--arch", default="mimo", choices=sorted(ARCHS))
    p.add_argument("--sliding-window", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layout", default=None, choices=["split", "fused_qkv"],
                   help="mimo-v2-flash / mimo-v2.5: attention projections as published (default split)")
    p.add_argument("--quant", default=None, choices=["fp8", "mxfp4"],
                   help="quantized as published: fp8 (mimo-v2-flash / mimo-v2.5, block FP8), mxfp4 (gpt-oss experts)")
    p.set_defaults(fn=cmd_tiny_model)

    p = sub.add_parser("encoder", help="run one encoder service")
    _add_common(p)
    p.add_argument("--model", default=None, help="bundle dir (default: the tiny model)")
    p.add_argument("--device", default=None)
    p.add_argument("--redis-url", default=None)
    p.add_argument("--max-batch-size", type=int, default=None)
    p.set_defaults(fn=cmd_encoder)

    p = sub.add_parser("llm", help="run one LLM service")
    _add_common(p)
    p.add_argument("--model", default=None, help="bundle dir (default: the tiny model)")
    p.add_argument("--device", default=None)
    p.add_argument("--backend", default=None, help="hf | swa")
    p.add_argument("--kv-bytes", type=int, default=None)
    p.add_argument("--kv-l3-url", default=None, help="Redis URL of the L3 KV tier shared by LLM replicas")
    p.add_argument("--media-redis-url", default=None,
                   help="the encoders' Redis embedding tier: media sent by reference is read there first")
    p.set_defaults(fn=cmd_llm)

    p = sub.add_parser("gateway", help="run the OpenAI-compatible gateway")
    _add_common(p)
    p.add_argument("--model-name", default=None)
    p.add_argument("--encoder-urls", default=None, help="comma-separated")
    p.add_argument("--llm-urls", default=None, help="comma-separated")
    p.add_argument("--api-keys", default=None, help="comma-separated")
    p.add_argument("--allowed-hosts", default=None, help="comma-separated SSRF allow-list")
    p.add_argument("--llm-routing", default=None, choices=["cache_aware", "round_robin"])
    p.set_defaults(fn=cmd_gateway)

    p = sub.add_parser("up", help="run gateway + encoders + LLM services as local processes")
    _add_common(p)
    p.add_argument("--model", default=None, help="bundle dir (default: the tiny model)")
    p.add_argument("--encoders", type=int, default=1)
    p.add_argument("--llms", type=int, default=1)
    p.add_argument("--backend", default=None, help="LLM backend: hf | swa")
    p.add_argument("--redis-url", default=None,
                   help="shared encoder cache and L3 KV tier of the LLMs (default: embedded cache, device + host KV)")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.set_defaults(fn=cmd_up)
    return ap


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
