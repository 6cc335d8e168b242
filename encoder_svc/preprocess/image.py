"""Image preprocessing backends behind one small interface and a registry (``IMAGE_BACKENDS``).

``ImageBackend.images(blobs)`` turns encoded images into the pixel batch the vision tower takes,
``[B, 3, h, w]`` float32 on the model's device, equal to what the bundle's HF image processor
produces (its torchvision backend: uint8 antialiased resize, then fused rescale+normalize).
``ImageBackend.frames(frames)`` does the same for already-decoded video frames.

Backends: ``torchvision`` (default; nvJPEG decode + on-device resize when the device is CUDA)
and ``dali`` (NVIDIA DALI pipeline; needs ``nvidia-dali``, CPU pipeline when not on CUDA).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict
from typing import Callable

import torch
from torchvision.transforms import InterpolationMode
from torchvision.transforms.v2 import functional as TF

from encoder_svc.errors import BadMedia, short_reason
from encoder_svc.preprocess.image_config import ImagePreprocessConfig
from encoder_svc.preprocess.image_decode import decode_rgb, probe
from shared.registry import Registry

# PIL resample id -> torchvision mode, as HF's pil_torch_interpolation_mapping (LANCZOS -> BICUBIC
# because torchvision cannot antialias LANCZOS on tensors, which HF also does).
_INTERP = {
    0: InterpolationMode.NEAREST_EXACT,
    1: InterpolationMode.BICUBIC,
    2: InterpolationMode.BILINEAR,
    3: InterpolationMode.BICUBIC,
    4: InterpolationMode.BOX,
    5: InterpolationMode.HAMMING,
}


def resize_normalize(batch: torch.Tensor, cfg: ImagePreprocessConfig) -> torch.Tensor:
    """uint8 [B, 3, H, W] -> float32 [B, 3, h, w], as HF's TorchvisionBackend._preprocess."""
    assert batch.dtype == torch.uint8 and batch.ndim == 4 and batch.shape[1] == 3, batch.shape
    if cfg.do_resize and tuple(batch.shape[-2:]) != (cfg.height, cfg.width):
        batch = TF.resize(batch, [cfg.height, cfg.width], interpolation=_INTERP[cfg.resample], antialias=True)
    x = batch.to(torch.float32)
    if cfg.do_normalize:
        scale = 1.0 / cfg.rescale_factor if cfg.do_rescale else 1.0
        mean = [m * scale for m in cfg.mean]
        std = [s * scale for s in cfg.std]
        return TF.normalize(x, mean, std)
    if cfg.do_rescale:
        return x * cfg.rescale_factor
    return x


class ImageBackend(ABC):
    """Contract: ``images`` raises ``BadMedia``/``MediaTooLarge`` for bad input before any model
    work; outputs are float32 ``[B, 3, cfg.height, cfg.width]`` on ``device``, in input order."""

    name: str = ""

    def __init__(self, cfg: ImagePreprocessConfig, device: torch.device, max_pixels: int) -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        self.max_pixels = max_pixels

    @abstractmethod
    def images(self, blobs: list[bytes]) -> torch.Tensor: ...

    def frames(self, frames: torch.Tensor) -> torch.Tensor:
        """uint8 [N, 3, H, W] decoded video frames -> float32 [N, 3, h, w] on the device."""
        return resize_normalize(frames.to(self.device, non_blocking=True), self.cfg)


# name -> backend class, built as (cfg, device, max_pixels)
IMAGE_BACKENDS: Registry[Callable[..., ImageBackend]] = Registry("image backend")


@IMAGE_BACKENDS.register("torchvision")
class TorchvisionImageBackend(ImageBackend):
    name = "torchvision"

    def images(self, blobs: list[bytes]) -> torch.Tensor:
        decoded = [decode_rgb(b, self.max_pixels, self.device) for b in blobs]
        out: list[torch.Tensor | None] = [None] * len(decoded)
        groups: dict[tuple, list[int]] = defaultdict(list)
        for i, img in enumerate(decoded):
            groups[tuple(img.shape)].append(i)
        for idx in groups.values():  # same-size images resize as one batch
            pix = resize_normalize(torch.stack([decoded[i] for i in idx]), self.cfg)
            for j, i in enumerate(idx):
                out[i] = pix[j]
        return torch.stack(out)  # type: ignore[arg-type]


@IMAGE_BACKENDS.register("dali")
class DaliImageBackend(ImageBackend):
    """DALI ``decoders.image -> resize -> crop_mirror_normalize``; ``mixed`` decode on CUDA."""

    name = "dali"
    _MAX_BATCH = 32

    def __init__(self, cfg: ImagePreprocessConfig, device: torch.device, max_pixels: int) -> None:
        super().__init__(cfg, device, max_pixels)
        try:
            from nvidia.dali import fn, pipeline_def, types
        except ImportError as e:
            raise RuntimeError("image_backend=dali needs the nvidia-dali package (pip install mmserve[dali])") from e
        on_gpu = self.device.type == "cuda"
        interp = {2: types.INTERP_LINEAR, 3: types.INTERP_CUBIC, 0: types.INTERP_NN}.get(cfg.resample, types.INTERP_LINEAR)
        scale = 1.0 / cfg.rescale_factor if cfg.do_rescale else 1.0
        mean = [m * scale for m in cfg.mean] if cfg.do_normalize else [0.0, 0.0, 0.0]
        std = [s * scale for s in cfg.std] if cfg.do_normalize else [scale] * 3

        @pipeline_def(batch_size=self._MAX_BATCH, num_threads=2,
                      device_id=(self.device.index or 0) if on_gpu else None, prefetch_queue_depth=1)
        def pipe():
            enc = fn.external_source(name="enc", dtype=types.UINT8, no_copy=False)
            img = fn.decoders.image(enc, device="mixed" if on_gpu else "cpu", output_type=types.RGB)
            img = fn.resize(img, resize_x=cfg.width, resize_y=cfg.height, interp_type=interp, antialias=True)
            return fn.crop_mirror_normalize(img, dtype=types.FLOAT, output_layout="CHW", mean=mean, std=std)

        self._pipe = pipe()
        self._pipe.build()

    def images(self, blobs: list[bytes]) -> torch.Tensor:
        import numpy as np

        # bomb guard + 400 for unknown formats before DALI sees the bytes; formats DALI does not
        # decode (GIF, animated WebP, ...) take the torchvision path, first frame
        probes = [probe(b, self.max_pixels) for b in blobs]
        out: list[torch.Tensor | None] = [None] * len(blobs)
        dali_idx = [i for i, (fmt, _, _, anim) in enumerate(probes) if fmt in ("JPEG", "PNG", "WEBP") and not anim]
        for i in set(range(len(blobs))) - set(dali_idx):
            out[i] = resize_normalize(decode_rgb(blobs[i], self.max_pixels, self.device)[None], self.cfg)[0]
        for s in range(0, len(dali_idx), self._MAX_BATCH):
            idx = dali_idx[s : s + self._MAX_BATCH]
            try:
                self._pipe.feed_input("enc", [np.frombuffer(blobs[i], dtype=np.uint8) for i in idx])
                (res,) = self._pipe.run()
            except RuntimeError as e:
                raise BadMedia(f"cannot decode the image: it is corrupt or truncated ({short_reason(e)})") from e
            if hasattr(res, "as_cpu"):  # TensorListGPU
                res = res.as_cpu()
            pix = torch.from_numpy(res.as_array()).to(self.device)  # [n, 3, h, w], all one size
            for j, i in enumerate(idx):
                out[i] = pix[j]
        return torch.stack(out)  # type: ignore[arg-type]


def make_image_backend(name: str, cfg: ImagePreprocessConfig, device: torch.device, max_pixels: int) -> ImageBackend:
    """The backend registered as ``name`` (the ``image_backend`` setting), built."""
    return IMAGE_BACKENDS.get(name)(cfg, device, max_pixels)
