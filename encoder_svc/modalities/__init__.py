"""One module per modality: raw bytes -> embeddings [num_tokens, hidden], via the batcher.

Each exposes ``async def encode(ctx: EncodeContext, data: bytes, params: EncodeParams)`` and
``def cache_signature(ctx, params) -> str`` (the preprocessing parameters in the cache key).
"""
