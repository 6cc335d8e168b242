"""KV bookkeeping for hybrid SWA models: slot pools, budget sizing, the SWA-aware radix cache.

Pure Python: slots are ints; the model runner owns the tensors they index.
"""

from llm_svc.kv.budget import KVGeometry, size_pools
from llm_svc.kv.manager import KVManager, SeqKV
from llm_svc.kv.pool import SlotPool
from llm_svc.kv.radix import LockHandle, MatchResult, RadixCache

__all__ = [
    "KVGeometry",
    "KVManager",
    "LockHandle",
    "MatchResult",
    "RadixCache",
    "SeqKV",
    "SlotPool",
    "size_pools",
]
