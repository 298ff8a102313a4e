"""The ``prefixserve demo`` command line: its parser, kept apart from ``demo`` so that building
the ``prefixserve`` parser imports neither rich nor the engine."""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``prefixserve demo`` on ``subparsers``."""
    parser = subparsers.add_parser(
        "demo",
        help="show the prefix cache at work",
        description="Runs requests that share a prefix through the prefix cache and shows, per "
        "request, how many prompt tokens came from the cache.",
    )
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Run the demo (imports the engine)."""
    from prefixserve.tools.demo import run_demo

    run_demo()
    return 0
