"""The ``prefixserve`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence


def _add_demo(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="show the prefix cache at work",
        description="Runs requests that share a prefix through the prefix cache and shows, per "
        "request, how many prompt tokens came from the cache.",
    )
    parser.set_defaults(func=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from prefixserve.tools.demo import run_demo

    run_demo()
    return 0


def _add_estimate(subparsers: argparse._SubParsersAction) -> None:
    description = """\
Replays a prompt log or a block-hash trace, in file order, through the engine's own prefix-cache
code (prefixserve.core) for each KV cache size asked for and for an infinite cache (the upper
bound), and reports the hit rate by blocks and by tokens, the prefill tokens saved, the 1/(1-h)
bound on prefill speed-up and the share of requests with any hit. No model is run.

Inputs (detected from the first record, or --format), plain, .gz or .xz, one JSON object a line:
  tokens          {"token_ids": [...], "output_token_ids"?, "cache_salt"?, "lora_id"?}
  text / chat     {"prompt": "..."} or {"messages": [...]} with optional "response", tokenised
                  with --tokenizer's tokenizer and chat template
  mooncake        {"hash_ids": [...], "input_length": n}: chained ids of 512-token blocks
                  (or the record's "block_size")
  bailian         {"chat_id", "hash_ids", "input_length", ...}: 16-token blocks hashed on their
                  own content; chained here so that a block only hits after the same history
  kvcache-tester  one session a line (64-token blocks, ids local to the session, sub-agent
                  requests nested): each session gets its own id space
The "timestamp" of a record is not used: requests are replayed in file order.

Blocks: the cache is simulated with --block-size blocks. A trace with larger blocks is split
(id i becomes sub-blocks (i, 0..k-1)); one with smaller blocks is merged. Only full blocks are
ever cached, as in the engine: the partial last block of a prompt (and any tokens a trace gives no
id for) is always computed and never cached, and a prompt that fills its last block exactly still
computes that block (logits need one computed token). Splitting cannot see that two different
trace blocks start with the same tokens, so it may miss hits inside a trace block (for the
infinite cache, it gives a lower bound).

Known outputs (output_token_ids, response) are decoded in the simulation: the blocks they fill
are cached, so a follow-up turn hits on the previous answer. Trace outputs (output_length) have
no ids and are not simulated. A request needing more blocks than a pool holds could never run:
it is counted with no hit and leaves that pool's cache as it was."""
    parser = subparsers.add_parser(
        "estimate",
        help="estimate what prefix caching would buy on a prompt log or trace",
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("input", help="the prompt log or trace (JSONL, optionally .gz/.xz; "
                        "- for stdin)")
    parser.add_argument("--format", choices=("tokens", "text", "chat", "mooncake", "bailian",
                                             "kvcache-tester"),
                        help="input format (default: detected from the first record)")
    parser.add_argument("--block-size", type=int, default=16,
                        help="simulated KV block size in tokens (default: 16, as the engine)")
    parser.add_argument("--trace-block-size", type=int,
                        help="tokens per hash_ids entry of a trace (default: the record's "
                        "block_size, else 512 mooncake, 16 bailian, the session's kvcache-tester)")
    parser.add_argument("--chain", action=argparse.BooleanOptionalAction, default=None,
                        help="chain trace ids here (treat them as per-block content hashes); "
                        "default: only for bailian")
    parser.add_argument("--tokenizer", metavar="MODEL",
                        help="tokenizer for text/chat logs: a .gguf file or HF directory "
                        "(default: the default model's)")
    sizes = parser.add_argument_group("KV cache sizes (default: 1%, 5%, 20% and 50% of the "
                                      "distinct blocks; the infinite cache is always added)")
    sizes.add_argument("--capacity", metavar="BLOCKS",
                       help="pool sizes in blocks of --block-size, e.g. 1000,10000,50000")
    sizes.add_argument("--kv-memory", metavar="SIZES",
                       help="pool sizes in bytes, e.g. 4GiB,16GiB (needs --kv-bytes-per-token "
                       "or --kv-model)")
    sizes.add_argument("--kv-bytes-per-token", type=int, metavar="N",
                       help="KV bytes one token takes (all layers, K and V)")
    sizes.add_argument("--kv-model", metavar="MODEL",
                       help="take the KV bytes per token from this model's config (a .gguf "
                       "file, an HF directory, or 'default')")
    sizes.add_argument("--kv-dtype", default="bf16",
                       help="KV cache dtype for --kv-model: fp32, bf16, fp16, fp8 (default bf16)")
    replay = parser.add_argument_group("replay")
    replay.add_argument("--concurrency", type=int, default=1, metavar="N",
                        help="requests kept resident, released in arrival order (default 1: "
                        "each request is allocated, decoded and freed before the next)")
    replay.add_argument("--warmup-fraction", type=float, default=0.0, metavar="F",
                        help="count figures only over the requests after the first F of them "
                        "(default 0)")
    replay.add_argument("--window", type=int, metavar="N",
                        help="requests in the rolling hit rate (default: 5%% of the requests, "
                        "at most 1000)")
    replay.add_argument("--jobs", type=int, metavar="N",
                        help="processes replaying caches in parallel (default: CPU count)")
    replay.add_argument("--skip-bad-lines", action="store_true",
                        help="count and skip unreadable lines instead of stopping at the first")
    output = parser.add_argument_group("output")
    output.add_argument("--json", metavar="FILE", help="write every figure to FILE as JSON")
    output.add_argument("--plot", metavar="FILE.png",
                        help="plot hit rate against cache size and the rolling hit rate")
    output.add_argument("--no-progress", action="store_true", help="never show a progress bar")

    def run(args: argparse.Namespace) -> int:
        from prefixserve.tools.estimate import run_estimate

        return run_estimate(args)

    parser.set_defaults(func=run)


_SERVE_DESCRIPTION = """\
Serves MODEL (a .gguf file or an HF directory; default: SmolLM2-135M-Instruct) over an
OpenAI-compatible HTTP API: POST /v1/completions, POST /v1/chat/completions (streamed or not),
GET /v1/models, plus GET /health, GET /version, GET /metrics (Prometheus) and
POST /reset_prefix_cache (an admin action). Prefix caching is on unless
--no-enable-prefix-caching; each response reports the prompt tokens served from the cache in
usage.prompt_tokens_details.cached_tokens. With --api-key, each key gets its own prefix-cache
namespace unless --share-cache-across-keys. The API is described at /openapi.json (and /docs).
SIGINT or SIGTERM stops it gracefully (exit status 0)."""


def _add_serve(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description=_SERVE_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("model", nargs="?", metavar="MODEL",
                        help="a .gguf file or an HF model directory (default: the default "
                        "model, SmolLM2-135M-Instruct)")
    _add_serve_http(parser.add_argument_group("HTTP"))
    _add_serve_security(parser.add_argument_group("keys and tenants"))
    _add_serve_limits(parser.add_argument_group("limits"))
    _add_serve_engine(parser.add_argument_group("engine"))
    _add_serve_logging(parser.add_argument_group("logging and metrics"))

    def run(args: argparse.Namespace) -> int:
        from prefixserve.server.launch import run_server

        return run_server(args)

    parser.set_defaults(func=run)


def _add_serve_http(http: argparse._ArgumentGroup) -> None:
    http.add_argument("--host", default="127.0.0.1", help="address to listen on (default "
                      "127.0.0.1; 0.0.0.0 for every interface)")
    http.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    http.add_argument("--served-model-name", nargs="+", metavar="NAME",
                      help="names requests may give as 'model' (default: MODEL as given, or "
                      "SmolLM2-135M-Instruct for the default model); the first is the "
                      "reported one")
    http.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                      help="on SIGTERM, how long running requests may take to finish before "
                      "they are ended with an error (default 30)")


def _add_serve_security(keys: argparse._ArgumentGroup) -> None:
    keys.add_argument("--api-key", action="append", metavar="KEY",
                      help="require 'Authorization: Bearer KEY' on /v1/*; repeat for several "
                      "keys, or give @FILE to read keys from FILE, one a line")
    keys.add_argument("--share-cache-across-keys", action="store_true",
                      help="let requests of different API keys share prefix-cache blocks "
                      "(default: each key has its own cache namespace, so one tenant cannot "
                      "time another's prompts)")
    keys.add_argument("--salt-by-api-key", action="store_true",
                      help=argparse.SUPPRESS)  # the default since 0.2; accepted, no effect
    keys.add_argument("--admin-key", action="append", metavar="KEY",
                      help="key (repeatable, or @FILE) for admin actions such as "
                      "POST /reset_prefix_cache; with --api-key and no admin key, nobody may "
                      "reset the cache")
    keys.add_argument("--metrics-key", action="append", metavar="KEY",
                      help="require this key (or an admin key) on GET /metrics (repeatable, or "
                      "@FILE; default: /metrics is open)")


def _add_serve_limits(limits: argparse._ArgumentGroup) -> None:
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
                        "with Retry-After (default "
                        f"{config.DEFAULT_MAX_WAITING_REQUESTS})")
    limits.add_argument("--max-request-body-size", metavar="SIZE", default="32MiB",
                        help="largest request body, e.g. 1MiB (default 32MiB); larger bodies "
                        "get 413")
    limits.add_argument("--request-read-timeout", type=float, metavar="SECONDS",
                        default=config.DEFAULT_REQUEST_READ_TIMEOUT,
                        help="seconds a client has to send a request's headers and body before "
                        "the connection is closed (default "
                        f"{config.DEFAULT_REQUEST_READ_TIMEOUT:g})")


def _add_serve_engine(engine: argparse._ArgumentGroup) -> None:
    from prefixserve.core import ALLOWED_BLOCK_SIZES, HASH_ALGOS

    engine.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                        help="weights and KV cache dtype (default bfloat16; float32 gives "
                        "results that do not depend on batch shapes)")
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=None, help="automatic prefix caching (default: on)")
    engine.add_argument("--prefix-caching-hash-algo", choices=HASH_ALGOS,
                        help="hash of the prefix-cache block keys (default builtin)")
    engine.add_argument("--block-size", type=int, choices=ALLOWED_BLOCK_SIZES,
                        help="tokens per KV cache block (default 16)")
    size = engine.add_mutually_exclusive_group()
    size.add_argument("--kv-cache-memory", metavar="SIZE",
                      help="memory for the KV cache, e.g. 512MiB or 2GiB (default 1GiB)")
    size.add_argument("--num-blocks", type=int, metavar="N",
                      help="KV cache size in blocks (instead of --kv-cache-memory)")
    engine.add_argument("--max-num-seqs", type=int, metavar="N",
                        help="sequences running at once (default 32)")
    engine.add_argument("--max-num-batched-tokens", type=int, metavar="N",
                        help="tokens computed per step (default 2048)")
    engine.add_argument("--max-model-len", type=int, metavar="N",
                        help="context length, prompt plus output (default: the model's, capped "
                        "by the KV cache)")
    engine.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                        default=None, help="compute long prompts in chunks (default: on; off, "
                        "a prompt longer than --max-num-batched-tokens is refused)")
    engine.add_argument("--num-threads", type=int, metavar="N",
                        help="CPU threads for the model (default: torch's)")


def _add_serve_logging(logs: argparse._ArgumentGroup) -> None:
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


_BENCH_DESCRIPTION = """\
Sends a dataset to an OpenAI-compatible server (this one or a peer) through /v1/completions,
streamed, and reports TTFT, TPOT, inter-token and end-to-end latency (mean, p50, p90, p99),
request and token throughput, the share of prompt tokens the server served from its cache
(usage.prompt_tokens_details.cached_tokens, when it reports it), what a perfect cache would have
served of the same prompts (prefixserve estimate), the change of the server's /metrics counters,
and errors. Prompts are token ids when the server accepts them, else the text they decode to
(the same tokens: prompts are made of words that round-trip through the tokenizer).

Datasets:
  shared-prefix  --num-groups G x --prompts-per-group P prompts: a system prompt of
                 --system-prompt-len tokens per group (default 1024) then a question of
                 --question-len tokens; shuffled (default) or --ordered
  multi-turn     --num-conversations C of --num-turns T: each turn's prompt is the whole
                 history (the previous prompt, the server's reply) plus a new user message of
                 --question-len tokens, after a shared system prompt (default 0 tokens); the
                 turns of a conversation are sent in order, conversations side by side
  trace          --trace-path: a Mooncake-style trace, hash_ids turned into token blocks of
                 trace-block-size / --scale tokens (equal ids, equal blocks), lengths scaled
                 the same way, arrivals at timestamp x --time-scale (or --compress-arrivals);
                 the first --num-prompts requests, or whole conversations drawn at random
                 (--trace-sample conversations)
  random         --num-prompts unrelated prompts of --input-len tokens (the 0%%-hit case)

Load: sessions (a request, or a conversation) start all at once, or as a Poisson process of
--request-rate per second, or at the trace's timestamps; --max-concurrency bounds the requests
in flight. 'prefixserve bench compare A.json B.json ... [--plot cdf.png]' prints runs side by
side."""


def _add_bench(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="benchmark a serving endpoint on prefix-sharing workloads",
        description=_BENCH_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    target = parser.add_argument_group("server")
    target.add_argument("--base-url", default="http://127.0.0.1:8000/v1",
                        help="the API root (default http://127.0.0.1:8000/v1)")
    target.add_argument("--model", help="the 'model' field to send (default: none sent)")
    target.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    target.add_argument("--prompt-type", choices=("auto", "token-ids", "text"), default="auto",
                        help="send prompts as token ids or text (default auto: token ids if "
                        "the server takes them)")
    target.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="send ignore_eos so that every request generates its full output "
                        "length (default: on)")
    target.add_argument("--cache-salt", help="sent as cache_salt in every request")
    target.add_argument("--extra-body", metavar="JSON",
                        help="a JSON object merged into every request body")
    target.add_argument("--metrics-url",
                        help="Prometheus endpoint (default: /metrics beside the API root)")
    target.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                        help="per-request timeout (default 600)")
    data = parser.add_argument_group("dataset")
    data.add_argument("--dataset", choices=("shared-prefix", "multi-turn", "trace", "random"))
    data.add_argument("--num-prompts", type=int, metavar="N",
                      help="random: prompts; trace: the first N requests (default 100)")
    data.add_argument("--seed", type=int, default=0, help="seed of prompts and arrivals")
    data.add_argument("--tokenizer", metavar="MODEL",
                      help="tokenizer of the prompts: a .gguf file or HF directory (default: "
                      "the default model's)")
    data.add_argument("--num-groups", type=int, default=8, metavar="G")
    data.add_argument("--prompts-per-group", type=int, default=16, metavar="P")
    data.add_argument("--system-prompt-len", type=int, metavar="S",
                      help="default 1024 for shared-prefix, 0 for multi-turn")
    data.add_argument("--question-len", type=int, default=64, metavar="Q")
    data.add_argument("--output-len", type=int, metavar="O",
                      help="tokens to generate (default 64; trace: its own, scaled)")
    data.add_argument("--input-len", type=int, default=1024, metavar="N",
                      help="random: prompt length (default 1024)")
    order = data.add_mutually_exclusive_group()
    order.add_argument("--shuffle", dest="shuffle", action="store_true", default=True,
                       help="shared-prefix: send prompts in random order (default)")
    order.add_argument("--ordered", dest="shuffle", action="store_false",
                       help="shared-prefix: send prompts group by group")
    data.add_argument("--num-conversations", type=int, default=16, metavar="C")
    data.add_argument("--num-turns", type=int, default=6, metavar="T")
    data.add_argument("--trace-path", metavar="FILE")
    data.add_argument("--trace-format", choices=("mooncake", "bailian"),
                      help="default: detected")
    data.add_argument("--trace-sample", choices=("first", "conversations"), default="first",
                      help="the first --num-prompts requests (default), or whole conversations "
                      "(requests with the same first two block ids) drawn at random")
    data.add_argument("--trace-block-size", type=int, default=512, metavar="N",
                      help="tokens per hash_ids entry (default 512)")
    data.add_argument("--scale", type=int, default=16,
                      help="divide the trace's lengths by this (default 16)")
    data.add_argument("--time-scale", type=float, default=1.0, metavar="F",
                      help="multiply the trace's arrival times by F (default 1)")
    data.add_argument("--compress-arrivals", action="store_true",
                      help="ignore the trace's timestamps (use --request-rate and "
                      "--max-concurrency)")
    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=float("inf"), metavar="RPS",
                      help="sessions started per second, Poisson (default inf: all at once)")
    load.add_argument("--max-concurrency", type=int, metavar="N",
                      help="requests in flight at most (default: no limit)")
    load.add_argument("--warmup", type=int, default=1, metavar="N",
                      help="unmeasured warm-up requests of unrelated prompts (default 1)")
    output = parser.add_argument_group("output")
    output.add_argument("--label", help="the run's name in tables and plots")
    output.add_argument("--json", metavar="FILE",
                        help="write the run, with every request, to FILE")
    output.add_argument("--plot", metavar="FILE.png", help="plot the TTFT CDF")
    output.add_argument("--save-prompts", metavar="FILE",
                        help="write the prompts sent and their replies as token ids, a log "
                        "'prefixserve estimate FILE' reads")
    output.add_argument("--no-progress", action="store_true", help="no progress bar")

    def run(args: argparse.Namespace) -> int:
        from prefixserve.tools.bench.command import run_bench

        return run_bench(args)

    parser.set_defaults(func=run)
    commands = parser.add_subparsers(dest="bench_command", metavar="compare")
    compare = commands.add_parser(
        "compare", help="print runs written with --json side by side",
        description="Prints runs written by 'prefixserve bench --json' side by side (ratios "
        "to the first run for throughput and mean latencies) and plots their TTFT CDFs.")
    compare.add_argument("runs", nargs="+", metavar="RUN.json")
    compare.add_argument("--plot", metavar="FILE.png", help="plot the TTFT CDFs")

    def run_compare(args: argparse.Namespace) -> int:
        from prefixserve.tools.bench.command import run_compare

        return run_compare(args)

    compare.set_defaults(func=run_compare)


COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_add_demo, _add_estimate,
                                                                _add_serve, _add_bench]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prefixserve",
        description="An LLM inference engine built around automatic prefix caching.",
    )
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    for add in COMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
