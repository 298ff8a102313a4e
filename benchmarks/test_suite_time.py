"""Wall-clock time of test files at two git refs, file by file, on this machine.

Each ref is exported (``git archive``) to a temporary directory and each file is run there as
its own ``python -m pytest -q -p no:cacheprovider FILE`` (the same interpreter, the default
thread settings, as CI runs them); the runs of the two refs alternate, ``--repeats`` times.
Prints, per file, the median seconds at each ref, the spread (max - min) and the ratio
new / old, then the totals. Run it on a quiet machine (other load inflates every figure)::

    python benchmarks/test_suite_time.py --old main --new HEAD --repeats 3 \\
        tests/engine/test_deterministic.py tests/engine/test_engine.py ...

Tests that read ``../shared/traces`` next to the checkout skip in the exported copies at both
refs alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def export(ref: str, into: Path) -> Path:
    """The tree of ``ref`` in ``into``."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref], check=True,
                             capture_output=True).stdout
    into.mkdir(parents=True)
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def run_file(tree: Path, path: str) -> tuple[float, int]:
    """Seconds of one pytest run of ``path`` in ``tree``, and its exit status."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           path], cwd=tree, env=env, capture_output=True, check=False)
    return time.monotonic() - start, done.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--old", default="main")
    parser.add_argument("--new", default="HEAD")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"old": export(args.old, Path(tmp) / "old"),
                 "new": export(args.new, Path(tmp) / "new")}
        times: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.repeats):
            for path in args.files:
                for side, tree in trees.items():
                    seconds, status = run_file(tree, path)
                    times.setdefault((side, path), []).append(seconds)
                    if status not in (0, 5):
                        print(f"warning: {path} at {side} exited {status}", file=sys.stderr)
    print(f"{'file':44} {'old s':>8} {'new s':>8} {'spread':>13} {'new/old':>8}")
    totals = {"old": 0.0, "new": 0.0}
    for path in args.files:
        medians = {side: statistics.median(times[(side, path)]) for side in trees}
        spread = "/".join(f"{max(times[(s, path)]) - min(times[(s, path)]):.1f}" for s in trees)
        for side in trees:
            totals[side] += medians[side]
        print(f"{path:44} {medians['old']:8.1f} {medians['new']:8.1f} {spread:>13} "
              f"{medians['new'] / medians['old']:8.2f}")
    print(f"{'total':44} {totals['old']:8.1f} {totals['new']:8.1f} {'':>13} "
          f"{totals['new'] / totals['old']:8.2f}")


if __name__ == "__main__":
    main()
