"""mmserve gateway: the OpenAI-compatible front that fetches media, encodes it on the encoder
replicas and generates on the LLM replicas.  Entry point: ``gateway.app.create_app(settings)``."""
