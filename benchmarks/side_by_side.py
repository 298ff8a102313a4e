"""prefixserve against llama.cpp on prefix-sharing traffic, each server started fresh per run.

Servers (each on the same GGUF file with 2 threads; prefixserve runs ``--parallel`` sequences
at once, 16 by default):

1. ``prefixserve`` — ``prefixserve serve`` with prefix caching on (the default);
2. ``prefixserve-nocache`` — the same with ``--no-enable-prefix-caching``;
3. ``llama-server`` — llama.cpp's own C++ server (``--llama-server``, built by
   ``benchmarks/build_llamacpp.sh`` from the llama.cpp that llama-cpp-python 0.3.36 vendors),
   the main llama.cpp row: one slot per client (``-np`` = the run's concurrency,
   ``--parallel`` for the trace) with continuous batching, ``-c`` = ``--n-ctx`` x slots
   (llama-server divides it among the slots), prompt caching in each slot plus
   ``--cache-reuse 256`` and a RAM prompt cache of ``--llamacpp-cache-bytes``
   (``--cache-ram``). It takes the prompts as token ids, honours the bench's ``ignore_eos``
   (so every request generates its full output length, as on prefixserve) and reports cached
   prompt tokens in its usage;
4. ``llamacpp`` — llama-cpp-python's OpenAI-compatible server (``python -m llama_cpp.server``,
   built from source) with its prompt cache on (``--cache true``, in RAM), from its own virtual
   environment (``--llamacpp-python``; skipped with a note when that does not exist). It runs
   one request at a time (it has no parallel slots), takes prompts as text only (the bench
   sends the same tokens as text), has no ``ignore_eos`` (a -100 logit bias on the end-of-text
   tokens stands in for it), reports no usage (so no cached-token share), and by default ends
   a stream as soon as another request arrives, which ``--interrupt_requests false`` turns off.

The llama.cpp builds are benchmark-only, outside the repository and outside ``make run`` /
``make test``.

Scenarios (issue 6): ``shared-prefix`` (8 groups x 16 prompts, 1,024-token system prompts,
64-token questions and answers) and ``multi-turn`` (16 conversations x 6 turns, 64-token
messages and answers), each at 1, 4 and 16 requests in flight, and a scaled replay of whole
conversations of a Mooncake trace at its timestamps (compressed). ``--quick`` shrinks everything
to check the script in a few minutes. Every server is started anew for every run, so each run
begins with a cold cache.

Each run is a ``prefixserve bench`` command (printed before it runs) whose JSON, prompt log and
server log go to ``--out``. After each scenario the runs are compared (``prefixserve bench
compare``, TTFT CDF plot ``<scenario>.png``), and the prompts the cached run sent are replayed
by ``prefixserve estimate`` with an infinite cache and with the server's own pool size, to put
the measured caching gain next to the predicted one. ``summary.md`` collects the tables and the
commands, ready for ``benchmarks/RESULTS.md``.

Usage::

    benchmarks/build_llamacpp.sh            # once: /work/llamacpp-build/bin/llama-server
    .venv/bin/python benchmarks/side_by_side.py --quick
    .venv/bin/python benchmarks/side_by_side.py   # the full run: hours on 2 cores (7 x 4 runs)
    .venv/bin/python benchmarks/side_by_side.py --servers prefixserve,llama-server \\
        --datasets shared-prefix --concurrency 4 --llama-server PATH/TO/llama-server
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
DEFAULT_TRACE = REPO.parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
DEFAULT_LLAMACPP_PYTHON = "/work/llamacpp-venv/bin/python"
DEFAULT_LLAMA_SERVER = "/work/llamacpp-build/bin/llama-server"
SERVER_NAMES = ("prefixserve", "prefixserve-nocache", "llama-server", "llamacpp")
PEERS = (("llama-server", "llama-server's"), ("llamacpp", "llama-cpp-python's"))
"""The llama.cpp rows prefixserve is measured against, the main one first."""
STARTUP_TIMEOUT_S = 300.0
PREFIXSERVE = [sys.executable, "-m", "prefixserve"]


@dataclass(frozen=True)
class Server:
    """How to start one server and what its bench runs send besides the dataset."""

    name: str
    command: list[str]
    bench_options: list[str]


@dataclass(frozen=True)
class Scenario:
    """A dataset and a load; ``concurrency`` None leaves arrivals to the dataset."""

    name: str
    dataset_options: list[str]
    concurrency: int | None


def default_model() -> str:
    from prefixserve.model.arch.config import default_model_path

    return default_model_path()


def llama_server(args: argparse.Namespace, port: int, slots: int) -> Server:
    """llama.cpp's C++ server with one slot per client: ``-c`` is shared among the slots, so
    each gets ``--n-ctx``. The bench's ``ignore_eos`` (its default) is honoured as is."""
    return Server("llama-server",
                  [args.llama_server, "-m", args.model, "--host", "127.0.0.1", "--port",
                   str(port), "-t", str(args.threads), "-tb", str(args.threads),
                   "-np", str(slots), "-c", str(args.n_ctx * slots), "--cont-batching",
                   "--cache-reuse", "256", "--cache-ram", str(args.llamacpp_cache_bytes >> 20),
                   "--metrics", *shlex.split(args.llama_server_args)],
                  [])


def servers(args: argparse.Namespace, port: int, slots: int) -> list[Server]:
    """The servers of ``--servers``; ``slots`` is the run's concurrency (llama-server's
    ``-np``)."""
    common = ["--host", "127.0.0.1", "--port", str(port), "--num-threads", str(args.threads),
              "--max-num-seqs", str(args.parallel), "--disable-access-log",
              "--log-stats-interval", "0"]
    extra = shlex.split(args.prefixserve_args)
    all_servers = [
        Server("prefixserve", [*PREFIXSERVE, "serve", args.model, *common, *extra], []),
        Server("prefixserve-nocache",
               [*PREFIXSERVE, "serve", args.model, *common, *extra,
                "--no-enable-prefix-caching"], []),
        Server("llamacpp",
               [args.llamacpp_python, "-m", "llama_cpp.server", "--model", args.model,
                "--host", "127.0.0.1", "--port", str(port), "--n_threads", str(args.threads),
                "--n_threads_batch", str(args.threads), "--n_ctx", str(args.n_ctx),
                "--cache", "true", "--cache_type", "ram",
                "--cache_size", str(args.llamacpp_cache_bytes),
                "--interrupt_requests", "false", "--verbose", "false"],
               # llama-cpp-python has no ignore_eos: a strong negative bias on the end-of-text
               # tokens makes it generate the full output length, as prefixserve does.
               ["--no-ignore-eos", "--extra-body",
                json.dumps({"logit_bias": {str(t): -100.0 for t in args.eos_ids}})]),
        llama_server(args, port, slots),
    ]
    return [s for s in all_servers if s.name in args.servers]


def scenarios(args: argparse.Namespace) -> list[Scenario]:
    out: list[Scenario] = []
    shared = ["--dataset", "shared-prefix", "--num-groups", str(args.num_groups),
              "--prompts-per-group", str(args.prompts_per_group), "--system-prompt-len",
              str(args.system_prompt_len), "--question-len", str(args.question_len),
              "--output-len", str(args.output_len)]
    chat = ["--dataset", "multi-turn", "--num-conversations", str(args.num_conversations),
            "--num-turns", str(args.num_turns), "--question-len", str(args.question_len),
            "--output-len", str(args.output_len)]
    for concurrency in args.concurrency:
        if "shared-prefix" in args.datasets:
            out.append(Scenario(f"shared-prefix-c{concurrency}", shared, concurrency))
        if "multi-turn" in args.datasets:
            out.append(Scenario(f"multi-turn-c{concurrency}", chat, concurrency))
    if "trace" in args.datasets:
        out.append(Scenario("trace", [
            "--dataset", "trace", "--trace-path", str(args.trace_path), "--trace-sample",
            "conversations", "--num-prompts", str(args.trace_prompts), "--scale",
            str(args.trace_scale), "--time-scale", str(args.trace_time_scale)], None))
    return out


def show(command: Sequence[str]) -> str:
    """The command as a newcomer types it: the repo's interpreter and relative paths."""
    text = shlex.join(command).replace(sys.executable, ".venv/bin/python")
    return text.replace(str(REPO) + "/", "").replace(str(REPO.parent) + "/", "../")


def start(server: Server, port: int, log_path: Path) -> subprocess.Popen[bytes]:
    """Starts ``server`` and returns once ``/v1/models`` answers (raises if it never does)."""
    print(f"$ {show(server.command)}", flush=True)
    log = open(log_path, "wb")  # noqa: SIM115 - handed to the process
    process = subprocess.Popen(server.command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{server.name} exited with {process.returncode}; see {log_path}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    stop(process)
    raise RuntimeError(f"{server.name} did not come up in {STARTUP_TIMEOUT_S:.0f} s; "
                       f"see {log_path}")


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def kv_blocks(port: int) -> int | None:
    """The server's KV pool in blocks, from prefixserve's ``/metrics`` (None elsewhere)."""
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    except httpx.HTTPError:
        return None
    for line in text.splitlines():  # prefixserve:kv_cache_num_blocks{model_name="..."} 256.0
        if line.split("{", 1)[0].split(" ", 1)[0] == "prefixserve:kv_cache_num_blocks":
            return int(float(line.split()[-1]))
    return None


def run_bench(args: argparse.Namespace, scenario: Scenario, server: Server, port: int,
              out: Path, commands: list[str]) -> tuple[Path, int | None]:
    """One run: fresh server, ``prefixserve bench``, server stopped. Returns the JSON path and
    the server's KV pool size in blocks (prefixserve only)."""
    stem = out / f"{scenario.name}--{server.name}"
    command = [*PREFIXSERVE, "bench", "--base-url", f"http://127.0.0.1:{port}/v1",
               *scenario.dataset_options, "--seed", str(args.seed), "--label", server.name,
               "--timeout", str(args.request_timeout), "--json", f"{stem}.json",
               "--save-prompts", f"{stem}.prompts.jsonl", "--no-progress",
               *server.bench_options]
    if scenario.concurrency is not None:
        command += ["--max-concurrency", str(scenario.concurrency)]
    process = start(server, port, Path(f"{stem}.server.log"))
    try:
        print(f"$ {show(command)}", flush=True)
        commands.append(f"# {scenario.name}, {server.name}: server\n{show(server.command)}\n"
                        f"# bench\n{show(command)}")
        result = subprocess.run(command, cwd=REPO, check=False)
        blocks = kv_blocks(port)
    finally:
        stop(process)
    if result.returncode != 0:
        raise RuntimeError(f"the bench of {scenario.name} on {server.name} failed "
                           f"({result.returncode})")
    return Path(f"{stem}.json"), blocks


def estimate(prompt_log: Path, blocks: int | None, concurrency: int | None,
             commands: list[str]) -> dict:
    """``prefixserve estimate`` on the prompts a run sent: infinite cache, and the server's
    pool when known."""
    out = prompt_log.with_suffix(".estimate.json")
    command = [*PREFIXSERVE, "estimate", str(prompt_log), "--format", "tokens", "--jobs", "1",
               "--no-progress", "--json", str(out), "--concurrency", str(concurrency or 1)]
    if blocks:
        command += ["--capacity", str(blocks)]
    commands.append(f"# estimate\n{show(command)}")
    subprocess.run(command, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    caches = json.loads(out.read_text())["caches"]
    infinite = next(c for c in caches if c["infinite"])
    pool = next((c for c in caches if c["capacity_blocks"] == blocks), None) if blocks else None
    return {"infinite": infinite["token_hit_rate"],
            "pool": pool["token_hit_rate"] if pool else None, "blocks": blocks}


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def scenario_rows(name: str, runs: dict[str, dict]) -> list[str]:
    rows = []
    for server, run in runs.items():
        s = run["summary"]
        rows.append(f"| {name} | {server} | {s['completed']}/{s['requests']} | "
                    f"{_num(s['request_throughput'], 3)} | {_num(s['output_throughput'])} | "
                    f"{_num(s['ttft_ms']['mean'])} | {_num(s['ttft_ms']['p99'])} | "
                    f"{_num(s['tpot_ms']['mean'])} | {_num(s['e2e_ms']['mean'])} | "
                    f"{_pct(s['cached_share'])} |")
    return rows


def caching_row(name: str, runs: dict[str, dict], predicted: dict | None) -> str | None:
    on, off = runs.get("prefixserve"), runs.get("prefixserve-nocache")
    if on is None or off is None or predicted is None:
        return None

    def computed(run: dict) -> float | None:
        """Prompt tokens the server computed over the run: all of them less the cache hits."""
        metrics = run.get("server_metrics") or {}
        prompt = metrics.get("prefixserve:prompt_tokens_total")
        hits = metrics.get("prefixserve:prefix_cache_hit_tokens_total",  # runs before the rename
                           metrics.get("prefixserve:prefix_cache_hits_total", 0.0))
        return None if prompt is None else prompt - hits

    on_computed, off_computed = computed(on), computed(off)
    saving = (1 - on_computed / off_computed) if on_computed is not None and off_computed else None
    h = on["summary"]["cached_share"]
    ttft_on, ttft_off = on["summary"]["ttft_ms"]["mean"], off["summary"]["ttft_ms"]["mean"]
    bound = 1 / (1 - h) if h is not None and h < 1 else None
    return (f"| {name} | {_pct(predicted['infinite'])} | {_pct(predicted['pool'])} | {_pct(h)} | "
            f"{_pct(saving)} | {_num(ttft_off / ttft_on if ttft_on and ttft_off else None, 2)}x | "
            f"{_num(bound, 2)}x |")


def verdict(ours: dict, peer: dict, whose: str) -> str:
    ratio = ours["summary"]["request_throughput"] / peer["summary"]["request_throughput"]
    ttft = ours["summary"]["ttft_ms"]["mean"] / peer["summary"]["ttft_ms"]["mean"]
    return (f"request throughput {ratio:.2f}x {whose} (target >= 2: "
            f"{'met' if ratio >= 2 else 'not met'}); mean TTFT {ttft:.2f}x (target <= 0.5: "
            f"{'met' if ttft <= 0.5 else 'not met'})")


def targets(runs: dict[str, dict]) -> list[str]:
    """prefixserve against each llama.cpp row that ran, llama-server first."""
    ours = runs.get("prefixserve")
    if ours is None:
        return []
    return [verdict(ours, runs[name], whose) for name, whose in PEERS if name in runs]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes (overriding the size options) to check the script")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--servers", default=",".join(SERVER_NAMES),
                        help=f"comma-separated subset of {', '.join(SERVER_NAMES)} (llamacpp "
                        "is skipped with a note when --llamacpp-python does not exist)")
    parser.add_argument("--datasets", default="shared-prefix,multi-turn,trace",
                        help="comma-separated subset of the datasets")
    parser.add_argument("--model", default=None, help="the GGUF file (default: the default "
                        "model's)")
    parser.add_argument("--llama-server", default=DEFAULT_LLAMA_SERVER,
                        help="llama.cpp's llama-server binary (benchmarks/build_llamacpp.sh)")
    parser.add_argument("--llamacpp-python", default=DEFAULT_LLAMACPP_PYTHON,
                        help="python of the venv with llama-cpp-python[server]")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefixserve-args", default="", metavar="ARGS",
                        help="more flags for prefixserve serve, e.g. '--kv-cache-dtype float16'")
    parser.add_argument("--llama-server-args", default="", metavar="ARGS",
                        help="more flags for llama-server, e.g. '--spec-type ngram-simple "
                        "--draft-max 3'")
    parser.add_argument("--parallel", type=int, default=16,
                        help="sequences a server runs at once (prefixserve --max-num-seqs)")
    parser.add_argument("--n-ctx", type=int, default=8192,
                        help="llama.cpp context (per slot for llama-server)")
    parser.add_argument("--llamacpp-cache-bytes", type=int, default=2 << 30,
                        help="llama.cpp prompt cache size in RAM (default 2 GiB; "
                        "llama-server's --cache-ram)")
    parser.add_argument("--eos-ids", default="0,2",
                        help="end-of-text token ids llama.cpp is kept from sampling")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout", type=float, default=1800.0)
    parser.add_argument("--num-groups", type=int, default=8)
    parser.add_argument("--prompts-per-group", type=int, default=16)
    parser.add_argument("--system-prompt-len", type=int, default=1024)
    parser.add_argument("--question-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-conversations", type=int, default=16)
    parser.add_argument("--num-turns", type=int, default=6)
    parser.add_argument("--trace-path", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--trace-prompts", type=int, default=100)
    parser.add_argument("--trace-scale", type=int, default=16)
    parser.add_argument("--trace-time-scale", type=float, default=0.1)
    args = parser.parse_args(argv)
    if args.quick:
        args.num_groups, args.prompts_per_group, args.system_prompt_len = 2, 4, 256
        args.question_len, args.output_len = 16, 8
        args.num_conversations, args.num_turns = 3, 3
        args.trace_prompts, args.trace_scale, args.trace_time_scale = 12, 64, 0.01
        args.concurrency = "1,4"
    args.model = args.model or default_model()
    args.servers = args.servers.split(",")
    args.datasets = args.datasets.split(",")
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.eos_ids = [int(t) for t in args.eos_ids.split(",")]
    check_servers(parser, args)
    return args


def check_servers(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Rejects unknown names and a missing llama-server; drops llamacpp, with a note, when
    its virtual environment does not exist."""
    unknown = sorted(set(args.servers) - set(SERVER_NAMES))
    if unknown:
        parser.error(f"unknown server(s) {', '.join(unknown)}; choose from "
                     f"{', '.join(SERVER_NAMES)}")
    if "llama-server" in args.servers and not os.access(args.llama_server, os.X_OK):
        parser.error(f"{args.llama_server} not found: build it with "
                     "benchmarks/build_llamacpp.sh or leave llama-server out of --servers")
    if "llamacpp" in args.servers and not os.path.exists(args.llamacpp_python):
        print(f"note: skipping llamacpp (llama-cpp-python's server): {args.llamacpp_python} "
              "not found (see benchmarks/RESULTS.md to build it there)", flush=True)
        args.servers.remove("llamacpp")
    if not args.servers:
        parser.error("no server left to run")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    commands: list[str] = []
    table = ["| scenario | server | ok | req/s | out tok/s | TTFT mean (ms) | TTFT p99 (ms) | "
             "TPOT mean (ms) | E2E mean (ms) | from cache |", "|" + " --- |" * 10]
    caching = ["| scenario | estimate: perfect cache | estimate: server's pool | measured: "
               "served from cache | measured: prefill tokens saved | mean TTFT off/on | "
               "1/(1-h) bound |", "|" + " --- |" * 7]
    notes = []
    started = time.monotonic()
    for scenario in scenarios(args):
        print(f"\n=== {scenario.name} ===", flush=True)
        paths: dict[str, Path] = {}
        predicted = None
        for server in servers(args, args.port, scenario.concurrency or args.parallel):
            path, blocks = run_bench(args, scenario, server, args.port, args.out, commands)
            paths[server.name] = path
            if server.name == "prefixserve":
                predicted = estimate(path.with_suffix(".prompts.jsonl"), blocks,
                                     scenario.concurrency, commands)
        runs = {name: json.loads(path.read_text()) for name, path in paths.items()}
        compare = [*PREFIXSERVE, "bench", "compare", *map(str, paths.values()), "--plot",
                   str(args.out / f"{scenario.name}.png")]
        commands.append(f"# {scenario.name}: comparison\n{show(compare)}")
        subprocess.run(compare, cwd=REPO, check=True)
        table += scenario_rows(scenario.name, runs)
        row = caching_row(scenario.name, runs, predicted)
        if row:
            caching.append(row)
        if scenario.name.startswith("shared-prefix"):
            for line in targets(runs):
                notes.append(f"- {scenario.name}: {line}")
                print(line)
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    summary = "\n".join([
        f"Side by side, {when}, {platform.machine()} with {os.cpu_count()} CPUs, "
        f"{'quick' if args.quick else 'full'} run of `benchmarks/side_by_side.py "
        f"{shlex.join(argv if argv is not None else sys.argv[1:])}` "
        f"({time.monotonic() - started:.0f} s).", "", *table, "",
        "Caching on vs off, against `prefixserve estimate` on the prompts the cached run sent:",
        "", *caching, "", *notes, "", "Commands, in order:", "", "```sh", *commands, "```", ""])
    (args.out / "summary.md").write_text(summary)
    print("\n" + summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
