"""mmserve encoder service: media bytes -> LM-space embeddings over ``POST /v1/encode``."""
