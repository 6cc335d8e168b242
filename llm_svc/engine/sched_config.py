"""The scheduler's knobs, checked when built (an unknown policy or a zero budget fails here)."""

from __future__ import annotations

from dataclasses import dataclass

from llm_svc.engine.sched_policy import make_policy


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_tokens: int = 512  # token budget per step (decodes + prefill chunks)
    max_running: int = 64
    window: int = 128
    decode_release_interval: int = 16  # N: release out-of-window SWA every N decode tokens
    enable_prefix_cache: bool = True
    policy: str = "fcfs"
    # False keeps SWA KV for every token (a conventional cache; the benchmarks' baseline)
    release_swa: bool = True
    max_chunk_tokens: int = 0  # largest prefill chunk of one request; 0 = max_batch_tokens
    # > 0: a step that already holds this many prefill tokens admits no more waiting prompts
    # (they start next step): prompts that arrive together finish their prefills one after
    # another instead of all at the end of one long step; 0 = fill max_batch_tokens
    prefill_step_tokens: int = 0
    # > 0: note pages of this many tokens (and SWA windows at their boundaries) for a shared
    # lower KV tier (``KVManager.note_l3``)
    l3_page_tokens: int = 0
    # speculative decoding: draft tokens one step verifies, shared by its decodes (each gets at
    # least one): a draft row is cheap beside a few decodes, not beside many (spec_decode on the
    # trained tiny MiMo, 16 in flight: k = 4 0.56-0.77x the plain decode, k = 2 1.16-1.35x)
    max_draft_tokens: int = 32

    def __post_init__(self) -> None:
        for name in ("max_batch_tokens", "max_running", "window", "decode_release_interval", "max_draft_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"SchedulerConfig.{name} must be >= 1")
        if self.l3_page_tokens < 0 or self.prefill_step_tokens < 0:
            raise ValueError("SchedulerConfig.l3_page_tokens and prefill_step_tokens must be >= 0")
        if not 0 <= self.max_chunk_tokens <= self.max_batch_tokens:
            raise ValueError("SchedulerConfig.max_chunk_tokens must be in [0, max_batch_tokens]")
        make_policy(self.policy)  # raises on an unknown name

    @property
    def chunk_tokens(self) -> int:
        return self.max_chunk_tokens or self.max_batch_tokens

    def min_swa_slots(self) -> int:
        """Smallest SWA pool that always lets one request progress (four windows: its own, a
        pinned cached one, a kept branch point and a kept checkpoint (a ``swa_checkpoints``
        entry or the prompt's end; one more for the prompt's last page boundary with a lower
        tier); plus a chunk or the decode release interval)."""
        windows = 5 if self.l3_page_tokens else 4
        return windows * self.window + max(self.chunk_tokens, self.decode_release_interval) + 1
