"""The model bundle: one directory that holds the LM, its tokenizer and the media encoders.

Two layouts are read (see docs/models.md, "Models: the bundle format"):

1. **mmserve bundle** (what ``mmserve tiny-model`` writes), with ``mmserve_bundle.json``::

       BUNDLE/
         mmserve_bundle.json        manifest (BundleSpec below)
         config.json, model.safetensors, generation_config.json     the LM, HF format
         tokenizer.json, tokenizer_config.json (with chat_template)   the tokenizer
         vision/   SiglipVisionModel (save_pretrained) + preprocessor_config.json
                   + projector.safetensors + projector.json
         audio/    WhisperModel (save_pretrained; only its encoder is used)
                   + preprocessor_config.json + projector.safetensors + projector.json

2. **A plain HF ``Gemma3ForConditionalGeneration`` checkpoint directory**, read as is: the LM is
   its language model, the vision tower and ``multi_modal_projector`` come from the same weights,
   placeholders come from ``boi_token_index / image_token_index / eoi_token_index``.

3. **A MiMo-V2.5 omni checkpoint directory** (``MiMoV2OmniForCausalLM``), read as is: LM, ViT
   (``visual.``) and audio encoder from the same weights; placeholders from ``config.json``'s
   ``processor_config`` token ids resolved through the tokenizer files; images take a
   size-dependent number of tokens (``tokens_per_image = 0``), videos the timestamped layout of
   vLLM's ``MiMoOmniProcessor`` (``Placeholder.layout == "timestamps"``).

This module only reads JSON: it never imports torch, so the gateway can use it cheaply.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

MANIFEST = "mmserve_bundle.json"
BUNDLE_FORMAT = "mmserve-bundle/1"


class BundleError(ValueError):
    """The directory is not a readable model bundle."""


class CheckpointError(BundleError):
    """A checkpoint file cannot be served as written; the message names the file and the field
    or tensor (an unknown config key, a missing weight, a shape that disagrees with the config)."""


@dataclass(frozen=True)
class Placeholder:
    """How one media item appears in the prompt: ``start + pad * num_tokens + end``.

    ``start``/``end`` may be empty strings. ``pad`` is a single special token whose id marks the
    positions whose input embeddings are replaced by the encoder's output.

    With ``layout == "timestamps"`` (MiMo-V2.5 video) the template's ``start + pad + end`` is
    replaced by ``outer_start + sum_g(timestamp_text(t_g) + start + pad * n_g + end) + outer_end``
    over the item's segments ``g`` (``EncodeResult.segments``: one per temporal patch group).
    """

    pad: str
    start: str = ""
    end: str = ""
    layout: str = "pad"  # "pad" | "timestamps"
    outer_start: str = ""
    outer_end: str = ""

    def __post_init__(self) -> None:
        if not self.pad:
            raise BundleError("a placeholder needs a pad token")
        if self.layout not in ("pad", "timestamps"):
            raise BundleError(f"unknown placeholder layout {self.layout!r}")
        if self.layout == "timestamps" and not (self.start and self.end and self.outer_start and self.outer_end):
            raise BundleError("a timestamps placeholder needs start, end, outer_start and outer_end tokens")


@dataclass(frozen=True)
class VisionSpec:
    """Vision tower + projector. ``kind``: ``siglip_projector`` (mmserve), ``gemma3`` (HF) or
    ``mimo_omni`` (MiMo-V2.5 ViT; ``tokens_per_image = 0``: the count depends on the image size)."""

    kind: str
    path: str
    tokens_per_image: int
    video_temporal_pool: int = 2  # video: average this many consecutive frames' tokens

    def __post_init__(self) -> None:
        if self.tokens_per_image < 0 or self.video_temporal_pool < 1:
            raise BundleError("tokens_per_image must be >= 0 (0: size-dependent) and video_temporal_pool >= 1")


@dataclass(frozen=True)
class AudioSpec:
    """Whisper-style encoder + projector; ``pool_stride`` encoder frames become one token."""

    kind: str
    path: str
    pool_stride: int = 20

    def __post_init__(self) -> None:
        if self.pool_stride < 1:
            raise BundleError("pool_stride must be >= 1")


@dataclass(frozen=True)
class BundleSpec:
    """What a service needs to know about a bundle before loading any weights."""

    root: Path
    name: str
    lm_architecture: str
    lm_path: str = "."
    vision: VisionSpec | None = None
    audio: AudioSpec | None = None
    placeholders: dict[str, Placeholder] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for modality in ("image", "video"):
            if modality in self.placeholders and self.vision is None:
                raise BundleError(f"{modality} placeholder declared but the bundle has no vision")
        if "audio" in self.placeholders and self.audio is None:
            raise BundleError("audio placeholder declared but the bundle has no audio encoder")

    @property
    def lm_dir(self) -> Path:
        return (self.root / self.lm_path).resolve()

    def component_dir(self, rel: str) -> Path:
        return (self.root / rel).resolve()

    def modalities(self) -> list[str]:
        return sorted(self.placeholders)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as e:
        raise BundleError(f"{path} not found") from e
    except json.JSONDecodeError as e:
        raise BundleError(f"{path} is not valid JSON: {e}") from e


def _from_manifest(root: Path, m: dict) -> BundleSpec:
    if m.get("format") != BUNDLE_FORMAT:
        raise BundleError(f"{root / MANIFEST}: format must be {BUNDLE_FORMAT!r}")
    vision = VisionSpec(**m["vision"]) if m.get("vision") else None
    audio = AudioSpec(**m["audio"]) if m.get("audio") else None
    return BundleSpec(
        root=root,
        name=m.get("name") or root.name,
        lm_architecture=m["lm"]["architecture"],
        lm_path=m["lm"].get("path", "."),
        vision=vision,
        audio=audio,
        placeholders={k: Placeholder(**v) for k, v in m.get("placeholders", {}).items()},
    )


def _added_tokens(root: Path) -> dict[int, str]:
    added: dict[int, str] = {}
    if (root / "tokenizer.json").exists():
        for t in _read_json(root / "tokenizer.json").get("added_tokens") or []:
            added[int(t["id"])] = t["content"]
    if (root / "tokenizer_config.json").exists():
        for tid, t in (_read_json(root / "tokenizer_config.json").get("added_tokens_decoder") or {}).items():
            added[int(tid)] = t["content"]
    return added


def _from_hf_gemma3(root: Path, cfg: dict) -> BundleSpec:
    added = _added_tokens(root)
    defaults = {255999: "<start_of_image>", 256000: "<end_of_image>", 262144: "<image_soft_token>"}

    def tok(key: str, fallback: int) -> str:
        idx = cfg.get(key, fallback)
        return added.get(idx) or defaults.get(idx) or ""

    image = Placeholder(
        pad=tok("image_token_index", 262144),
        start=tok("boi_token_index", 255999),
        end=tok("eoi_token_index", 256000),
    )
    vision = VisionSpec(kind="gemma3", path=".", tokens_per_image=cfg.get("mm_tokens_per_image", 256))
    return BundleSpec(
        root=root,
        name=root.name,
        lm_architecture="Gemma3ForConditionalGeneration",
        vision=vision,
        placeholders={"image": image, "video": image},
    )


def _from_hf_mimo_omni(root: Path, cfg: dict) -> BundleSpec:
    """Token ids from ``processor_config`` (where vLLM's ``MiMoOmniProcessor.from_hf_config``
    reads them), falling back to the top-level keys; each resolved through the tokenizer files."""
    path = root / "config.json"
    pc = cfg.get("processor_config")
    if not isinstance(pc, dict):
        raise CheckpointError(f"{path}: field 'processor_config' is missing; it names the media tokens")
    if not isinstance(cfg.get("vision_config"), dict):
        raise CheckpointError(f"{path}: field 'vision_config' is missing or not an object")
    added = _added_tokens(root)

    def tok(key: str) -> str:
        idx = pc.get(key, cfg.get(key))
        if not isinstance(idx, int):
            raise CheckpointError(f"{path}: field 'processor_config.{key}' is missing or not an int")
        if idx not in added:
            raise CheckpointError(f"{path}: field 'processor_config.{key}' = {idx} is not a special token of "
                                  f"{root / 'tokenizer.json'}")
        return added[idx]

    start, end = tok("vision_start_token_id"), tok("vision_end_token_id")
    placeholders = {
        "image": Placeholder(pad=tok("image_token_id"), start=start, end=end),
        "video": Placeholder(pad=tok("video_token_id"), start=start, end=end, layout="timestamps",
                             outer_start=tok("video_start_token_id"), outer_end=tok("video_end_token_id")),
    }
    audio = None
    if cfg.get("audio_config") is not None:
        audio = AudioSpec(kind="mimo_omni", path=".")
        placeholders["audio"] = Placeholder(pad=tok("audio_token_id"), start=tok("audio_start_token_id"),
                                            end=tok("audio_end_token_id"))
    return BundleSpec(
        root=root,
        name=root.name,
        lm_architecture="MiMoV2OmniForCausalLM",
        vision=VisionSpec(kind="mimo_omni", path=".", tokens_per_image=0),
        audio=audio,
        placeholders=placeholders,
    )


def load_bundle_spec(model_dir: str | Path) -> BundleSpec:
    """Read a bundle directory (either layout) without loading weights."""
    root = Path(model_dir).expanduser().resolve()
    if not root.is_dir():
        raise BundleError(f"model directory {root} does not exist")
    if (root / MANIFEST).exists():
        return _from_manifest(root, _read_json(root / MANIFEST))
    cfg = _read_json(root / "config.json")
    archs = cfg.get("architectures") or []
    if "Gemma3ForConditionalGeneration" in archs:
        return _from_hf_gemma3(root, cfg)
    if "MiMoV2OmniForCausalLM" in archs:
        return _from_hf_mimo_omni(root, cfg)
    if not archs:
        raise BundleError(f"{root / 'config.json'} names no architectures")
    # a text-only HF checkpoint: an LM without media encoders
    return BundleSpec(root=root, name=root.name, lm_architecture=archs[0])
