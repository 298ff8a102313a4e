"""The ``prefixserve`` command line: a dispatcher over the commands' own parsers.

Each command module builds its subparser with ``add_parser(subparsers)`` and sets ``func``, the
function that runs it. Those modules import only argparse and a few constants, so building the
parser (and ``prefixserve --help``) never imports torch or the engine."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from prefixserve.serve_ray import args as replica_args
from prefixserve.server import cli_args as serve_args
from prefixserve.tools import demo_args
from prefixserve.tools.bench import args as bench_args
from prefixserve.tools.estimate import args as estimate_args

#: Packages of the ``tools`` extra (tables, plots, the benchmark's HTTP client): the server and
#: the engine run without them.
TOOLS_PACKAGES = frozenset({"rich", "matplotlib", "httpx"})



def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """``prefixserve serve``: the server's flags, with the replica flags of Ray Serve
    plugged in."""
    parser = serve_args.add_parser(subparsers)
    replica_args.add_replica_arguments(parser)
    return parser


COMMANDS: list[Callable[[argparse._SubParsersAction], argparse.ArgumentParser]] = [
    demo_args.add_parser,
    estimate_args.add_parser,
    add_serve_parser,
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
    try:
        return args.func(args)
    except ModuleNotFoundError as exc:
        if exc.name not in TOOLS_PACKAGES:
            raise
        print(f"prefixserve: this command needs {exc.name}, part of the 'tools' extra: "
              "pip install 'prefixserve[tools]'", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
