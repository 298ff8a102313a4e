"""The ``prefixserve estimate`` command line: its parser, one function per argument group. Only
argparse and the router's defaults are imported here; ``estimate`` itself is imported when the
command runs."""

from __future__ import annotations

import argparse
import sys

from prefixserve.router.policy import DEFAULT_BALANCE_ABS, DEFAULT_BALANCE_REL
from prefixserve.tools.estimate.replicas import DEFAULT_DECODE_COST

DESCRIPTION = """\
Replays a prompt log or a block-hash trace, in file order, through the engine's own prefix-cache
code (prefixserve.core) for each KV cache size asked for and for an infinite cache (the upper
bound), and reports the hit rate by blocks and by tokens, the prefill tokens saved, the 1/(1-h)
bound on prefill speed-up and the share of requests with any hit. No model is run.

Inputs (detected from the first record, or --format), plain, .gz or .xz, one JSON object a line:
  tokens          {"token_ids": [...], "output_token_ids"?, "cache_salt"?, "lora_id"?,
                  "mm_inputs"?}
  text / chat     {"prompt": "..."} or {"messages": [...]} with optional "response",
                  "cache_salt", "lora_id", "mm_inputs", tokenised with --tokenizer's tokenizer
                  and chat template
  mooncake        {"hash_ids": [...], "input_length": n}: chained ids of 512-token blocks
                  (or the record's "block_size")
  bailian         {"chat_id", "hash_ids", "input_length", ...}: 16-token blocks hashed on their
                  own content; chained here so that a block only hits after the same history
  kvcache-tester  one session a line (64-token blocks, ids local to the session, sub-agent
                  requests nested): each session gets its own id space
Requests are replayed in file order; a record's "timestamp" is only the clock of --ttl.
Images: "mm_inputs": [{"offset": 12, "length": 196, "hash": "..."}] names the images whose
placeholder tokens [offset, offset + length) the prompt holds (offsets in the tokenised
prompt); every block a run overlaps is keyed by its hash, as in the engine, so another image
at the same place misses from the block its run starts in. Block-hash traces take no
mm_inputs: their ids already name the blocks' content.

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


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``prefixserve estimate`` on ``subparsers``."""
    parser = subparsers.add_parser(
        "estimate",
        help="estimate what prefix caching would buy on a prompt log or trace",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_input(parser)
    _add_sizes(parser.add_argument_group(
        "KV cache sizes (default: 1%, 5%, 20% and 50% of the distinct blocks; the infinite "
        "cache is always added)"))
    _add_replay(parser.add_argument_group("replay"))
    _add_replicas(parser.add_argument_group(
        "replicas (with --replicas N > 1: N per-replica caches of each --capacity, routed)"))
    _add_output(parser.add_argument_group("output"))
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Run the estimate (imports the estimator)."""
    if args.replicas > 1:
        from prefixserve.tools.estimate.replicas import run_replica_estimate

        return run_replica_estimate(args)
    return run_estimate(args)


def run_estimate(args: argparse.Namespace) -> int:
    """The one-server estimate: prints the table, writes ``--json``/``--plot``.

    Returns 0, or 2 after printing the reason when the input or an option is unusable. (The
    estimator and its reports are imported here, at the top: neither imports the other.)"""
    from prefixserve.tools.estimate.lora import lora_figures, print_lora_report
    from prefixserve.tools.estimate.replay import estimate
    from prefixserve.tools.estimate.report import print_report, write_json, write_plot
    from prefixserve.tools.trace_formats import TraceError

    try:
        result = estimate(args)
    except (TraceError, ValueError, OSError) as exc:
        print(f"prefixserve estimate: error: {exc}", file=sys.stderr)
        return 2
    result.lora = lora_figures(result.workload, result.settings)
    print_report(result)
    if result.lora is not None:
        print_lora_report(result.lora)
    if args.json:
        write_json(result, args.json)
    if args.plot:
        write_plot(result, args.plot)
    return 0


def _add_input(parser: argparse.ArgumentParser) -> None:
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


def _add_sizes(sizes: argparse._ArgumentGroup) -> None:
    sizes.add_argument("--capacity", metavar="BLOCKS",
                       help="pool sizes in blocks of --block-size, e.g. 1000,10000,50000")
    sizes.add_argument("--kv-memory", metavar="SIZES",
                       help="pool sizes in bytes, e.g. 4GiB,16GiB (needs --kv-bytes-per-token "
                       "or --kv-model)")
    sizes.add_argument("--tier-capacity", type=int, metavar="BLOCKS",
                       help="model a second cache tier (disk, Redis) of BLOCKS blocks below "
                       "each pool, written through and read past the pool's hit; the table "
                       "then shows hits by tier")
    sizes.add_argument("--kv-bytes-per-token", type=int, metavar="N",
                       help="KV bytes one token takes (all layers, K and V)")
    sizes.add_argument("--kv-model", metavar="MODEL",
                       help="take the KV bytes per token from this model's config (a .gguf "
                       "file, an HF directory, or 'default')")
    sizes.add_argument("--kv-dtype", default="bf16",
                       help="KV cache dtype for --kv-model: fp32, bf16, fp16, fp8 (default bf16)")


def _add_replay(replay: argparse._ArgumentGroup) -> None:
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
    replay.add_argument("--pin-top", type=int, default=0, metavar="K",
                        help="pin the prefixes up to the K most reused blocks when first "
                        "computed (an oracle choice, within half the pool; default 0: none)")
    replay.add_argument("--ttl", type=float, metavar="SECONDS",
                        help="give every request without a retention of its own a whole-prompt "
                        "retention for SECONDS (trace time; one second a request when the "
                        "trace has no times)")
    replay.add_argument("--ttl-priority", type=int, default=80, metavar="P",
                        help="the priority of --ttl retentions (default 80; 35 is the default "
                        "of every block)")
    replay.add_argument("--skip-bad-lines", action="store_true",
                        help="count and skip unreadable lines instead of stopping at the first")


def _add_replicas(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--replicas", type=int, default=1, metavar="N",
                       help="simulate N replicas, each with its own cache of --capacity blocks "
                       "(default 1: one cache, the plain estimate)")
    group.add_argument("--routing", default="round-robin,prefix-aware,pooled",
                       metavar="POLICIES",
                       help="comma-separated: round-robin, prefix-aware (the deployment's "
                       "router, fed by the replicas' KV events), pooled (one cache of N times "
                       "the size: the upper bound); default all three")
    group.add_argument("--in-flight", type=int, metavar="N",
                       help="requests taken to be in flight for the router's load balance: the "
                       "last N routed (default 8 per replica)")
    group.add_argument("--clients", type=int, metavar="N",
                       help="in place of --in-flight: N closed-loop clients, each sending the "
                       "next request when its last one finishes; a replica shares its time "
                       "among its unfinished requests, each taking its uncached prompt tokens "
                       "plus --decode-cost per output token, and its load is how many it has")
    group.add_argument("--decode-cost", type=float, default=DEFAULT_DECODE_COST, metavar="X",
                       help="with --clients: the work of one output token in prompt tokens "
                       f"(default {DEFAULT_DECODE_COST:g}: a CPU replica decoding a few "
                       "sequences at once)")
    group.add_argument("--balance-abs-threshold", type=int, default=DEFAULT_BALANCE_ABS,
                       metavar="N",
                       help="the router's load-balance rule, as `prefixserve serve "
                       f"--balance-abs-threshold` (default {DEFAULT_BALANCE_ABS}; serve's is 2 x "
                       "its --max-num-seqs - 1: give that to replay a deployment)")
    group.add_argument("--balance-rel-threshold", type=float, default=DEFAULT_BALANCE_REL,
                       metavar="F",
                       help="the rule's factor, as `prefixserve serve --balance-rel-threshold` "
                       f"(default {DEFAULT_BALANCE_REL})")


def _add_output(output: argparse._ArgumentGroup) -> None:
    output.add_argument("--json", metavar="FILE", help="write every figure to FILE as JSON")
    output.add_argument("--plot", metavar="FILE.png",
                        help="plot hit rate against cache size and the rolling hit rate")
    output.add_argument("--no-progress", action="store_true", help="never show a progress bar")
