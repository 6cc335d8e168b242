"""The one cache root of every mmserve process: ``$MMSERVE_CACHE_DIR``, default ``~/.cache/mmserve``.

Under it: ``tiny-mimo/`` (the default model bundle ``mmserve up`` writes on first use) and
``kernels/`` (the engine's C kernels, built once per machine, ``llm_svc`` ckernels). The older
name ``MMSERVE_CACHE`` (the kernels' alone) is still read when ``MMSERVE_CACHE_DIR`` is unset,
with a deprecation warning.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger(__name__)

CACHE_DIR_VAR = "MMSERVE_CACHE_DIR"
DEPRECATED_VAR = "MMSERVE_CACHE"
DEFAULT_MODEL = "tiny-mimo"  # the default tiny bundle's directory under the root
KERNELS = "kernels"  # the C kernels' builds

_warned: set[str] = set()


def cache_root(environ: Mapping[str, str] | None = None) -> Path:
    """The cache root: ``MMSERVE_CACHE_DIR``, else the deprecated ``MMSERVE_CACHE`` (warned once
    per process), else ``~/.cache/mmserve``."""
    env = os.environ if environ is None else environ
    root, old = env.get(CACHE_DIR_VAR), env.get(DEPRECATED_VAR)
    if old and old != root and DEPRECATED_VAR not in _warned:
        _warned.add(DEPRECATED_VAR)
        if root:
            log.warning("%s is deprecated and ignored: %s=%s is the cache root", DEPRECATED_VAR, CACHE_DIR_VAR, root)
        else:
            log.warning("%s is deprecated: set %s=%s instead (the root of the model and kernel caches)",
                        DEPRECATED_VAR, CACHE_DIR_VAR, old)
    return Path(root or old or Path.home() / ".cache" / "mmserve")


def cache_path(subdir: str, environ: Mapping[str, str] | None = None) -> Path:
    """``subdir`` of the cache root (``KERNELS``, ``DEFAULT_MODEL``, ...); not created."""
    return cache_root(environ) / subdir
