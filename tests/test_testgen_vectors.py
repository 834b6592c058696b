"""P4Testgen's vectors of the Tofino programs (TNA: Tofino 1, T2NA: Tofino 2) and of the v1model program, held
against the protocol with no P4 tool (docs/tofino.md, "Executed by P4Testgen"; the checker is
tests/conformance/testgen.py). Fails when the vectors are stale for the program."""

from __future__ import annotations

import collections
import copy
import json
from pathlib import Path

import pytest

from tests.conformance import testgen, tofino_tree, tree_sequences, vector_tool

ROOT = Path(__file__).resolve().parent.parent
tool = vector_tool.load()

TNA = tool.PROGRAMS["tna"]
T2NA = tool.PROGRAMS["t2na"]
V1MODEL = tool.PROGRAMS["v1model"]
V1MODEL_TREE = tool.PROGRAMS["v1model_tree"]  # the tree sequences, at 4 lanes
T2NA_TREE = tool.PROGRAMS["t2na_tree"]  # the same on the Tofino 2 program, at 8 lanes
TOFINO = [TNA, T2NA]


def _load(program) -> dict:
    return json.loads((ROOT / program.vectors).read_text())


@pytest.fixture(scope="module")
def vectors() -> dict:
    return _load(TNA)


@pytest.fixture(scope="module", params=TOFINO, ids=lambda p: p.name)
def tofino(request) -> dict:
    """The vectors of one Tofino program (its file says its target: "tofino" or "tofino2")."""
    return _load(request.param)


def lanes_of(vectors: dict) -> int:
    return int(vectors["defines"]["PASSING_LANES"])


@pytest.mark.parametrize("program", [TNA, T2NA, V1MODEL, V1MODEL_TREE, T2NA_TREE], ids=lambda p: p.name)
def test_the_vectors_are_those_of_the_program_as_it_is(program):
    assert tool.stale(program) is None, tool.stale(program)


# The rules every Tofino program's vectors must show, compared (the second passes are Tofino 1's).
NEEDED_RULES = ("a completed round: ", "a retransmission to a completed round",
                "the state machine drops it (aggregated", "the state machine drops it (duplicate",
                "the state machine drops it (stale", "the state machine drops it (rejected",
                "relayed: to the job's multicast group", "rejected: ", "l2: ", "malformed: ")
SECOND_PASS_RULES = ("the second pass of a completed round", "the second pass of an answer: to the worker's port")


def test_every_vector_does_what_the_protocol_says(tofino):
    vectors, chip = tofino, tofino["target"]
    rules: collections.Counter = collections.Counter()
    outside: collections.Counter = collections.Counter()
    compared: collections.Counter = collections.Counter()  # (class, what was compared)
    divergences = []
    lanes = lanes_of(vectors)
    for vector in vectors["tests"]:
        try:
            want = testgen.expect(vector, lanes, chip)
            testgen.compare(vector, want)
            testgen.compare_registers(vector, want, lanes)
        except testgen.Outside as e:
            outside[str(e).split(":")[0]] += 1
            continue
        except testgen.Divergence as e:
            divergences.append(f"{vector['run']} test {vector['id']}: {e}")
            continue
        rules[want.rule] += 1
        output = "drop bit" if want.to == "drop" else "headers, lanes and port"
        effect = "no register written" if want.after is None else "registers after the packet"
        compared[(vector["run"], f"{output}; {effect}")] += 1  # the classes docs/tofino.md counts
    print("\n".join(f"{n:4d}  {rule}" for rule, n in sorted(rules.items())))
    print("\n".join(f"{n:4d}  outside: {why}" for why, n in sorted(outside.items())))
    print("\n".join(f"{n:4d}  {cls}: {what}" for (cls, what), n in sorted(compared.items())))
    assert not divergences, "\n".join(divergences)
    # the rules that matter are among the vectors compared (in both passes, on Tofino 1)
    for needed in NEEDED_RULES + (SECOND_PASS_RULES if chip == "tofino" else ()):
        assert any(rule.startswith(needed) for rule in rules), f"no vector compared for: {needed}"
    assert sum(outside.values()) <= sum(rules.values()) // 4, outside


def test_the_lanes_compared_carry_data(tofino):
    """Non-zero lanes of both signs, sums that saturate and sums that do not, in the lanes a first pass emits and
    in the registers it leaves (the preconditions' shaped lanes and the sequences)."""
    vectors = tofino
    lanes = lanes_of(vectors)
    emitted = [v for t in vectors["tests"] if t["ingress"] and t["ingress"]["emit"]
               for e in t["ingress"]["emit"] if e["header"] == "lanes_h" for v in e["fields"].values()]
    written = [int(w["fields"][f]) for t in vectors["tests"] for w in t["writes"]
               if w["register"].startswith("lane_pair_") for f in ("first", "second") if f in w["fields"]]
    for values in (emitted, written):
        signed = [tool.signed32(int(v)) for v in values]
        assert sum(v > 0 for v in signed) > lanes and sum(v < 0 for v in signed) > lanes
        assert 0x7FFFFFFF in signed and -0x80000000 in signed  # saturated both ways
        assert sum(v != 0 for v in signed) > 0.8 * len(signed)


# What each sequence must show, step by step (p4/testgen_vectors.py SEQUENCES), as rule prefixes; Tofino 1's
# second passes are left out on Tofino 2, which needs none.
SEQUENCE_RULES = {
    "round": ["the state machine drops it (aggregated)", "the state machine drops it (aggregated, overflow)",
              "the state machine drops it (duplicate)", "a completed round: ",
              "the second pass of a completed round", "a retransmission to a completed round",
              "the second pass of an answer: to the worker's port", "the state machine drops it (stale)",
              "the state machine drops it (aggregated)", "the state machine drops it (rejected)"],
    "refused": ["the state machine drops it (rejected)", "the state machine drops it (rejected)",
                "malformed: "],
    "relay": ["relayed: ", "rejected: a relayed kind", "relayed: ", "rejected: a relayed kind"],
    "alone": ["a completed round: ", "the second pass of a completed round"],
    "saturate": ["the state machine drops it (aggregated)", "a completed round: ",
                 "the second pass of a completed round", "the state machine drops it (aggregated)"],
    "max": ["the state machine drops it (aggregated)", "a completed round: ", "the second pass of a completed round"],
    "next_allocation": ["the state machine drops it (aggregated)", "a completed round: ",
                        "the second pass of a completed round", "the state machine drops it (aggregated)",
                        "rejected: not admitted", "a completed round: ", "the second pass of a completed round"],
    "foreign_owner": {"tofino": ["the state machine drops it (aggregated)"],  # Tofino 1 cannot check the owner
                      "tofino2": ["the state machine drops it (rejected)"]},
    "owner_only": ["the state machine drops it (aggregated)", "the state machine drops it (aggregated, overflow)",
                   "a completed round: ", "the second pass of a completed round"],
}


def sequence_rules(name: str, chip: str) -> list[str]:
    rules = SEQUENCE_RULES[name]
    if isinstance(rules, dict):
        return rules[chip]
    return [r for r in rules if chip == "tofino" or not r.startswith("the second pass")]


@pytest.mark.parametrize("name", sorted(SEQUENCE_RULES))
def test_each_sequence_runs_its_packets_through_the_registers_the_earlier_ones_left(tofino, name):
    """A sequence's vectors chain (each starts from the registers the earlier ones wrote; a second pass is what
    its first pass emitted) and each does, in order, what the sequence is for."""
    chain = sorted((v for v in tofino["tests"] if v.get("sequence") == name), key=lambda v: v["step"])
    testgen.check_chain(chain, lanes_of(tofino))
    rules = [testgen.check(v, lanes_of(tofino), tofino["target"]) for v in chain]
    want = sequence_rules(name, tofino["target"])
    assert len(rules) == len(want), rules
    for got, rule in zip(rules, want):
        assert got.startswith(rule), rules


def test_the_sequences_give_as_batches_what_they_give_one_packet_at_a_time(tofino):
    """The sequences' packets, interleaved, through one engine in batches and through another one at a time
    (testgen.check_batches); a bug in what only a batch reaches (the engine's waves, a wave of SUM and MAX rounds
    together: the "batches" mutants, which no vector of one packet shows) is a divergence there."""
    from tests.conformance import mutants

    testgen.check_batches(tofino, lanes_of(tofino))
    batch_mutants = [m for m in mutants.ENGINE_MUTANTS if m.area == "batches"]
    assert len(batch_mutants) == 2
    for mutant in batch_mutants:
        with mutants.engine_with(mutant), pytest.raises(testgen.Divergence, match="batch"):
            testgen.check_batches(tofino, lanes_of(tofino))


def test_a_chain_with_a_register_the_sequence_did_not_leave_is_a_divergence(vectors):
    chain = copy.deepcopy(sorted((v for v in vectors["tests"] if v.get("sequence") == "round"),
                                 key=lambda v: v["step"]))
    bitmap = next(r for r in chain[1]["registers"] if r["register"].endswith("slot_bitmap"))
    bitmap["value"]["bitmap"] = 4  # the second packet finds worker 2's bit, not worker 0's
    with pytest.raises(testgen.Divergence, match="slot_bitmap starts at"):
        testgen.check_chain(chain, lanes_of(vectors))


def test_the_sequences_allocations_are_the_controllers():
    """The admission entries of the sequences are those controller/passing_controller/allocation.py writes."""
    from passing_controller.allocation import Allocation, Worker
    from passing_controller.topology import Host

    for events in tool.SEQUENCES.values():
        for event in events:
            if isinstance(event, tool.Allocate):
                a = event.alloc
                hosts = [Host(f"h{w}", "02:00:00:00:00:01", "10.0.0.1", port) for w, port in enumerate(a.ports)]
                ours = Allocation(a.job, a.generation, a.base, a.pool,
                                  tuple(Worker(w, h, 40000 + w) for w, h in enumerate(hosts)))
                assert a.params() == {"base": ours.base, "pool": ours.pool, "full": ours.full, "epoch": ours.epoch,
                                      "group": ours.group}


def _first(vectors: dict, rule: str) -> dict:
    for vector in vectors["tests"]:
        try:
            if testgen.check(vector, lanes_of(vectors)) == rule:
                return vector
        except (testgen.Outside, testgen.Divergence):
            continue
    pytest.fail(f"no vector for {rule}")


@pytest.mark.parametrize("mutate,message", [
    (lambda v: v["ingress"]["emit"][-1]["fields"].__setitem__("value_1", 7), "lane 1"),
    (lambda v: v["ingress"].__setitem__("port", 5), "port"),
    (lambda v: v["ingress"]["emit"][0]["fields"].__setitem__("group", 99), "bridged_h.group"),
    (lambda v: v["ingress"].__setitem__("dropped", True), "drops it"),
])
def test_a_wrong_output_is_a_divergence(vectors, mutate, message):
    """The checker fails on what it must catch: a completed round's output changed in one place."""
    vector = copy.deepcopy(_first(vectors, "a completed round: the first pass, to the recirculation port"))
    mutate(vector)
    with pytest.raises(testgen.Divergence, match=message):
        testgen.check(vector, lanes_of(vectors))


@pytest.mark.parametrize("register,field", [("lane_pair_0", "first"), ("slot_bitmap", "bitmap"),
                                            ("slot_overflow", "value")])
def test_a_wrong_register_write_is_a_divergence(tofino, register, field):
    """A contribution's effect on its slot/set changed in one register: the checker says which."""
    vector = copy.deepcopy(next(v for v in tofino["tests"] if v.get("sequence") == "round" and v["step"] == 1))
    write = next(w for w in vector["writes"] if w["register"] == register)
    write["fields"][field] = (write["fields"][field] + 1) % (1 << 32)
    with pytest.raises(testgen.Divergence, match=f"{register} after the packet"):
        testgen.check(vector, lanes_of(tofino), tofino["target"])


def v1model_rules() -> collections.Counter:
    """The checker's rule for each of the v1model program's vectors (P4Testgen's bmv2 target, which BMv2 replays
    in bmv2_tests/): their final output against the protocol's. The bmv2 model starts every register at 0, so
    each DATA meets a new round; a vector whose admission no controller writes is outside. A divergence fails."""
    vectors = json.loads((ROOT / V1MODEL.vectors).read_text())
    rules: collections.Counter = collections.Counter()
    outside = 0
    divergences = []
    for vector in vectors["tests"]:
        if vector["run"] == "sequence":  # the tree sequences: as chains (test_each_tree_sequence_...)
            continue
        try:
            rules[testgen.v1model_check(vector, lanes_of(vectors))] += 1
        except testgen.Outside:
            outside += 1
        except testgen.Divergence as e:
            divergences.append(f"test {vector['id']}: {e}")
    print("\n".join(f"{n:4d}  {rule}" for rule, n in sorted(rules.items())), f"\n{outside:4d}  outside")
    assert not divergences, "\n".join(divergences)
    return rules


def test_every_v1model_vector_does_what_the_protocol_says():
    rules = v1model_rules()
    for needed in ("parser error", "l2: forwarded", "rejected: "):
        assert any(rule.startswith(needed) for rule in rules), f"no v1model vector compared for: {needed}"


# The tree roles' program generated with seed 3 (seed 2's in_domain run spent its tests on the tree's tables and
# reached no admitted round; docs/tofino.md, "Executed by P4Testgen").
def test_the_v1model_vectors_reach_the_state_machine():
    rules = v1model_rules()
    for needed in ("the state machine drops it (aggregated", "a completed round"):
        assert any(rule.startswith(needed) for rule in rules), f"no v1model vector compared for: {needed}"


# ---- the tree roles on the v1model program: pinned sequences (p4/testgen_tree_sequences.py) ----------------------

# What each tree sequence must show, step by step (TREE_SEQUENCES), as rule prefixes (tree_vectors, testgen.v1model_*)
TREE_SEQUENCE_RULES = {
    "leaf_round": ["leaf: the state machine drops it (aggregated)", "leaf: a leaf's partial up (aggregated, completed",
                   "leaf: a leaf's partial up (duplicate, sent_up)", "down: the state machine drops it (rejected)",
                   "down: the state machine drops it (rejected)",
                   "down: a completed round: multicast (RESULT; answered",
                   "down: the state machine drops it (late_answer)",
                   "leaf: a retransmission to a completed round: answered (duplicate_answered)"],
    "leaf_ack": ["leaf: the state machine drops it (aggregated)", "down: the state machine drops it (late_answer)",
                 "leaf: a leaf's partial up (aggregated, completed",
                 "down: a completed round: multicast (ACK; answered",
                 "leaf: a retransmission to a completed round: answered (duplicate_answered)",
                 "leaf: a retransmission to a completed round: answered (duplicate_answered)"],
    "leaf_owner": ["leaf: the state machine drops it (aggregated)", "leaf: a leaf's partial up (aggregated, completed",
                   "down: a completed round: multicast (RESULT; answered"],
    "leaf_relay": ["leaf: a leaf's NACK up (relayed, sent_up)", "leaf: relayed (GATHER; relayed, sent_up)",
                   "down: relayed (NACK; relayed)", "down: the state machine drops it (rejected)"],
    "root_round": ["root: the state machine drops it (aggregated)", "root: a completed round: multicast (DATA;",
                   "root: a retransmission to a completed round: answered (duplicate_answered)"],
}


def _tree_chain(name: str, program=V1MODEL_TREE) -> list[dict]:
    vectors = _load(program)
    return sorted((v for v in vectors["tests"] if v.get("sequence") == name), key=lambda v: v["step"])


# each program's tree sequences and their checker: the v1model program's final packets, the Tofino 2 program's at
# its traffic manager (tests/conformance/tofino_tree.py)
TREE_CHECKERS = {V1MODEL_TREE.name: tree_sequences.check_tree_sequence, T2NA_TREE.name: tofino_tree.check_tree_sequence}


@pytest.mark.parametrize("program", [V1MODEL_TREE, T2NA_TREE], ids=lambda p: p.name)
@pytest.mark.parametrize("name", sorted(TREE_SEQUENCE_RULES))
def test_each_tree_sequence_runs_through_the_registers_the_earlier_ones_left(program, name):
    """A tree sequence's vectors chain through the registers, and each packet's output and the registers it
    leaves are the reference's roles' (tree_sequences / tofino_tree.check_tree_sequence), doing in order what it
    is for."""
    assert set(tool.TREE_SEQUENCES) == set(TREE_SEQUENCE_RULES)
    chain = _tree_chain(name, program)
    rules = TREE_CHECKERS[program.name](chain, lanes_of(_load(program)))
    want = TREE_SEQUENCE_RULES[name]
    assert len(rules) == len(want), rules
    for got, rule in zip(rules, want):
        assert got.startswith(rule), rules


def _emitted(vector: dict, header: str) -> dict:
    return next(e["fields"] for e in vector["ingress"]["emit"] if e["header"] == header)


# One thing the Tofino 2 program hands its traffic manager changed in a tree sequence's vector: the checker names it
@pytest.mark.parametrize("name,step,mutate,message", [
    ("leaf_round", 1, lambda v: _emitted(v, "lanes_h").__setitem__("value_3", 5), "lane 3 is 5"),
    ("leaf_round", 1, lambda v: _emitted(v, "ethernet_h").__setitem__("dst_addr", 5), "ethernet_h.dst_addr is 5"),
    ("leaf_round", 1, lambda v: v["ingress"].__setitem__("port", 2), "to port 6, the program sends it to port 2"),
    ("leaf_round", 2, lambda v: _emitted(v, "tree_bridged_h").__setitem__("resend", 0), "resend is 0"),
    ("leaf_round", 5, lambda v: _emitted(v, "passing_h").__setitem__("generation", 4), "passing_h.generation is 4"),
    ("leaf_ack", 4, lambda v: _emitted(v, "tree_bridged_h").__setitem__("ack", 0), "ack is 0"),
    ("leaf_owner", 2, lambda v: _emitted(v, "tree_bridged_h").__setitem__("owner_only", 0), "owner_only is 0"),
    ("leaf_owner", 2, lambda v: _emitted(v, "tree_bridged_h").__setitem__("owner_rid", 0), "owner_rid is 0"),
    ("leaf_relay", 1, lambda v: _emitted(v, "tree_bridged_h").__setitem__("relay_up", 0), "relay_up is 0"),
    ("root_round", 1, lambda v: _emitted(v, "passing_h").__setitem__("flags", 0), "passing_h.flags is 0"),
])
def test_a_tofino2_tree_vector_with_a_wrong_output_is_a_divergence(name, step, mutate, message):
    chain = copy.deepcopy(_tree_chain(name, T2NA_TREE))
    mutate(chain[step])
    with pytest.raises(testgen.Divergence, match=f"step {step}: .*{message}"):
        tofino_tree.check_tree_sequence(chain, lanes_of(_load(T2NA_TREE)))


@pytest.mark.parametrize("register,field", [("slot_phase", "value"), ("lane_pair_0", "first"),
                                            ("slot_overflow", "value")])
def test_a_tofino2_tree_vector_that_writes_what_the_reference_does_not_is_a_divergence(register, field):
    """The root's RESULT taken at a leaf (step 5 of leaf_round): its phase, sums or flag recorded otherwise."""
    chain = copy.deepcopy(_tree_chain("leaf_round", T2NA_TREE))
    write = next(w for w in chain[5]["writes"] if w["register"] == register)
    write["fields"][field] = (write["fields"][field] + 1) % (1 << 32)
    with pytest.raises(testgen.Divergence, match=f"step 5 .*after the packet: {register}"):
        tofino_tree.check_tree_sequence(chain, lanes_of(_load(T2NA_TREE)))


def test_a_leafs_nack_up_is_the_tree_roles_not_a_flat_jobs():
    """A leaf's NACK to another rack's server leaves by the uplink's port: the tree model holds it (the flat-only
    checker called it a divergence: a flat job of two workers has no owner 3 and drops the NACK)."""
    vector = copy.deepcopy(_tree_chain("leaf_relay")[0])
    lanes = lanes_of(_load(V1MODEL_TREE))
    assert testgen.v1model_check(vector, lanes).startswith("leaf: a leaf's NACK up")
    flat = copy.deepcopy(vector)
    flat["tables"] = [e for e in flat["tables"] if not e["table"].endswith(("tree_role", "owner_map"))]
    with pytest.raises(testgen.Divergence, match="the program sends it to port 6"):
        testgen.v1model_check(flat, lanes)
    vector["expect"]["packet"] = vector["expect"]["packet"][:-2] + "00"  # the last lane's last byte
    with pytest.raises(testgen.Divergence, match="the program's packet"):
        testgen.v1model_check(vector, lanes)


@pytest.mark.parametrize("step,register", [(1, "lane_acc"), (5, "slot_phase"), (5, "lane_acc")])
def test_a_tree_sequence_that_writes_what_the_reference_does_not_is_a_divergence(step, register):
    """A write of the leaf's round changed (the partial's sums, the root's answer recorded): the chain fails there
    (the next vector then starts from registers the sequence did not leave, and that is a divergence too)."""
    chain = copy.deepcopy(_tree_chain("leaf_round"))
    write = next(w for w in chain[step]["writes"] if w["register"] == register)
    write["value"] = (write["value"] + 1) % (1 << 32)
    with pytest.raises(testgen.Divergence, match=f"step {step} .*after the packet: {register}"):
        tree_sequences.check_tree_sequence(chain, lanes_of(_load(V1MODEL_TREE)))


# ---- the mutation score (docs/tofino.md, "Mutation score") --------------------------------------------------

# The engine's mutants no vector can see, and why (docs/tofino.md lists them with the same words).
ENGINE_SURVIVORS = {
    "a GATHER relayed back to its sender too": "which replicas leave is the egress's; neither model replicates",
}


@pytest.mark.slow
def test_the_vectors_kill_nine_in_ten_bugs_planted_in_the_reference():
    """`make p4-mutants` without P4MUTANTS: every planted bug of the reference engine is killed by a vector check
    but the documented survivors, and at least 90 % are."""
    from tests.conformance import mutants

    results = mutants.engine_score([_load(TNA), _load(T2NA)], _load(V1MODEL), [_load(V1MODEL_TREE), _load(T2NA_TREE)])
    survivors = {r["mutant"] for r in results if not r["killed"]}
    assert survivors == set(ENGINE_SURVIVORS), survivors
    assert len(results) >= 25 and sum(r["killed"] for r in results) >= 0.9 * len(results)


def test_the_recorded_p4_mutants_are_of_the_program_as_it_is():
    """p4/tna/mutants.json (`make p4-mutants P4MUTANTS=1`): each mutant still applies to the program, at least six
    were run, at least 90 % were killed, and docs/tofino.md names each survivor."""
    from tests.conformance import mutants

    recorded = json.loads((ROOT / "p4" / "tna" / "mutants.json").read_text())
    by_name = {m.name: m for m in mutants.P4_MUTANTS}
    assert {r["mutant"] for r in recorded["results"]} == set(by_name)
    for m in mutants.P4_MUTANTS:
        mutants.p4_file_of(m)  # raises when the program no longer has the mutated text
    killed = sum(r["killed"] for r in recorded["results"])
    assert len(recorded["results"]) >= 6 and killed >= 0.9 * len(recorded["results"])
    docs = (ROOT / "docs" / "tofino.md").read_text()
    for r in recorded["results"]:
        assert r["killed"] or r["mutant"] in docs, f"survivor not in docs/tofino.md: {r['mutant']}"


@pytest.mark.parametrize("program", ["v1model", "t2na"])
def test_the_recorded_tree_mutants_are_of_the_program_as_it_is(program):
    """p4/v1model/tree_mutants.json, p4/t2na/tree_mutants.json (`make p4-mutants P4MUTANTS=1`): each mutant of the
    program's tree rules still applies to the program, at least 90 % were killed, and docs/tofino.md names each
    survivor."""
    from tests.conformance import tree_mutants

    target = tree_mutants.TARGETS[program]
    recorded = json.loads(target.record.read_text())
    assert {r["mutant"] for r in recorded["results"]} == {m.name for m in target.mutants}
    for m in target.mutants:
        tree_mutants.file_of(target, m)  # raises when the program no longer has the mutated text
    killed = sum(r["killed"] for r in recorded["results"])
    assert len(recorded["results"]) >= 4 and killed >= 0.9 * len(recorded["results"])
    docs = (ROOT / "docs" / "tofino.md").read_text()
    for r in recorded["results"]:
        assert r["killed"] or r["mutant"] in docs, f"survivor not in docs/tofino.md: {r['mutant']}"
