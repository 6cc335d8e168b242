"""Speculative decoding's pure building blocks: the settings (``SpeculativeConfig``), n-gram
drafts (``NgramProposer``), verification of drafts against the target's logits (``verify``,
``verify_batch``) and the counters (``SpecStats``). The engine's use of them is
``llm_svc.engine.speculate``."""

from llm_svc.engine.spec.config import SpeculativeConfig
from llm_svc.engine.spec.ngram import NgramProposer
from llm_svc.engine.spec.rejection import verify, verify_batch
from llm_svc.engine.spec.stats import SpecStats

__all__ = ["NgramProposer", "SpecStats", "SpeculativeConfig", "verify", "verify_batch"]
