"""The mutation score of the last ``mutmut run`` (``make mutation``), per target and per module.

Reads mutmut's result files under ``mutants/`` (``*.meta``: an exit code per mutant) and
prints, for ``prefixserve/core`` and for the scheduler, how many mutants were killed (a test
failed; a timeout counts as killed: the mutant made the tests hang), survived (every selected
test passed), had no test reaching them, were not checked, or are listed in
``mutation_equivalent.txt`` (surviving mutants that cannot change behaviour, each with its
reason), and the score ``killed / (killed + survived + no tests)``, equivalent and unchecked
mutants left out. Then the surviving and the untested mutants, one a line (``mutmut show
NAME`` prints the change). Usage::

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

EQUIVALENT_FILE = Path(__file__).with_name("mutation_equivalent.txt")


def load_equivalent(path: Path = EQUIVALENT_FILE) -> dict[str, str]:
    """{mutant name: why it is equivalent} from ``mutation_equivalent.txt`` (``NAME: reason``
    lines; ``#`` comments)."""
    out = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, reason = line.partition(": ")
            out[name.strip()] = reason.strip()
    return out


EQUIVALENT = load_equivalent()


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
          f"{'equivalent':>11} {'score':>7}")
    for target, prefix in TARGETS.items():
        totals: Counter[str] = Counter()
        for source, codes in results.items():
            if not source.startswith(prefix):
                continue
            counts = Counter(_status(name, code) for name, code in codes.items())
            totals += counts
            survivors += [(name, _status(name, code)) for name, code in codes.items()
                          if _status(name, code) in ("survived", "no tests")]
            _row(f"  {source}", counts)
        _row(target, totals)
    if "--survivors" in sys.argv:
        print("\nsurvived or reached by no test:")
        for name, status in survivors:
            print(f"  {name}" + (" (no tests)" if status == "no tests" else ""))
        print("\nequivalent (left out of the score):")
        for name, reason in EQUIVALENT.items():
            print(f"  {name}: {reason}")


def _status(name: str, code: int | None) -> str:
    status = STATUS.get(code, "killed")
    return "equivalent" if name in EQUIVALENT and status == "survived" else status


def _row(label: str, counts: Counter[str]) -> None:
    judged = counts["killed"] + counts["survived"] + counts["no tests"]
    score = f"{100 * counts['killed'] / judged:.1f}%" if judged else "-"
    print(f"{label:<34} {counts['killed']:>7} {counts['survived']:>9} {counts['no tests']:>9} "
          f"{counts['not checked']:>10} {counts['equivalent']:>11} {score:>7}")


if __name__ == "__main__":
    main()
