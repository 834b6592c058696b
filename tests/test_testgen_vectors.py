"""P4Testgen's vectors of the TNA program, held against the protocol with no P4 tool (docs/tofino.md, "Executed by
P4Testgen"; the checker is tests/conformance/testgen.py). Fails when the vectors are stale for the program."""

from __future__ import annotations

import collections
import copy
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tests.conformance import testgen

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("testgen_vectors", ROOT / "p4" / "testgen_vectors.py")
tool = importlib.util.module_from_spec(_spec)
sys.modules["testgen_vectors"] = tool  # p4/ is no package (`p4` is p4runtime's protobuf package)
_spec.loader.exec_module(tool)

TNA = tool.PROGRAMS["tna"]
V1MODEL = tool.PROGRAMS["v1model"]


@pytest.fixture(scope="module")
def vectors() -> dict:
    return json.loads((ROOT / TNA.vectors).read_text())


def lanes_of(vectors: dict) -> int:
    return int(vectors["defines"]["PASSING_LANES"])


@pytest.mark.parametrize("program", [TNA, V1MODEL], ids=lambda p: p.name)
def test_the_vectors_are_those_of_the_program_as_it_is(program):
    assert tool.stale(program) is None, tool.stale(program)


def test_every_vector_does_what_the_protocol_says(vectors):
    rules: collections.Counter = collections.Counter()
    outside: collections.Counter = collections.Counter()
    divergences = []
    for vector in vectors["tests"]:
        try:
            rules[testgen.check(vector, lanes_of(vectors))] += 1
        except testgen.Outside as e:
            outside[str(e).split(":")[0]] += 1
        except testgen.Divergence as e:
            divergences.append(f"{vector['run']} test {vector['id']}: {e}")
    print("\n".join(f"{n:4d}  {rule}" for rule, n in sorted(rules.items())))
    print("\n".join(f"{n:4d}  outside: {why}" for why, n in sorted(outside.items())))
    assert not divergences, "\n".join(divergences)
    # the rules that matter are among the vectors compared, in both passes
    for needed in ("a completed round: the first pass", "a retransmission to a completed round",
                   "the state machine drops it (aggregated", "the state machine drops it (duplicate",
                   "the state machine drops it (stale", "relayed: to the job's multicast group",
                   "rejected: ", "l2: ", "the second pass of a completed round",
                   "the second pass of an answer: to the worker's port"):
        assert any(rule.startswith(needed) for rule in rules), f"no vector compared for: {needed}"
    assert sum(outside.values()) <= sum(rules.values()) // 4, outside


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


def test_every_v1model_vector_does_what_the_protocol_says():
    """The same checker on the v1model program's vectors (P4Testgen's bmv2 target, which BMv2 replays in
    bmv2_tests/): their final output against the protocol's. The bmv2 model starts every register at 0, so each
    DATA meets a new round; a vector whose admission no controller writes is outside."""
    vectors = json.loads((ROOT / V1MODEL.vectors).read_text())
    rules: collections.Counter = collections.Counter()
    outside = 0
    divergences = []
    for vector in vectors["tests"]:
        try:
            rules[testgen.v1model_check(vector, lanes_of(vectors))] += 1
        except testgen.Outside:
            outside += 1
        except testgen.Divergence as e:
            divergences.append(f"test {vector['id']}: {e}")
    print("\n".join(f"{n:4d}  {rule}" for rule, n in sorted(rules.items())), f"\n{outside:4d}  outside")
    assert not divergences, "\n".join(divergences)
    for needed in ("parser error", "l2: forwarded", "rejected: ", "the state machine drops it (aggregated",
                   "a completed round"):
        assert any(rule.startswith(needed) for rule in rules), f"no v1model vector compared for: {needed}"
