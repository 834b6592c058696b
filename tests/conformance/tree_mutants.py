"""Mutants of the tree rules of the v1model and Tofino 2 programs (docs/tofino.md, "Mutation score"): one bug planted
at a time in the program (``p4/v1model/passing.p4``; ``p4/t2na/passing.p4`` or the Tofino include that holds the
text); the tree sequences (p4/testgen_tree_sequences.py) are made again on the mutated program by P4Testgen and
checked as chains against the reference as it is (tree_sequences.check_tree_sequence, tofino_tree's for Tofino 2).
A mutant is killed when a chain diverges, or when a pinned packet has no path with the controller's entries.

    python -m tests.conformance.tree_mutants [--program t2na] [--only NAME [--update]] [--record FILE]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from . import tofino_tree, tree_sequences, vector_tool
from .mutants import ROOT, Mutant, mutated
from .tree_vectors import Divergence

tool = vector_tool.load()
V1MODEL = ROOT / "p4" / "v1model" / "passing.p4"
T2NA = ROOT / "p4" / "t2na" / "passing.p4"

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

# The same rules in the Tofino 2 program (p4/t2na/passing.p4, p4/include/tofino_tree*.p4), and the rules only its
# ingress decides for the egress (the tree bridged header's flags)
T2NA_TREE_MUTANTS = (
    Mutant("a re-sent partial not flagged RETRANSMIT", "tree", "meta.tree.resend = 1;", ""),
    Mutant("the root's RESULT not written over the partial", "tree",
           "if (!is_ack) {\n                                meta.lane_op = LANE_WRITE;", "if (false) {"),
    Mutant("a second answer from the root taken again", "tree",
           "if (phase == 0) {\n                phase = 1;", "if (phase <= 2) {\n                phase = 1;"),
    Mutant("a NACK to another rack's server relayed in the rack", "tree",
           "} else if (meta.leaf == 1 && meta.owner_up == 1) {", "} else if (false) {"),
    Mutant("the root's ACK's OVERFLOW flag not recorded", "tree",
           "meta.round_overflow = overflow_start.execute(meta.slot_set);\n                            "
           "meta.verdict = VERDICT_ANSWERED;", "meta.verdict = VERDICT_ANSWERED;"),
    Mutant("the root's answer from a server's port taken", "tree",
           "if (meta.up_port_x != 0 || meta.up_generation_x != 0", "if (meta.up_generation_x != 0"),
    Mutant("the root's answer of another generation taken", "tree",
           "meta.up_port_x != 0 || meta.up_generation_x != 0 || meta.up_worker_x != 0",
           "meta.up_port_x != 0 || meta.up_worker_x != 0"),
    Mutant("an answer from the root for a round not complete here taken", "tree",
           "meta.old_bitmap = bitmap_read.execute(meta.slot_set);\n                            "
           "if (meta.old_bitmap == meta.full) {",
           "meta.old_bitmap = bitmap_read.execute(meta.slot_set);\n                            if (true) {"),
    Mutant("a partial up with the leaf's generation", "tree",
           "hdr.passing.job = meta.tree.up_job;\n        hdr.passing.generation = meta.tree.up_generation;\n"
           "        hdr.passing.worker = meta.tree.up_worker;\n        hdr.passing.flags = meta.up_flags;",
           "hdr.passing.job = meta.tree.up_job;\n        hdr.passing.worker = meta.tree.up_worker;\n"
           "        hdr.passing.flags = meta.up_flags;"),
    Mutant("a root's answers without OWNER_ONLY", "tree",
           "meta.result_flags = meta.round_flags;", "meta.result_flags = meta.round_overflow;"),
    Mutant("the root's OWNER_ONLY RESULT at a leaf sent whole to every server", "tree",
           "meta.tree.owner_only = 1;  /* the RESULT to the rack's owner", "/* the RESULT to the rack's owner"),
    Mutant("a leaf's GATHER not copied up", "tree", "meta.tree.relay_up = 1;", ""),
    Mutant("a leaf answered by an ACK answers a retransmission with the partial", "tree",
           "if (meta.leaf == 1 && meta.phase == 2) {", "if (false) {"),
)


@dataclass(frozen=True)
class Target:
    """A program whose tree rules are mutated: its mutants, its tree sequences' generator and checker."""

    name: str  # of testgen_vectors.PROGRAMS
    source: Path
    mutants: tuple[Mutant, ...]
    lanes: int  # the tree sequences' (the program's vectors file)
    run: Callable
    check: Callable
    record: Path


TARGETS = {
    "v1model": Target("v1model_tree", V1MODEL, P4_TREE_MUTANTS, 4, tool.run_tree_sequence,
                      tree_sequences.check_tree_sequence, ROOT / "p4" / "v1model" / "tree_mutants.json"),
    "t2na": Target("t2na_tree", T2NA, T2NA_TREE_MUTANTS, 8, tool.run_tofino_tree_sequence,
                   tofino_tree.check_tree_sequence, ROOT / "p4" / "t2na" / "tree_mutants.json"),
}


def file_of(target: Target, mutant: Mutant) -> Path:
    """The one file of the program (it or an include) where the mutant's text is, once."""
    found = [f for f in tool.sources_of(target.source) if mutant.old in f.read_text()]
    if len(found) != 1:
        raise ValueError(f"mutant {mutant.name!r}: its text is in {len(found)} files of {target.source.name}")
    mutated(found[0].read_text(), mutant)  # raises unless it is there once
    return found[0]


def failure_of(target: Target, source: Path) -> str | None:
    """The tree sequences of a variant of the program, made side by side, each checked as a chain; the first
    divergence, or None."""
    program = tool.PROGRAMS[target.name]

    def one(name: str) -> str | None:
        roles, events = tool.TREE_SEQUENCES[name]
        try:
            chain = target.run(program, name, roles, events, target.lanes, source, [])
        except SystemExit as e:  # the pinned packet has no path with the controller's entries
            return f"sequence {name}: no vector: {e}"
        try:
            target.check(chain, target.lanes)
        except Divergence as e:
            return str(e)
        return None

    with ThreadPoolExecutor(len(tool.TREE_SEQUENCES)) as pool:
        failures = [f for f in pool.map(one, tool.TREE_SEQUENCES) if f]
    return failures[0] if failures else None


def score(target: Target, only: list[str] | None = None) -> list[dict]:
    results = []
    for mutant in target.mutants:
        if only and mutant.name not in only:
            continue
        where = file_of(target, mutant)
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="passing-tree-mutant-") as d:
            shutil.copytree(ROOT / "p4", Path(d) / "p4", ignore=shutil.ignore_patterns("*.json", "__pycache__"))
            copy = Path(d) / where.relative_to(ROOT)
            copy.write_text(mutated(where.read_text(), mutant))
            failure = failure_of(target, Path(d) / target.source.relative_to(ROOT))
        results.append({"mutant": mutant.name, "killed": failure is not None, "by": failure,
                        "seconds": round(time.monotonic() - started, 1)})
        print(json.dumps(results[-1]), flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--program", choices=sorted(TARGETS), default="v1model")
    parser.add_argument("--only", action="append", help="a mutant by name (repeatable)")
    parser.add_argument("--record", type=Path, help="write the results there (JSON)")
    parser.add_argument("--update", action="store_true",
                        help="with --record and --only: replace those mutants' results in the record, keep the "
                             "others' (the record must be of the program as it is)")
    args = parser.parse_args(argv)
    target = TARGETS[args.program]
    program = tool.program_sha256(target.source)
    kept: list[dict] = []
    if args.update:
        if not (args.record and args.only):
            parser.error("--update needs --record and --only")
        recorded = json.loads(args.record.read_text())
        if recorded["program_sha256"] != program or recorded["lanes"] != target.lanes:
            sys.exit(f"--update: {args.record} is of another program or lane count: record every mutant")
        kept = [r for r in recorded["results"] if r["mutant"] not in args.only]
    results = score(target, args.only)
    if args.record:
        order = [m.name for m in target.mutants]
        merged = sorted(kept + results, key=lambda r: order.index(r["mutant"]))
        args.record.write_text(json.dumps({"program_sha256": program, "lanes": target.lanes, "results": merged},
                                          indent=1) + "\n")
    return 0 if sum(r["killed"] for r in results) >= 0.9 * len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
