"""The v1model program's tree sequences held against the reference's roles (docs/tofino.md, "Sequences"; made by
p4/testgen_tree_sequences.py): packets chained through the registers, each a pinned P4Testgen run of the bmv2
target.

One reference engine holds the sequence's jobs with their roles (``engine_for``: the vectors' ``allocations`` and
``roles``, as the controller installs them) and takes the packets in order, as the switch does. For each vector:

1. its registers are what the earlier vectors wrote (the chain);
2. its output (P4Testgen's expected packet and port, or a drop) is the reference's (testgen.v1model_check with the
   sequence's engine: a partial or a NACK up leaves by the uplink's port, an answer by the worker's, a multicast
   is a drop in the model);
3. the registers it leaves (its registers with its ``writes``) are the reference's slot/sets after it, through
   the abstraction: ``slot_epoch`` the allocation's epoch (0: never used, the reference's -1), ``slot_tag`` the
   round's psn, ``slot_bitmap`` its contributors, ``slot_overflow`` its flag, ``lane_acc[slot_set * lanes + i]``
   lane i, and at a leaf job's slot/set ``slot_phase`` whether the root answered (0 no, 1 a RESULT, 2 an ACK).
   Every slot/set either side changed is compared.
"""

from __future__ import annotations

import numpy as np

from passing.aggregator import engine as reference
from passing.aggregator.engine import JobSpec, Uplink

from . import testgen, tree_vectors
from .tree_vectors import Divergence

SLOT_REGISTERS = ("slot_epoch", "slot_tag", "slot_bitmap", "slot_overflow", "slot_phase")


def engine_for(vector: dict, lanes: int) -> tuple[reference.AggregationEngine, set[int]]:
    """The reference with the sequence's jobs in their roles; and the leaf jobs' slot/sets (``slot_phase``), as the
    reference indexes them ((base + slot) * 2 + set, the v1model program's too)."""
    roles = {r["job"]: r for r in vector["roles"]}
    specs, leaf_slots = [], set()
    for a in vector["allocations"]:
        r = roles.get(a["job"], {"role": "flat", "owners": [], "up": None})
        up = r["up"]
        specs.append(JobSpec(a["job"], a["base"], a["pool"], list(a["ports"]), generation=a["generation"],
                             lanes=None, role=r["role"], owners=list(r["owners"]) or None,
                             up=None if up is None else Uplink(up["job"], up["generation"], up["worker"], up["port"])))
        if r["role"] == "leaf":
            leaf_slots |= set(range(a["base"] * 2, (a["base"] + a["pool"]) * 2))
    return tree_vectors.engine_of(specs, lanes), leaf_slots


def _engine_state(engine: reference.AggregationEngine) -> tuple[np.ndarray, ...]:
    return (engine.state_epoch.copy(), engine.tag.copy(), engine.bitmap.copy(), engine.overflow.copy(),
            engine.phase.copy(), engine.acc.copy())


def _reference_view(engine: reference.AggregationEngine, k: int, leaf: bool) -> dict[str, object]:
    view = {"slot_epoch": max(int(engine.state_epoch[k]), 0), "slot_tag": int(engine.tag[k]) % (1 << 32),
            "slot_bitmap": int(engine.bitmap[k]), "slot_overflow": int(engine.overflow[k]),
            "lanes": [int(v) % (1 << 32) for v in engine.acc[k]]}
    if leaf:
        view["slot_phase"] = int(engine.phase[k])
    return view


def _program_view(state: dict[tuple[str, int], int], k: int, lanes: int, leaf: bool) -> dict[str, object]:
    view: dict[str, object] = {r: state.get((r, k), 0) for r in SLOT_REGISTERS if r != "slot_phase" or leaf}
    view["lanes"] = [state.get(("lane_acc", k * lanes + i), 0) for i in range(lanes)]
    return view


def _difference(program: dict, ref: dict) -> str:
    for name, value in ref.items():
        if name == "lanes":
            wrong = [i for i, (a, b) in enumerate(zip(program["lanes"], value)) if a != b]
            if wrong:
                i = wrong[0]
                return f"lane_acc lane {i} = {program['lanes'][i]}, the reference's {value[i]} ({len(wrong)} lanes)"
        elif program[name] != value:
            return f"{name} = {program[name]}, the reference's {value}"
    return ""


def check_tree_sequence(chain: list[dict], lanes: int) -> list[str]:
    """The rules of a chain of vectors, in order; raises Divergence where the program and the reference part."""
    engine, leaf_slots = engine_for(chain[0], lanes)
    state: dict[tuple[str, int], int] = {}
    rules = []
    for vector in chain:
        where = f"sequence {vector['sequence']} step {vector['step']}"
        for r in vector["registers"]:
            if state.get((r["register"], r["index"]), 0) != r["value"]:
                raise Divergence(f"{where}: {r['register']}[{r['index']}] starts at {r['value']}, the sequence "
                                 f"left {state.get((r['register'], r['index']), 0)}")
        before = _engine_state(engine)
        try:
            rules.append(testgen.v1model_check(vector, lanes, engine))
        except Divergence as e:
            raise Divergence(f"{where}: {e}") from e
        touched = set()
        for w in vector["writes"]:
            state[(w["register"], w["index"])] = w["value"]
            touched.add(w["index"] // lanes if w["register"] == "lane_acc" else w["index"])
        after = _engine_state(engine)
        for b, a in zip(before, after):
            changed = b != a
            touched |= set(np.flatnonzero(changed.any(axis=1) if changed.ndim > 1 else changed).tolist())
        for k in sorted(touched):
            leaf = k in leaf_slots
            wrong = _difference(_program_view(state, k, lanes, leaf), _reference_view(engine, k, leaf))
            if wrong:
                raise Divergence(f"{where} ({rules[-1]}): slot/set {k} after the packet: {wrong}")
    return rules
