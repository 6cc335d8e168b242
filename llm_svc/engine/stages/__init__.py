"""The stages of an engine step's postprocess, each a small class that owns one field of a
request's ``Live`` record (``start`` creates it, ``release`` drops it) and has its step hook:

* ``penalties``: ``logit_bias`` and the repetition / frequency / presence penalties;
* ``grammar_mask``: structured outputs' masks and the grammars' advance;
* ``logprobs``: sampled tokens' logprobs and prompt logprobs;
* ``verify``: speculative decoding's verification of a step's drafts;
* ``draft``: drafts for the next step (MTP layers or n-gram prompt lookup).

Sampling itself (``min_tokens``' ban, then the sampler) stays in ``Engine._sample``.
"""

from llm_svc.engine.stages.draft import Draft
from llm_svc.engine.stages.grammar_mask import GrammarMask
from llm_svc.engine.stages.logprobs import Logprobs
from llm_svc.engine.stages.penalties import Penalties
from llm_svc.engine.stages.verify import Verify

__all__ = ["Draft", "GrammarMask", "Logprobs", "Penalties", "Verify"]
