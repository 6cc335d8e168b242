"""Stand-ins for tests and benchmarks, never imported by a service: ``fake_services`` (fake
encoder and LLM apps, uvicorn in a thread), ``sched_sim`` (a model stand-in that drives the
scheduler without tensors), ``in_process`` (an engine and its outputs in one process, stepped
by the caller)."""
