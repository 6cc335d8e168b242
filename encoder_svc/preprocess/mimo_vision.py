"""MiMo-V2.5 vision preprocessing: pixels -> the ViT's patch rows, as the published processor.

Reference: vLLM 0.32 ``vllm/transformers_utils/processors/mimo_v2_omni.py`` (``MiMoVLProcessor``,
"ported from SGLang's MiMoV2OmniProcessor"), fed from ``config.json``'s ``processor_config``
(``MiMoOmniProcessor.from_hf_config``):

* ``smart_resize`` to multiples of ``factor = patch_size * merge_size`` with the pixel count in
  ``[min_pixels, max_pixels]`` (an upscale branch for a side below ``factor``; aspect <= 200);
* ``F.interpolate(mode="bilinear", align_corners=False)`` on float 0..255 (no antialias, no
  rounding), then ImageNet mean/std in 0..255 units. The hub's ``preprocessor_config.json``
  (``Qwen2VLImageProcessor``, CLIP mean/std) is not what the serving stacks apply; we follow them;
* an image is ``temporal_patch_size`` copies of itself (one temporal group); a video's frames are
  padded to a multiple of ``temporal_patch_size`` by repeating the last one, and all of them are
  resized to one size whose bound is ``max(min_px, min(total_max_pixels * tp // n, max_px))``
  for ``n`` sampled frames;
* patch rows in merge-block order: ``[t, gh/m, gw/m, m, m, C, tp, ps, ps]`` flattened.

Output layout here: ``[t, lh, lw, m*m, C*tp*ps*ps]`` float32 (``lh = gh / m``): one row per
merged token ``(lh, lw)``, holding its ``m*m`` patches in the processor's order. All on the
tensor's device (CUDA when the service runs there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from encoder_svc.errors import BadMedia
from shared.bundle import CheckpointError

PIXEL_MEAN = (123.675, 116.28, 103.53)
PIXEL_STD = (58.395, 57.12, 57.375)

# processor_config keys read here; ``*_token_id`` (bundle.py), ``audio_*`` (the audio side) and
# frame sampling (``fps``, ``num_frames``, ``max_frames``, ``min_frames``: the service samples
# frames itself, as vLLM's server does with its own video loader) are not the pixels' business;
# ``video_audio_interleave_length`` only concerns videos with their audio track (not served)
_READ = {"patch_size", "merge_size", "temporal_patch_size", "temporal_compression_ratio", "image_min_pixels",
         "image_max_pixels", "video_min_pixels", "video_max_pixels", "video_total_max_pixels", "rope_type",
         "use_video_timestamps", "use_per_grid_t_timestamps"}
_ELSEWHERE = {"fps", "num_frames", "max_frames", "min_frames", "video_audio_interleave_length"}


@dataclass(frozen=True)
class MiMoVisionPreprocess:
    patch: int = 16
    merge: int = 2
    temporal_patch: int = 2
    image_min_pixels: int = 4 * 32 * 32
    image_max_pixels: int = 4096 * 32 * 32
    video_min_pixels: int = 4 * 32 * 32
    video_max_pixels: int = 4096 * 32 * 32
    video_total_max_pixels: int = 16384 * 32 * 32

    def __post_init__(self) -> None:
        if min(self.patch, self.merge, self.temporal_patch) < 1:
            raise ValueError(f"bad patch geometry {self}")
        if not 0 < self.image_min_pixels <= self.image_max_pixels or not 0 < self.video_min_pixels <= self.video_max_pixels:
            raise ValueError(f"bad pixel bounds {self}")

    @property
    def factor(self) -> int:
        return self.patch * self.merge

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal_patch * self.patch * self.patch

    @classmethod
    def from_config(cls, cfg: dict, path: str | Path) -> "MiMoVisionPreprocess":
        """From ``config.json`` (``processor_config`` + ``vision_config``); refuses what would
        make other pixels or another prompt layout than the published processor's."""
        pc = cfg.get("processor_config") or {}
        vc = cfg.get("vision_config") or {}

        def bad(key: str, why: str) -> CheckpointError:
            return CheckpointError(f"{path}: field 'processor_config.{key}' {why}")

        unknown = sorted(k for k in pc if k not in _READ | _ELSEWHERE and not k.endswith("_token_id")
                         and not k.startswith("audio_"))
        if unknown:
            raise bad(unknown[0], f"is not understood by mmserve's MiMo processor (all unknown: {unknown})")

        if pc.get("rope_type", "rope") not in ("rope", "1d"):
            raise bad("rope_type", f"= {pc['rope_type']!r}: only 1-D rope (the timestamped video layout) is served")
        if pc.get("use_video_timestamps", True) is not True:
            raise bad("use_video_timestamps", "must be true (vLLM's MiMo processor asserts it)")
        if pc.get("use_per_grid_t_timestamps", False) is not False:
            raise bad("use_per_grid_t_timestamps", "= true is not understood by mmserve's MiMo processor")
        if pc.get("temporal_compression_ratio", 1) != 1:
            raise bad("temporal_compression_ratio", f"= {pc['temporal_compression_ratio']}: only 1 is supported")
        patch = int(pc.get("patch_size", vc.get("patch_size", 14)))
        merge = int(pc.get("merge_size", vc.get("spatial_merge_size", 2)))
        tp = int(pc.get("temporal_patch_size", vc.get("temporal_patch_size", 2)))
        for key, want in (("patch_size", patch), ("spatial_merge_size", merge), ("temporal_patch_size", tp)):
            if key in vc and int(vc[key]) != want:
                raise bad(key.replace("spatial_", ""), f"= {want} disagrees with vision_config.{key} = {vc[key]}")
        unit = (patch * merge) ** 2

        def px(key: str, default_units: int) -> int:
            v = pc.get(key) or default_units * unit  # vLLM: ``pc.get(key) or default``
            if not isinstance(v, int) or v < 1:
                raise bad(key, f"must be a positive int, got {v!r}")
            return v

        try:
            return cls(patch, merge, tp, px("image_min_pixels", 4), px("image_max_pixels", 4096),
                       px("video_min_pixels", 4), px("video_max_pixels", 4096), px("video_total_max_pixels", 16384))
        except ValueError as e:
            raise CheckpointError(f"{path}: processor_config: {e}") from e

    def signature(self) -> str:
        return (f"mimo/{self.patch}x{self.merge}x{self.temporal_patch}/img{self.image_min_pixels}-"
                f"{self.image_max_pixels}/vid{self.video_min_pixels}-{self.video_max_pixels}-"
                f"{self.video_total_max_pixels}/bilinear/imagenet255")

    def smart_resize(self, h: int, w: int, min_px: int, max_px: int) -> tuple[int, int]:
        f = self.factor
        if min(h, w) < f:
            if h < w:
                h, w = f, int(w * f / h)
            else:
                w, h = f, int(h * f / w)
        elif max(h, w) / min(h, w) > 200:
            raise BadMedia(f"the image is {w}x{h}: aspect ratios over 200 are not accepted")
        hb, wb = round(h / f) * f, round(w / f) * f
        if hb * wb > max_px:
            beta = math.sqrt((h * w) / max_px)
            hb, wb = math.floor(h / beta / f) * f, math.floor(w / beta / f) * f
        elif hb * wb < min_px:
            beta = math.sqrt(min_px / (h * w))
            hb, wb = math.ceil(h * beta / f) * f, math.ceil(w * beta / f) * f
        return int(hb), int(wb)

    def video_max_px(self, num_frames: int) -> int:
        return max(self.video_min_pixels,
                   min(self.video_total_max_pixels * self.temporal_patch // max(num_frames, 1), self.video_max_pixels))

    def _resize_normalize(self, frames: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """uint8/float [n, 3, H, W] -> float32 [n, 3, h, w] standardized (0..255 units)."""
        x = F.interpolate(frames.float(), size, mode="bilinear", align_corners=False)
        mean = torch.tensor(PIXEL_MEAN, device=x.device).view(1, 3, 1, 1)
        std = torch.tensor(PIXEL_STD, device=x.device).view(1, 3, 1, 1)
        return (x - mean) / std

    def _patches(self, x: torch.Tensor) -> torch.Tensor:
        """[T*tp, 3, h, w] -> [T, lh, lw, m*m, 3*tp*ps*ps] (vLLM ``_flatten_visual`` order)."""
        n, c, h, w = x.shape
        tp, ps, m = self.temporal_patch, self.patch, self.merge
        assert n % tp == 0 and h % (ps * m) == 0 and w % (ps * m) == 0, x.shape
        t, lh, lw = n // tp, h // (ps * m), w // (ps * m)
        x = x.reshape(t, tp, c, lh, m, ps, lw, m, ps).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return x.reshape(t, lh, lw, m * m, c * tp * ps * ps).contiguous()

    def image(self, img: torch.Tensor) -> torch.Tensor:
        """uint8 [3, H, W] -> [1, lh, lw, m*m, D]: one temporal group of ``tp`` copies."""
        size = self.smart_resize(img.shape[-2], img.shape[-1], self.image_min_pixels, self.image_max_pixels)
        x = self._resize_normalize(img[None], size)
        return self._patches(x.expand(self.temporal_patch, -1, -1, -1))

    def video_size(self, height: int, width: int, num_frames: int) -> tuple[int, int]:
        return self.smart_resize(height, width, self.video_min_pixels, self.video_max_px(num_frames))

    def video(self, frames: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """uint8 [n, 3, H, W] (n a multiple of ``tp``) -> [n / tp, lh, lw, m*m, D] at ``size``."""
        assert frames.shape[0] % self.temporal_patch == 0, frames.shape
        return self._patches(self._resize_normalize(frames, size))
