"""The ``prefixserve bench`` command line (and ``prefixserve bench compare``): its parser, one
function per argument group. Only argparse is imported here; ``command`` is imported when the
command runs."""

from __future__ import annotations

import argparse

DESCRIPTION = """\
Sends a dataset to an OpenAI-compatible server (this one or a peer) through /v1/completions (or
/v1/chat/completions with --endpoint chat), streamed, and reports TTFT, TPOT, inter-token and
end-to-end latency (mean, p50, p90, p99), request and token throughput, the share of prompt
tokens the server served from its cache (usage.prompt_tokens_details.cached_tokens, when it
reports it), what a perfect cache would have served of the same prompts (prefixserve estimate),
the change of the server's /metrics counters, and errors. Prompts are token ids when the server
accepts them, else the text they decode to (the same tokens: prompts are made of words that
round-trip through the tokenizer).

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
  agent          --num-sessions agent sessions of --num-turns turns, shaped after the
                 kv-cache-tester coding-agent traces: a shared system prompt
                 (--system-tokens) and tool manifest (--tool-tokens words over --num-tools
                 functions) before a --question-len task; later turns are tool results of
                 --result-len words, or user messages (--user-share of them)
  multimodal     --num-conversations C chats of --num-turns T about --num-images pictures
                 (coloured shapes drawn with Pillow, sent as PNG data: URLs in image_url
                 parts; always /v1/chat/completions): conversation c shows picture
                 c %% num-images in its first message, after a shared system prompt (default
                 0 tokens), then --question-len questions with the whole history, so later
                 turns, and other chats about the same picture, hit the image's blocks

--endpoint chat sends /v1/chat/completions instead: messages rendered by the server's chat
template, with the agent dataset's manifest as 'tools' and its tool results as 'tool' messages
answering a call on the previous assistant message.

Load: sessions (a request, or a conversation) start all at once, or as a Poisson process of
--request-rate per second, or at the trace's timestamps; --max-concurrency bounds the requests
in flight. 'prefixserve bench compare A.json B.json ... [--plot cdf.png]' prints runs side by
side."""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``prefixserve bench`` and its ``compare`` subcommand on ``subparsers``."""
    parser = subparsers.add_parser(
        "bench",
        help="benchmark a serving endpoint on prefix-sharing workloads",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_server(parser.add_argument_group("server"))
    data = parser.add_argument_group("dataset")
    _add_dataset(data)
    _add_trace(data)
    _add_load(parser.add_argument_group("load"))
    _add_output(parser.add_argument_group("output"))
    parser.set_defaults(func=run)
    _add_compare(parser.add_subparsers(dest="bench_command", metavar="compare"))
    return parser


def run(args: argparse.Namespace) -> int:
    """Run the benchmark (imports the client and the tokenizer)."""
    from prefixserve.tools.bench.command import run_bench

    return run_bench(args)


def run_compare(args: argparse.Namespace) -> int:
    """Compare saved runs."""
    from prefixserve.tools.bench.command import run_compare

    return run_compare(args)


def _add_server(target: argparse._ArgumentGroup) -> None:
    target.add_argument("--base-url", default="http://127.0.0.1:8000/v1",
                        help="the API root (default http://127.0.0.1:8000/v1)")
    target.add_argument("--model", help="the 'model' field to send (default: none sent)")
    target.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                        help="/v1/completions (token ids or text) or /v1/chat/completions "
                        "(messages, with the agent dataset's tool manifest; default "
                        "completions)")
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


def _add_dataset(data: argparse._ArgumentGroup) -> None:
    """The generated datasets' arguments (and the ones all datasets share)."""
    data.add_argument("--dataset", choices=("shared-prefix", "multi-turn", "trace", "random",
                                            "agent", "multimodal"))
    data.add_argument("--num-prompts", type=int, metavar="N",
                      help="random: prompts; trace: the first N requests (default 100)")
    data.add_argument("--seed", type=int, default=0, help="seed of prompts and arrivals")
    data.add_argument("--tokenizer", metavar="MODEL",
                      help="tokenizer of the prompts: a .gguf file or HF directory (default: "
                      "the default model's)")
    data.add_argument("--num-groups", type=int, default=8, metavar="G")
    data.add_argument("--prompts-per-group", type=int, default=16, metavar="P")
    data.add_argument("--system-prompt-len", type=int, metavar="S",
                      help="default 1024 for shared-prefix, 0 for multi-turn and multimodal")
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
    data.add_argument("--num-sessions", type=int, default=16, metavar="N",
                      help="agent: sessions (default 16)")
    data.add_argument("--tool-tokens", type=int, default=768, metavar="N",
                      help="agent: words of the tool manifest (default 768)")
    data.add_argument("--system-tokens", type=int, default=192, metavar="N",
                      help="agent: words of the system prompt (default 192)")
    data.add_argument("--num-tools", type=int, default=8, metavar="N",
                      help="agent: functions in the manifest (default 8)")
    data.add_argument("--result-len", type=int, default=96, metavar="N",
                      help="agent: words of a tool result (default 96)")
    data.add_argument("--user-share", type=float, default=0.16, metavar="P",
                      help="agent: share of later turns that are user messages (default 0.16)")
    data.add_argument("--num-images", type=int, default=4, metavar="N",
                      help="multimodal: pictures the conversations are about (default 4)")


def _add_trace(data: argparse._ArgumentGroup) -> None:
    """The trace dataset's arguments (in the same "dataset" group)."""
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


def _add_load(load: argparse._ArgumentGroup) -> None:
    load.add_argument("--request-rate", type=float, default=float("inf"), metavar="RPS",
                      help="sessions started per second, Poisson (default inf: all at once)")
    load.add_argument("--max-concurrency", type=int, metavar="N",
                      help="requests in flight at most (default: no limit)")
    load.add_argument("--warmup", type=int, default=1, metavar="N",
                      help="unmeasured warm-up requests of unrelated prompts (default 1)")


def _add_output(output: argparse._ArgumentGroup) -> None:
    output.add_argument("--label", help="the run's name in tables and plots")
    output.add_argument("--json", metavar="FILE",
                        help="write the run, with every request, to FILE")
    output.add_argument("--plot", metavar="FILE.png", help="plot the TTFT CDF")
    output.add_argument("--save-prompts", metavar="FILE",
                        help="write the prompts sent and their replies as token ids (and "
                        "their pictures as mm_inputs), a log 'prefixserve estimate FILE' reads")
    output.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_compare(commands: argparse._SubParsersAction) -> None:
    compare = commands.add_parser(
        "compare", help="print runs written with --json side by side",
        description="Prints runs written by 'prefixserve bench --json' side by side (ratios "
        "to the first run for throughput and mean latencies) and plots their TTFT CDFs.")
    compare.add_argument("runs", nargs="+", metavar="RUN.json")
    compare.add_argument("--plot", metavar="FILE.png", help="plot the TTFT CDFs")
    compare.set_defaults(func=run_compare)
