"""The speculative-decoding settings of one LLM service, read from a JSON like vLLM's
``--speculative-config`` (``{"method": "ngram", "num_speculative_tokens": 3,
"prompt_lookup_max": 4}``).

vLLM 0.32's rules (``vllm/config/speculative.py``), kept here:
- ``method`` "ngram" (also spelled "[ngram]", or given as ``"model": "ngram"`` without a method)
  or "mtp" (vLLM's per-model aliases such as "mimo_mtp" / "mimo_v2_mtp" / "deepseek_mtp" mean
  "mtp"; vLLM warns that they are deprecated).
- ``num_speculative_tokens`` > 0. Required for n-gram; for MTP, left out means the checkpoint's
  number of MTP layers (vLLM: the draft config's ``n_predict``), filled in once at load by
  ``with_mtp_layers``, which also applies vLLM's rule that a k above the layer count must be a
  multiple of it.
- n-gram bounds, each >= 1: both missing -> 5 and 5; one missing -> the other's value;
  ``prompt_lookup_min`` > ``prompt_lookup_max`` is an error. They are 0 for other methods
  (vLLM sets them to 0); giving them with "mtp" is refused here rather than dropped.

Keys vLLM knows that change nothing here are accepted and ignored (``IGNORED_KEYS``: they tune
how vLLM runs its drafter), others only at the value that means what we do
(``DEFAULT_ONLY_KEYS``); any other key is refused with its name.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from typing import Any

METHODS = ("ngram", "mtp")
_NGRAM_ALIASES = {"ngram": "ngram", "[ngram]": "ngram"}
# vLLM 0.32's MTPModelTypes that name MiMo's or a generic MTP head: all mean "mtp" there too
_MTP_ALIASES = {"mtp": "mtp", "mimo_mtp": "mtp", "mimo_v2_mtp": "mtp", "deepseek_mtp": "mtp"}
_NGRAM_DEFAULT_N = 5  # vLLM: "arbitrarily chosen", used when neither bound is given

# vLLM keys that only tune how vLLM executes its drafter (graphs, padding, parallelism): no effect
# on which tokens come out
IGNORED_KEYS = frozenset({
    "enforce_eager", "disable_padded_drafter_batch", "draft_tensor_parallel_size",
    "disable_eagle_block_drop", "use_local_argmax_reduction",
})
# vLLM keys accepted only at the value that is what mmserve does (anything else is refused)
DEFAULT_ONLY_KEYS: dict[str, Any] = {
    "model": None,  # no separate draft model; "ngram" is handled as vLLM does (the method)
    "quantization": None,
    "max_model_len": None,
    "revision": None,
    "code_revision": None,
    "parallel_drafting": False,
    "rejection_sample_method": "standard",
    "draft_sample_method": "greedy",
}
_FIELDS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
           "num_speculative_tokens_per_batch_size", "draft_policy")
DRAFT_POLICIES = ("auto", "fixed")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Which drafts to propose and how many per step. Invariants (checked on creation):
    ``method`` in ``METHODS``; ``num_speculative_tokens`` >= 1 (None only for "mtp" before
    ``with_mtp_layers``); for "ngram" 1 <= ``prompt_lookup_min`` <= ``prompt_lookup_max``, for
    "mtp" both 0."""

    method: str
    num_speculative_tokens: int | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    # vLLM's dynamic speculation: [(first, last, k), ...], inclusive batch-size ranges -> k
    num_speculative_tokens_per_batch_size: tuple[tuple[int, int, int], ...] | None = None
    # mmserve's: "auto" picks k per request and step for goodput (spec/policy.py), "fixed" always k
    draft_policy: str = "auto"

    def __post_init__(self) -> None:
        if self.draft_policy not in DRAFT_POLICIES:
            raise ValueError(f"speculative config: draft_policy must be one of {list(DRAFT_POLICIES)}, "
                             f"got {self.draft_policy!r}")
        table = self.num_speculative_tokens_per_batch_size
        if table is not None:
            object.__setattr__(self, "num_speculative_tokens_per_batch_size", _batch_table(table))
        method = (_NGRAM_ALIASES.get(self.method) or _MTP_ALIASES.get(self.method)
                  if isinstance(self.method, str) else None)
        if method is None:
            raise ValueError(f"speculative config: method must be one of {list(METHODS)}, got {self.method!r}")
        object.__setattr__(self, "method", method)
        k = self.num_speculative_tokens
        if k is None:
            if method == "ngram":
                raise ValueError("speculative config: num_speculative_tokens is required with method \"ngram\" "
                                 "(the number of draft tokens per step, e.g. 3)")
        elif not _is_int(k) or k < 1:
            raise ValueError(f"speculative config: num_speculative_tokens must be an integer >= 1, got {k!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if method == "mtp":
            if lo or hi:
                raise ValueError("speculative config: prompt_lookup_min / prompt_lookup_max are n-gram settings; "
                                 "remove them with method \"mtp\"")
            object.__setattr__(self, "prompt_lookup_min", 0)
            object.__setattr__(self, "prompt_lookup_max", 0)
            return
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if v is not None and (not _is_int(v) or v < 1):
                raise ValueError(f"speculative config: {name} must be an integer >= 1, got {v!r}")
        if lo is None and hi is None:
            lo = hi = _NGRAM_DEFAULT_N
        elif lo is None:
            lo = hi
        elif hi is None:
            hi = lo
        if lo > hi:
            raise ValueError(f"speculative config: prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    @classmethod
    def parse(cls, value: str | dict | None) -> SpeculativeConfig | None:
        """A JSON object (text or dict) -> the config; None, "" or "null" -> None (speculation
        off). Raises ValueError naming what is wrong."""
        if value is None:
            return None
        if isinstance(value, str):
            if not value.strip() or value.strip() == "null":
                return None
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative config: not valid JSON ({e})") from None
            if value is None:
                return None
        if not isinstance(value, dict):
            raise ValueError(f"speculative config: expected a JSON object, got {type(value).__name__}")
        d = dict(value)
        model, method = d.get("model"), d.get("method")
        if isinstance(model, str) and model in _NGRAM_ALIASES and method in (None, *_NGRAM_ALIASES):
            d["method"] = "ngram"  # vLLM infers the method from model="ngram"
            del d["model"]
        unknown = sorted(k for k in d if k not in _FIELDS and k not in IGNORED_KEYS and k not in DEFAULT_ONLY_KEYS)
        if unknown:
            raise ValueError(f"speculative config: unknown keys {unknown}; known: {sorted(_FIELDS)} "
                             f"(and vLLM's {sorted(IGNORED_KEYS | DEFAULT_ONLY_KEYS.keys())})")
        for key, default in DEFAULT_ONLY_KEYS.items():
            if key in d and d[key] != default:
                raise ValueError(f"speculative config: {key}={d[key]!r} is not supported; "
                                 f"remove it or set it to {json.dumps(default)}")
        if d.get("method") is None:
            raise ValueError(f"speculative config: method is required, one of {list(METHODS)}")
        return cls(**{k: d[k] for k in _FIELDS if k in d})

    @classmethod
    def resolve(cls, value: str | dict | None, mtp_layers: int) -> SpeculativeConfig | None:
        """The service's setting: ``"auto"`` (the default) is MTP with the automatic draft length
        where the checkpoint has MTP layers (``mtp_layers``), else off; ``"off"`` is off; anything
        else as ``parse``."""
        if isinstance(value, str) and value.strip().lower() in ("auto", "off"):
            if value.strip().lower() == "off" or mtp_layers < 1:
                return None
            return cls("mtp").with_mtp_layers(mtp_layers)
        return cls.parse(value)

    def with_mtp_layers(self, num_layers: int) -> SpeculativeConfig:
        """For "mtp": the config with ``num_speculative_tokens`` filled in from the checkpoint's
        MTP layer count when it was left out; raises (vLLM's rule) when a k above the layer count
        is not a multiple of it. Any other method: unchanged."""
        if self.method != "mtp":
            return self
        if num_layers < 1:
            raise ValueError("speculative config: method \"mtp\" needs a checkpoint with MTP layers "
                             "(num_nextn_predict_layers >= 1)")
        k = self.num_speculative_tokens
        if k is None:
            return replace(self, num_speculative_tokens=num_layers)
        if k > num_layers and k % num_layers:
            raise ValueError(f"speculative config: num_speculative_tokens={k} must be at most {num_layers} "
                             f"(the checkpoint's MTP layers) or a multiple of it")
        return self

    def to_dict(self) -> dict[str, Any]:
        """The resolved settings (defaults filled in), for /readyz."""
        return asdict(self)


def _batch_table(table) -> tuple[tuple[int, int, int], ...]:
    """vLLM's rules for ``num_speculative_tokens_per_batch_size``: a non-empty list of
    ``[first, last, k]`` integers, 1 <= first <= last, k >= 0, ranges not overlapping."""
    if not isinstance(table, (list, tuple)) or not table:
        raise ValueError("speculative config: num_speculative_tokens_per_batch_size must be a non-empty list of "
                         "[first_batch_size, last_batch_size, num_speculative_tokens] entries")
    out = []
    for e in table:
        if not isinstance(e, (list, tuple)) or len(e) != 3 or not all(_is_int(x) for x in e) \
                or not 1 <= e[0] <= e[1] or e[2] < 0:
            raise ValueError(f"speculative config: num_speculative_tokens_per_batch_size entry {e!r} must be "
                             "[first, last, k] with 1 <= first <= last and k >= 0")
        out.append(tuple(e))
    out.sort()
    for (_, hi, _), (lo, _, _) in zip(out, out[1:]):
        if lo <= hi:
            raise ValueError("speculative config: num_speculative_tokens_per_batch_size ranges overlap")
    return tuple(out)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
