"""Hashed embedding cache: tiers (process LRU, host shared memory, Redis) behind one interface."""
