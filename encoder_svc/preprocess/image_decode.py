"""Image bytes -> uint8 RGB tensor [3, H, W], with the decompression-bomb guard.

The header is parsed first (PIL reads only the header on ``open``) so an image whose pixel count
exceeds the limit is refused before any pixel is decoded. JPEG/PNG/still WebP decode with
torchvision (libjpeg-turbo / libpng / libwebp; nvJPEG for JPEG when ``device`` is CUDA); GIF,
animated WebP and other PIL formats decode their first frame with PIL. Alpha is dropped like
HF's ``convert_to_rgb`` (``Image.convert("RGB")``).
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torchvision.io import ImageReadMode, decode_image, decode_jpeg

from encoder_svc.errors import BadMedia, MediaTooLarge, short_reason

_TORCHVISION_FORMATS = {"JPEG", "PNG", "WEBP"}


def probe(data: bytes, max_pixels: int) -> tuple[str, int, int, bool]:
    """(format, width, height, animated) from the header only; raises 400/413."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            fmt, (w, h) = img.format or "", img.size
            animated = bool(getattr(img, "is_animated", False))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise MediaTooLarge(f"image is too large to decode ({e}); send at most {max_pixels} pixels") from e
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        raise BadMedia(f"cannot decode the image: not a supported image file ({short_reason(e)})") from e
    if w * h > max_pixels:
        raise MediaTooLarge(f"image is {w}x{h} = {w * h} pixels; the limit is {max_pixels}, send a smaller image")
    if w < 1 or h < 1:
        raise BadMedia(f"image has an empty size {w}x{h}")
    return fmt, w, h, animated


def _pil_first_frame(data: bytes) -> torch.Tensor:
    try:
        with Image.open(io.BytesIO(data)) as img:
            img.seek(0)
            rgb = img.convert("RGB")
            arr = np.asarray(rgb, dtype=np.uint8)
    except (OSError, ValueError, SyntaxError, EOFError) as e:
        raise BadMedia(f"cannot decode the image: it is corrupt or truncated ({short_reason(e)})") from e
    return torch.from_numpy(arr.copy()).permute(2, 0, 1).contiguous()  # [3, H, W]


def decode_rgb(data: bytes, max_pixels: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """uint8 [3, H, W] on ``device`` (JPEG decodes there directly with nvJPEG on CUDA)."""
    fmt, w, h, animated = probe(data, max_pixels)
    device = torch.device(device)
    if fmt not in _TORCHVISION_FORMATS or animated:
        return _pil_first_frame(data).to(device)
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    try:
        if fmt == "JPEG" and device.type == "cuda":
            out = decode_jpeg(raw, mode=ImageReadMode.RGB, device=device)
        else:
            out = decode_image(raw, mode=ImageReadMode.RGB).to(device)
    except RuntimeError as e:
        raise BadMedia(f"cannot decode the {fmt} image: it is corrupt or truncated ({short_reason(e)})") from e
    if tuple(out.shape) != (3, h, w):
        raise BadMedia(f"decoded {fmt} image has shape {tuple(out.shape)}, header said {h}x{w}")
    return out
