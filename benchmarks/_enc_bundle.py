"""An encoder-only mmserve bundle with a larger random SigLIP tower, for the encoder benchmarks.

The tiny test tower (hidden 32, 2 layers) costs less than an HTTP round trip, so batching and
caching would measure HTTP, not encoding; this one (24 layers, 16 patches per image) makes the
forward dominate (~13 ms per image at batch 1 on one core here). Like a GPU at small batch, its
batch-1 forward is bound by per-op overhead, which fusing requests amortises (forward alone:
~3x per image at batch 16 measured here). Written once into a cache directory and reused.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from shared.bundle import BUNDLE_FORMAT, MANIFEST

CACHE_DIR = Path(os.environ.get("MMSERVE_BENCH_CACHE", Path.home() / ".cache" / "mmserve-bench"))

BENCH_VISION = dict(image_size=64, patch_size=16, hidden_size=128, intermediate_size=512,
                    num_hidden_layers=24, num_attention_heads=4)
# SigLIP-so400m's tower geometry (width 1152, 27 layers, 16 heads, MLP 4304, patch 14; ~400 M
# parameters), random weights, at 112 px (64 patches) so a 2-core CPU finishes a round in
# seconds; per-op overhead no longer dominates here, the matmuls do.
SO400M_VISION = dict(image_size=112, patch_size=14, hidden_size=1152, intermediate_size=4304,
                     num_hidden_layers=27, num_attention_heads=16)
# the MiMo-V2.5 omni ViT (GQA, row/column band windows with sinks, merge 2), random, 16 blocks of
# width 128, written as a whole omni checkpoint (mmserve/tiny/mimo_omni.py); a 96 px image = 36 patches
MIMO_VISION = dict(depth=16, hidden=128, intermediate=512, heads=4, kv_heads=2, head_dim=32,
                   window_types=(-1,) + (0, 1) * 7 + (-1,), full_blocks=(0, 15))
TOWERS = {"small": ("enc-bench-siglip-p16-l24", BENCH_VISION), "so400m": ("enc-bench-siglip-so400m-112", SO400M_VISION),
          "mimo-omni": ("enc-bench-mimo-omni-vit-l16", MIMO_VISION)}


def bench_bundle(tower: str = "small") -> Path:
    name, vision = TOWERS[tower]
    out = CACHE_DIR / name
    if tower == "mimo-omni":
        if not (out / "config.json").exists():
            from mmserve.tiny.mimo_omni import TinyVisionSpec, write_mimo_omni

            write_mimo_omni(out.with_name(out.name + ".tmp"), vision=TinyVisionSpec(**vision)).rename(out)
        return out
    if (out / MANIFEST).exists():
        return out
    import torch
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

    from shared.projector import PoolProjector, ProjectorConfig

    torch.manual_seed(0)
    cfg = SiglipVisionConfig(num_channels=3, **vision)
    tmp = out.with_name(out.name + ".tmp")
    SiglipVisionModel(cfg).eval().save_pretrained(tmp / "vision")
    size = vision["image_size"]
    SiglipImageProcessor(size={"height": size, "width": size}).save_pretrained(tmp / "vision")
    PoolProjector(ProjectorConfig(cfg.hidden_size, 256, "grid2d", tokens=16)).save(tmp / "vision")
    manifest = {
        "format": BUNDLE_FORMAT,
        "name": name,
        "lm": {"path": ".", "architecture": "none (encoder-only benchmark bundle)"},
        "vision": {"kind": "siglip_projector", "path": "vision", "tokens_per_image": 16, "video_temporal_pool": 2},
        "placeholders": {"image": {"pad": "<|image_pad|>"}, "video": {"pad": "<|video_pad|>"}},
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
    tmp.rename(out)
    return out


def random_images(n: int, size: int = 96, seed: int = 0) -> list[bytes]:
    """``n`` distinct PNG images."""
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(buf, "PNG")
        out.append(buf.getvalue())
    return out
