"""The sides of ``benchmarks.spec_decode``: one server (group) per configuration, each a list
entry (engine + vLLM-form ``--speculative-config`` or None), started together, a refusal recorded
instead of raised; and the speculative-decoding counters of both engines read from their
``/metrics`` (deltas over a run: drafts, draft tokens, accepted tokens, accepted per position).

Ours: ``benchmarks._vs_vllm_servers.our_services`` (swa LLM service + gateway, as ``vs_vllm``),
the config in ``MMSERVE_LLM_SPECULATIVE_CONFIG``. vLLM: ``vllm_service`` with vs_vllm's default
binding (``VLLM_CPU_OMP_THREADS_BIND`` auto) and preloads (tcmalloc + Intel OpenMP when found),
the config as ``--speculative-config``."""

from __future__ import annotations

import contextlib
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks import _vs_vllm_servers as srv
from benchmarks._vs_vllm_runs import resolve_preload
from mmserve.launcher import wait_ready


@dataclass(frozen=True)
class SideSpec:
    """One configuration: ``engine`` "ours" or "vllm", ``spec`` a vLLM-form speculative config
    (None: speculation off). ``skip``: why it is not started at all (a reason, printed)."""

    name: str
    engine: str
    spec: dict | None = None
    skip: str | None = None

    def __post_init__(self) -> None:
        assert self.engine in ("ours", "vllm"), self.engine


def ngram(k: int, lo: int, hi: int) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lo, "prompt_lookup_max": hi}


def mtp_layers(model_dir: Path) -> int:
    """The checkpoint's MTP layer count (``num_nextn_predict_layers``; 0 without)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    return int(cfg.get("num_nextn_predict_layers") or 0)


def vllm_cpu_refusal(model_dir: Path) -> str | None:
    """Why vLLM 0.32's CPU build cannot serve the checkpoint (None: it can, as far as known).
    qk head dim != v head dim (MiMo-V2-Flash's 192 / 128, ``mmserve/tiny/trained_mimo``'s 32 / 16):
    its ``mimo_v2.py`` picks ``TRITON_ATTN_DIFFKV``, and without Triton's CPU backend the first
    forward fails (``module 'triton' has no attribute 'next_power_of_2'``) after minutes of start-up."""
    cfg = json.loads((model_dir / "config.json").read_text())
    dims = [(cfg.get("head_dim"), cfg.get("v_head_dim")), (cfg.get("swa_head_dim"), cfg.get("swa_v_head_dim"))]
    if any(q is not None and v is not None and q != v for q, v in dims):
        return ("vLLM 0.32 CPU has no attention for qk head dim != v head dim (TRITON_ATTN_DIFFKV is Triton-only); "
                "mmserve/tiny/trained_mimo_qkv is the trained checkpoint it serves")
    return None


# the default checkpoint when MTP sides run: vs_vllm's MiMo (qk head dim = v head dim, which vLLM's
# CPU build needs) with 3 random MTP layers (as the hub's), the LM's weights unchanged
MTP_LAYERS = 3


def default_checkpoint(args) -> Path:
    """The checkpoint without ``--model``: ``srv.MiMoSpec()``'s, with ``MTP_LAYERS`` MTP layers
    when the MTP sides run (``vllm-mtp1`` on vLLM 0.32 CPU's ``mimo_v2_mtp``, which reads
    ``model.mtp.layers.0``; ``tests/integration/test_spec_vllm_mtp.py`` checks that it drafts
    and accepts as ours does), written on first use."""
    return srv.ensure_checkpoint(srv.MiMoSpec(mtp_layers=MTP_LAYERS if args.mtp else 0))


def side_list(args, model_dir: Path) -> list[SideSpec]:
    """Every configuration, in A-B order: ours off, ours n-gram per k, ours MTP with one layer
    and with all (the service refuses what it does not serve: recorded), vLLM off, vLLM n-gram
    per k, vLLM MTP with one layer (its ``mimo_v2_mtp`` runs only the first MTP layer) when the
    checkpoint has MTP layers (``default_checkpoint`` has; a vLLM start-up costs minutes here, so a
    start it must refuse is not tried: no vLLM side for a checkpoint ``vllm_cpu_refusal`` names)."""
    lo, hi = args.ngram_min, args.ngram_max
    out = [SideSpec("ours-off", "ours")]
    out += [SideSpec(f"ours-ngram{k}", "ours", ngram(k, lo, hi)) for k in args.ngram_k]
    # the automatic draft length is the default; "-fixed": the configured k every step (before it)
    out += [SideSpec(f"ours-ngram{args.ngram_k[-1]}-fixed", "ours",
                     {**ngram(args.ngram_k[-1], lo, hi), "draft_policy": "fixed"})]
    if args.mtp:
        out += [SideSpec("ours-mtp1", "ours", {"method": "mtp", "num_speculative_tokens": 1}),
                SideSpec("ours-mtp", "ours", {"method": "mtp"}),
                SideSpec("ours-mtp-fixed", "ours", {"method": "mtp", "draft_policy": "fixed"})]  # fmt: skip
    if args.vllm:
        cannot = vllm_cpu_refusal(model_dir)
        out.append(SideSpec("vllm-off", "vllm", skip=cannot))
        out += [SideSpec(f"vllm-ngram{k}", "vllm", ngram(k, lo, hi), skip=cannot) for k in args.vllm_ngram_k]
        if args.mtp:
            why = cannot or (None if mtp_layers(model_dir) else
                             "the checkpoint has no MTP layers (num_nextn_predict_layers 0)")
            out.append(SideSpec("vllm-mtp1", "vllm", {"method": "mtp", "num_speculative_tokens": 1}, skip=why))
    return out


@dataclass
class Side:
    """A configuration's running server(s): ``url`` takes the chat completions (our gateway,
    vLLM itself), ``metrics_url`` serves /metrics (our LLM service, vLLM)."""

    spec: SideSpec
    services: list = field(default_factory=list)
    refused: str | None = None
    startup_s: float | None = None
    served_config: dict | None = None  # what the server says it runs (our /readyz; vLLM: as passed)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def url(self) -> str:
        return self.services[-1].url

    @property
    def metrics_url(self) -> str:
        return self.services[0].url

    def pids(self) -> list[int]:
        return [s.proc.pid for s in self.services if s.proc is not None]

    def stop(self) -> None:
        for s in self.services:
            s.stop(30.0)


def build(spec: SideSpec, model_dir: Path, log_dir: Path, served: str, max_len: int, kv_bytes: int) -> Side:
    cfg = json.dumps(spec.spec) if spec.spec else ""
    if spec.engine == "ours":
        svcs = srv.our_services(model_dir, log_dir, {"MMSERVE_LLM_SPECULATIVE_CONFIG": cfg or "off"}, served, max_len,
                                kv_bytes, spec.name)  # fmt: skip
    else:
        env = {"LD_PRELOAD": resolve_preload("auto"), "VLLM_CPU_OMP_THREADS_BIND": ""}
        extra = ["--speculative-config", cfg] if cfg else []
        svcs = [srv.vllm_service(model_dir, log_dir, served, max_len, kv_bytes, extra, env, spec.name)]
    return Side(spec, svcs)


def start_all(sides: list[Side], stack: contextlib.ExitStack, timeout: float) -> None:
    """Start every side's processes at once, then wait for each; a side that fails to start is
    marked ``refused`` with the server's own reason (our /healthz detail, vLLM's last error
    line) and stopped. Start-up times overlap (all start together)."""
    t0 = time.perf_counter()
    for side in sides:
        for s in side.services:
            stack.callback(s.stop, 30.0)
            s.start()
    for side in sides:
        try:
            if side.spec.engine == "ours":
                wait_ready([side.services[0]], timeout)  # 200 once the weights are loaded and the engine runs
                srv.wait_http(side.services[1], "/healthz", timeout)
                side.served_config = httpx.get(side.metrics_url + "/readyz", timeout=5).json().get("speculative_config")
            else:
                srv.wait_http(side.services[0], "/v1/models", timeout)
                side.served_config = side.spec.spec
            side.startup_s = round(time.perf_counter() - t0, 1)
        except (RuntimeError, TimeoutError) as e:
            side.refused = refusal(side, e)
            side.stop()


def refusal(side: Side, err: Exception) -> str:
    """The reason a side did not start, in the server's words where it gives one."""
    if side.spec.engine == "ours":
        with contextlib.suppress(httpx.HTTPError, ValueError):
            detail = httpx.get(side.metrics_url + "/healthz", timeout=5).json().get("detail")
            if detail:
                return detail
    tail = side.services[0].log_tail(20000).splitlines()
    errs = [re.sub(r"\x1b\[[0-9;]*m", "", x).strip() for x in tail
            if re.search(r"Error|error:|refuse|not supported", x)]
    return (errs[-1] if errs else f"{type(err).__name__}: {str(err).splitlines()[0]}")[:600]


# ---- speculative-decoding counters ------------------------------------------------------------
SPEC_KEYS = {  # (drafts, draft tokens, accepted tokens, accepted per position) as each /metrics names them
    "ours": ("mmserve_llm_spec_decode_num_drafts", "mmserve_llm_spec_decode_num_draft_tokens",
             "mmserve_llm_spec_decode_num_accepted_tokens", "mmserve_llm_spec_decode_num_accepted_tokens_per_pos"),
    "vllm": ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
             "vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_accepted_tokens_per_pos_total"),
}  # fmt: skip
_POS = re.compile(r'position="(\d+)"')


def spec_counters(engine: str, metrics: dict[str, float]) -> dict:
    """Cumulative counters from a ``srv.scrape`` result: drafts, draft_tokens, accepted, per_pos."""
    d, t, a, pos = SPEC_KEYS[engine]
    per: dict[int, float] = {}
    for k, v in metrics.items():
        if k.startswith(pos + "{"):
            m = _POS.search(k)
            if m:
                per[int(m.group(1))] = per.get(int(m.group(1)), 0.0) + v
    return {"drafts": metrics.get(d, 0.0), "draft_tokens": metrics.get(t, 0.0), "accepted": metrics.get(a, 0.0),
            "per_pos": [per[j] for j in sorted(per)]}  # fmt: skip


def spec_delta(before: dict, after: dict) -> dict:
    """``after`` - ``before`` (a position missing before counts from 0)."""
    b = before["per_pos"]
    return {**{k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted")},
            "per_pos": [x - (b[j] if j < len(b) else 0.0) for j, x in enumerate(after["per_pos"])]}


def spec_sum(deltas: list[dict]) -> dict:
    """The counters of several runs added (per position: up to the longest)."""
    n = max((len(d["per_pos"]) for d in deltas), default=0)
    return {"drafts": sum(d["drafts"] for d in deltas), "draft_tokens": sum(d["draft_tokens"] for d in deltas),
            "accepted": sum(d["accepted"] for d in deltas),
            "per_pos": [sum(d["per_pos"][j] for d in deltas if j < len(d["per_pos"])) for j in range(n)]}


def acceptance(c: dict) -> dict:
    """vLLM's meanings: mean acceptance length 1 + accepted / drafts, acceptance rate accepted /
    draft tokens, per position accepted at j / drafts. None where no draft was made."""
    n = c["drafts"]
    return {
        "drafts": int(c["drafts"]), "draft_tokens": int(c["draft_tokens"]), "accepted_tokens": int(c["accepted"]),
        "mean_acceptance_length": round(1 + c["accepted"] / n, 3) if n else None,
        "acceptance_rate": round(c["accepted"] / c["draft_tokens"], 3) if c["draft_tokens"] else None,
        "acceptance_per_pos": [round(x / n, 3) for x in c["per_pos"]] if n else None,
    }  # fmt: skip
