"""Replica discovery, health, and routing policies (encoder ring, LLM router)."""
