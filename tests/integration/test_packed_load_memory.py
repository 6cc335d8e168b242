"""Loading an FP8 checkpoint packed peaks near the packed model's size: the checkpoint is read
tensor by tensor into its packed form (``weights.load_strict(keep_packed=True)`` on a
meta-built tree), never widened as a whole and never held twice. A tiny MiMo-V2-Flash made large
enough to see it (~200 MB of FP8 experts), loaded in a fresh process: its peak resident memory
(VmHWM) above the baseline after the imports is at most 1.25x the loaded model's bytes.

The same for gpt-oss' MXFP4 experts (``gpt_oss_moe``, read and packed one expert at a time):
~53 MB of packed experts (400 MB in float32); the process first loads the tiny gpt-oss, so the
one-time costs (transformers' model module, the tokenizer) are paid before the baseline."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from mmserve.tiny import mimo_published as mp
from mmserve.tiny.gpt_oss import write_gpt_oss
from tests.conftest import SMALL_W

pytestmark = pytest.mark.integration

PROBE = r"""
import json, sys
import torch
from llm_svc.loading.loader import load_lm
from llm_svc.models import qweight

assert qweight.kernel("fp8") is not None and qweight.kernel("mxfp4") is not None  # built before the baseline
if len(sys.argv) > 3:
    load_lm(sys.argv[3])  # a small model of the same family first: its one-time costs


def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024


base = status("VmRSS")
lm = load_lm(sys.argv[1], keep_packed=sys.argv[2] == "1")
peak = status("VmHWM")
mods = list(lm.model.modules())
packed = sum(m.qweight.nbytes for m in mods if getattr(m, "qweight", None) is not None)
packed += sum(m.nbytes for m in mods if type(m).__name__ == "PackedGptOssExperts")
tensors = {t.data_ptr(): t.numel() * t.element_size() for t in (*lm.model.parameters(), *lm.model.buffers())}
print(json.dumps({"base": base, "peak": peak, "packed": packed, "model": packed + sum(tensors.values())}))
"""


def _probe(d, keep_packed: bool, warm=None) -> dict:
    args = [str(d), "1" if keep_packed else "0"] + ([str(warm)] if warm is not None else [])
    out = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=600,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_loading_a_large_fp8_checkpoint_peaks_near_its_packed_size(tmp_path):
    spec = replace(mp.FLASH, hidden=1024, intermediate=1024, moe_intermediate=512, experts=16, mtp_layers=0)
    d = mp.write_mimo_published(tmp_path / "fp8", spec, sliding_window=SMALL_W, quant="fp8")
    got = _probe(d, True)
    grew = got["peak"] - got["base"]
    print(f"\n[packed load] model {got['model'] / 2**20:.0f} MiB ({got['packed'] / 2**20:.0f} packed FP8), "
          f"peak above baseline {grew / 2**20:.0f} MiB = {grew / got['model']:.2f}x", file=sys.stderr)
    assert got["packed"] > 150 * 2**20
    assert grew <= 1.25 * got["model"], (grew, got)
    ref = _probe(d, False)  # the dequantize-at-load path holds float32: ~4x the bytes
    assert ref["model"] > 3 * got["model"]


def test_loading_a_large_mxfp4_gpt_oss_peaks_near_its_packed_size(tmp_path):
    tiny = write_gpt_oss(tmp_path / "tiny", sliding_window=SMALL_W, quant="mxfp4")
    d = write_gpt_oss(tmp_path / "mxfp4", sliding_window=SMALL_W, quant="mxfp4", hidden=512, intermediate=512,
                      experts=32, layers=4)
    got = _probe(d, True, tiny)
    grew = got["peak"] - got["base"]
    print(f"\n[packed load] gpt-oss model {got['model'] / 2**20:.0f} MiB ({got['packed'] / 2**20:.0f} packed MXFP4), "
          f"peak above baseline {grew / 2**20:.0f} MiB = {grew / got['model']:.2f}x", file=sys.stderr)
    assert got["packed"] > 50 * 2**20
    assert grew <= 1.25 * got["model"], (grew, got)
    ref = _probe(d, False, tiny)  # the dequantize-at-load path holds the experts in float32: ~7.5x their bytes
    assert ref["model"] > 5 * got["model"]
