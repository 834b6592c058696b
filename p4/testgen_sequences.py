"""Sequences (p4/testgen_vectors.py): packets chained through the registers, each one a P4Testgen run pinned
to it (its input, the controller's admission entry and the registers the earlier packets left); the registers'
values before and after a write. Standard library only."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from testgen_p4testgen import run_p4testgen
from testgen_programs import (
    FLAT_ONLY,
    HEADER_FIELDS,
    HEADER_VARIABLES,
    PIN_FILE,
    Program,
    Run,
    header_size,
    ipv4_checksum,
)


@dataclass(frozen=True)
class Allocation:
    """A job's allocation, as the controller writes it into ``admission`` (controller/passing_controller/
    allocation.py; the checker holds these properties to that class): worker w sends from ``ports[w]``."""

    job: int
    generation: int
    base: int
    pool: int
    ports: tuple[int, ...]

    @property
    def epoch(self) -> int:
        return self.job << 16 | self.generation

    @property
    def full(self) -> int:
        return (1 << len(self.ports)) - 1

    @property
    def group(self) -> int:
        return self.job + 1

    def params(self) -> dict[str, int]:
        return {"base": self.base, "pool": self.pool, "full": self.full, "epoch": self.epoch, "group": self.group}


INT32_MAX, INT32_MIN = (1 << 31) - 1, -(1 << 31)


def lane_data(pattern: str, lanes: int) -> list[int]:
    """The int32 lanes of a sequence's packet (any lane count, so that a mutant's run at 4 lanes has the same
    shapes): "up"/"down": small lanes of both signs; "big": each lane half of int32's range on the side of its
    pair's lane 2k (two "big" contributions saturate every lane, lane 2k at INT32_MAX, 2k + 1 at INT32_MIN);
    "low"/"high": for MAX, in each pair lane 2k of "low" and lane 2k + 1 of "high" are the larger."""
    sign = [1 if i % 2 == 0 else -1 for i in range(lanes)]
    if pattern == "up":
        return [s * (1000 * i + 17) for i, s in zip(range(lanes), sign)]
    if pattern == "down":
        return [-s * (77 * i + 5) for i, s in zip(range(lanes), sign)]
    if pattern == "big":
        return [s * (0x60000000 + i) for i, s in zip(range(lanes), sign)]
    if pattern == "low":
        return [(900 - i) if i % 2 == 0 else -(900 - i) for i in range(lanes)]
    if pattern == "high":
        return [-(800 - i) if i % 2 == 0 else (800 - i) for i in range(lanes)]
    raise ValueError(f"no lane pattern {pattern!r}")


@dataclass(frozen=True)
class Send:
    """A DATA packet of a sequence: worker ``worker`` of ``alloc`` from its port."""

    alloc: Allocation
    worker: int
    slot: int
    psn: int
    data: str  # lane_data's pattern
    set: int = 0
    op: int = 0  # PASSING_OP_SUM; 1: MAX
    flags: int = 0  # PASSING_FLAG_*
    owner: int = 0
    generation: int | None = None  # the allocation's unless given (a late packet of an earlier one)
    type: int = 1  # PASSING_TYPE_DATA; 4: GATHER, 5: NACK
    version: int = 3  # PASSING_VERSION
    port: int | None = None  # the worker's port unless given (a packet from another worker's port)


@dataclass(frozen=True)
class Allocate:
    alloc: Allocation


@dataclass(frozen=True)
class Free:
    alloc: Allocation


AGGREGATOR_IP, AGGREGATOR_MAC = 0x0A0000FE, 0x02000000FE00
OVERFLOW, RETRANSMIT, OWNER_ONLY = 0x01, 0x02, 0x04  # p4/include/constants.p4
_ROUND = Allocation(job=7, generation=3, base=40, pool=16, ports=(1, 2, 3))
_SATURATE = Allocation(job=12, generation=0, base=0, pool=4, ports=(4, 5))
_MAX = Allocation(job=3, generation=1, base=900, pool=100, ports=(6, 7))
_OLD = Allocation(job=9, generation=5, base=200, pool=8, ports=(8, 9))
_NEW = Allocation(job=10, generation=0, base=198, pool=16, ports=(10, 11))
_OWNED = Allocation(job=20, generation=7, base=500, pool=32, ports=(12, 13, 14))
_ALONE = Allocation(job=30, generation=1, base=700, pool=2, ports=(15,))
GATHER, NACK = 4, 5
# What the sequences are for (docs/tofino.md, "Sequences"): every rule of the state machine met on a state an
# earlier packet of the sequence wrote, with the second pass of every completion and answer.
SEQUENCES: dict[str, tuple] = {
    # a round of three filled by every worker, one flagged OVERFLOW; a duplicate; a retransmission answered
    # after completion; a packet of the round before (stale); the next round in the slot; a late packet of
    # an earlier allocation of the job
    "round": (Allocate(_ROUND),
              Send(_ROUND, 0, slot=5, set=1, psn=21, data="up"),
              Send(_ROUND, 1, slot=5, set=1, psn=21, data="down", flags=OVERFLOW),
              Send(_ROUND, 1, slot=5, set=1, psn=21, data="down", flags=OVERFLOW | RETRANSMIT),
              Send(_ROUND, 2, slot=5, set=1, psn=21, data="up"),
              Send(_ROUND, 0, slot=5, set=1, psn=21, data="up", flags=RETRANSMIT),
              Send(_ROUND, 1, slot=5, set=1, psn=5, data="down"),
              Send(_ROUND, 2, slot=5, set=1, psn=37, data="down"),
              Send(_ROUND, 0, slot=5, set=1, psn=37, data="up", generation=2)),
    # what admission refuses with the job's entries installed: a slot just past the pool, a worker from another
    # worker's port, another protocol version
    "refused": (Allocate(_ROUND),
                Send(_ROUND, 1, slot=16, psn=3, data="up"),
                Send(_ROUND, 1, slot=2, psn=3, data="up", port=3),
                Send(_ROUND, 1, slot=2, psn=3, data="up", version=2)),
    # GATHER and NACK: a piece of the sender's own and a NACK to a peer relayed; a GATHER of another worker's
    # piece and a NACK to the sender itself refused
    "relay": (Allocate(_OWNED),
              Send(_OWNED, 1, slot=0, psn=40, data="up", type=GATHER, owner=1),
              Send(_OWNED, 1, slot=0, psn=40, data="up", type=GATHER, owner=2),
              Send(_OWNED, 2, slot=3, psn=40, data="up", type=NACK, owner=0),
              Send(_OWNED, 2, slot=3, psn=40, data="up", type=NACK, owner=2)),
    # a job of one worker: every packet completes its round
    "alone": (Allocate(_ALONE),
              Send(_ALONE, 0, slot=1, psn=2, data="down", flags=OVERFLOW)),
    # two contributions that saturate every lane, unflagged; the next round across the psn's wrap
    "saturate": (Allocate(_SATURATE),
                 Send(_SATURATE, 0, slot=3, psn=0xFFFFFFFC, data="big"),
                 Send(_SATURATE, 1, slot=3, psn=0xFFFFFFFC, data="big"),
                 Send(_SATURATE, 1, slot=3, psn=0, data="up")),
    # MAX: in each pair the stored lane wins on one side and the packet's on the other
    "max": (Allocate(_MAX),
            Send(_MAX, 0, slot=99, set=1, psn=7, data="low", op=1),
            Send(_MAX, 1, slot=99, set=1, psn=7, data="high", op=1)),
    # the slot reused by the next allocation: a completed round of an old one, then a round of the new one at
    # the same psn (only the epoch tells them apart), and the old allocation's late packet rejected
    "next_allocation": (Allocate(_OLD),
                        Send(_OLD, 0, slot=2, set=1, psn=50, data="up"),
                        Send(_OLD, 1, slot=2, set=1, psn=50, data="up"),
                        Free(_OLD), Allocate(_NEW),
                        Send(_NEW, 1, slot=4, set=1, psn=50, data="down"),
                        Send(_OLD, 1, slot=2, set=1, psn=50, data="up"),
                        Send(_NEW, 0, slot=4, set=1, psn=50, data="up")),
    # an OWNER_ONLY DATA whose owner is no worker of the job: Tofino 2 refuses it, Tofino 1 runs the round as any
    # (it cannot check the owner: docs/tofino.md)
    "foreign_owner": (Allocate(_OWNED),
                      Send(_OWNED, 0, slot=30, psn=11, data="up", flags=OWNER_ONLY, owner=5)),
    # an OWNER_ONLY round (owner 2, set 1): its owner's packet last
    "owner_only": (Allocate(_OWNED),
                   Send(_OWNED, 0, slot=31, set=1, psn=9, data="up", flags=OWNER_ONLY, owner=2),
                   Send(_OWNED, 1, slot=31, set=1, psn=9, data="down", flags=OWNER_ONLY | OVERFLOW, owner=2),
                   Send(_OWNED, 2, slot=31, set=1, psn=9, data="up", flags=OWNER_ONLY, owner=2)),
}


def frame(send: Send, lanes: int) -> dict:
    """The headers of a Send as the parser extracts them, and its port."""
    alloc = send.alloc
    port = alloc.ports[send.worker] if send.port is None else send.port
    ip = {"version": 4, "ihl": 5, "diffserv": 0, "total_len": 20 + 8 + 16 + 4 * lanes, "identification": 0,
          "flags": 0, "frag_offset": 0, "ttl": 64, "protocol": 17, "hdr_checksum": 0,
          "src_addr": 0x0A000000 + port, "dst_addr": AGGREGATOR_IP}
    ip["hdr_checksum"] = ipv4_checksum(pack("ipv4_h", ip))
    generation = alloc.generation if send.generation is None else send.generation
    return {"port": port, "headers": {
        "ethernet_h": {"dst_addr": AGGREGATOR_MAC, "src_addr": 0x020000000000 + port, "ether_type": 0x0800},
        "ipv4_h": ip,
        "udp_h": {"src_port": 40000 + send.worker, "dst_port": 9877, "length": 8 + 16 + 4 * lanes, "checksum": 0},
        "passing_h": {"version": send.version, "type": send.type, "op": send.op, "flags": send.flags, "job": alloc.job,
                      "slot": send.slot, "worker": send.worker, "owner": send.owner, "set": send.set,
                      "generation": generation, "psn": send.psn},
        "lanes_h": {f"value_{i}": v % (1 << 32) for i, v in enumerate(lane_data(send.data, lanes))}}}


def pack(header: str, fields: dict[str, int]) -> bytes:
    value = 0
    for name, bits in HEADER_FIELDS[header]:
        value = value << bits | fields[name]
    return value.to_bytes(header_size(header), "big")


_ZERO = {"slot_tag": {"tag": 0, "epoch": 0}, "slot_bitmap": {"bitmap": 0, "psn": 0}, "slot_overflow": 0,
         "slot_phase": 0}
_ONE_VALUE = ("slot_overflow", "slot_phase")  # registers of one value, not a struct


def unwritten(name: str) -> object:
    """What an entry of register ``name`` holds before anything wrote it: 0 in every field."""
    return _ZERO.get(name, {"first": 0, "second": 0})


def written(name: str, old: object, fields: dict[str, int]) -> object:
    """An entry of register ``name`` after a RegisterAction wrote ``fields`` into it (a ``writes_of`` entry):
    slot_overflow's or slot_phase's one value, or the struct with those fields replaced."""
    return fields["value"] if name in _ONE_VALUE else {**old, **fields}


def register_of(state: dict, name: str, index: int) -> object:
    return state.get((name, index), unwritten(name))


def signed32(value: int) -> int:
    """An int32 held as an unsigned word (setRegisterValue's, the lanes') as its signed value."""
    return value - (1 << 32) if value & (1 << 31) else value


def pin_source(inp: dict, admit: dict | None, state: dict, index: int, lanes: int,
               tree: list[str] | None = None) -> str:
    """passing_pin.p4 (p4/include/testgen.p4): the input's port and every header field (a datagram without lanes:
    the header alone), the admission entry's parameters (``false``: no entry of the controller matches), the
    registers of the slot/set ``index``, and ``tree``: the tree tables' pins (p4/testgen_tofino_tree.py; None: a
    flat sequence, no entry of them)."""
    conds = [f"ig_intr_md.ingress_port == {inp['port']}"]
    for header, fields in inp["headers"].items():
        var = f"hdr.{HEADER_VARIABLES[header]}"
        conds.append(f"{var}.isValid()")
        conds += [f"{var}.{name} == {value}" for name, value in fields.items()]
    if "lanes_h" not in inp["headers"]:
        conds.append("!hdr.lanes.isValid()")
    admitted = " && ".join(f"({name}) == {value}" for name, value in admit.items()) if admit else "false"
    tag, bitmap = register_of(state, "slot_tag", index), register_of(state, "slot_bitmap", index)
    lines = [f"#define PASSING_PIN_INPUT ({' && '.join(conds)})",
             f"#define PASSING_PIN_ADMIT(base, pool, full, epoch, group) ({admitted})",
             f"#define PASSING_PIN_ROUND(value) ((value).tag == {tag['tag']} && (value).epoch == {tag['epoch']})",
             f"#define PASSING_PIN_CONTRIBUTORS(value) ((value).bitmap == {bitmap['bitmap']} "
             f"&& (value).psn == {bitmap['psn']})",
             f"#define PASSING_PIN_OVERFLOW(value) ((value) == {register_of(state, 'slot_overflow', index)})"]
    for k in range(lanes // 2):
        pair = register_of(state, f"lane_pair_{k}", index)
        lines.append(f"#define PASSING_PIN_PAIR_{k}(value) ((value).first == {signed32(pair['first'])} "
                     f"&& (value).second == {signed32(pair['second'])})")
    lines.append("#define PASSING_PIN_PAIR(k, value) PASSING_PIN_PAIR_##k(value)")
    if tree is None:  # a flat sequence: no entry of the tree roles' tables (p4/include/tofino_tree_common.p4)
        lines += [f"#define {name} {value}" for name, value in FLAT_ONLY.items()]
    else:
        lines += tree + [f"#define PASSING_PIN_PHASE(phase) ((phase) == {register_of(state, 'slot_phase', index)})"]
    return "\n".join(lines) + "\n"


def admission_hit(test: dict) -> dict | None:
    for entry in test["tables"]:
        if entry["table"].endswith(".admission") and not entry.get("default"):
            return {k.split(".")[-1]: int(v) for k, v in entry["params"].items()}
    return None


def has_entry(test: dict, table: str) -> bool:
    return any(e["table"].endswith(f".{table}") and not e.get("default") for e in test["tables"])


def run_sequence(program: Program, name: str, events: tuple, lanes: int, source: Path, log: list[str]) -> list[dict]:
    """Every packet of a sequence as one P4Testgen run pinned to it (PASSING_TESTGEN_PIN): its input, the
    controller's admission entry and the registers the earlier packets left in its slot/set; a packet the first
    pass sends to the recirculation port makes the next run, on port 68, with what the ingress emitted. Each
    run's paths are the pinned packet's, one per way P4Testgen may set the tables; the one that has the
    controller's tables (the admission entry iff one is installed, the aggregator's address) is the vector.
    The registers carry over: a vector's initial registers are what the earlier ones wrote."""
    state: dict[tuple[str, int], object] = {}
    live: dict[tuple, Allocation] = {}
    vectors: list[dict] = []
    todo: list[tuple[int, dict, dict | None, int, Allocation | None]] = []  # (pass, input, admit, index, alloc)
    for event in events:
        if isinstance(event, Allocate):
            for w, port in enumerate(event.alloc.ports):
                live[(event.alloc.job, event.alloc.generation, w, port)] = event.alloc
            continue
        if isinstance(event, Free):
            live = {k: a for k, a in live.items() if a != event.alloc}
            continue
        inp = frame(event, lanes)
        p = inp["headers"]["passing_h"]
        alloc = live.get((p["job"], p["generation"], p["worker"], inp["port"]))
        index = p["set"] * 1024 + alloc.base + p["slot"] if alloc else 0
        todo.append((1, inp, alloc.params() if alloc else None, index, alloc))
        while todo:
            which, inp, admit, index, alloc = todo.pop(0)
            test = _pinned_run(program, which, inp, admit, state, index, lanes, source, log)
            for write in test["writes"]:
                key = (write["register"], write["index"])
                state[key] = written(write["register"], register_of(state, *key), write["fields"])
            test.update(run="sequence", sequence=name, step=len(vectors),
                        allocations=[{"job": a.job, "generation": a.generation, "base": a.base, "pool": a.pool,
                                      "ports": list(a.ports), **a.params()} for a in dict.fromkeys(live.values())])
            vectors.append(test)
            got = test["ingress"]
            if which == 1 and got and not got["dropped"] and isinstance(got["port"], int) \
                    and got["port"] & 0x7F == 68:
                emitted = {e["header"]: e["fields"] for e in got["emit"]}
                again = {"port": got["port"], "headers": emitted}
                todo.append((2, again, None, emitted["bridged_h"]["slot_set"], alloc))  # no entry for port 68
    return vectors


def _pinned_run(program: Program, which: int, inp: dict, admit: dict | None, state: dict, index: int, lanes: int,
                source: Path, log: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="passing-pin-") as pins:
        (Path(pins) / PIN_FILE).write_text(pin_source(inp, admit, state, index, lanes))
        run = Run(f"pin{which}", {"PASSING_TESTGEN": which, "PASSING_TESTGEN_PIN": 1}, ())
        tests, meta = run_p4testgen(program, run, 32, 1, {"PASSING_LANES": lanes}, [f"-I{pins}"], None, source,
                                    coverage=False)
    log.append(f"{which} {meta['seconds']} s {len(tests)} paths")
    for test in tests:
        hit = admission_hit(test)
        if hit == admit and not has_entry(test, "l2_forward") and (which == 2 or has_entry(test, "aggregator_address")):
            return test
    raise SystemExit(f"no path of the pinned packet has the controller's tables: {inp}")
