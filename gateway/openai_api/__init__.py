"""OpenAI's API as the gateway serves it: the request bodies it accepts (``requests``: chat and
text completions; ``responses_api``: ``/v1/responses``), the checks pydantic cannot express
(``validate``) and the named per-request limits (``request_limits``), the bodies it answers
(``answers``) and how they are made from the LLM's replies (``answer_format``: chat and text
completions, JSON and SSE; ``responses_format``: a Responses request as a chat request, and its
answer). What the gateway forwards to the services is in ``shared.schemas``."""
