"""How many greedy outputs change with the batch, the prefix cache, the chunking and the
server's load: with ``--deterministic`` (must be none) and without it (documented, not asserted).

Reproduce with::

    .venv/bin/python benchmarks/determinism_report.py                       # the issue's checks
    .venv/bin/python benchmarks/determinism_report.py --prompts 8 --max-tokens 8 --no-server

For each weights mode (``--weights bf16 --dtype bfloat16`` and ``--weights auto``) and each of
the default and the deterministic mode, it runs ``--prompts`` varied prompts
(``prefixserve.tools.determinism.varied_prompts``) greedily, ``--max-tokens`` tokens each, and
counts the prompts whose tokens differ from the prompt run alone without cache: (a) in a batch
of 16 others, (b) read from the prefix cache, (c) chunked at ``--chunk`` tokens instead of 2048,
and (d) through a server, concurrent vs sequential (``--no-server`` skips it). The counts do
not depend on machine load: they can be recorded with the date, the command and the CPU.

First it shows why the mode needs its own products: for each weight shape of the default
model and each dtype, the row counts M at which torch's ``F.linear`` gives the same bits for
row 0 (one group per kernel torch picked; ``--gemm-only`` stops there).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from prefixserve import LLM
from prefixserve.tools.determinism import (
    CheckResult,
    offline_checks,
    server_checks,
    varied_prompts,
)

ROOT = Path(__file__).resolve().parent.parent
MODES = {"bf16": ("bf16", "bfloat16"), "packed": ("auto", "auto")}


#: (out, in) features of the default model's products: QKV, O, gate+up, down, output head.
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576))
ROW_COUNTS = (1, 2, 3, 4, 5, 8, 16, 17, 32, 64, 65, 128, 256, 300)


def gemm_groups(dtype: torch.dtype, shape: tuple[int, int]) -> list[list[int]]:
    """Row counts grouped by the bits of row 0 of ``F.linear`` (random weights and input)."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(*shape, generator=gen).to(dtype)
    x = torch.randn(max(ROW_COUNTS), shape[1], generator=gen).to(dtype)
    groups: list[tuple[torch.Tensor, list[int]]] = []
    for rows in ROW_COUNTS:
        row = F.linear(x[:rows], weight)[0]
        match = next((g for g in groups if torch.equal(g[0], row)), None)
        if match is None:
            groups.append((row, [rows]))
        else:
            match[1].append(rows)
    return [members for _, members in groups]


def print_gemm_groups(console: Console) -> None:
    table = Table(title=f"torch F.linear: row counts giving the same row 0 "
                  f"({torch.get_num_threads()} threads)")
    for column in ("dtype", "out x in", "groups of row counts"):
        table.add_column(column)
    for dtype in (torch.float32, torch.bfloat16):
        for shape in SHAPES:
            groups = gemm_groups(dtype, shape)
            table.add_row(str(dtype).removeprefix("torch."), f"{shape[0]}x{shape[1]}",
                          " | ".join(",".join(map(str, g)) for g in groups))
    console.print(table)


def run_offline(weights: str, dtype: str, deterministic: bool, args: argparse.Namespace
                ) -> list[CheckResult]:
    prompts = varied_prompts(args.prompts)
    llm = LLM(weights=weights, dtype=dtype, deterministic=deterministic)
    chunked = LLM(weights=weights, dtype=dtype, deterministic=deterministic,
                  max_num_batched_tokens=args.chunk)
    return offline_checks(llm, prompts, args.max_tokens, batch_size=17, chunked=chunked)


def run_server(weights: str, dtype: str, deterministic: bool, args: argparse.Namespace
               ) -> CheckResult:
    sys.path.insert(0, str(ROOT / "tests"))
    from server_helpers import ServerProcess  # the tests' real server process

    flags = ["--weights", weights, "--dtype", dtype] + (["--deterministic"] * deterministic)
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess(flags, Path(tmp) / "server.log").start()
        try:
            return server_checks(server.url, "SmolLM2-135M-Instruct",
                                 varied_prompts(args.prompts), args.max_tokens, concurrency=16)
        finally:
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--modes", default="bf16,packed", help="bf16, packed or both")
    parser.add_argument("--only", choices=("default", "deterministic"),
                        help="run one of the two modes (a row takes ~15 min on 2 cores)")
    parser.add_argument("--no-server", action="store_true")
    parser.add_argument("--gemm-only", action="store_true")
    args = parser.parse_args()
    console = Console()
    print_gemm_groups(console)
    if args.gemm_only:
        return
    table = Table(title=f"prompts (of {args.prompts}) whose greedy tokens differ from alone, "
                  "uncached, unchunked")
    for column in ("weights", "mode", "batch of 17", "cache (hit tokens)",
                   f"chunked at {args.chunk}", "server concurrent", "seconds"):
        table.add_column(column)
    for name in args.modes.split(","):
        weights, dtype = MODES[name]
        for deterministic in (False, True):
            if args.only and (args.only == "deterministic") != deterministic:
                continue
            start = time.perf_counter()
            results = run_offline(weights, dtype, deterministic, args)
            if not args.no_server:
                results.append(run_server(weights, dtype, deterministic, args))
            by_name = {r.name: r for r in results}
            cells = [str(len(by_name["batch"].differing)),
                     f"{len(by_name['cache'].differing)} ({by_name['cache'].cached_tokens})",
                     str(len(by_name["chunked"].differing)),
                     str(len(by_name["server"].differing)) if "server" in by_name else "-"]
            table.add_row(name, "deterministic" if deterministic else "default", *cells,
                          f"{time.perf_counter() - start:.0f}")
            console.print(name, "deterministic" if deterministic else "default", *cells)
    console.print(table)


if __name__ == "__main__":
    main()
