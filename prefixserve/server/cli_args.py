"""The ``prefixserve serve`` command line: its parser, one function per argument group. Building
it imports only the constants of ``prefixserve.core`` and ``prefixserve.server.config``; the
server itself (``launch``) is imported when the command runs."""

from __future__ import annotations

import argparse

from prefixserve.server.lora_args import add_lora_arguments

DESCRIPTION = """\
Serves MODEL (a .gguf file or an HF directory; default: SmolLM2-135M-Instruct) over an
OpenAI-compatible HTTP API: POST /v1/completions, POST /v1/chat/completions (streamed or not),
GET /v1/models, plus GET /health, GET /version, GET /metrics (Prometheus) and
POST /reset_prefix_cache (an admin action). Prefix caching is on unless
--no-enable-prefix-caching; each response reports the prompt tokens served from the cache in
usage.prompt_tokens_details.cached_tokens. With --api-key, each key gets its own prefix-cache
namespace unless --share-cache-across-keys. The API is described at /openapi.json (and /docs).
SIGINT or SIGTERM stops it gracefully (exit status 0)."""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``prefixserve serve`` on ``subparsers``."""
    parser = subparsers.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("model", nargs="?", metavar="MODEL",
                        help="a .gguf file or an HF model directory (default: the default "
                        "model, SmolLM2-135M-Instruct)")
    _add_http(parser.add_argument_group("HTTP"))
    _add_security(parser.add_argument_group("keys and tenants"))
    _add_limits(parser.add_argument_group("limits"))
    _add_images(parser.add_argument_group("images (a model that takes them: LLaVA)"))
    _add_engine(parser.add_argument_group("engine"))
    add_lora_arguments(parser.add_argument_group("LoRA adapters"))
    _add_speculation(parser.add_argument_group("speculative decoding (n-gram prompt lookup)"))
    _add_tiers(parser.add_argument_group("KV cache tiers (below the pool: disk, Redis)"))
    _add_logging(parser.add_argument_group("logging and metrics"))
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Run the server (imports the engine and the HTTP stack)."""
    from prefixserve.server.launch import run_server

    return run_server(args)


def _add_http(http: argparse._ArgumentGroup) -> None:
    http.add_argument("--host", default="127.0.0.1", help="address to listen on (default "
                      "127.0.0.1; 0.0.0.0 for every interface)")
    http.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    http.add_argument("--served-model-name", nargs="+", metavar="NAME",
                      help="names requests may give as 'model' (default: MODEL's file or "
                      "folder name, or SmolLM2-135M-Instruct for the default model); the first "
                      "is the reported one")
    http.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                      help="on SIGTERM, how long running requests may take to finish before "
                      "they are ended with an error (default 30)")
    http.add_argument("--allowed-origins", nargs="+", metavar="ORIGIN", default=[],
                      help="origins whose browser pages may call the API (CORS), e.g. "
                      "https://app.example.com, or * for any; default: none (CORS off)")
    http.add_argument("--no-ui", action="store_true",
                      help="do not serve the console page at / (its /v1/cache/* routes stay)")
    http.add_argument("--max-stored-responses", type=int, default=1024, metavar="N",
                      help="/v1/responses kept in memory for previous_response_id, oldest "
                      "dropped first (default 1024; 0 keeps none)")


def _add_security(keys: argparse._ArgumentGroup) -> None:
    keys.add_argument("--api-key", action="append", metavar="KEY",
                      help="require 'Authorization: Bearer KEY' on /v1/*; repeat for several "
                      "keys, or give @FILE to read keys from FILE, one a line")
    keys.add_argument("--share-cache-across-keys", action="store_true",
                      help="let requests of different API keys share prefix-cache blocks "
                      "(default: each key has its own cache namespace, so one tenant cannot "
                      "time another's prompts)")
    keys.add_argument("--salt-by-api-key", action="store_true",
                      help=argparse.SUPPRESS)  # the default now; accepted (still needs --api-key)
    keys.add_argument("--admin-key", action="append", metavar="KEY",
                      help="key (repeatable, or @FILE) for admin actions such as "
                      "POST /reset_prefix_cache; with --api-key and no admin key, nobody may "
                      "reset the cache")
    keys.add_argument("--metrics-key", action="append", metavar="KEY",
                      help="require this key (or an admin key) on GET /metrics (repeatable, or "
                      "@FILE; default: /metrics is open)")


def _add_limits(limits: argparse._ArgumentGroup) -> None:
    from prefixserve.server import config

    limits.add_argument("--max-prompts-per-request", type=int, metavar="N",
                        default=config.DEFAULT_MAX_PROMPTS_PER_REQUEST,
                        help="prompts one /v1/completions request may batch (default "
                        f"{config.DEFAULT_MAX_PROMPTS_PER_REQUEST})")
    limits.add_argument("--max-n", type=int, metavar="N", default=config.DEFAULT_MAX_N,
                        help=f"largest n (sequences per prompt; default {config.DEFAULT_MAX_N})")
    limits.add_argument("--max-sequences-per-request", type=int, metavar="N",
                        default=config.DEFAULT_MAX_SEQUENCES_PER_REQUEST,
                        help="sequences one request may ask for in all, prompts times n "
                        f"(default {config.DEFAULT_MAX_SEQUENCES_PER_REQUEST})")
    limits.add_argument("--max-waiting-requests", type=int, metavar="N",
                        default=config.DEFAULT_MAX_WAITING_REQUESTS,
                        help="sequences that may wait to be scheduled; beyond, requests get 503 "
                        "with Retry-After (all prompts and n of a request are admitted or "
                        "refused together), and one larger than this alone gets 400 (default "
                        f"{config.DEFAULT_MAX_WAITING_REQUESTS})")
    limits.add_argument("--max-request-body-size", metavar="SIZE", default="32MiB",
                        help="largest request body, e.g. 1MiB (default 32MiB); larger bodies "
                        "get 413")
    limits.add_argument("--max-json-schema-depth", type=int, metavar="LEVELS",
                        default=config.DEFAULT_MAX_JSON_SCHEMA_DEPTH,
                        help="levels of objects and arrays a JSON schema (response_format, "
                        "structured_outputs, tool parameters) may nest; deeper ones get 400 "
                        f"(default {config.DEFAULT_MAX_JSON_SCHEMA_DEPTH})")
    limits.add_argument("--request-read-timeout", type=float, metavar="SECONDS",
                        default=config.DEFAULT_REQUEST_READ_TIMEOUT,
                        help="seconds a client has to send a request's headers and body before "
                        "the connection is closed (default "
                        f"{config.DEFAULT_REQUEST_READ_TIMEOUT:g})")
    limits.add_argument("--max-retention-duration", type=float, metavar="SECONDS",
                        default=config.DEFAULT_MAX_RETENTION_DURATION,
                        help="longest retention a request may ask for (`retention`, Anthropic "
                        "`cache_control` ttl); longer gets 400 (default "
                        f"{config.DEFAULT_MAX_RETENTION_DURATION:g})")
    limits.add_argument("--request-log-size", type=int, metavar="N", default=10_000,
                        help="recent requests the console's what-if replays (block hash ids "
                        "and lengths only, no text; default 10000; 0 keeps none)")
    limits.add_argument("--max-pinned-fraction", type=float, metavar="F",
                        help="share of the KV pool that admin pins may hold (default 0.5, less "
                        "room for one request of the whole context); a pin beyond gets 400")


def _add_images(images: argparse._ArgumentGroup) -> None:
    from prefixserve.model.arch import vision_config

    images.add_argument("--limit-mm-per-prompt", type=int, metavar="N",
                        help="images one prompt may hold; more get 400 (default "
                        f"{vision_config.DEFAULT_LIMIT_IMAGES_PER_PROMPT})")
    images.add_argument("--max-image-pixels", type=int, metavar="N",
                        help="pixels (width x height) one image may have, checked before it "
                        "is decoded; more get 400 (default "
                        f"{vision_config.DEFAULT_MAX_IMAGE_PIXELS})")
    images.add_argument("--allowed-media-domains", nargs="+", metavar="HOST", default=[],
                        help="hosts whose http(s) image URLs the server fetches (default: "
                        "none; images come as data: URLs or base64, other URLs get 400)")
    images.add_argument("--encoder-cache-size", type=int, metavar="ROWS",
                        help="image embedding rows the encoder cache keeps, so that a recent "
                        "image skips the vision encoder (default 8192)")


def _add_engine(group: argparse._ArgumentGroup) -> None:
    from prefixserve.core import ALLOWED_BLOCK_SIZES, HASH_ALGOS

    group.add_argument("--device", help="auto (default: the GPU where torch sees CUDA, else "
                       "the CPU), cpu, cuda or cuda:N")
    group.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"),
                       help="activations, dense weights and KV cache dtype (default auto: "
                       "bfloat16 where the CPU has native bfloat16 (AVX512-BF16, AMX), else "
                       "float32; float32 gives results that do not depend on batch shapes)")
    group.add_argument("--kv-cache-dtype", choices=("auto", "float32", "bfloat16", "float16"),
                       help="KV cache dtype (default auto: --dtype's); float16 or bfloat16 "
                       "beside float32 activations halve the cache's memory and what each "
                       "decode step reads")
    group.add_argument("--weights", choices=("auto", "bf16", "int8", "int4"),
                       help="how matmul weights are held (default auto: a GGUF file's quantized "
                       "tensors stay packed in memory; int8/int4: pack every matmul weight "
                       "as Q8_0/Q4_1, quantizing at load; bf16: dense, dequantized to --dtype)")
    group.add_argument("--weight-layout", choices=("stream", "file"),
                       help="how packed Q4_0 weights lie in memory (default stream: moved at "
                       "load into the layout one-sequence decode reads at the memory's speed, "
                       "a copy; file: the file's layout, views of the mapped file where it "
                       "allows, pages shared between processes)")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=None, help="automatic prefix caching (default: on)")
    group.add_argument("--prefix-caching-hash-algo", choices=HASH_ALGOS,
                       help="hash of the prefix-cache block keys (default builtin; sha256 "
                       "when a KV tier is configured, which needs a process-stable hash)")
    group.add_argument("--block-size", type=int, choices=ALLOWED_BLOCK_SIZES,
                       help="tokens per KV cache block (default 16)")
    _add_kv_cache_size(group.add_mutually_exclusive_group())
    group.add_argument("--max-num-seqs", type=int, metavar="N",
                       help="sequences running at once (default 32)")
    group.add_argument("--max-num-batched-tokens", type=int, metavar="N",
                       help="tokens computed per step (default 2048)")
    group.add_argument("--max-model-len", type=int, metavar="N",
                       help="context length, prompt plus output (default: the model's, capped "
                       "by the KV cache)")
    group.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                       default=None, help="compute long prompts in chunks (default: on; off, "
                       "a prompt longer than --max-num-batched-tokens is refused)")
    group.add_argument("--long-prefill-token-threshold", type=int, metavar="N",
                       help="while requests wait, a running prefill computes at most N tokens "
                       "per step and leaves N of the step's budget to them, so a short request "
                       "starts beside a long prompt's prefill (default: a quarter of "
                       "--max-num-batched-tokens; 0: off)")
    group.add_argument("--shared-prefix-wait-tokens", type=int, metavar="N",
                       help="a waiting request whose next N uncached prompt tokens a running "
                       "prefill is computing waits a step or so and hits them, instead of "
                       "computing the same prefix beside it (default 32; 0: off)")
    group.add_argument("--num-threads", type=int, metavar="N",
                       help="CPU threads for the model (default: torch's)")
    group.add_argument("--deterministic", action="store_true", default=None,
                       help="batch-invariant kernels: a request's output depends only on its "
                       "own tokens, sampling parameters and seed, never on the batch, the "
                       "chunking or the prefix cache (slower; float32 or bfloat16)")
    group.add_argument("--enforce-eager", action="store_true", default=None,
                       help="run decode steps layer by layer through torch instead of the "
                       "fused C decode kernel (slower; for comparisons and debugging)")


def _add_speculation(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--num-speculative-tokens", type=int, metavar="K",
                       help="draft up to K tokens per step by looking up "
                       "the sequence's last tokens earlier in it, and keep those the model "
                       "agrees with (default 0: off)")
    group.add_argument("--prompt-lookup-min", type=int, metavar="N",
                       help="shortest n-gram the lookup matches (default 2)")
    group.add_argument("--prompt-lookup-max", type=int, metavar="N",
                       help="longest n-gram the lookup matches, tried first (default 4)")


def _add_kv_cache_size(size: argparse._MutuallyExclusiveGroup) -> None:
    size.add_argument("--kv-cache-memory", metavar="SIZE",
                      help="memory for the KV cache, e.g. 512MiB or 2GiB (default 1GiB)")
    size.add_argument("--num-blocks", type=int, metavar="N",
                      help="KV cache size in blocks (instead of --kv-cache-memory)")


def _add_tiers(tiers: argparse._ArgumentGroup) -> None:
    tiers.add_argument("--kv-disk-dir", metavar="DIR",
                       help="keep KV blocks in files under DIR, found again after a restart of "
                       "the same model and settings (default: no disk tier)")
    tiers.add_argument("--kv-disk-size", metavar="SIZE",
                       help="size budget of the disk tier, least recently used blocks deleted "
                       "past it (default 20GiB)")
    tiers.add_argument("--kv-redis-url", metavar="URL",
                       help="share KV blocks through the Redis at URL (redis://host:port/db) "
                       "with every server of the same model (default: no Redis tier)")
    tiers.add_argument("--kv-redis-ttl", type=float, metavar="SECONDS",
                       help="seconds a block stays in Redis after its write (default 86400)")
    tiers.add_argument("--kv-redis-max-memory", metavar="SIZE",
                       help="set Redis' maxmemory to SIZE with LRU eviction (default: leave "
                       "Redis' own settings)")
    tiers.add_argument("--kv-tier-write-policy", choices=("through", "back"),
                       help="write a block to the tiers once it is full (through) or when the "
                       "pool evicts it and at shutdown (back) (default through)")
    tiers.add_argument("--kv-tier-min-prefix-tokens", type=int, metavar="N",
                       help="write only the blocks of prompts of at least N tokens (default 256)")
    tiers.add_argument("--kv-tier-timeout", type=float, metavar="SECONDS",
                       help="timeout of one call to a remote tier (default 1)")
    tiers.add_argument("--kv-tier-retry-after", type=float, metavar="SECONDS",
                       help="how long a failed tier is left alone before it is tried again "
                       "(default 10)")
    tiers.add_argument("--kv-tier-write-queue", metavar="SIZE",
                       help="KV bytes waiting to be written to the tiers at most; past it, "
                       "blocks are dropped rather than waited for (default 512MiB)")


def _add_logging(logs: argparse._ArgumentGroup) -> None:
    logs.add_argument("--log-stats-interval", type=float, default=10.0, metavar="SECONDS",
                      help="seconds between engine stats log lines (throughput, queue, KV "
                      "cache usage, rolling prefix cache hit rate); 0 turns them off "
                      "(default 10)")
    logs.add_argument("--log-level", default="info",
                      choices=("critical", "error", "warning", "info", "debug"),
                      help="log level (default info)")
    logs.add_argument("--disable-access-log", action="store_true",
                      help="do not log every HTTP request")
    logs.add_argument("--metrics-prefix", choices=("prefixserve", "vllm"), default="prefixserve",
                      help="prefix of the /metrics names: prefixserve:... (default) or vllm:... "
                      "so that vLLM's Grafana dashboards and autoscaling rules work unchanged")
    logs.add_argument("--kv-events-zmq", metavar="ENDPOINT",
                      help="publish the prefix cache's KV events on a ZMQ PUB socket bound to "
                      "ENDPOINT, e.g. tcp://*:5557 (needs pyzmq; see docs/KV_EVENTS.md)")
