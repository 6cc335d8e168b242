"""The engine core in its own process: ``process`` (the core's loop), ``client`` (the HTTP
process's client and supervisor), ``output`` (the core's token ids -> text deltas, in the HTTP
process), ``convert`` (requests <-> protocol messages), ``build`` (model + pools + scheduler +
runner -> ``Engine``), ``messages`` (the protocol between the two processes). An engine and its
outputs in one process, for tests and benchmarks: ``mmserve.testing.in_process``."""
