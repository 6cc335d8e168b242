"""mmserve's developer tooling, above the services: the ``mmserve`` console script (``cli``), the
local stack (``launcher``, ``supervisor``, ``compose_local``) and the tiny random-weight
checkpoint writers (``tiny_model``, ``tiny``)."""
