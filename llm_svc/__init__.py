"""LLM service: generate from a chat whose media arrive as embeddings.

Layout (one job per module):

* ``app.py`` / ``routes.py`` / ``state.py`` / ``metrics.py`` - the HTTP service
  (``create_app(LLMSettings)``: ``POST /v1/generate``, ``/healthz``, ``/readyz``, ``/metrics``).
* ``loader.py`` (HF model + tokenizer from a bundle), ``prompt.py`` (chat template, placeholder
  expansion, validation -> ``PreparedRequest``), ``textproc.py`` (streaming detokenization, stop
  strings), ``errors.py``.
* ``backends/`` - one async interface (``submit`` / iterate / ``abort``) with a registry:
  ``hf`` (transformers ``generate``, one request at a time: the reference) and ``swa`` (ours).
* ``types.py`` - the core types: ``PreparedRequest``, the scheduler's ``Request``, and
  ``ForwardBatch``, where the scheduler and the runner meet.
* ``engine/`` - the swa engine: ``scheduler.py`` (bookkeeping) and ``model_runner.py``
  (tensors) meet at ``ForwardBatch``; ``engine.py`` is the step loop; ``sampler.py`` samples.
* ``core/`` - the engine in its own process (``process.py``) and the front's client of it.
* ``kv/`` - slot pools, pool sizing, the SWA-aware radix prefix cache (no tensors).
* ``models/`` - our forward passes (MiMo-V2-Flash, Gemma 3) over the HF weights.
* ``attention/`` - attention backends (pool KV through index tensors) with a registry.
"""
