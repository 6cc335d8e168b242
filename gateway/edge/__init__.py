"""The gateway's edge: what a request meets before any route runs. ``door``: the API key, checked
before the body is read (ASGI middleware); ``auth``: the key comparison and the routes'
dependencies; ``limits``: body-size caps and the admission slot (overload), taken before the
body is read."""
