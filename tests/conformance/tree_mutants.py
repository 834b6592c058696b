"""Mutants of the v1model program's tree rules (docs/tofino.md, "Mutation score"): one bug planted at a time in
``p4/v1model/passing.p4``; the tree sequences (p4/testgen_tree_sequences.py) are made again on the mutated program
by P4Testgen and checked as chains against the reference as it is (tree_sequences.check_tree_sequence). A mutant is
killed when a chain diverges.

    python -m tests.conformance.tree_mutants [--only NAME] [--record p4/v1model/tree_mutants.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from . import tree_sequences, vector_tool
from .mutants import ROOT, Mutant, mutated
from .tree_vectors import Divergence

tool = vector_tool.load()
V1MODEL = ROOT / "p4" / "v1model" / "passing.p4"
LANES = 4  # the tree sequences' (p4/v1model/testgen_tree.json)

P4_TREE_MUTANTS = (
    Mutant("a re-sent partial not flagged RETRANSMIT", "tree",
           "go_up(round_overflow | PASSING_FLAG_RETRANSMIT | keep_owner_only);",
           "go_up(round_overflow | keep_owner_only);"),
    Mutant("the root's RESULT not written over the partial", "tree",
           "FOR_EACH_LANE(LANE_WRITE)", ""),
    Mutant("a second answer from the root taken again", "tree",
           "if (epoch == meta.epoch && tag == hdr.passing.psn && bitmap == meta.full && phase == 0) {",
           "if (epoch == meta.epoch && tag == hdr.passing.psn && bitmap == meta.full) {"),
    Mutant("a NACK to another rack's server relayed in the rack", "tree",
           "} else if (relay && owner_up) {", "} else if (relay && owner_up && false) {"),
    Mutant("the root's ACK's OVERFLOW flag not recorded", "tree",
           "slot_overflow.write(meta.slot_set, flags);", ""),
)


def failure_of(source: Path) -> str | None:
    """The tree sequences of a variant of the program, made side by side, each checked as a chain; the first
    divergence, or None."""
    program = tool.PROGRAMS["v1model_tree"]

    def one(name: str) -> str | None:
        roles, events = tool.TREE_SEQUENCES[name]
        try:
            chain = tool.run_tree_sequence(program, name, roles, events, LANES, source, [])
        except SystemExit as e:  # the pinned packet has no path with the controller's entries
            return f"sequence {name}: no vector: {e}"
        try:
            tree_sequences.check_tree_sequence(chain, LANES)
        except Divergence as e:
            return str(e)
        return None

    with ThreadPoolExecutor(len(tool.TREE_SEQUENCES)) as pool:
        failures = [f for f in pool.map(one, tool.TREE_SEQUENCES) if f]
    return failures[0] if failures else None


def score(only: list[str] | None = None) -> list[dict]:
    results = []
    text = V1MODEL.read_text()
    for mutant in P4_TREE_MUTANTS:
        if only and mutant.name not in only:
            continue
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="passing-tree-mutant-") as d:
            source = Path(d) / "passing.p4"
            source.write_text(mutated(text, mutant).replace('#include "../include/',
                                                              f'#include "{V1MODEL.parent.parent}/include/'))
            failure = failure_of(source)
        results.append({"mutant": mutant.name, "killed": failure is not None, "by": failure,
                        "seconds": round(time.monotonic() - started, 1)})
        print(json.dumps(results[-1]), flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", help="a mutant by name (repeatable)")
    parser.add_argument("--record", type=Path, help="write the results there (JSON)")
    args = parser.parse_args(argv)
    results = score(args.only)
    if args.record:
        args.record.write_text(json.dumps({"program_sha256": tool.program_sha256(V1MODEL), "lanes": LANES,
                                           "results": results}, indent=1) + "\n")
    return 0 if sum(r["killed"] for r in results) >= 0.9 * len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
