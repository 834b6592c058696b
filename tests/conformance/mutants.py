"""How much the P4Testgen vectors hold the programs to: a mutation score (docs/tofino.md, "Mutation score").

Each mutant is one plausible bug planted in one place: in the reference engine
(``host/passing/aggregator/engine.py``, the side every vector is compared with), or in the TNA program itself.
A mutant is *killed* when a vector check fails on it: for the engine, the checks of the vectors in the
repository (the Tofino vectors one by one, their sequences as chains and as batches, the v1model vectors) run
against the mutated engine; for the TNA program, P4Testgen makes the vectors of the mutated program (both runs
and the sequences, at 4 lanes to keep each mutant to minutes) and the same checks run on them against the engine
as it is. A mutant no vector sees *survives*; docs/tofino.md says why for each.

    python -m tests.conformance.mutants             # the engine's mutants (seconds; `make p4-mutants`)
    python -m tests.conformance.mutants --p4        # and the TNA program's (needs p4testgen; minutes each)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
import time
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from passing.aggregator import engine as engine_module

from . import testgen, tofino_tree, tree_sequences, tree_vectors, vector_tool

ROOT = Path(__file__).resolve().parent.parent.parent
tool = vector_tool.load()


@dataclass(frozen=True)
class Mutant:
    name: str
    area: str  # what the bug is about
    old: str  # the text it replaces, exactly once in the file
    new: str


ENGINE_MUTANTS = (
    # completion
    Mutant("a round completes one contribution early", "completion",
           "done = (fresh | contrib) & (self.bitmap[k] == jobs.full[d])",
           "done = (fresh | contrib) & ((self.bitmap[k] == jobs.full[d]) | (self.bitmap[k] == jobs.full[d] >> 1))"),
    Mutant("a duplicate completes the round again", "completion",
           "done = (fresh | contrib) & (self.bitmap[k] == jobs.full[d])",
           "done = (fresh | contrib | dup) & (self.bitmap[k] == jobs.full[d])"),
    Mutant("a round a single contribution fills never completes", "completion",
           "done = (fresh | contrib) & (self.bitmap[k] == jobs.full[d])",
           "done = contrib & (self.bitmap[k] == jobs.full[d])"),
    # saturation
    Mutant("negative saturation to INT32_MAX", "saturation",
           "np.where(current[wrapped] < 0, wire.INT32_MIN, wire.INT32_MAX)",
           "np.where(current[wrapped] < 0, wire.INT32_MAX, wire.INT32_MAX)"),
    Mutant("positive saturation to INT32_MIN", "saturation",
           "np.where(current[wrapped] < 0, wire.INT32_MIN, wire.INT32_MAX)",
           "np.where(current[wrapped] < 0, wire.INT32_MIN, wire.INT32_MIN)"),
    Mutant("sums wrap instead of saturating", "saturation", "if wrapped.any():", "if False:"),
    Mutant("overflow told from one operand's sign", "saturation",
           "wrapped = ((current ^ combined) & (incoming ^ combined)) < 0", "wrapped = (current ^ combined) < 0"),
    # flags
    Mutant("a saturated lane sets no flag", "flags",
           "lane_overflow = lane_overflow | (wrapped.any(axis=1) & ~is_max)", "lane_overflow = lane_overflow"),
    Mutant("the OVERFLOW flag overwritten instead of OR-ed", "flags",
           "self.overflow[ck] |= lane_overflow", "self.overflow[ck] = lane_overflow"),
    Mutant("a new round keeps the old round's flag", "flags",
           "self.overflow[fk] = flagged[fresh]", "self.overflow[fk] |= flagged[fresh]"),
    Mutant("a contribution's OVERFLOW flag ignored", "flags",
           "lane_overflow = flagged[contrib]", "lane_overflow = flagged[contrib] & False"),
    Mutant("the RESULT carries no OVERFLOW flag", "flags",
           'rh["flags"] = self.overflow[k[src]] * wire.FLAG_OVERFLOW', 'rh["flags"] = 0'),
    # admission
    Mutant("slot <= pool admitted", "admission",
           "(~is_data | (slot < jobs.pool[dc]))", "(~is_data | (slot <= jobs.pool[dc]))"),
    Mutant("a worker's origin not checked", "admission",
           "& (jobs.sources[dc, np.minimum(worker, wire.MAX_WORKERS - 1)] == sources)", ""),
    Mutant("another protocol version taken", "admission",
           '(hdr["version"] == wire.VERSION)', '(hdr["version"] >= 2)'),
    # generation and epoch
    Mutant("no generation check", "generation/epoch",
           '& (hdr["generation"] == jobs.generation[dc])', ""),
    Mutant("no epoch check", "generation/epoch",
           "same_epoch = self.state_epoch[k] == job_epoch", "same_epoch = self.state_epoch[k] >= -1"),
    Mutant("a round records the generation as its epoch", "generation/epoch",
           "self.state_epoch[fk] = job_epoch[fresh]", "self.state_epoch[fk] = jobs.generation[d][fresh]"),
    # duplicates
    Mutant("a duplicate is added again", "duplicates", "contrib = same_round & ~has_bit", "contrib = same_round"),
    Mutant("a duplicate answered before completion", "duplicates",
           "answered = dup & (bitmap == jobs.full[d])", "answered = dup"),
    Mutant("a retransmission to a completed round not answered", "duplicates",
           "answered = dup & (bitmap == jobs.full[d])", "answered = dup & False"),
    # staleness
    Mutant("a packet behind the round starts a new one", "staleness",
           "fresh = ~same_epoch | ((ahead != 0) & (ahead < 1 << 31))", "fresh = ~same_epoch | (ahead != 0)"),
    Mutant("psn compared without serial-number wrap", "staleness",
           "ahead = (psn - self.tag[k]) & 0xFFFFFFFF", "ahead = psn - self.tag[k]"),
    # MAX
    Mutant("MAX keeps the incoming value", "MAX",
           "combined = np.maximum(current, incoming)", "combined = incoming.copy()"),
    Mutant("MAX keeps the stored value", "MAX",
           "combined = np.maximum(current, incoming)", "combined = current.copy()"),
    Mutant("MAX runs as SUM", "MAX", 'is_max = hdr["op"][contrib] == wire.MAX', 'is_max = hdr["op"][contrib] == 99'),
    # OWNER_ONLY
    Mutant("OWNER_ONLY answers everyone with the sums", "OWNER_ONLY",
           'ack = ((hdr["flags"][src] & wire.FLAG_OWNER_ONLY) != 0) & (dest_worker != owner[src])',
           "ack = np.zeros(src.size, dtype=bool)"),
    Mutant("an OWNER_ONLY owner that is no worker admitted", "OWNER_ONLY",
           "& (~owner_only | (owner >= 0) | (owner == UP))", ""),
    # GATHER and NACK relay
    Mutant("a GATHER of another worker's piece relayed", "GATHER relay",
           "& ((kind != wire.GATHER) | (owner == worker))", ""),
    Mutant("a NACK to its own sender relayed", "GATHER relay",
           "& ((kind != wire.NACK) | ((owner != worker) & ((owner >= 0) | (owner == UP))))",
           "& ((kind != wire.NACK) | ((owner >= 0) | (owner == UP)))"),
    Mutant("a GATHER relayed back to its sender too", "GATHER relay",
           "np.flatnonzero(np.arange(jobs.workers[j]) != w) if g", "np.arange(jobs.workers[j]) if g"),
    # set and slot addressing
    Mutant("the set ignored", "set/slot addressing",
           'key = (jobs.base[d[idx]] + slot[idx]) * 2 + (hdr["set"][idx] & 1)',
           "key = (jobs.base[d[idx]] + slot[idx]) * 2"),
    Mutant("the job's base ignored", "set/slot addressing",
           'key = (jobs.base[d[idx]] + slot[idx]) * 2 + (hdr["set"][idx] & 1)',
           'key = slot[idx] * 2 + (hdr["set"][idx] & 1)'),
    Mutant("a new round adds onto the slot's old sums", "set/slot addressing",
           "acc[fk] = payload[fresh]", "acc[fk] = acc[fk] + payload[fresh]"),
    # the tree's roles (docs/protocol.md, "Trees across racks"): a leaf's partial up and its re-sending, what
    # comes down from the root and what it leaves, a root's answers (the v1model tree sequences)
    Mutant("a leaf's completed round not sent up", "tree",
           "up_i = np.flatnonzero((done & leaf) | pending)", "up_i = np.flatnonzero(pending)"),
    Mutant("a retransmission to a leaf's unanswered round answered with the partial", "tree",
           "pending = answered & leaf & (phase == 0)", "pending = answered & leaf & (phase == 0) & False"),
    Mutant("a re-sent partial not flagged RETRANSMIT", "tree", "| resent * wire.FLAG_RETRANSMIT)", ")"),
    Mutant("a partial up without its OWNER_ONLY", "tree", '| (hdr["flags"][up_i] & wire.FLAG_OWNER_ONLY)', ""),
    Mutant("a partial up with the leaf's job and generation", "tree",
           'uh["job"], uh["generation"], uh["worker"] = jobs.up_job[du], jobs.up_generation[du], jobs.up_worker[du]',
           'uh["job"], uh["generation"], uh["worker"] = jobs.job_id[du], jobs.generation[du], jobs.up_worker[du]'),
    Mutant("the root's RESULT not written over the partial", "tree",
           "acc[k[result]] = payload[result]", "acc[k[result]] = acc[k[result]]"),
    Mutant("the root's answer's OVERFLOW flag not kept", "tree",
           "self.overflow[k[down]] = flagged[down]", "self.overflow[k[down]] = self.overflow[k[down]]"),
    Mutant("a root's ACK recorded as a RESULT", "tree",
           "self.phase[k[down]] = np.where(result[down], 1, 2)", "self.phase[k[down]] = np.where(result[down], 1, 1)"),
    Mutant("a second answer from the root taken again", "tree",
           "down = ~data & same_round & (bitmap == jobs.full[d]) & (phase == 0)",
           "down = ~data & same_round & (bitmap == jobs.full[d])"),
    Mutant("an answer from the root for a round not complete here taken", "tree",
           "down = ~data & same_round & (bitmap == jobs.full[d]) & (phase == 0)",
           "down = ~data & same_round & (phase == 0)"),
    Mutant("the root's answer taken from any origin", "tree", "& (jobs.up_source[dc] == sources)", ""),
    Mutant("the root's answer of another generation taken", "tree",
           '(hdr["generation"] == jobs.up_generation[dc])', '(hdr["generation"] >= 0)'),
    Mutant("a NACK to another rack's server not sent up", "tree",
           "goes_up = ~down & jobs.leaf[d] & (gather | (owner == UP))", "goes_up = ~down & jobs.leaf[d] & gather"),
    Mutant("a root's answers without OWNER_ONLY", "tree",
           'rh["flags"] |= jobs.root[d[src]] * (hdr["flags"][src] & wire.FLAG_OWNER_ONLY)', 'rh["flags"] |= 0'),
    # batches: what only several packets in one engine call reach (testgen.check_batches)
    Mutant("a batch's packets of one slot/set in one wave", "batches",
           "rank[order] = position - np.maximum.accumulate(np.where(first, position, 0))", "rank[order] = 0"),
    Mutant("a MAX contribution in a wave with SUM ones summed", "batches",
           "combined[is_max] = np.maximum(current[is_max], incoming[is_max])", "combined[is_max] = combined[is_max]"),
)

TNA = ROOT / "p4" / "tna" / "passing.p4"
P4_MUTANTS = (
    Mutant("a packet of the round under way starts it again", "staleness",
           "(int<32>)(hdr.passing.psn - value.tag) > 0", "(int<32>)(hdr.passing.psn - value.tag) >= 0"),
    Mutant("the OVERFLOW flag overwritten instead of OR-ed", "flags",
           "value = value | meta.flagged;", "value = meta.flagged;"),
    Mutant("lane 2k wraps instead of saturating", "saturation",
           "value.first = value.first |+| (int<32>)hdr.lanes.value_##a;",
           "value.first = value.first + (int<32>)hdr.lanes.value_##a;"),
    Mutant("MAX runs as SUM", "MAX", "(_, _, PASSING_OP_MAX): contribute_max();",
           "(_, _, PASSING_OP_MAX): contribute_add();"),
    Mutant("a stale packet joins the round", "staleness",
           "if (value.psn == hdr.passing.psn) {", "if (true) {"),
    Mutant("the RESULT flagged with the last packet's flag", "flags",
           "hdr.passing.flags = meta.round_overflow;", "hdr.passing.flags = meta.flagged;"),
    Mutant("the second pass reads lane 2k + 1", "set/slot addressing",
           "first = value.first;                                                                 \\",
           "first = value.second;                                                                \\"),
    Mutant("the set ignored in the slot/set index", "set/slot addressing",
           "meta.slot_set = (bit<32>)(hdr.passing.set[0:0] ++ meta.base_plus_slot[PASSING_SLOT_BITS - 1:0]);",
           "meta.slot_set = (bit<32>)(1w0 ++ meta.base_plus_slot[PASSING_SLOT_BITS - 1:0]);"),
    Mutant("a retransmission to a completed round counted a duplicate", "duplicates",
           "if (meta.old_bitmap == meta.full) {", "if (meta.old_bitmap == 0xffffffff) {"),
)


def mutated(text: str, mutant: Mutant) -> str:
    if text.count(mutant.old) != 1:
        raise ValueError(f"mutant {mutant.name!r}: {mutant.old!r} occurs {text.count(mutant.old)} times")
    return text.replace(mutant.old, mutant.new)


def p4_file_of(mutant: Mutant) -> Path:
    """The one file of the TNA program (it or an include) where the mutant's text is, once."""
    found = [f for f in tool.sources_of(TNA) if mutant.old in f.read_text()]
    if len(found) != 1:
        raise ValueError(f"mutant {mutant.name!r}: its text is in {len(found)} files of the TNA program")
    return found[0]


@contextlib.contextmanager
def engine_with(mutant: Mutant) -> Iterator[None]:
    """The checker's reference engine replaced by the mutated one for the duration."""
    path = Path(engine_module.__file__)
    module = types.ModuleType("passing.aggregator.engine_mutant")
    module.__package__ = "passing.aggregator"
    module.__file__ = str(path)
    sys.modules[module.__name__] = module  # its dataclasses look their module up
    exec(compile(mutated(path.read_text(), mutant), str(path), "exec"), module.__dict__)
    saved = testgen.reference
    testgen.reference = tree_vectors.reference = module
    try:
        yield
    finally:
        testgen.reference = tree_vectors.reference = saved
        del sys.modules[module.__name__]


def first_failure(tofino: list[dict], v1model: dict | None, trees: Sequence[dict] = ()) -> str | None:
    """The first vector check that fails (a divergence, or the checker failing on a mutated engine), or None:
    the vectors of each Tofino program one by one, their sequences as chains and as batches, then the v1model
    ones, then the tree sequences (``trees``: the v1model program's and the Tofino 2 program's) as chains."""
    for vectors in tofino:
        lanes, chip = int(vectors["defines"]["PASSING_LANES"]), vectors.get("target", "tofino")
        sequences: dict[str, list[dict]] = {}
        for vector in vectors["tests"]:
            try:
                testgen.check(vector, lanes, chip)
            except testgen.Outside:
                continue
            except Exception as e:  # noqa: BLE001 -- a mutant may make the checker fail any way: it is killed
                where = f"sequence {vector['sequence']} step {vector['step']}" if vector["run"] == "sequence" \
                    else f"{vector['run']} test {vector['id']}"
                return f"{chip} {where}: {type(e).__name__}: {e}"
            if vector["run"] == "sequence":
                sequences.setdefault(vector["sequence"], []).append(vector)
        for name, chain in sequences.items():
            try:
                testgen.check_chain(sorted(chain, key=lambda v: v["step"]), lanes)
            except testgen.Divergence as e:
                return f"{chip} sequence {name}: {e}"
        try:
            testgen.check_batches(vectors, lanes)
        except Exception as e:  # noqa: BLE001
            return f"{chip} sequences as batches: {type(e).__name__}: {e}"
    if v1model is not None:
        lanes = int(v1model["defines"]["PASSING_LANES"])
        for vector in v1model["tests"]:
            try:
                testgen.v1model_check(vector, lanes)
            except testgen.Outside:
                continue
            except Exception as e:  # noqa: BLE001
                return f"v1model test {vector['id']}: {type(e).__name__}: {e}"
    for vectors in trees:
        lanes, chip = int(vectors["defines"]["PASSING_LANES"]), vectors["target"]
        check = tofino_tree.check_tree_sequence if chip == "tofino2" else tree_sequences.check_tree_sequence
        chains: dict[str, list[dict]] = {}
        for vector in vectors["tests"]:
            chains.setdefault(vector["sequence"], []).append(vector)
        for name, chain in chains.items():
            try:
                check(sorted(chain, key=lambda v: v["step"]), lanes)
            except Exception as e:  # noqa: BLE001
                return f"{chip} tree sequence {name}: {type(e).__name__}: {e}"
    return None


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def engine_score(tofino: list[dict], v1model: dict | None, trees: Sequence[dict] = ()) -> list[dict]:
    """Each engine mutant against the vectors; first the engine as it is, which must pass them (the control)."""
    control = first_failure(tofino, v1model, trees)
    if control is not None:
        raise SystemExit(f"the vectors fail with the engine as it is: {control}")
    results = []
    for mutant in ENGINE_MUTANTS:
        with engine_with(mutant):
            failure = first_failure(tofino, v1model, trees)
        results.append({"mutant": mutant.name, "area": mutant.area, "killed": failure is not None,
                        "by": failure})
    return results


def _mutant_failure(source: Path, lanes: int, seed: int, max_tests: int) -> str | None:
    """P4Testgen's vectors of a variant of the TNA program checked as they come, stopping at the first failure: the
    sequences first, one at a time (a round's bugs show in a few packets), then the two runs."""
    program = tool.PROGRAMS["tna"]
    for name, events in tool.SEQUENCES.items():
        vectors = tool.run_sequence(program, name, events, lanes, source, [])
        failure = first_failure([{"defines": {"PASSING_LANES": lanes}, "target": program.target, "tests": vectors}],
                                None)
        if failure is not None:
            return failure
    for run in program.runs:
        tests, _ = tool.run_p4testgen(program, run, max_tests, seed, {"PASSING_LANES": lanes}, [], None, source)
        for t in tests:
            t["run"] = run.name
        failure = first_failure([{"defines": {"PASSING_LANES": lanes}, "target": program.target, "tests": tests}],
                                None)
        if failure is not None:
            return failure
    return None


def p4_score(lanes: int, seed: int, max_tests: int, only: list[str] | None = None, control: bool = True) -> list[dict]:
    """Each TNA mutant's vectors made by P4Testgen and checked (stopping at the first failure); first, unless told
    not to, the program as it is, which must pass all of them (the control)."""
    results = []
    for mutant in ((None,) if control else ()) + P4_MUTANTS:
        if only and mutant is not None and mutant.name not in only:
            continue
        with tempfile.TemporaryDirectory(prefix="passing-mutant-") as tmp:
            shutil.copytree(ROOT / "p4", Path(tmp) / "p4", ignore=shutil.ignore_patterns("*.json", "__pycache__"))
            source = Path(tmp) / "p4" / "tna" / "passing.p4"
            if mutant is not None:
                where = p4_file_of(mutant)
                target = Path(tmp) / where.relative_to(ROOT)
                target.write_text(mutated(where.read_text(), mutant))
            started = time.monotonic()
            failure = _mutant_failure(source, lanes, seed, max_tests)
        seconds = round(time.monotonic() - started)
        if mutant is None:
            if failure is not None:
                raise SystemExit(f"the TNA program as it is fails its own vectors at {lanes} lanes: {failure}")
            print(f"the program as it is: its vectors pass ({seconds} s)", flush=True)
            continue
        results.append({"mutant": mutant.name, "area": mutant.area, "killed": failure is not None,
                        "by": failure, "seconds": seconds})
        print(f"{'killed  ' if failure else 'SURVIVED'} {mutant.name}: {failure or ''} ({seconds} s)", flush=True)
    return results


def report(title: str, results: list[dict]) -> float:
    killed = sum(r["killed"] for r in results)
    print(f"\n{title}: {killed} of {len(results)} killed ({100 * killed / len(results):.0f} %)")
    for r in results:
        print(f"  {'killed  ' if r['killed'] else 'SURVIVED'} [{r['area']}] {r['mutant']}"
              + (f"\n             by {r['by'][:150]}" if r["killed"] else ""))
    return killed / len(results)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--p4", action="store_true", help="also the TNA program's mutants (needs p4testgen)")
    parser.add_argument("--lanes", type=int, default=4, help="PASSING_LANES of the TNA mutants' vectors")
    parser.add_argument("--record", type=Path, help="write the TNA mutants' results there (JSON)")
    parser.add_argument("--only", action="append", help="a TNA mutant by name (repeatable)")
    parser.add_argument("--no-engine", action="store_true", help="the TNA program's mutants alone")
    parser.add_argument("--no-control", action="store_true",
                        help="skip the run of the TNA program as it is (the control; minutes)")
    parser.add_argument("--max-tests", type=int, default=100,
                        help="paths each greedy run of a TNA mutant explores (at 4 lanes the runs' coverage stops "
                             "growing well before 100)")
    args = parser.parse_args(argv)
    rates = []
    if not args.no_engine:
        tofino = [_load(ROOT / tool.PROGRAMS[name].vectors) for name in ("tna", "t2na")]
        v1model = _load(ROOT / tool.PROGRAMS["v1model"].vectors)
        trees = [_load(ROOT / tool.PROGRAMS[name].vectors) for name in ("v1model_tree", "t2na_tree")]
        rates.append(report("Reference engine mutants against the TNA, T2NA, v1model and both tree sequences' vectors",
                            engine_score(tofino, v1model, trees)))
        for name, vectors in zip(("TNA", "T2NA"), tofino):
            report(f"Reference engine mutants against the {name} vectors alone", engine_score([vectors], None))
        report("Reference engine mutants against the v1model vectors alone", engine_score([], v1model))
        for name, vectors in zip(("v1model", "T2NA"), trees):
            report(f"Reference engine mutants against the {name} tree sequences alone",
                   engine_score([], None, [vectors]))
    if args.p4:
        results = p4_score(args.lanes, 2, args.max_tests, args.only, not args.no_control)
        rates.append(report(f"TNA program mutants ({args.lanes} lanes)", results))
        if args.record:
            args.record.write_text(json.dumps({"program_sha256": tool.program_sha256(TNA), "lanes": args.lanes,
                                               "max_tests": args.max_tests, "results": results}, indent=1) + "\n")
    return 0 if all(rate >= 0.9 for rate in rates) else 1


if __name__ == "__main__":
    sys.exit(main())
