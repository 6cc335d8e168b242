"""The path a generation request walks, in one direction: checked, its media loaded, the LLM's
request built from the OpenAI one (``prompt``), sent as one generation per choice (``choices``),
answered as JSON or as SSE (``answer``, ``stream``). ``chat`` strings the chat stages together
(chat completions and Responses); ``completions`` does the same for text completions."""
