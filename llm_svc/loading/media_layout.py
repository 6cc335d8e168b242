"""Placeholder layouts beyond ``start + pad * n + end``: MiMo-V2.5's timestamped video.

vLLM 0.32 ``MiMoVLProcessor.process`` (``transformers_utils/processors/mimo_v2_omni.py``) replaces
the template's ``<|vision_start|><|video_pad|><|vision_end|>`` by

    <|mimo_video_start|> [ts_0 <|vision_start|> pad * n_0 <|vision_end|>] ... <|mimo_video_end|>

with ``ts_g`` the tokens of ``MM:SS`` (``_format_timestamp``) of temporal group g's first frame.
The LM itself uses plain 1-D positions (its ``MiMoV2OmniForCausalLM`` runs the MiMo-V2 LM with
the token positions; the processor's ``position_ids`` are ``arange``), so nothing else changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.schemas import MediaSegment


def format_timestamp(seconds: float) -> str:
    return f"{int(seconds // 60):02d}:{int(seconds % 60):02d}"


@dataclass(frozen=True)
class TimestampLayout:
    """Token ids of a ``layout == "timestamps"`` placeholder."""

    pad: int
    start: int
    end: int
    outer_start: int
    outer_end: int
    _ts_cache: dict = field(default_factory=dict, compare=False, repr=False)

    def render(self, tokenizer, segments: list[MediaSegment]) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids that replace ``start pad end``, and ``(offset, length)`` of each pad run in them."""
        ids = [self.outer_start]
        runs: list[tuple[int, int]] = []
        for g in segments:
            text = format_timestamp(g.start_s)
            ts = self._ts_cache.get(text)
            if ts is None:
                ts = self._ts_cache[text] = list(tokenizer.encode(text, add_special_tokens=False))
            ids += ts
            ids.append(self.start)
            runs.append((len(ids), g.num_tokens))
            ids += [self.pad] * g.num_tokens
            ids.append(self.end)
        ids.append(self.outer_end)
        return ids, runs
