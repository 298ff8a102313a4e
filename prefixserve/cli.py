"""The ``prefixserve`` command line: a dispatcher over the commands' own parsers.

Each command module builds its subparser with ``add_parser(subparsers)`` and sets ``func``, the
function that runs it. Those modules import only argparse and a few constants, so building the
parser (and ``prefixserve --help``) never imports torch or the engine."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from prefixserve.server import cli_args as serve_args
from prefixserve.tools import demo_args, estimate_args
from prefixserve.tools.bench import args as bench_args

COMMANDS: list[Callable[[argparse._SubParsersAction], argparse.ArgumentParser]] = [
    demo_args.add_parser,
    estimate_args.add_parser,
    serve_args.add_parser,
    bench_args.add_parser,
]


def build_parser() -> argparse.ArgumentParser:
    """The ``prefixserve`` parser, with every command registered in ``COMMANDS`` order."""
    parser = argparse.ArgumentParser(
        prog="prefixserve",
        description="An LLM inference engine built around automatic prefix caching.",
    )
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    for add in COMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the command it names; returns the exit status."""
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
