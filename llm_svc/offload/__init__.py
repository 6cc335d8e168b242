"""KV below the device: the host tier's tensors (``host_kv``), the shared Redis tier (``l3``)
and the engine-side coordinator (``tiers``). Bookkeeping (which slot holds what) stays in
``llm_svc.kv``; this package moves bytes."""
