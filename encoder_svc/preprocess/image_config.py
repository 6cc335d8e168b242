"""The image preprocessing a bundle asks for, read from its ``preprocessor_config.json``.

Only the HF image-processor fields that change pixels are kept: resize target + resample,
rescale factor, normalize mean/std. ``signature()`` enters the embedding cache key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from shared.bundle import BundleError

# PIL resample ids (PIL.Image.Resampling) -> defaults of the HF processor classes we read.
_DEFAULT_RESAMPLE = {"SiglipImageProcessor": 3, "Gemma3ImageProcessor": 2}
_SUPPORTED_TYPES = ("SiglipImageProcessor", "Gemma3ImageProcessor", "SiglipImageProcessorFast",
                    "Gemma3ImageProcessorFast")


@dataclass(frozen=True)
class ImagePreprocessConfig:
    height: int
    width: int
    resample: int = 2  # PIL id: 0 nearest, 2 bilinear, 3 bicubic, 1 lanczos
    do_resize: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    def __post_init__(self) -> None:
        if self.height < 1 or self.width < 1:
            raise BundleError(f"image size must be positive, got {self.height}x{self.width}")
        if len(self.mean) != 3 or len(self.std) != 3 or min(self.std) <= 0:
            raise BundleError("image mean/std need 3 values and std > 0")
        if self.resample not in (0, 1, 2, 3, 4, 5):
            raise BundleError(f"unknown resample id {self.resample}")

    @classmethod
    def from_json(cls, path: str | Path) -> "ImagePreprocessConfig":
        """Read an HF ``preprocessor_config.json`` (SigLIP or Gemma 3 image processor)."""
        try:
            d = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise BundleError(f"cannot read image preprocessor config {path}: {e}") from e
        kind = d.get("image_processor_type", "SiglipImageProcessor")
        if kind not in _SUPPORTED_TYPES:
            raise BundleError(f"{path}: unsupported image processor {kind!r}")
        if d.get("do_pan_and_scan"):
            raise BundleError(f"{path}: do_pan_and_scan is not supported by the encoder service")
        size = d.get("size") or {}
        if "height" not in size or "width" not in size:
            raise BundleError(f"{path}: size must give height and width, got {size}")
        return cls(
            height=int(size["height"]),
            width=int(size["width"]),
            resample=int(d.get("resample", _DEFAULT_RESAMPLE.get(kind.removesuffix("Fast"), 2))),
            do_resize=bool(d.get("do_resize", True)),
            do_rescale=bool(d.get("do_rescale", True)),
            rescale_factor=float(d.get("rescale_factor", 1 / 255)),
            do_normalize=bool(d.get("do_normalize", True)),
            mean=tuple(float(x) for x in d.get("image_mean", (0.5, 0.5, 0.5))),
            std=tuple(float(x) for x in d.get("image_std", (0.5, 0.5, 0.5))),
        )

    def signature(self) -> str:
        return (
            f"{self.height}x{self.width}/r{self.resample}/{int(self.do_resize)}{int(self.do_rescale)}"
            f"{int(self.do_normalize)}/{self.rescale_factor:.6g}/{self.mean}/{self.std}"
        )
