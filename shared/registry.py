"""The one shape of a swappable part's name lookup: ``Registry[T]``.

Implementations register themselves where they are defined (``@REG.register("name")``); the
code choosing one by a setting calls ``REG.get(name)``, and an unknown name is an ``UnknownName``
(a ``ValueError``) whose message lists every accepted name.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class UnknownName(ValueError):
    """A name no implementation is registered under; the message lists the accepted names."""


class Registry(Generic[T]):
    """The implementations of one swappable part, by name (and aliases of a name).

    ``kind`` names the part in messages: ``unknown {kind} 'x'; choose one of [...]``.
    ``load`` is called once, before the first lookup: it imports the modules whose
    implementations register themselves, so that the registry's own module need not.
    ``error``: the ``ValueError`` subclass an unknown name raises (``UnknownName`` unless the
    part has its own, e.g. a bundle error). ``also``: names the caller resolves itself before the
    lookup (e.g. ``"auto"``), listed among the choices.
    """

    def __init__(self, kind: str, *, load: Callable[[], object] | None = None,
                 error: type[ValueError] = UnknownName, also: Iterable[str] = ()) -> None:
        self.kind = kind
        self._load = load
        self._loaded = load is None
        self._loading = False
        self._lock = threading.RLock()
        self._error = error
        self._also = tuple(also)
        self._items: dict[str, T] = {}
        self._aliases: dict[str, str] = {}

    def register(self, name: str, *aliases: str) -> Callable[[T], T]:
        """Decorator registering its target as ``name`` (and ``aliases``); returns it unchanged."""

        def deco(impl: T) -> T:
            return self.add(name, impl, *aliases)

        return deco

    def add(self, name: str, impl: T, *aliases: str) -> T:
        """Register ``impl`` as ``name`` (and ``aliases``); a name taken already is refused."""
        for n in (name, *aliases):
            if n in self._items or n in self._aliases or n in self._also:
                raise ValueError(f"{self.kind} {n!r} is registered already")
        self._items[name] = impl
        self._aliases.update(dict.fromkeys(aliases, name))
        return impl

    def get(self, name: str) -> T:
        """The implementation registered as ``name`` or as an alias of it."""
        self._ensure_loaded()
        impl = self._items.get(self._aliases.get(name, name))
        if impl is None:
            raise self._error(f"unknown {self.kind} {name!r}; choose one of {self.choices()}")
        return impl

    def names(self) -> list[str]:
        """The registered names, sorted (aliases not included)."""
        self._ensure_loaded()
        return sorted(self._items)

    def choices(self) -> list[str]:
        """Every name ``get`` accepts, and the caller-resolved ones (``also``), sorted."""
        self._ensure_loaded()
        return sorted({*self._items, *self._aliases, *self._also})

    def __contains__(self, name: object) -> bool:
        self._ensure_loaded()
        return name in self._items or name in self._aliases

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names() if self._loaded else '<not loaded>'})"

    def _ensure_loaded(self) -> None:
        if self._loaded:
            return
        with self._lock:
            if self._loaded or self._loading:  # loading: a registering module looks a name up
                return
            self._loading = True
            try:
                self._load()  # type: ignore[misc]
            finally:  # once even if it failed: a rerun would register its survivors twice
                self._loaded = True
