"""How much of a served benchmark run the engine is busy: every engine step of the server timed.

    .venv/bin/python benchmarks/served_steps.py [--out DIR] [--port 8123]
        [--serve-args "--max-num-seqs 16"] [--bench-args "--dataset multi-turn ..."]

Starts ``prefixserve serve`` (the default model, two threads) in a child process whose engine
writes one line per step (start, seconds, kind, tokens, requests) to ``DIR/steps.jsonl``; runs
``prefixserve bench`` against it (by default side_by_side.py's multi-turn run at 16 clients:
16 conversations x 6 turns, 64-token messages and answers); stops the server and prints the
bench's wall time next to the engine's busy time, split into decode steps (every request adds
one token) and mixed steps (some request computes prompt tokens; ``replay_split.step_kind``),
and each mixed step. Where
the engine is busy nearly the whole wall, the HTTP side costs the run nothing measurable and
the run's speed is the steps' (``replay_split.py`` replays the prompts without HTTP).
The per-step timing costs the step one ``perf_counter`` pair and one short write.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

from replay_split import step_kind
from side_by_side import REPO, Server, start, stop

BENCH_DEFAULT = ("--dataset multi-turn --num-conversations 16 --num-turns 6 --question-len 64 "
                 "--output-len 64 --seed 0 --max-concurrency 16")


def serve_timed(log_path: str, serve_argv: list[str]) -> int:
    """The child: ``prefixserve serve`` with every engine step timed into ``log_path``."""
    from prefixserve.cli import main
    from prefixserve.engine import llm_engine
    from prefixserve.engine.scheduler import SchedulerOutput

    execute = llm_engine.LLMEngine._execute
    log = open(log_path, "w")  # noqa: SIM115 - open for the server's lifetime

    def timed(engine: llm_engine.LLMEngine, scheduled: SchedulerOutput):  # type: ignore[no-untyped-def]
        begin = time.perf_counter()
        out = execute(engine, scheduled)
        seconds = time.perf_counter() - begin
        log.write(json.dumps([begin, seconds, step_kind(scheduled), scheduled.num_tokens,
                              len(scheduled.scheduled)]) + "\n")
        log.flush()
        return out

    llm_engine.LLMEngine._execute = timed  # type: ignore[method-assign]
    return main(["serve", *serve_argv])


def report(steps_path: Path, bench_path: Path) -> None:
    rows = [json.loads(line) for line in steps_path.open()]
    wall = json.loads(bench_path.read_text())["wall_s"]
    first, last = rows[0], rows[-1]
    span = last[0] + last[1] - first[0]
    busy = sum(r[1] for r in rows)
    print(f"\nbench wall {wall:.2f} s; engine steps {len(rows)} over {span:.2f} s, busy "
          f"{busy:.2f} s ({busy / wall:.0%} of the bench wall, {busy / span:.0%} of the span)")
    print("| steps | count | seconds | ms per step | tokens |")
    print("|---|---|---|---|---|")
    for kind in ("decode", "mixed"):
        chosen = [r for r in rows if r[2] == kind]
        seconds = sum(r[1] for r in chosen)
        print(f"| {kind} | {len(chosen)} | {seconds:.2f} | "
              f"{seconds / max(1, len(chosen)) * 1e3:.1f} | {sum(r[3] for r in chosen)} |")
    print("\nmixed steps: | at s | ms | tokens | requests |")
    for r in rows:
        if r[2] == "mixed":
            print(f"| {r[0] - first[0]:.2f} | {r[1] * 1e3:.0f} | {r[3]} | {r[4]} |")


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        sys.exit(serve_timed(sys.argv[2], sys.argv[3:]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("served-steps"))
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--serve-args", default="--max-num-seqs 16")
    parser.add_argument("--bench-args", default=BENCH_DEFAULT)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    steps, bench = args.out / "steps.jsonl", args.out / "bench.json"
    serve_argv = ["--host", "127.0.0.1", "--port", str(args.port), "--num-threads", "2",
                  "--disable-access-log", "--log-stats-interval", "0",
                  *shlex.split(args.serve_args)]
    server = Server("prefixserve", [sys.executable, __file__, "--child", str(steps.resolve()),
                                    *serve_argv], [])
    process = start(server, args.port, args.out / "server.log")
    try:
        command = [sys.executable, "-m", "prefixserve", "bench", "--base-url",
                   f"http://127.0.0.1:{args.port}/v1", *shlex.split(args.bench_args),
                   "--json", str(bench.resolve()), "--no-progress"]
        print("$", shlex.join(command).replace(sys.executable, ".venv/bin/python"), flush=True)
        subprocess.run(command, check=True, cwd=REPO)
    finally:
        stop(process)
    report(steps, bench)


if __name__ == "__main__":
    main()
