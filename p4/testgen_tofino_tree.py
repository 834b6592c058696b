"""The Tofino 2 program's sequences through the tree roles (p4/testgen_vectors.py; docs/tofino.md, "Sequences"):
the packets of TREE_SEQUENCES (p4/testgen_tree_sequences.py), chained through the registers, each one P4Testgen
run of the tofino2 target pinned to it. Standard library only.

The program has the pins built in (p4/include/testgen.p4, tofino_tree_common.p4), as for the flat sequences
(testgen_sequences.py): a run's passing_pin.p4 pins its input, the admission entry (a server's packet) or none
(what comes down from the root), the registers of its slot/set (slot_phase too) and the entries of the tree
roles' tables (``table_pins``: the controller's, tree_roles.leaf_entries / root_entries). What a run writes
comes from its trace (``writes``), what the ingress hands the traffic manager too (``ingress``); the program's
egress does nothing under P4Testgen (docs/tofino.md, "Executed by P4Testgen").
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from testgen_p4testgen import run_p4testgen
from testgen_programs import PIN_FILE, Program, Run
from testgen_sequences import Send, admission_hit, has_entry, pin_source, register_of, written
from testgen_tree_sequences import Role, admission, frame, sequence_of, table_pins

SLOTS = 1024  # PASSING_SLOTS: a slot/set is set * SLOTS + base + slot on Tofino
# in the order the ingress applies them: whether one is applied hangs on the earlier ones' hits
TREE_TABLES = ("uplink", "tree_role", "owner_map")


def run_tofino_tree_sequence(program: Program, name: str, roles: tuple[Role, ...], events: tuple, lanes: int,
                             source: Path, log: list[str]) -> list[dict]:
    """Every packet of a tree sequence as one pinned P4Testgen run of the tofino2 target; the registers carry over
    (a vector's initial registers are what the earlier ones wrote into its slot/set)."""
    state: dict[tuple[str, int], object] = {}
    vectors: list[dict] = []
    tree = table_pins(roles)
    for event in events:
        inp = frame(event, lanes)
        p = inp["headers"]["passing_h"]
        alloc = event.alloc if isinstance(event, Send) else event.role.alloc
        index = (p["set"] & 1) * SLOTS + alloc.base + p["slot"]
        admit = admission(event, inp)
        test = _pinned_run(program, pin_source(inp, admit, state, index, lanes, tree), admit, lanes, source, log)
        for write in test["writes"]:
            key = (write["register"], write["index"])
            state[key] = written(write["register"], register_of(state, *key), write["fields"])
        test.update(run="sequence", sequence=name, step=len(vectors), slot_set=index, **sequence_of(roles))
        vectors.append(test)
    return vectors


def _pinned_run(program: Program, pins: str, admit: dict | None, lanes: int, source: Path, log: list[str]) -> dict:
    """The pinned packet's path with the controller's tables: the admission entry iff one is installed, the
    aggregator's address, no L2 entry, and the most hits of the tree tables (every hit is pinned to the
    controller's entry: a path that misses one the controller installed is P4Testgen's choice, not the switch's),
    counted table by table in the order the ingress applies them (a path that misses uplink may hit tree_role,
    which a packet that hits uplink never meets)."""
    with tempfile.TemporaryDirectory(prefix="passing-pin-") as d:
        (Path(d) / PIN_FILE).write_text(pins)
        run = Run("pin1", {"PASSING_TESTGEN": 1, "PASSING_TESTGEN_PIN": 1}, ())
        tests, meta = run_p4testgen(program, run, 64, 1, {"PASSING_LANES": lanes}, [f"-I{d}"], None, source,
                                    coverage=False)
    log.append(f"{meta['seconds']} s {len(tests)} paths")
    ours = [t for t in tests
            if admission_hit(t) == admit and not has_entry(t, "l2_forward") and has_entry(t, "aggregator_address")]
    if not ours:
        raise SystemExit(f"no path of the pinned packet has the controller's tables: {pins.splitlines()[0]}")
    hits = [tuple(int(has_entry(t, table)) for table in TREE_TABLES) for t in ours]  # a path applies a table once
    best = [t for t, n in zip(ours, hits) if n == max(hits)]
    kept = {repr((sorted(repr(e) for e in t["tables"]), t["ingress"], t["writes"])) for t in best}
    if len(kept) != 1:
        raise SystemExit(f"{len(best)} paths hit the tree tables {max(hits)} times and differ: the pins leave a "
                         "choice\n" + "\n".join(sorted(kept)))
    return best[0]


__all__ = ["run_tofino_tree_sequence"]
