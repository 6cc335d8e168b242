"""LLM service: generate from a chat whose media arrive as embeddings.

Layout, top to bottom (imports point down):

* ``front/`` - the HTTP service (``create_app(LLMSettings)``: ``POST /v1/generate``, ``/tokenize``,
  probes, ``/metrics``), its state, and the request shaping done before the engine core: the
  chat template and media spans (``prompt.py``), tool choice, output shape, KV events publisher.
* ``backends/`` - one async interface (``submit`` / iterate / ``abort``) with a registry:
  ``hf`` (transformers ``generate``, one request at a time: the reference) and ``swa`` (ours).
* ``core/`` - the engine in its own process (``process.py``), the front's client of it, the
  output conversion, and the media fetch by key.
* ``engine/`` - the swa engine: ``scheduler.py`` (bookkeeping) and ``model_runner.py``
  (tensors) meet at ``ForwardBatch``; ``engine.py`` is the step loop; ``sampler.py`` samples;
  ``textproc.py`` detokenizes and stops.
* ``parsers/`` - reasoning and tool-call parsers of the model's output.
* ``loading/`` - model and tokenizer from a bundle, context length, media layout, prompt bounds.
* ``models/`` - our forward passes (MiMo-V2-Flash, Gemma 3, gpt-oss) over the HF weights.
* ``attention/`` - attention backends (pool KV through index tensors) with a registry.
* ``kv/`` - slot pools, pool sizing, the SWA-aware radix prefix cache (no tensors);
  ``offload/`` - the host and Redis tiers.
* ``kernels/`` - the C kernels' build and load; ``types/`` - the core types (``PreparedRequest``,
  the scheduler's ``Request``, ``ForwardBatch``), the front <-> core messages, errors.
"""
