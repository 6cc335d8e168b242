"""A real-size vocabulary for tests and benchmarks: a byte-level BPE of ~50k tokens trained here
(no hub), whose longest tokens are runs of 256 bytes as in GPT-4's and Qwen's, with the tiny
MiMo's ChatML specials at ids 0-9; and a copy of a tiny bundle that speaks it."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

_SYLLABLES = ["ka", "lo", "mi", "nu", "re", "sa", "ti", "vo", "zen", "qua", "bri", "dor", "ph", "st", "ex", "ing",
              "al", "be", "cu", "dy", "fo", "gri", "ha", "jo", "ke", "mon", "ner", "ol", "pu", "ty"]


def pseudo_words(n: int, seed: int) -> list[str]:
    """``n`` distinct pseudo-words of 1-4 syllables."""
    rng = random.Random(seed)
    out: dict[str, None] = {}
    while len(out) < n:
        out["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4)))] = None
    return list(out)


def train_real_size_bpe(vocab_size: int = 50000, seed: int = 0):
    """A ``PreTrainedTokenizerFast``: pseudo-word sentences and runs of up to 256 dashes, spaces,
    '=', '#', '*' (about 2 s to train), ChatML specials and template, ``<|im_end|>`` as EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from mmserve.tiny_model import CHATML_SPECIALS, CHATML_TEMPLATE

    rng = random.Random(seed)
    words = pseudo_words(40000, seed)
    lines = []
    for i in range(60000):
        lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(4, 16))) + rng.choice(".,?!"))
        if i % 20 == 0:
            lines.append(rng.choice("-=#* ") * rng.choice([16, 32, 64, 128, 256]))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=CHATML_SPECIALS,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML_TEMPLATE
    return fast


def bundle_with_tokenizer(src: Path, dst: Path, tokenizer, seed: int = 0) -> Path:
    """A copy of the tiny MiMo bundle ``src`` at ``dst`` speaking ``tokenizer``: its tokenizer
    files replaced, its embedding and LM-head rows redrawn (random) for ``len(tokenizer)`` ids.
    The specials must keep the ids they have in ``src`` (ChatML at 0-9)."""
    import torch
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        (dst / name).unlink(missing_ok=True)
    tokenizer.save_pretrained(dst)
    n = len(tokenizer)
    g = torch.Generator().manual_seed(seed)
    weights = load_file(dst / "model.safetensors")
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        w = weights[key]
        weights[key] = (torch.randn(n, w.shape[1], generator=g) * 0.02).to(w.dtype)
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["vocab_size"] = n
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst
