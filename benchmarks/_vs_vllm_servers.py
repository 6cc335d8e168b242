"""What ``benchmarks.vs_vllm`` serves and how: one random-weight text-only ``Gemma3ForCausalLM``
checkpoint (HF layout, seeded, cached under ``~/.cache/mmserve/``), vLLM's OpenAI server from
its own venv, and our stack (one ``swa`` LLM service + one gateway, no encoder: text only).

Every server is a ``shared.launcher.Service`` (its own process session), so stopping it kills
its whole process group (vLLM's engine-core child, our engine child) and leaves no orphans.
"""

from __future__ import annotations

import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from shared.cli import CACHE_DIR
from shared.launcher import Service, free_port, wait_ready
from shared.tiny_model import GEMMA_SPECIALS, GEMMA_TEMPLATE

VLLM_VENV = CACHE_DIR / "vllm-venv"
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
SERVED_NAME = "gemma3-bench"
KV_GIB = 2  # both sides: VLLM_CPU_KVCACHE_SPACE=2 and our kv_bytes = 2 GiB
MAX_MODEL_LEN = 4096


@dataclass(frozen=True)
class CheckpointSpec:
    """The benchmark model: Gemma 3's 5 sliding : 1 full pattern, equal qk / v head dims."""

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


# ---- the checkpoint ----------------------------------------------------------------------------
_SYLLABLES = "ka lo mi re tu sa ne pi vo da li ru ze ma to fe gi ho ju ny ba ce qu wi xo".split()


def word_list(n: int = 6000, seed: int = 0) -> list[str]:
    """Pseudo-words of 1-4 syllables, ASCII only (so every token decodes to whole characters)."""
    rng = random.Random(seed)
    words: dict[str, None] = {}
    while len(words) < n:
        words["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4)))] = None
    return list(words)


def build_tokenizer(vocab: int, seed: int = 0):
    """A byte-level BPE with about ``vocab`` tokens, trained on random pseudo-word text.

    Not ``shared.tiny_model.build_tokenizer``: its fixed ~70-word corpus stops well below a few
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
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab, special_tokens=GEMMA_SPECIALS,
                                                        show_progress=False))  # fmt: skip
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<end_of_turn>", pad_token="<pad>",
                                   bos_token="<bos>", unk_token="<unk>")  # fmt: skip
    fast.chat_template = GEMMA_TEMPLATE
    return fast


def ensure_checkpoint(spec: CheckpointSpec = CheckpointSpec()) -> Path:
    """The checkpoint directory, written on first use (seeded: identical on every machine)."""
    out = CACHE_DIR / "bench" / spec.dirname
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
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
        # Special tokens get zero (tied) embeddings, so their logit is 0 and greedy decoding
        # never picks one: no early EOS (our gateway drops ``ignore_eos``) and no special token
        # that one detokenizer prints and the other skips.
        model.model.embed_tokens.weight[list(ids.values())] = 0.0
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if not (tmp / "chat_template.jinja").exists():
        (tmp / "chat_template.jinja").write_text(GEMMA_TEMPLATE)
    tmp.rename(out)
    return out


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


def vllm_service(model_dir: Path, log_dir: Path, extra_args: list[str] = ()) -> Service:
    port = free_port()
    argv = [
        str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", str(MAX_MODEL_LEN), "--dtype", "float32",
        *extra_args,
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(KV_GIB), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           # vLLM 0.32 + torch 2.13 cannot load its own AOT-compiled artifact ("'function' object
           # has no attribute 'finalize_loading'") and recompiles on every start (~55 s here);
           # the older compile cache path reloads (the warm-up drops to ~12 s). Same graph.
           "VLLM_USE_AOT_COMPILE": "0"}  # fmt: skip
    env.pop("PYTHONPATH", None)  # never let the venv's python import this repo's packages
    return Service("vllm", f"http://127.0.0.1:{port}", argv, env, log_dir / "vllm.log")


def our_services(model_dir: Path, log_dir: Path, llm_env: dict[str, str] | None = None) -> list[Service]:
    """LLM service (swa, float32, 2 GiB KV) and a gateway; the gateway's encoder URL is a closed
    port (a text-only request never calls an encoder)."""
    py = [sys.executable, "-m", "shared.cli"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    lport, gport, dead = free_port(), free_port(), free_port()
    llm_env = {"MMSERVE_LLM_DTYPE": "float32", "MMSERVE_LLM_MAX_MODEL_LEN": str(MAX_MODEL_LEN), **(llm_env or {})}
    llm = Service(
        "llm", f"http://127.0.0.1:{lport}",
        py + ["llm", "--model", str(model_dir), "--port", str(lport), "--backend", "swa",
              "--kv-bytes", str(KV_GIB << 30)],
        {**env, **llm_env}, log_dir / "llm.log",
    )  # fmt: skip
    gateway = Service(
        "gateway", f"http://127.0.0.1:{gport}",
        py + ["gateway", "--port", str(gport), "--model-name", SERVED_NAME,
              "--encoder-urls", f"http://127.0.0.1:{dead}", "--llm-urls", llm.url],
        env, log_dir / "gateway.log",
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
