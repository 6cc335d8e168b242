"""The model bundle: one directory that holds the LM, its tokenizer and the media encoders.

Two layouts are read (see README, "Model bundle format"):

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
    """

    pad: str
    start: str = ""
    end: str = ""

    def __post_init__(self) -> None:
        if not self.pad:
            raise BundleError("a placeholder needs a pad token")


@dataclass(frozen=True)
class VisionSpec:
    """Vision tower + projector. ``kind``: ``siglip_projector`` (mmserve) or ``gemma3`` (HF)."""

    kind: str
    path: str
    tokens_per_image: int
    video_temporal_pool: int = 2  # video: average this many consecutive frames' tokens

    def __post_init__(self) -> None:
        if self.tokens_per_image < 1 or self.video_temporal_pool < 1:
            raise BundleError("tokens_per_image and video_temporal_pool must be >= 1")


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


def _from_hf_gemma3(root: Path, cfg: dict) -> BundleSpec:
    added: dict[int, str] = {}
    if (root / "tokenizer.json").exists():
        for t in _read_json(root / "tokenizer.json").get("added_tokens") or []:
            added[int(t["id"])] = t["content"]
    if (root / "tokenizer_config.json").exists():
        for tid, t in (_read_json(root / "tokenizer_config.json").get("added_tokens_decoder") or {}).items():
            added[int(tid)] = t["content"]
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
    if not archs:
        raise BundleError(f"{root / 'config.json'} names no architectures")
    # a text-only HF checkpoint: an LM without media encoders
    return BundleSpec(root=root, name=root.name, lm_architecture=archs[0])
