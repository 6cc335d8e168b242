"""The host (L2) KV pools are committed when they are built (zero-filled, not merely allocated):
the configured bound is resident from the start, so RSS stays flat while the tier fills and a
bound the machine cannot hold fails at start. Measured as the resident memory of a fresh process
(an untouched ``torch.empty`` of this size maps pages without making them resident)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20

# one full and one sliding layer, 8 KV heads of 64 (K and V), float32: 4 KiB per slot per layer
PROBE = """
import json, torch
from llm_svc.attention import FULL, SLIDING, LayerKV
from llm_svc.offload.host_kv import HostKV

def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))

device = [LayerKV.empty(1, 8, 64, 64, torch.float32) for _ in range(2)]
before = rss()
host = HostKV(device, [FULL, SLIDING], num_full=61440, num_swa=4096)
grew = rss() - before
zeros = all(not bool(t.any()) for kv in host.host for t in (kv.k, kv.v))
print(json.dumps({"nbytes": host.nbytes(), "grew": grew, "zeros": zeros}))
"""


def test_host_pools_are_resident_and_zero_once_built():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["nbytes"] == 256 * MiB
    assert got["zeros"]
    # every page touched at construction (allow a little for pages the allocator reuses)
    assert got["grew"] >= 0.95 * got["nbytes"], f"RSS grew {got['grew'] / MiB:.0f} MiB for a 256 MiB host pool"
