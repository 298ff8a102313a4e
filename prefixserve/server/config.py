"""What the HTTP layer needs besides the engine: names, keys, limits and metric names.

Every limit here has a ``prefixserve serve`` flag of the same name (``max_n`` is ``--max-n``...)
and a default sized for one machine. The defaults are secure for a shared server: with API keys,
each key gets its own prefix-cache namespace (``share_cache_across_keys`` turns that off), and
``/reset_prefix_cache`` needs an admin key.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixserve.model.arch.vision_config import DEFAULT_MAX_IMAGE_PIXELS

#: Prompts one ``/v1/completions`` request may batch.
DEFAULT_MAX_PROMPTS_PER_REQUEST = 256
#: Sequences one prompt may ask for (``n``): OpenAI's limit, the most the API accepts.
MAX_N = DEFAULT_MAX_N = 128
#: Sequences one request may ask for in all (prompts times ``n``).
DEFAULT_MAX_SEQUENCES_PER_REQUEST = 256
#: Largest request body, in bytes.
DEFAULT_MAX_REQUEST_BODY_SIZE = 32 << 20
#: Levels of objects and arrays a JSON schema (output constraint or tool parameters) may nest:
#: the schema checks recurse, and about 100 levels exhaust Python's stack.
DEFAULT_MAX_JSON_SCHEMA_DEPTH = 64
#: Seconds a client has to send a request's headers and body.
DEFAULT_REQUEST_READ_TIMEOUT = 30.0
DEFAULT_MAX_RETENTION_DURATION = 3600.0
#: Sequences that may wait for a slot before new requests get 503.
DEFAULT_MAX_WAITING_REQUESTS = 1024
#: ``/v1/responses`` kept for ``previous_response_id``.
DEFAULT_MAX_STORED_RESPONSES = 1024
#: Metric name prefixes ``--metrics-prefix`` accepts (``vllm`` for vLLM's dashboards).
METRICS_PREFIXES = ("prefixserve", "vllm")


@dataclass(frozen=True)
class ServerConfig:
    """The server's settings.

    ``served_model_names``: the names requests may give as ``model`` (the first is reported
    when a request gives none). ``api_keys``: accepted bearer tokens (empty: no
    authentication). With keys, each key's requests get their own cache salt unless
    ``share_cache_across_keys``. ``admin_keys`` may call admin routes (with API keys and no
    admin key, nobody may); ``metrics_keys`` (or an admin key) are needed for ``/metrics`` when
    given, else it is open. ``allowed_origins``: origins allowed by CORS (empty: CORS off,
    ``*``: any). ``max_stored_responses``: ``/v1/responses`` kept for
    ``previous_response_id``."""

    served_model_names: tuple[str, ...]
    api_keys: tuple[str, ...] = ()
    share_cache_across_keys: bool = False
    admin_keys: tuple[str, ...] = ()
    metrics_keys: tuple[str, ...] = ()
    metrics_prefix: str = "prefixserve"
    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST
    max_n: int = DEFAULT_MAX_N
    max_sequences_per_request: int = DEFAULT_MAX_SEQUENCES_PER_REQUEST
    max_request_body_size: int = DEFAULT_MAX_REQUEST_BODY_SIZE
    max_json_schema_depth: int = DEFAULT_MAX_JSON_SCHEMA_DEPTH
    request_read_timeout: float = DEFAULT_REQUEST_READ_TIMEOUT
    allowed_origins: tuple[str, ...] = ()
    max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES
    max_retention_duration: float = DEFAULT_MAX_RETENTION_DURATION
    console: bool = True
    kv_events_zmq: str | None = None
    """A ZMQ endpoint the server publishes its KV events on (``kv_event_zmq``); None: off."""
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    """The most pixels an image in a request may have (``server/media.py``)."""
    allowed_media_domains: tuple[str, ...] = ()
    """Hosts whose ``http(s)`` image URLs the server fetches (none: only ``data:`` URLs)."""

    def __post_init__(self) -> None:
        if not self.served_model_names:
            raise ValueError("at least one served model name is needed")
        for name in ("max_prompts_per_request", "max_n", "max_sequences_per_request",
                     "max_request_body_size", "max_json_schema_depth", "max_image_pixels"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_n > MAX_N:
            raise ValueError(f"max_n may be at most {MAX_N} (OpenAI's limit), got {self.max_n}")
        if self.request_read_timeout <= 0:
            raise ValueError("request_read_timeout must be positive")
        if self.max_stored_responses < 0:
            raise ValueError("max_stored_responses must be >= 0")
        if not self.max_retention_duration > 0:
            raise ValueError("max_retention_duration must be positive")
        if self.metrics_prefix not in METRICS_PREFIXES:
            raise ValueError(f"metrics_prefix must be one of {METRICS_PREFIXES}")

    @property
    def salt_by_api_key(self) -> bool:
        """Whether each caller's key is mixed into its cache salt."""
        return bool(self.api_keys) and not self.share_cache_across_keys

    @property
    def admin_protected(self) -> bool:
        """Whether admin routes need an admin key (they do once any key is configured)."""
        return bool(self.api_keys or self.admin_keys or self.metrics_keys)
