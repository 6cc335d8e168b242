"""Each tensor-/expert-parallel rank reads only its share of an FP8 checkpoint, tensor by
tensor, straight to its packed form: its peak resident memory while loading (VmHWM above the
baseline after the imports) is at most 1.25x the share it ends up holding, and the shares of
the two ranks together are about the one-rank model (the replicated embedding, norms and
``lm_head`` counted on both). A tiny MiMo-V2-Flash made large enough to see it (~370 MB of FP8
experts), each rank in a fresh process, as the engine core would start them."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from dataclasses import replace

import pytest

from mmserve.tiny import mimo_published as mp
from tests.conftest import SMALL_W

pytestmark = pytest.mark.integration

PROBE = r"""
import json, sys, time
import torch
from llm_svc.loading.loader import load_lm
from llm_svc.models import qweight
from llm_svc.parallel import ParallelConfig
from llm_svc.parallel.comm import init_group

assert qweight.kernel("fp8") is not None  # built (cached) before the baseline
rank, world, port, ep = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"


def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024


group = init_group(rank, world, port, "gloo")
base = status("VmRSS")
t0 = time.perf_counter()
lm = load_lm(sys.argv[1], parallel=ParallelConfig(world, enable_expert_parallel=ep), group=group)
secs = time.perf_counter() - t0
peak = status("VmHWM")
mods = list(lm.model.modules())
packed = sum(m.qweight.nbytes for m in mods if getattr(m, "qweight", None) is not None)
tensors = {t.data_ptr(): t.numel() * t.element_size() for t in (*lm.model.parameters(), *lm.model.buffers())}
print(json.dumps({"base": base, "peak": peak, "packed": packed, "model": packed + sum(tensors.values()),
                  "load_s": secs}))
group.close()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _probe(d, world: int, ep: bool) -> list[dict]:
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-c", PROBE, str(d), str(r), str(world), str(port), "1" if ep else "0"],
                              stdout=subprocess.PIPE, text=True) for r in range(world)]
    out = []
    for p in procs:
        text, _ = p.communicate(timeout=600)
        assert p.returncode == 0
        out.append(json.loads(text.strip().splitlines()[-1]))
    return out


@pytest.fixture(scope="module")
def big_fp8(tmp_path_factory):
    spec = replace(mp.FLASH, hidden=1024, intermediate=1024, moe_intermediate=512, experts=32, mtp_layers=0)
    return mp.write_mimo_published(tmp_path_factory.mktemp("tpmem") / "fp8", spec, sliding_window=SMALL_W,
                                   quant="fp8")


@pytest.mark.parametrize("ep", [False, True], ids=["tp2", "ep2"])
def test_each_rank_peaks_near_its_share(big_fp8, ep):
    (one,) = _probe(big_fp8, 1, False)
    ranks = _probe(big_fp8, 2, ep)
    print(f"\n[one rank] {one['model'] / 2**20:.0f} MiB, peak above baseline {(one['peak'] - one['base']) / 2**20:.0f} MiB", file=sys.stderr)
    for r, got in enumerate(ranks):
        grew = got["peak"] - got["base"]
        print(f"\n[rank {r} of 2, {'EP' if ep else 'TP'}] share {got['model'] / 2**20:.0f} MiB "
              f"({got['packed'] / 2**20:.0f} packed FP8) of {one['model'] / 2**20:.0f}, peak above baseline "
              f"{grew / 2**20:.0f} MiB = {grew / got['model']:.2f}x, loaded in {got['load_s']:.2f} s", file=sys.stderr)
        assert got["packed"] > 0.4 * one["packed"]  # the experts stay packed on each rank
        assert grew <= 1.25 * got["model"], (r, grew, got)
        assert got["model"] < 0.6 * one["model"], (r, got, one)  # a share, not the whole model
