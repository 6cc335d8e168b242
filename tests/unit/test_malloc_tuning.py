"""The gateway and the LLM front pin glibc's mmap threshold at start, so a large read buffer freed once does not
move every later one into the heap (where, shrunk in place, they fragment it: shared/malloc_tuning.py).

Each case runs in a fresh interpreter: the threshold is process-wide state. What is checked is
whether a 4 MB block, allocated after an 8 MB one was freed, is its own mapping (mallinfo2's
``hblks``) or was carved from the heap (the same mechanism as asyncio's 256 KiB buffers, at
sizes no free space in the heap can already hold, so the answer does not depend on its state)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from shared.malloc_tuning import malloc_heap

pytestmark = pytest.mark.skipif(malloc_heap() is None, reason="glibc only (the CI and GPU machines are glibc)")

PROBE = """
import ctypes, ctypes.util
from shared.malloc_tuning import _MallInfo2
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallinfo2.restype = _MallInfo2
{setup}
b = bytes(8 << 20); del b           # glibc's dynamic threshold rises to 8 MB here
before = libc.mallinfo2().hblks
x = bytes(4 << 20)                  # larger than any free space the heap holds, so it is either
                                    # a new mapping or the heap grows for it
print(libc.mallinfo2().hblks - before)
"""


def run_probe(setup: str) -> int:
    code = textwrap.dedent(PROBE).format(setup=textwrap.dedent(setup))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.strip().splitlines()[-1])


def test_without_pinning_a_freed_block_moves_large_buffers_into_the_heap():
    assert run_probe("") == 0  # the control: glibc's dynamic threshold, what the fix is about


def test_pinned_threshold_keeps_large_buffers_in_their_own_mapping():
    assert run_probe("from shared.malloc_tuning import pin_mmap_threshold\nassert pin_mmap_threshold()") == 1


GATEWAY = """
from fastapi.testclient import TestClient
from gateway.app import create_app
from shared.settings import GatewaySettings
app = create_app(GatewaySettings(malloc_mmap_threshold={threshold}, health_interval=0, dns_interval=0))
client = TestClient(app)
client.__enter__()                  # runs the lifespan: what `mmserve gateway` does at start
assert client.get("/healthz").status_code == 200
"""


LLM_FRONT = """
import tempfile
from fastapi.testclient import TestClient
from llm_svc.front.app import create_app
from shared.settings import LLMSettings
app = create_app(LLMSettings(model_dir=tempfile.mkdtemp(), malloc_mmap_threshold={threshold}))
client = TestClient(app)
client.__enter__()                  # the lifespan (the empty model dir fails to load, in the background)
assert client.get("/healthz").status_code in (200, 500)  # 500: the load failed, as it should here
"""


@pytest.mark.parametrize(("threshold", "own_mapping"), [(128 * 1024, 1), (0, 0)])
@pytest.mark.parametrize("service", ["gateway", "llm front"])
def test_the_service_pins_it_at_start_unless_told_not_to(service, threshold, own_mapping):
    setup = GATEWAY if service == "gateway" else LLM_FRONT
    assert run_probe(setup.format(threshold=threshold)) == own_mapping


@pytest.mark.parametrize("service", ["gateway", "llm"])
def test_the_service_reports_its_heap(service):
    from gateway.metrics import GatewayMetrics
    from llm_svc.front.metrics import LLMMetrics

    from prometheus_client import generate_latest

    text = generate_latest((GatewayMetrics() if service == "gateway" else LLMMetrics()).registry).decode()
    values = {k: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              for k in ("heap", "in_use", "free") if line.startswith(f'mmserve_{service}_malloc_bytes{{kind="{k}"}}')}
    assert set(values) == {"heap", "in_use", "free"}
    assert values["heap"] >= values["in_use"] > 0 and values["free"] >= 0


def test_heap_reading_loads_libc_once():
    """A /metrics scrape reads the heap three times; the C library is loaded once per process,
    not once per read (each ``CDLL`` made a ctypes class the cyclic collector had to free)."""
    import gc

    from shared import malloc_tuning

    if malloc_tuning.malloc_heap() is None:
        pytest.skip("not glibc")
    gc.collect()
    before = len(gc.get_objects())
    for _ in range(200):
        malloc_tuning.malloc_heap()
    assert malloc_tuning._libc() is malloc_tuning._libc()
    assert len(gc.get_objects()) - before < 20
