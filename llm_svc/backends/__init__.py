"""Generation backends, ``hf`` (transformers reference) and ``swa`` (our engine), each registered
in ``BACKENDS`` (``@BACKENDS.register(name)``) by the ``backend`` setting's name; a backend
class's ``needs_weights`` tells how to load the LM."""

from __future__ import annotations

from collections.abc import Callable

from shared.registry import Registry
from shared.settings import LLMSettings

from llm_svc.loading.loader import LoadedLM
from .base import Backend, BackendStats, GenOutput, RequestStream

BackendFactory = Callable[[LLMSettings, LoadedLM], Backend]


def _load_builtin() -> None:
    from . import hf, swa  # noqa: F401  (register)


BACKENDS: Registry[BackendFactory] = Registry("backend", load=_load_builtin)


def create_backend(settings: LLMSettings, lm: LoadedLM) -> Backend:
    return BACKENDS.get(settings.backend)(settings, lm)


__all__ = ["BACKENDS", "Backend", "BackendStats", "GenOutput", "RequestStream", "create_backend"]
