"""Prefill / decode disaggregation (docs/disagg.md): a prefill replica runs a prompt to its first
token and hands the request over (``messages.Handover``: the full layers' KV of every prompt
token, the sliding layers' KV of the last ``W`` only); a decode replica verifies it and continues
the request from it, or recomputes the prompt when anything does not check out.

* ``messages``: the hand-over and its pages (typed, beside their users);
* ``prefill``: the prefill side of an engine (export after the first token);
* ``decode``: the decode side (verify, adopt the KV, or fall back to recomputing);
* ``transport``: how a hand-over travels (an interface, and a plain TCP stream behind it).
"""
