"""The mutation score of the last ``mutmut run`` (``make mutation``), per target and per module.

Reads mutmut's result files under ``mutants/`` (``*.meta``: an exit code per mutant) and
prints, for ``prefixserve/core`` and for the scheduler, how many mutants were killed (a test
failed; a timeout counts as killed: the mutant made the tests hang), survived (every selected
test passed), had no test reaching them, were not checked, or are listed in ``EQUIVALENT``
below (surviving mutants that cannot change behaviour, each with its reason), and the score
``killed / (killed + survived + no tests)``, equivalent and unchecked mutants left out. Then
the surviving mutants, one a line (``mutmut show NAME`` prints the change). Usage::

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

EQUIVALENT: dict[str, str] = {
    # Equivalent mutants: changes no test can observe, each with the reason. They are listed
    # apart (``equivalent`` column) and left out of the score; a mutant listed here that a test
    # kills is counted killed. Names are mutmut's (``mutmut show NAME``); a change to the
    # function renumbers its mutants, so check this list after editing one of them.
    **dict.fromkeys([
        "prefixserve.core.hashing.x__encode__mutmut_27",
        "prefixserve.core.hashing.x__encode__mutmut_51",
        "prefixserve.core.hashing.x__encode__mutmut_63",
        "prefixserve.core.hashing.x__encode__mutmut_75",
        "prefixserve.core.hashing.x_serialize_block__mutmut_10",
    ], '"<i" for "<I" packing a length: equal bytes below 2**31 (no key or block is 2 GiB)'),
    **dict.fromkeys([
        "prefixserve.core.hashing.x__token_bytes__mutmut_9",
        "prefixserve.core.hashing.x__token_bytes__mutmut_10",
    ], "the big-endian branch's test mangled: this machine is little-endian"),
    **dict.fromkeys([
        "prefixserve.core.block_pool.xǁBlockPoolǁ_take_retained__mutmut_5",
        "prefixserve.core.block_pool.xǁBlockPoolǁ_take_retained__mutmut_6",
    ], "a hit's expiry_seq reset mangled: while held its heap entries are stale by ref_cnt, "
       "and the next release at a retained level sets expiry_seq again"),
    "prefixserve.core.block_pool.xǁBlockPoolǁ_free_retained__mutmut_17":
        "the heap sequence stepped by 2: still unique and increasing (tie order unchanged)",
    "prefixserve.core.block_pool.xǁBlockPoolǁget_new_blocks__mutmut_17":
        "out[None:] resets blocks taken from earlier levels again: they already hold the "
        "default values",
    **dict.fromkeys([
        "prefixserve.core.block_pool.xǁBlockPoolǁget_new_blocks__mutmut_27",
        "prefixserve.core.block_pool.xǁBlockPoolǁget_new_blocks__mutmut_28",
    ], "an evicted block's expiry_seq mangled: held, its old heap entries are stale by ref_cnt "
       "and priority, and a later retained release sets expiry_seq again"),
    "prefixserve.core.block_pool.xǁBlockPoolǁfree_blocks__mutmut_8":
        "ref_cnt >= 0 inside `if ref_cnt:`: ref_cnt is never 0 there",
    "prefixserve.core.hashing.x_hash_block_chain__mutmut_66":
        "[None] * (end + first) is at least as long as needed; only the range's entries are read",
    "prefixserve.core.block_pool.xǁBlockPoolǁ_add_level__mutmut_4":
        "sort(key=None) sorts (priority, queue) pairs: priorities are distinct, same order",
    **dict.fromkeys([
        "prefixserve.core.block_pool.xǁBlockPoolǁreset_prefix_cache__mutmut_23",
        "prefixserve.core.block_pool.xǁBlockPoolǁreset_prefix_cache__mutmut_24",
        "prefixserve.core.block_pool.xǁBlockPoolǁreset_prefix_cache__mutmut_30",
    ], "[None:1], [0:None] and [0:2] of a one-element list are that list"),
}


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
            survivors += [name for name, code in codes.items()
                          if _status(name, code) == "survived"]
            _row(f"  {source}", counts)
        _row(target, totals)
    if "--survivors" in sys.argv:
        print("\nsurvived:")
        for name in survivors:
            print(f"  {name}")
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
