"""The sequences through the tree roles (p4/testgen_vectors.py; docs/tofino.md, "Sequences"): packets chained
through the registers, each one a P4Testgen run pinned to it; here the sequences, their frames and the tree
tables' pins, and their runs on the v1model program (the bmv2 target; the Tofino 2 program's runs are
testgen_tofino_tree.py's). Standard library only.

P4Testgen's bmv2 target starts every register at 0 and takes no initial value, so a pinned run is made on a
*pinned variant* of the program (``pinned_program``), written for the run and never part of the program:

* after every ``register.read`` the value read is replaced by the sequence's register of that slot/set
  (``PASSING_PIN_<register>``, a lane's ``PASSING_PIN_LANE_<i>``), which the earlier packets wrote;
* after every ``register.write`` the index and value are assigned to metadata fields of the variant, which
  P4Testgen's trace records with their computed values (``writes_of_trace``): what the packet wrote;
* the ingress assumes the pinned input (its port and every header field) and every table action assumes the
  controller's entry for its key (or none: ``false``), as p4/include/testgen.p4 does for admission.

A run's paths are the pinned packet's, one per way P4Testgen may set the tables (an entry hit or missed);
every hit is pinned to the controller's entry, so the path with the most hits is the one with the controller's
tables. Its vector carries the table entries, the input, P4Testgen's expected output, the registers of the
slot/set it started from (``registers``) and what it wrote (``writes``), and the tree's allocations
(``allocations``, ``roles``), for tests/conformance/tree_sequences.py.
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from testgen_p4testgen import run_p4testgen
from testgen_programs import HEADER_VARIABLES, PIN_FILE, ROOT, Program, Run, ipv4_checksum
from testgen_sequences import AGGREGATOR_IP, AGGREGATOR_MAC, Allocation, Send, lane_data, pack

REGISTERS = ("slot_epoch", "slot_tag", "slot_bitmap", "slot_overflow", "slot_phase", "lane_acc")
RESULT, ACK, GATHER, NACK = 2, 3, 4, 5
OVERFLOW, RETRANSMIT, OWNER_ONLY = 0x01, 0x02, 0x04
UP, NONE = -2, -1  # an owner map's values but worker indices (controller/passing_controller/tree_roles.py)


@dataclass(frozen=True)
class Up:
    """A leaf job's uplink, as tree_roles.leaf_entries writes it: the root's job id (the controller gives the leaf
    and root jobs one id), generation and this leaf's worker there, the port toward the root and its addresses."""

    job: int
    generation: int
    worker: int
    port: int
    mac: int = 0x0200000000EE
    ip: int = 0x0A0000EE


@dataclass(frozen=True)
class Role:
    """A job's tree role on this switch: its allocation (admission), ``leaf`` with ``up`` or ``root``, and its
    owner map (a server's number in the whole job -> a worker here, UP or NONE)."""

    alloc: Allocation
    role: str
    up: Up | None = None
    owners: tuple[int, ...] | None = None

    def entries(self) -> list[dict]:
        """The table entries of tree_roles.leaf_entries / root_entries, as a vector's ``tables`` reads them."""
        a = self.alloc
        out = []
        if self.role == "leaf":
            u = self.up
            out.append({"table": "tree_role", "key": {"job": a.job}, "action": "leaf",
                        "params": {"up_job": u.job, "up_generation": u.generation, "up_worker": u.worker,
                                   "port": u.port, "mac": u.mac, "ip": u.ip}})
            out.append({"table": "uplink", "key": {"job": u.job}, "action": "from_uplink",
                        "params": {"port": u.port, "generation": u.generation, "worker": u.worker,
                                   "leaf_job": a.job, "leaf_generation": a.generation, **a.params()}})
        else:
            out.append({"table": "tree_role", "key": {"job": a.job}, "action": "root", "params": {}})
        for g, o in enumerate(self.owners or ()):
            if o == UP:
                out.append({"table": "owner_map", "key": {"job": a.job, "owner": g}, "action": "owner_up",
                            "params": {}})
            elif o != NONE:
                out.append({"table": "owner_map", "key": {"job": a.job, "owner": g}, "action": "owner_worker",
                            "params": {"worker": o}})
        return out


@dataclass(frozen=True)
class Down:
    """A packet from the root to a leaf job, on its uplink's port: a RESULT (lanes ``data``), an ACK (the header
    alone), or a GATHER or NACK relayed down."""

    role: Role
    type: int
    slot: int
    psn: int
    data: str = "up"
    set: int = 0
    flags: int = 0
    owner: int = 0
    generation: int | None = None  # the uplink's unless given
    port: int | None = None  # the uplink's port unless given (a RESULT from a server's port)


_LEAF = Role(Allocation(job=5, generation=2, base=10, pool=8, ports=(1, 2)), "leaf", Up(5, 4, 1, 6),
             owners=(0, 1, UP, UP))
_ROOT = Role(Allocation(job=40, generation=0, base=100, pool=4, ports=(3, 4)), "root", owners=(0, 0, 1, 1))
TREE_SEQUENCES: dict[str, tuple[tuple[Role, ...], tuple]] = {
    # a leaf's round: completion sends the partial up, a retransmission re-sends it (RETRANSMIT); a RESULT from a
    # server's port and one of another generation of the root's job refused; the root's RESULT is written over
    # the partial and answers the rack, a second one (other sums) is late, a retransmission is then answered
    # with the root's sums read back
    "leaf_round": ((_LEAF,), (
        Send(_LEAF.alloc, 0, slot=3, set=1, psn=11, data="up"),
        Send(_LEAF.alloc, 1, slot=3, set=1, psn=11, data="down", flags=OVERFLOW),
        Send(_LEAF.alloc, 1, slot=3, set=1, psn=11, data="down", flags=OVERFLOW | RETRANSMIT),
        Down(_LEAF, RESULT, slot=3, set=1, psn=11, data="up", port=1),
        Down(_LEAF, RESULT, slot=3, set=1, psn=11, data="up", generation=3),
        Down(_LEAF, RESULT, slot=3, set=1, psn=11, data="big"),
        Down(_LEAF, RESULT, slot=3, set=1, psn=11, data="down"),
        Send(_LEAF.alloc, 0, slot=3, set=1, psn=11, data="up", flags=RETRANSMIT))),
    # an OWNER_ONLY round whose owner is in another rack: an ACK before the round is complete here is late; the
    # partial up keeps the flag, the root's ACK (flagged OVERFLOW) answers it, a retransmission gets an ACK, and
    # so does one that says no OWNER_ONLY (the slot holds a partial, no sums to give)
    "leaf_ack": ((_LEAF,), (
        Send(_LEAF.alloc, 0, slot=5, psn=20, data="up", flags=OWNER_ONLY, owner=3),
        Down(_LEAF, ACK, slot=5, psn=20, flags=OWNER_ONLY, owner=3),
        Send(_LEAF.alloc, 1, slot=5, psn=20, data="down", flags=OWNER_ONLY, owner=3),
        Down(_LEAF, ACK, slot=5, psn=20, flags=OWNER_ONLY | OVERFLOW, owner=3),
        Send(_LEAF.alloc, 1, slot=5, psn=20, data="down", flags=OWNER_ONLY | RETRANSMIT, owner=3),
        Send(_LEAF.alloc, 0, slot=5, psn=20, data="up", flags=RETRANSMIT))),
    # an OWNER_ONLY round whose owner (server 1) is in this rack: the root's RESULT goes down as the owner's sums and
    # the other servers' ACKs
    "leaf_owner": ((_LEAF,), (
        Send(_LEAF.alloc, 0, slot=6, psn=40, data="up", flags=OWNER_ONLY, owner=1),
        Send(_LEAF.alloc, 1, slot=6, psn=40, data="down", flags=OWNER_ONLY, owner=1),
        Down(_LEAF, RESULT, slot=6, psn=40, data="big", flags=OWNER_ONLY, owner=1))),
    # GATHER and NACK across racks: a NACK to another rack's server goes up; a server's GATHER to its rack and up;
    # from the root, a NACK to a server here relayed down, a GATHER of this rack's own piece refused
    "leaf_relay": ((_LEAF,), (
        Send(_LEAF.alloc, 1, slot=2, psn=30, data="up", type=NACK, owner=3),
        Send(_LEAF.alloc, 0, slot=0, psn=30, data="up", type=GATHER, owner=0),
        Down(_LEAF, NACK, slot=2, psn=31, owner=0),
        Down(_LEAF, GATHER, slot=0, psn=31, owner=1))),
    # a root's OWNER_ONLY round (owner 3, under the second leaf): completion multicast, a retransmission from
    # the first leaf answered with an ACK that keeps OWNER_ONLY
    "root_round": ((_ROOT,), (
        Send(_ROOT.alloc, 0, slot=1, psn=7, data="up", flags=OWNER_ONLY, owner=3),
        Send(_ROOT.alloc, 1, slot=1, psn=7, data="down", flags=OWNER_ONLY, owner=3),
        Send(_ROOT.alloc, 0, slot=1, psn=7, data="up", flags=OWNER_ONLY | RETRANSMIT, owner=3))),
}


def frame(packet: Send | Down, lanes: int) -> dict:
    """The headers of a packet as the v1model parser extracts them, and its port (an ACK: the header alone)."""
    if isinstance(packet, Send):
        a, port, worker = packet.alloc, packet.alloc.ports[packet.worker], packet.worker
        passing = {"version": packet.version, "type": packet.type, "op": packet.op, "flags": packet.flags,
                   "job": a.job, "slot": packet.slot, "worker": worker, "owner": packet.owner, "set": packet.set,
                   "generation": a.generation if packet.generation is None else packet.generation,
                   "psn": packet.psn}
        src_mac, src_ip, src_port, data = 0x020000000000 + port, 0x0A000000 + port, 40000 + worker, packet.data
    else:
        u = packet.role.up
        port = u.port if packet.port is None else packet.port
        passing = {"version": 3, "type": packet.type, "op": 0, "flags": packet.flags, "job": u.job,
                   "slot": packet.slot, "worker": u.worker, "owner": packet.owner, "set": packet.set,
                   "generation": u.generation if packet.generation is None else packet.generation,
                   "psn": packet.psn}
        src_mac, src_ip, src_port, data = u.mac, u.ip, 9877, packet.data
    with_lanes = passing["type"] != ACK
    length = 8 + 16 + (4 * lanes if with_lanes else 0)
    ip = {"version": 4, "ihl": 5, "diffserv": 0, "total_len": 20 + length, "identification": 0, "flags": 0,
          "frag_offset": 0, "ttl": 64, "protocol": 17, "hdr_checksum": 0, "src_addr": src_ip,
          "dst_addr": AGGREGATOR_IP}
    ip["hdr_checksum"] = ipv4_checksum(pack("ipv4_h", ip))
    headers = {"ethernet_h": {"dst_addr": AGGREGATOR_MAC, "src_addr": src_mac, "ether_type": 0x0800},
               "ipv4_h": ip, "udp_h": {"src_port": src_port, "dst_port": 9877, "length": length, "checksum": 0},
               "passing_h": passing}
    if with_lanes:
        headers["lanes_h"] = {f"value_{i}": v % (1 << 32) for i, v in enumerate(lane_data(data, lanes))}
    return {"port": port, "headers": headers}


# ---- the pinned variant of the program -------------------------------------------------------------------------

_READ = re.compile(r"\b(" + "|".join(REGISTERS) + r")\.read\(([^,;]+),\s*([^;]+?)\);")
_WRITE = re.compile(r"\b(" + "|".join(REGISTERS) + r")\.write\(([^,;]+),\s*([^;]+?)\);")
_LANE_INDEX = re.compile(r"meta\.lane_base \+ \((\w+)\)")
# a table action's pin: the action's opening line -> the pin macro it assumes
_ACTIONS = {"leaf": "PASSING_PIN_LEAF", "root": "PASSING_PIN_ROOT", "from_uplink": "PASSING_PIN_UPLINK",
            "owner_worker": "PASSING_PIN_OWNER_WORKER", "owner_up": "PASSING_PIN_OWNER_UP"}


def _read(m: re.Match) -> str:
    register, var, index = m[1], m[2], m[3]
    lane = _LANE_INDEX.fullmatch(index.strip())
    value = f"PASSING_PIN_LANE_##{lane[1]}" if register == "lane_acc" and lane else f"PASSING_PIN_{register}"
    return f"{m[0]} {var} = {value};"


def _write(m: re.Match) -> str:
    """A write's index and value into metadata fields of their own (a lane's: one per lane, as the compiler
    keeps only the last of several assignments to one field)."""
    register, index, value = m[1], m[2], m[3]
    lane = _LANE_INDEX.fullmatch(index.strip())
    if register == "lane_acc" and lane:
        return f"{m[0]} meta.pin_lane_base = meta.lane_base; meta.pin_lane_##{lane[1]} = (bit<32>)({value});"
    return f"{m[0]} meta.pin_{register}_index = (bit<32>)({index}); meta.pin_{register} = (bit<32>)({value});"


def pinned_program(text: str, lanes: int) -> str:
    """The v1model program as a sequence's pinned run executes it (the module's docstring)."""
    text = text.replace('#include "../include/', f'#include "{ROOT}/p4/include/')
    fields = "".join(f"    bit<32> pin_{r}_index;\n    bit<32> pin_{r};\n" for r in REGISTERS)
    fields += "    bit<32> pin_lane_base;\n" + "".join(f"    bit<32> pin_lane_{i};\n" for i in range(lanes))
    text = text.replace("struct metadata_t {\n", "struct metadata_t {\n" + fields, 1)
    text = _WRITE.sub(_write, _READ.sub(_read, text))
    for action, pin in _ACTIONS.items():
        text, n = re.subn(rf"(\n\s*action {action}\([^)]*\) \{{)", rf"\1 testgen_assume({pin});", text, count=1)
        if n != 1:
            raise ValueError(f"the program has no action {action} to pin")
    start = text.index("control PassingIngress(")
    at = text.index("\n    apply {", start) + len("\n    apply {")
    return text[:at] + " testgen_assume(PASSING_PIN_INPUT);" + text[at:]


def _equal(params: dict[str, int]) -> str:
    return " && ".join(f"{name} == {value}" for name, value in params.items()) or "true"


def table_pins(roles: tuple[Role, ...]) -> list[str]:
    """The pins of the tree roles' table actions: each the controller's entries of its table, as conditions on
    the key and the action's parameters (in scope where the pin is expanded: inside the action, in the v1model
    variant and in p4/include/tofino_tree*.p4 alike); ``false`` for a table with none."""
    pins: dict[str, list[str]] = {pin: [] for pin in _ACTIONS.values()}
    for role in roles:
        for e in role.entries():
            key = " && ".join([f"hdr.passing.job == {e['key']['job']}"] if e["table"] != "owner_map" else
                              [f"meta.map_job == {e['key']['job']}", f"hdr.passing.owner == {e['key']['owner']}"])
            pins[_ACTIONS[e["action"]]].append(f"({key} && {_equal(e['params'])})")
    return [f"#define {pin} ({' || '.join(alts) or 'false'})" for pin, alts in pins.items()]


def pin_source(inp: dict, admit: dict | None, roles: tuple[Role, ...], state: dict, index: int, lanes: int) -> str:
    """passing_pin.p4 of one packet: its input, the entries of its tables, the registers of slot/set ``index``."""
    conds = [f"sm.ingress_port == {inp['port']}"]
    for header in ("ethernet_h", "ipv4_h", "udp_h", "passing_h", "lanes_h"):
        var = f"hdr.{HEADER_VARIABLES[header]}"
        if header not in inp["headers"]:
            conds.append(f"!{var}.isValid()")
            continue
        conds.append(f"{var}.isValid()")
        conds += [f"{var}.{name} == {value}" for name, value in inp["headers"][header].items()]
    admitted = " && ".join(f"({name}) == {value}" for name, value in admit.items()) if admit else "false"
    lines = [f"#define PASSING_PIN_INPUT ({' && '.join(conds)})",
             f"#define PASSING_PIN_ADMIT(base, pool, full, epoch, group) ({admitted})",
             "#define PASSING_PIN_ROUND(value) true", "#define PASSING_PIN_CONTRIBUTORS(value) true",
             "#define PASSING_PIN_OVERFLOW(value) true", "#define PASSING_PIN_PAIR(k, value) true"]
    lines += table_pins(roles)
    lines += [f"#define PASSING_PIN_{r} {state.get((r, index), 0)}" for r in REGISTERS if r != "lane_acc"]
    lines += [f"#define PASSING_PIN_LANE_{i} {state.get(('lane_acc', index * lanes + i), 0)}"
              for i in range(lanes)]
    return "\n".join(lines) + "\n"


_PIN_WRITE = re.compile(r"Computed: meta\.pin_(\w+?)(_index)? = (-?\d+);")


def writes_of_trace(trace: str, lanes: int) -> list[dict]:
    """The register writes of a pinned run, in order, from its trace: {register, index, value} (lane i of
    ``lane_acc`` at lane_base + i)."""
    out, index, base, lane = [], None, None, {}
    for m in _PIN_WRITE.finditer(trace):
        value = int(m[3]) % (1 << 32)
        if m[1] == "lane_base":
            base = value  # the same for every lane of the packet (the compiler may keep one assignment)
        elif m[1].startswith("lane_") and m[1][5:].isdigit():
            lane[int(m[1][5:])] = value
        elif m[2]:
            index = value
        else:
            out.append({"register": m[1], "index": index, "value": value})
    if lane and base is None:
        raise ValueError("lane writes without their slot/set's lane_base in the trace")
    return out + [{"register": "lane_acc", "index": base + i, "value": v} for i, v in sorted(lane.items())]


def admission(event: Send | Down, inp: dict) -> dict | None:
    """The admission entry a packet meets: a server's packet, its allocation's when it says the allocation's
    generation and comes from its worker's port (the controller installs (job, generation, worker, port) of each
    worker); what comes down from the root, none (the ingress does not apply admission to it)."""
    if not isinstance(event, Send):
        return None
    p, a = inp["headers"]["passing_h"], event.alloc
    if p["generation"] == a.generation and p["worker"] < len(a.ports) and inp["port"] == a.ports[p["worker"]]:
        return a.params()
    return None


def sequence_of(roles: tuple[Role, ...]) -> dict:
    """What every vector of a tree sequence carries of its jobs: their allocations and roles, as the checkers
    (tests/conformance/tree_sequences.py, tofino_tree.py) install them in the reference."""
    return {"allocations": [{"job": r.alloc.job, "generation": r.alloc.generation, "base": r.alloc.base,
                             "pool": r.alloc.pool, "ports": list(r.alloc.ports), **r.alloc.params()} for r in roles],
            "roles": [{"job": r.alloc.job, "role": r.role, "owners": list(r.owners or ()),
                       "up": None if r.up is None else vars(r.up)} for r in roles]}


def run_tree_sequence(program: Program, name: str, roles: tuple[Role, ...], events: tuple, lanes: int,
                      source: Path, log: list[str]) -> list[dict]:
    """Every packet of a tree sequence as one pinned P4Testgen run of the bmv2 target; the registers carry over
    (a vector's ``registers`` are what the earlier ones wrote into its slot/set)."""
    variant = pinned_program(source.read_text(), lanes)
    state: dict[tuple[str, int], int] = {}
    vectors: list[dict] = []
    for event in events:
        inp = frame(event, lanes)
        p = inp["headers"]["passing_h"]
        a = event.alloc if isinstance(event, Send) else event.role.alloc
        index = (a.base + p["slot"]) * 2 + (p["set"] & 1)
        pins = pin_source(inp, admission(event, inp), roles, state, index, lanes)
        test = _pinned_run(program, variant, pins, lanes, log)
        registers = [{"register": r, "index": index, "value": state.get((r, index), 0)}
                     for r in REGISTERS if r != "lane_acc"]
        registers += [{"register": "lane_acc", "index": index * lanes + i,
                       "value": state.get(("lane_acc", index * lanes + i), 0)} for i in range(lanes)]
        test["writes"] = writes_of_trace(test.pop("trace"), lanes)
        for w in test["writes"]:
            state[(w["register"], w["index"])] = w["value"]
        test.update(run="sequence", sequence=name, step=len(vectors), registers=registers, **sequence_of(roles))
        vectors.append(test)
    return vectors


def _pinned_run(program: Program, variant: str, pins: str, lanes: int, log: list[str]) -> dict:
    """The pinned packet's path with the controller's entries (the most hits: every hit is pinned to one)."""
    with tempfile.TemporaryDirectory(prefix="passing-pin-") as d:
        (Path(d) / PIN_FILE).write_text(pins)
        (Path(d) / "passing.p4").write_text(variant)
        run = Run("pin", {"PASSING_TESTGEN": 1, "PASSING_TESTGEN_PIN": 1}, ())
        tests, meta = run_p4testgen(program, run, 64, 1, {"PASSING_LANES": lanes}, [f"-I{d}"], None,
                                    Path(d) / "passing.p4", coverage=False, traces=True)
    log.append(f"{meta['seconds']} s {len(tests)} paths")
    if not tests:
        raise SystemExit(f"no path of the pinned packet: {pins.splitlines()[0]}")
    hits = [sum(not e.get("default") for e in t["tables"]) for t in tests]
    best = [t for t, n in zip(tests, hits) if n == max(hits)]
    shortest = min(len(t["input"]["packet"]) for t in best)  # P4Testgen may append bytes after the headers
    best = [t for t in best if len(t["input"]["packet"]) == shortest]
    # paths that differ in what the pins do not fix (P4Testgen's choices outside the tables and the input) must
    # agree on what the vector keeps: the entries, the output and the writes
    kept = {repr((sorted(repr(e) for e in t["tables"]), t["expect"], writes_of_trace(t["trace"], lanes)))
            for t in best}
    if len(kept) != 1:
        raise SystemExit(f"{len(best)} paths hit {max(hits)} tables and differ: the pins leave a choice\n"
                         + "\n".join(sorted(kept)))
    return best[0]


__all__ = ["REGISTERS", "TREE_SEQUENCES", "Down", "Role", "Up", "admission", "frame", "pin_source", "pinned_program",
           "run_tree_sequence", "sequence_of", "table_pins", "writes_of_trace"]
