"""What each LLM replica reported it can take (``/readyz`` ``limits``)."""

from __future__ import annotations

from pydantic import ValidationError

from shared.schemas import HealthStatus, ServiceLimits


class ReplicaLimits:
    """Limits by replica URL, learned from readiness probes; ``best()`` is the most permissive
    combination (a prompt that may fit some replica is sent on, and that replica decides)."""

    def __init__(self) -> None:
        self._by_url: dict[str, ServiceLimits] = {}

    def record(self, url: str, body: object) -> None:
        try:
            limits = HealthStatus.model_validate(body).limits
        except ValidationError:
            return
        if limits is not None:
            self._by_url[url] = limits

    def best(self) -> ServiceLimits | None:
        if not self._by_url:
            return None
        known = self._by_url.values()
        return ServiceLimits(
            max_model_len=max(v.max_model_len for v in known),
            max_token_bytes=max(v.max_token_bytes for v in known),
        )
