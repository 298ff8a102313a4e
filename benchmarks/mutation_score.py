"""The mutation score of the last ``mutmut run`` (``make mutation``), per target and per module.

Reads mutmut's result files under ``mutants/`` (``*.meta``: an exit code per mutant) and
prints, for ``prefixserve/core`` and for the scheduler, how many mutants were killed (a test
failed; a timeout counts as killed: the mutant made the tests hang), survived (every selected
test passed), had no test reaching them, or were not checked, and the score
``killed / (killed + survived + no tests)``. Then the surviving mutants, one a line
(``mutmut show NAME`` prints the change). Usage::

    python benchmarks/mutation_score.py [--survivors]
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

STATUS = {1: "killed", 3: "killed", 36: "killed", -24: "killed", 24: "killed", 152: "killed",
          255: "killed", 0: "survived", 5: "no tests", 33: "no tests", None: "not checked"}
TARGETS = {"core": "prefixserve/core/", "scheduler": "prefixserve/engine/scheduler.py"}


def load(root: Path) -> dict[str, dict[str, int | None]]:
    """{source path: {mutant name: exit code}} from mutmut's ``.meta`` files."""
    out = {}
    for meta in sorted(root.rglob("*.py.meta")):
        source = str(meta.relative_to(root))[: -len(".meta")]
        out[source] = json.loads(meta.read_text())["exit_code_by_key"]
    return out


def main() -> None:
    results = load(Path("mutants"))
    if not results:
        sys.exit("no mutmut results under mutants/: run `make mutation` first")
    survivors = []
    print(f"{'target':<34} {'killed':>7} {'survived':>9} {'no tests':>9} {'unchecked':>10} "
          f"{'score':>7}")
    for target, prefix in TARGETS.items():
        totals: Counter[str] = Counter()
        for source, codes in results.items():
            if not source.startswith(prefix):
                continue
            counts = Counter(STATUS.get(code, "killed") for code in codes.values())
            totals += counts
            survivors += [name for name, code in codes.items() if code == 0]
            _row(f"  {source}", counts)
        _row(target, totals)
    if "--survivors" in sys.argv:
        print("\nsurvived:")
        for name in survivors:
            print(f"  {name}")


def _row(label: str, counts: Counter[str]) -> None:
    judged = counts["killed"] + counts["survived"] + counts["no tests"]
    score = f"{100 * counts['killed'] / judged:.1f}%" if judged else "-"
    print(f"{label:<34} {counts['killed']:>7} {counts['survived']:>9} {counts['no tests']:>9} "
          f"{counts['not checked']:>10} {score:>7}")


if __name__ == "__main__":
    main()
