"""OpenAI's API as the gateway serves it: the request bodies it accepts (``requests``: chat and
text completions; ``responses_api``: ``/v1/responses``) and the bodies it answers (``answers``).
What the gateway forwards to the services is in ``shared.schemas``."""
