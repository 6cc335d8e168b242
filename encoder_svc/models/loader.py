"""Load a bundle's media encoders once, and fingerprint them for the embedding-cache key."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from encoder_svc.models.vision import VisionEncoder, load_vision
from encoder_svc.preprocess.image_config import ImagePreprocessConfig
from shared.bundle import BundleError, BundleSpec

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModels:
    """What the service runs. ``model_id`` changes whenever any encoder weight file changes."""

    spec: BundleSpec
    model_id: str
    device: torch.device
    vision: VisionEncoder | None = None
    image_cfg: ImagePreprocessConfig | None = None
    audio: "torch.nn.Module | None" = None

    @property
    def takes_patches(self) -> bool:
        """The vision tower takes MiMo patch rows (its own preprocessing), not fixed-size pixels."""
        return getattr(self.vision, "input_kind", "pixels") == "mimo_patches"

    def modalities(self) -> list[str]:
        mods = []
        if self.vision is not None:
            mods += ["image", "video"]
        if self.audio is not None:
            mods.append("audio")
        return mods


def fingerprint(spec: BundleSpec, dirs: list[Path]) -> str:
    """Name + a hash of each encoder weight/config file's size, header and sampled bytes.

    Hashing every weight byte would cost seconds on real checkpoints; the safetensors header
    (names, shapes, offsets) plus 64 KiB from the start, middle and end of the data tell apart
    re-saved or re-initialised weights, which is what keeps stale cache entries from being hit.
    """
    h = xxhash.xxh3_128()
    for d in dirs:
        for f in sorted(d.iterdir()):
            if not f.is_file() or f.suffix not in (".json", ".safetensors"):
                continue
            size = f.stat().st_size
            h.update(f"{f.name}:{size}".encode())
            with f.open("rb") as fh:
                for off in (0, max(0, size // 2 - 32768), max(0, size - 65536)):
                    fh.seek(off)
                    h.update(fh.read(65536))
    return f"{spec.name}@{h.hexdigest()[:16]}"


def load_models(spec: BundleSpec, device: str = "cpu", dtype: str = "float32") -> LoadedModels:
    if dtype not in DTYPES:
        raise BundleError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    dev = torch.device(device)
    td = DTYPES[dtype]
    vision = image_cfg = audio = None
    dirs: list[Path] = []
    if spec.vision is not None:
        vdir = spec.component_dir(spec.vision.path)
        vision = load_vision(spec.root, spec.vision, td).to(dev)
        if getattr(vision, "input_kind", "pixels") == "pixels":
            image_cfg = ImagePreprocessConfig.from_json(vdir / "preprocessor_config.json")
        dirs.append(vdir)
    if spec.audio is not None:
        from encoder_svc.models.audio import load_audio

        adir = spec.component_dir(spec.audio.path)
        audio = load_audio(spec.root, spec.audio, td).to(dev)
        dirs += getattr(audio, "weight_dirs", None) or [adir]  # MiMo: + audio_tokenizer/
    if vision is None and audio is None:
        raise BundleError(f"bundle {spec.root} has no media encoder (no vision, no audio)")
    models = LoadedModels(spec, fingerprint(spec, dirs), dev, vision, image_cfg, audio)
    log.info("loaded encoders %s (%s) on %s", models.modalities(), models.model_id, dev)
    return models
