"""LLM service: generate from a chat whose media arrive as embeddings."""
