"""The engine core in its own process: ``process`` (the core's loop), ``front`` (the HTTP
process's client and supervisor), ``convert`` (requests <-> protocol messages), ``build``
(model + pools + scheduler + runner -> ``Engine``)."""
