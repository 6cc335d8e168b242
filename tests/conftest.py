"""Fixtures shared by every tier: tiny model bundles written once per session, media makers."""

from __future__ import annotations

import io
import os
import socket
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _no_cuda() -> bool:
    import torch

    return not torch.cuda.is_available()


# Triton fixes its mode when it is first imported (any earlier import, e.g. by transformers, would
# leave the CPU tests of our Triton kernels with a compiled-mode runtime): without a GPU, every
# Triton kernel in the tests runs under the interpreter
if "TRITON_INTERPRET" not in os.environ and _no_cuda():
    os.environ["TRITON_INTERPRET"] = "1"

REDIS_HOST, REDIS_PORT = "127.0.0.1", 6379
TIERS = ("unit", "integration", "e2e")


def pytest_collection_modifyitems(config, items):
    """Every test gets the marker of its tier folder (tests/unit, tests/integration, tests/e2e),
    so ``-m unit`` selects by where a test lives and never skips a file without ``pytestmark``."""
    root = Path(__file__).parent
    for item in items:
        try:
            tier = Path(item.path).relative_to(root).parts[0]
        except ValueError:
            continue
        if tier in TIERS and item.get_closest_marker(tier) is None:
            item.add_marker(getattr(pytest.mark, tier))


@pytest.fixture(scope="session")
def mimo_bundle(tmp_path_factory) -> Path:
    """A tiny MiMo-V2-Flash bundle (vision + audio), sliding window 128."""
    from mmserve.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("bundles") / "tiny-mimo", arch="mimo")


@pytest.fixture(scope="session")
def gemma3_bundle(tmp_path_factory) -> Path:
    """A tiny plain-HF Gemma3ForConditionalGeneration checkpoint directory, window 128."""
    from mmserve.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("bundles") / "tiny-gemma3", arch="gemma3")


def make_png(width: int = 48, height: int = 40, seed: int = 0, fmt: str = "PNG") -> bytes:
    """A real image file (PIL-encoded) with a seed-dependent pattern."""
    from PIL import Image

    img = Image.new("RGB", (width, height))
    img.putdata(
        [((x * 7 + seed * 31) % 256, (y * 5 + seed * 17) % 256, (x * y + seed) % 256) for y in range(height) for x in range(width)]
    )
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


@pytest.fixture
def png_bytes() -> bytes:
    return make_png()


@pytest.fixture(scope="session")
def redis_url() -> str:
    """The machine's real Redis; the suite's runner (.ci/run, scripts/test.sh) starts it."""
    with socket.socket() as s:
        s.settimeout(1.0)
        if s.connect_ex((REDIS_HOST, REDIS_PORT)) != 0:
            pytest.fail(f"Redis is not running at {REDIS_HOST}:{REDIS_PORT}; start it (see README)")
    return f"redis://{REDIS_HOST}:{REDIS_PORT}/0"


SMALL_W = 16  # a window small enough that a few hundred tokens span several windows


@pytest.fixture(scope="session")
def mimo16(tmp_path_factory):
    """The tiny MiMo bundle with sliding window 16, loaded by llm_svc.loading.loader."""
    from llm_svc.loading.loader import load_lm
    from mmserve.tiny_model import write_tiny_model

    return load_lm(str(write_tiny_model(tmp_path_factory.mktemp("b") / "mimo16", sliding_window=SMALL_W)))


@pytest.fixture(scope="session")
def gemma16(tmp_path_factory):
    """The tiny Gemma 3 checkpoint with sliding window 16, loaded by llm_svc.loading.loader."""
    from llm_svc.loading.loader import load_lm
    from mmserve.tiny_model import write_tiny_model

    return load_lm(str(write_tiny_model(tmp_path_factory.mktemp("b") / "gemma16", arch="gemma3", sliding_window=SMALL_W)))


@pytest.fixture(scope="session")
def redis_cluster():
    """A real 3-primary Redis Cluster of this session (tests/redis_cluster.py): ``.url`` is the
    services' ``redis+cluster://`` form, ``.node_of(key)`` / ``.keys_by_node(match)`` show
    where keys landed."""
    from tests.redis_cluster import running_cluster

    with running_cluster() as cluster:
        yield cluster


@pytest.fixture(params=["redis", "redis-cluster"])
def any_redis_url(request) -> str:
    """Runs the test twice: against the single Redis and against the Redis Cluster."""
    if request.param == "redis":
        return request.getfixturevalue("redis_url")
    return request.getfixturevalue("redis_cluster").url
