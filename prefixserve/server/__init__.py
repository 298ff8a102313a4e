"""The OpenAI-compatible HTTP server (``prefixserve serve``): FastAPI routes in ``app``, request
and response models in ``protocol``, the endpoints' logic in ``serving``, Prometheus metrics in
``metrics``, the command's startup and shutdown in ``launch``."""
