"""The LLM service's HTTP front: the app, its routes, its state and metrics, and the request shaping done before the engine core."""
