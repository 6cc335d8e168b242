"""What the routes of one LLM service app share: settings, the loaded model, the backend."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from shared.settings import LLMSettings

from .backends import Backend, create_backend
from .loader import LoadedLM, load_lm
from .metrics import LLMMetrics

log = logging.getLogger(__name__)


@dataclass
class ServiceState:
    settings: LLMSettings
    metrics: LLMMetrics = field(default_factory=LLMMetrics)
    lm: LoadedLM | None = None
    backend: Backend | None = None
    error: str | None = None
    in_flight: set[str] = field(default_factory=set)

    @property
    def model_name(self) -> str:
        if self.settings.model_name:
            return self.settings.model_name
        return self.lm.spec.name if self.lm else self.settings.model_dir

    @property
    def ready(self) -> bool:
        return self.backend is not None

    async def load(self) -> None:
        """Load weights off the event loop, then start the backend; failures land in ``error``."""
        try:
            s = self.settings
            lm = await asyncio.to_thread(load_lm, s.model_dir, s.device, s.dtype)
            backend = await asyncio.to_thread(create_backend, s, lm)
            await backend.start()
            self.lm, self.backend = lm, backend
            log.info("llm service ready: %s backend=%s", self.model_name, s.backend)
        except Exception as e:
            log.exception("llm service failed to load")
            self.error = f"{type(e).__name__}: {e}"

    async def close(self) -> None:
        if self.backend is not None:
            await self.backend.close()
            self.backend = None
