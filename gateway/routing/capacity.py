"""What each LLM replica reported it can take (``/readyz`` ``limits``), and length buckets:
replicas labelled with a prompt-length range get the prompts of that range (Xiaomi's
length-bucketed serving); routing stays cache-aware inside a bucket."""

from __future__ import annotations

from pydantic import ValidationError

from shared.schemas import HealthStatus, ServiceLimits


class ReplicaLimits:
    """Limits by replica URL, learned from readiness probes; ``best()`` is the most permissive
    combination (a prompt that may fit some replica is sent on, and that replica decides)."""

    def __init__(self) -> None:
        self._by_url: dict[str, ServiceLimits] = {}
        self.models: dict[str, str] = {}  # replica URL -> the model name it serves
        self.instances: dict[str, str] = {}  # replica URL -> the instance id of its KV events

    def record(self, url: str, body: object) -> None:
        try:
            health = HealthStatus.model_validate(body)
        except ValidationError:
            return
        if health.model:
            self.models[url] = health.model
        if health.kv_instance:
            self.instances[url] = health.kv_instance
        else:
            self.instances.pop(url, None)
        if health.limits is not None:
            self._by_url[url] = health.limits

    def best(self) -> ServiceLimits | None:
        if not self._by_url:
            return None
        known = self._by_url.values()
        return ServiceLimits(
            max_model_len=max(v.max_model_len for v in known),
            max_token_bytes=max(v.max_token_bytes for v in known),
        )

    def bucketed(self, replicas: list[str], est_tokens: int) -> list[str]:
        """The replicas whose length bucket holds ``est_tokens`` (unlabelled ones hold every
        length); if none does, those whose bucket is above it, then all of them."""
        def bucket(url: str) -> tuple[int, int | None]:
            lim = self._by_url.get(url)
            return (0, None) if lim is None else (lim.min_prompt_tokens, lim.max_prompt_tokens)

        fits = [r for r in replicas if bucket(r)[0] <= est_tokens and (bucket(r)[1] or est_tokens + 1) > est_tokens]
        if fits:
            return fits
        above = [r for r in replicas if bucket(r)[0] > est_tokens]
        return above or replicas


def estimate_prompt_tokens(text_bytes: int, media_tokens: int) -> int:
    """A routing estimate (not a bound): ~4 bytes per text token, plus the media rows."""
    return text_bytes // 4 + media_tokens
