"""Registry of generation backends: ``hf`` (transformers reference) and ``swa`` (our engine)."""

from __future__ import annotations

from collections.abc import Callable

from shared.settings import LLMSettings

from ..loader import LoadedLM
from .base import Backend, BackendStats, GenOutput, RequestStream

BackendFactory = Callable[[LLMSettings, LoadedLM], Backend]
_REGISTRY: dict[str, BackendFactory] = {}


def register_backend(name: str) -> Callable[[BackendFactory], BackendFactory]:
    def deco(factory: BackendFactory) -> BackendFactory:
        _REGISTRY[name] = factory
        return factory

    return deco


def _ensure_builtin() -> None:
    from . import hf, swa  # noqa: F401


def available_backends() -> list[str]:
    _ensure_builtin()
    return sorted(_REGISTRY)


def backend_class(name: str) -> BackendFactory:
    """The registered backend ``name`` (its ``needs_weights`` tells how to load the LM)."""
    _ensure_builtin()
    if name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}; choose one of {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def create_backend(settings: LLMSettings, lm: LoadedLM) -> Backend:
    return backend_class(settings.backend)(settings, lm)


__all__ = ["Backend", "BackendStats", "GenOutput", "RequestStream", "available_backends",
           "backend_class", "create_backend", "register_backend"]
