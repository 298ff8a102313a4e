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


COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_add_demo]


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
