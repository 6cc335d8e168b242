"""The hybrid SWA engine: request state, scheduling, KV bookkeeping, model running."""
