"""The ``mmserve`` console script.

    mmserve tiny-model --out DIR [--arch mimo|gemma3|mimo-v2-flash|...] [--sliding-window W] [--layout L] [--quant Q]
    mmserve encoder  --model DIR [--port 8100] [...]        one encoder service
    mmserve llm      --model DIR [--port 8200] [--backend hf|swa] [...]
    mmserve gateway  [--port 8000] [--encoder-urls URL,...] [--llm-urls URL,...]
    mmserve up       [--model DIR] [--encoders N] [--llms M]   the whole stack as local processes
    mmserve plan     --model DIR --gpus N [--gpu h100|h200]    deployment arithmetic per TP/EP/DP layout

Every setting of a service (``shared/settings.py``) is a flag of its command, named after the
field (``max_model_len``: ``--max-model-len``; booleans also ``--no-...``), plus vLLM's name where
one means the same (``SETTINGS_ALIASES``); each is also an environment variable
(``MMSERVE_<SERVICE>_<FIELD>``); flags win.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from shared.cache_dir import DEFAULT_MODEL, cache_root
from shared.env_check import STRICT_FLAG, STRICT_VAR, check_service_env

CACHE_DIR = cache_root()
DEFAULT_MODEL_DIR = CACHE_DIR / DEFAULT_MODEL


# extra flags of a setting (its own flag is the field's name in kebab case): vLLM's names where the
# setting means the same, and the short ``--model`` of the bundle directory
SETTINGS_ALIASES = {
    "model-dir": "model",
    "model-name": "served-model-name",
    "max-running": "max-num-seqs",
    "max-batch-tokens": "max-num-batched-tokens",
    "enable-prefix-cache": "enable-prefix-caching",
    "role": "kv-role",
    "kv-transport": "kv-connector",
}


def _add_settings_flags(p: argparse.ArgumentParser, settings_cls) -> None:
    """One flag per field of ``settings_cls`` (help from its description), and its aliases; the
    parsed flags go to the settings as their highest-priority source."""
    from pydantic_settings import CliSettingsSource

    source = CliSettingsSource(settings_cls, root_parser=p, cli_kebab_case=True, cli_implicit_flags=True,
                               cli_enforce_required=False, cli_shortcuts=SETTINGS_ALIASES)
    p.set_defaults(settings_cls=settings_cls, settings_source=source, settings_parser=p)


def _settings(args: argparse.Namespace):
    """The command's settings: flags, then ``MMSERVE_<SERVICE>_*``, then the defaults; a model
    service without a bundle directory serves the default tiny model."""
    from pydantic import ValidationError

    cls = args.settings_cls
    check_service_env(args.cmd, args.strict_env)  # before any model is written or loaded
    if "model_dir" in cls.model_fields and not getattr(args, "model_dir", None) and not _in_env(cls, "model_dir"):
        args.model_dir = ensure_default_model(None)
    flags = argparse.Namespace(**{k: v for k, v in vars(args).items() if k in cls.model_fields})
    try:
        return cls(_cli_settings_source=args.settings_source(parsed_args=flags))
    except ValidationError as e:  # a bad flag or environment value: say which, no traceback
        prefix = cls.model_config.get("env_prefix", "")
        args.settings_parser.error("; ".join(
            f"--{str(err['loc'][0]).replace('_', '-')} / {prefix}{str(err['loc'][0]).upper()}: {err['msg']}"
            if err["loc"] else err["msg"] for err in e.errors()))


def _in_env(settings_cls, field: str) -> bool:
    name = (settings_cls.model_config.get("env_prefix", "") + field).lower()
    return any(k.lower() == name for k in os.environ)


def _add_strict_env(p: argparse.ArgumentParser) -> None:
    p.add_argument(STRICT_FLAG, action="store_true", help="an MMSERVE_* variable that names no setting is a "
                   f"start-up error (exit code 2), not a warning; also {STRICT_VAR}=1")


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--log-level", default=None)


def _serve(app, settings, access_log: bool = True) -> None:
    """Runs ``app`` under uvicorn; ``access_log`` False: no line per request below debug level."""
    import uvicorn

    debug = str(settings.log_level).lower() == "debug"
    if not debug:
        # httpx logs every upstream request at INFO: a line per request (the access log has one
        # already), formatted and written on the event loop of a service on a CPU budget
        logging.getLogger("httpx").setLevel(logging.WARNING)
    # a bounded graceful shutdown (as the gateway's): an open stream must not hold SIGTERM forever
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                access_log=access_log or debug, timeout_keep_alive=settings.keep_alive_timeout,
                timeout_graceful_shutdown=5)


def cmd_tiny_model(args: argparse.Namespace) -> int:
    from mmserve.tiny_model import write_tiny_model

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
        from mmserve.tiny_model import write_tiny_model

        print(f"writing the default tiny model to {DEFAULT_MODEL_DIR} ...", flush=True)
        write_tiny_model(DEFAULT_MODEL_DIR)
    return str(DEFAULT_MODEL_DIR)


def _run_service(args: argparse.Namespace, create_app, access_log: bool = True) -> int:
    from shared.memtrace import maybe_start

    settings = _settings(args)
    maybe_start(args.cmd)  # MMSERVE_TRACEMALLOC=1 only
    try:
        app = create_app(settings)
    except ValueError as e:  # a combination of settings the service refuses: say so, no traceback
        print(f"mmserve {args.cmd}: {e}", file=sys.stderr)
        return 2
    _serve(app, settings, access_log)
    return 0


# each service is imported by its own command only (an encoder process never loads the LLM's code)
def cmd_encoder(args: argparse.Namespace) -> int:
    from encoder_svc.app import create_app

    return _run_service(args, create_app)


def cmd_llm(args: argparse.Namespace) -> int:
    from llm_svc.front.app import create_app

    # its callers are the gateway (which logs each client request) and the pool's /readyz
    # probes: a formatted line for each costs the CPU the engine core's threads run on
    return _run_service(args, create_app, access_log=False)


def cmd_gateway(args: argparse.Namespace) -> int:
    from gateway.app import create_app

    return _run_service(args, create_app)


def cmd_up(args: argparse.Namespace) -> int:
    from shared.bundle import load_bundle_spec
    from mmserve.launcher import LocalStack, StackSpec

    check_service_env("up", args.strict_env)  # every service's variables, before any starts
    model_dir = ensure_default_model(args.model)
    spec = StackSpec(
        model_dir=model_dir,
        host=args.host or "127.0.0.1",
        gateway_port=args.port or 8000,
        encoders=args.encoders if load_bundle_spec(model_dir).modalities() else 0,  # text-only LM: no encoder
        llms=args.llms,
        prefill_llms=args.prefill_llms,
        llm_backend=args.backend,
        redis_url=args.redis_url,
        trust_request_chat_template=args.trust_request_chat_template,
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
    from mmserve.tiny_model import ARCHS

    p.add_argument("--arch", default="mimo", choices=sorted(ARCHS))
    p.add_argument("--sliding-window", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layout", default=None, choices=["split", "fused_qkv"],
                   help="mimo-v2-flash / mimo-v2.5: attention projections as published (default split)")
    p.add_argument("--quant", default=None, choices=["fp8", "mxfp4"],
                   help="quantized as published: fp8 (mimo-v2-flash / mimo-v2.5, block FP8), mxfp4 (gpt-oss experts)")
    p.set_defaults(fn=cmd_tiny_model)

    from shared.settings import EncoderSettings, GatewaySettings, LLMSettings

    for name, help_, settings_cls, fn in (
        ("encoder", "run one encoder service (no --model: the tiny model)", EncoderSettings, cmd_encoder),
        ("llm", "run one LLM service (no --model: the tiny model)", LLMSettings, cmd_llm),
        ("gateway", "run the OpenAI-compatible gateway", GatewaySettings, cmd_gateway),
    ):
        p = sub.add_parser(name, help=help_, description=f"{help_}; every flag is also MMSERVE_"
                           f"{name.upper()}_<FLAG> in the environment (flags win)")
        _add_settings_flags(p, settings_cls)
        _add_strict_env(p)
        p.set_defaults(fn=fn)

    p = sub.add_parser("up", help="run gateway + encoders + LLM services as local processes")
    _add_common(p)
    p.add_argument("--model", default=None, help="bundle dir (default: the tiny model)")
    p.add_argument("--encoders", type=int, default=1)
    p.add_argument("--llms", type=int, default=1)
    p.add_argument("--prefill-llms", type=int, default=0,
                   help="prefill replicas (docs/disagg.md): with any, the --llms replicas decode and the gateway "
                        "prefills long text prompts on these first")
    p.add_argument("--backend", default=None, help="LLM backend: hf | swa")
    p.add_argument("--redis-url", default=None,
                   help="shared encoder cache and L3 KV tier of the LLMs (default: embedded cache, device + host KV)")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="gateway and LLMs render a chat template a request sends (vLLM's flag); off: a 400")
    _add_strict_env(p)
    p.set_defaults(fn=cmd_up)

    from mmserve.plan_report import add_parser as add_plan_parser

    add_plan_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
