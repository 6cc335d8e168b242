"""Load the MiMo omni audio tower from a checkpoint directory as published, strictly.

Tensor names (vLLM 0.32 ``mimo_v2_omni.py`` ``hf_to_vllm_mapper``: ``speech_embeddings.`` ->
``audio_encoder.speech_embeddings.``, ``audio_encoder.*`` loaded by name; ``mimo_audio.py``
``_load_audio_tokenizer`` reads ``audio_tokenizer/model.safetensors`` into ``MiMoAudioTokenizer``):

    model.safetensors (or its index's shards)
        speech_embeddings.{c}.weight                                   [vocab_c, local_dim]
        audio_encoder.input_local_transformer.layers.{l}.{input_layernorm,post_attention_layernorm}.weight
        audio_encoder.input_local_transformer.layers.{l}.self_attn.{q,k,v}_proj.{weight,bias}, o_proj.weight
        audio_encoder.input_local_transformer.layers.{l}.mlp.{gate,up,down}_proj.weight
        audio_encoder.input_local_transformer.norm.weight               (add_post_norm)
        audio_encoder.projection.weight | audio_encoder.projection.mlp.{0,2}.weight
    audio_tokenizer/model.safetensors
        encoder.{conv1,conv2}.{weight,bias}, encoder.layers.{i}.self_attn.{q,v,out}_proj.{weight,bias},
        encoder.layers.{i}.self_attn.k_proj.weight, encoder.layers.{i}.{self_attn_layer_norm,
        final_layer_norm,fc1,fc2}.{weight,bias}, encoder.layer_norm.*, encoder.down_sample_layer.0.weight,
        encoder.down_sample_norm.*, encoder.quantizer.vq.layers.{q}._codebook.embed  [codebook_q, d]

Read past on purpose: ``audio_encoder.input_local_transformer.embed_tokens.weight`` (Qwen2Model
has one; the tower is fed embeddings), the codebooks' training statistics (``inited``,
``cluster_size``, ``embed_avg``), and everything outside ``encoder.`` in the tokenizer file (its
decoder and vocoder synthesise audio). Any other tensor under these prefixes, a missing one or a
shape the configs do not imply is a ``CheckpointError`` naming the file and the tensor.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from encoder_svc.models.mimo_audio import MiMoAudioTower
from encoder_svc.models.mimo_audio_config import TOKENIZER_DIR, AudioEncoderConfig, AudioTokenizerConfig, check_pair
from shared.bundle import CheckpointError

INDEX = "model.safetensors.index.json"
_CODEBOOK = re.compile(r"^quantizer\.vq\.layers\.(\d+)\._codebook\.(embed|inited|cluster_size|embed_avg)$")


def _main_files(root: Path) -> dict[str, Path]:
    """Tower tensor name -> file, from the index when there is one (the LM's shards hold them)."""
    from safetensors import safe_open

    if (root / INDEX).exists():
        try:
            wm = json.loads((root / INDEX).read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{root / INDEX}: not a safetensors index ({e})") from e
        return {n: root / f for n, f in wm.items() if n.startswith(("speech_embeddings.", "audio_encoder."))}
    path = root / "model.safetensors"
    if not path.exists():
        raise CheckpointError(f"{root}: no model.safetensors (or {INDEX}) for the audio tower")
    with safe_open(str(path), "pt") as h:
        return {n: path for n in h.keys() if n.startswith(("speech_embeddings.", "audio_encoder."))}


def _main_target(name: str) -> str | None:
    if name.startswith("speech_embeddings."):
        return name
    rest = name[len("audio_encoder."):]
    if rest == "input_local_transformer.embed_tokens.weight":
        return None
    return rest


def _tokenizer_target(name: str) -> str | None:
    if not name.startswith("encoder."):
        return None  # decoder / vocoder
    rest = name[len("encoder."):]
    m = _CODEBOOK.match(rest)
    if m:
        return f"tokenizer.codebooks.{m.group(1)}.embed" if m.group(2) == "embed" else None
    return f"tokenizer.{rest}"


def _published(target: str) -> str:
    """Our module's tensor name -> the name in the published file (for error messages)."""
    m = re.match(r"^tokenizer\.codebooks\.(\d+)\.embed$", target)
    if m:
        return f"encoder.quantizer.vq.layers.{m.group(1)}._codebook.embed"
    if target.startswith("tokenizer."):
        return "encoder." + target[len("tokenizer."):]
    return target if target.startswith("speech_embeddings.") else "audio_encoder." + target


def _copy(want: dict[str, torch.Tensor], names: dict[str, Path], target, seen: set[str]) -> None:
    from safetensors import safe_open

    by_file: dict[Path, list[tuple[str, str]]] = {}
    for name, f in names.items():
        t = target(name)
        if t is None:
            continue
        if t not in want:
            if name.endswith(("_scale_inv", "weight_scale")):  # vLLM's tower (plain nn.Linear) loads none either
                raise CheckpointError(f"{f}: tensor {name!r}: quantized (FP8) audio tower weights are not "
                                      "supported; dequantize the audio tensors to bf16 first")
            raise CheckpointError(f"{f}: tensor {name!r} is not part of the audio tower the configs describe")
        by_file.setdefault(f, []).append((name, t))
    with torch.no_grad():
        for f, pairs in by_file.items():
            if not f.exists():
                raise CheckpointError(f"{f}: shard named by {INDEX} is missing")
            with safe_open(str(f), "pt") as h:
                for name, t in pairs:
                    src = h.get_tensor(name)
                    if tuple(src.shape) != tuple(want[t].shape):
                        raise CheckpointError(f"{f}: tensor {name!r} has shape {list(src.shape)}, the configs "
                                              f"imply {list(want[t].shape)}")
                    want[t].copy_(src.to(want[t].dtype))
                    seen.add(t)


def load_mimo_audio(root: Path, dtype: torch.dtype, lm_hidden: int | None = None) -> MiMoAudioTower:
    """Build the tower from ``root``'s configs and fill every tensor from its files."""
    from safetensors import safe_open

    tok_cfg = AudioTokenizerConfig.from_dir(root)
    enc_cfg = AudioEncoderConfig.from_dir(root)
    check_pair(root, enc_cfg, tok_cfg, lm_hidden)
    tower = MiMoAudioTower(enc_cfg, tok_cfg)
    want = dict(tower.state_dict())
    seen: set[str] = set()
    _copy(want, _main_files(root), _main_target, seen)
    tok_file = root / TOKENIZER_DIR / "model.safetensors"
    if not tok_file.exists():
        raise CheckpointError(f"{tok_file} not found: the audio tokenizer's weights")
    with safe_open(str(tok_file), "pt") as h:
        tok_names = {n: tok_file for n in h.keys()}
    _copy(want, tok_names, _tokenizer_target, seen)
    missing = sorted(set(want) - seen)
    if missing:
        m = missing[0]
        where = tok_file if m.startswith("tokenizer.") else (
            root / INDEX if (root / INDEX).exists() else root / "model.safetensors")
        raise CheckpointError(f"{where}: tensor {_published(m)!r} is missing "
                              f"({len(missing)} audio tensors missing in all)")
    # the quantizer runs in float32 whatever the service dtype; like vLLM (tokenizer.to(bf16), then
    # quantizer.float()) the codebooks pass through the service dtype first
    tower = tower.to(dtype).eval()
    for book in tower.tokenizer.codebooks:
        book.embed.data = book.embed.data.float()
    tower.weight_dirs = [root, root / TOKENIZER_DIR]
    return tower
