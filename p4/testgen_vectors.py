"""P4Testgen's tests of the PASSING programs, kept as data beside them (docs/tofino.md, "Executed by P4Testgen").

P4Testgen (upstream p4c, backends/p4tools) executes a P4 program symbolically and writes one test per path:
table entries, initial register values, an input packet and port, and the expected output packet and port
(or none: a drop). `make p4-testgen` runs it where it is installed and turns its output into *vectors*: one
JSON file per program (``p4/tna/testgen.json``, ``p4/t2na/testgen.json``, ``p4/v1model/testgen.json``), one
test a line, with the hash of the program (and of every file it includes) that they came from, so that a check
needing no P4 tool can hold them against the protocol (tests/conformance/testgen.py), and
bmv2_tests/test_testgen_replay_bmv2.py replays the v1model ones on BMv2. For the Tofino programs a vector also
carries what each RegisterAction wrote back (``writes``, from the path's trace), and the vectors include
*sequences*: packets chained through the registers, one P4Testgen run pinned to each (SEQUENCES).

Standard library only: this runs on a machine that has P4Testgen and nothing of PASSING installed.

    python3 p4/testgen_vectors.py generate tna        # p4testgen -> p4/tna/testgen.json
    python3 p4/testgen_vectors.py generate t2na --lanes 72   # -> p4/t2na/testgen.json (patched p4testgen)
    python3 p4/testgen_vectors.py generate v1model    # p4testgen -> p4/v1model/testgen.json
    python3 p4/testgen_vectors.py check               # exit 1 if a vector file is missing or stale
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# p4/include/headers.p4, in wire order: (field, bits). What the checker unpacks and the sequences pin.
HEADER_FIELDS = {
    "ethernet_h": (("dst_addr", 48), ("src_addr", 48), ("ether_type", 16)),
    "ipv4_h": (("version", 4), ("ihl", 4), ("diffserv", 8), ("total_len", 16), ("identification", 16),
               ("flags", 3), ("frag_offset", 13), ("ttl", 8), ("protocol", 8), ("hdr_checksum", 16),
               ("src_addr", 32), ("dst_addr", 32)),
    "udp_h": (("src_port", 16), ("dst_port", 16), ("length", 16), ("checksum", 16)),
    "passing_h": (("version", 8), ("type", 8), ("op", 8), ("flags", 8), ("job", 16), ("slot", 16),
                  ("worker", 8), ("owner", 7), ("set", 1), ("generation", 16), ("psn", 32)),
    "bridged_h": (("pad0", 7), ("ingress_port", 9), ("slot_set", 16), ("group", 16), ("pad1", 3),
                  ("relay", 1), ("flood", 1), ("result_multicast", 1), ("second_pass", 1), ("answer", 1)),
}
HEADER_VARIABLES = {"ethernet_h": "ethernet", "ipv4_h": "ipv4", "udp_h": "udp", "passing_h": "passing",
                    "bridged_h": "bridged", "lanes_h": "lanes"}  # headers_t's member of each header type


def header_size(header: str) -> int:
    return sum(bits for _, bits in HEADER_FIELDS[header]) // 8


def unpack(header: str, raw: bytes) -> dict[str, int]:
    fields = HEADER_FIELDS[header]
    width = sum(bits for _, bits in fields)
    value = int.from_bytes(raw[:width // 8], "big")
    out = {}
    for name, bits in fields:
        width -= bits
        out[name] = value >> width & ((1 << bits) - 1)
    return out


def ipv4_checksum(header: bytes) -> int:
    """RFC 791's checksum of a 20-byte IPv4 header (its checksum field taken as 0)."""
    words = [int.from_bytes(header[i:i + 2], "big") for i in range(0, 20, 2) if i != 10]
    total = sum(words)
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


@dataclass(frozen=True)
class Run:
    """One p4testgen run over a program: its name (a vector's ``run``), the defines and the arguments."""

    name: str
    defines: dict
    args: tuple[str, ...]


@dataclass(frozen=True)
class Program:
    name: str
    source: str  # relative to the repository root
    vectors: str
    target: str  # p4testgen --target
    arch: str  # p4testgen --arch
    test_backend: str  # the output format whose parser is below
    ingress_deparser: str | None  # the control whose output a vector records from the trace (see ingress_of)
    runs: tuple[Run, ...]
    sequences: bool = False  # P4Testgen runs pinned to the packets of SEQUENCES (the tofino target only)


# The tofino target writes initial registers only in PTF (its STF has none). Greedy statement search, and only
# tests that cover something new, until nothing new is found. The two passes of a round are two runs, each kept
# to its own inputs by the preconditions of p4/include/testgen.p4: ports 0-63 and the recirculation port 68 of
# pipe 0 (an output port outside --port-ranges is a P4Testgen error, so 68 must be in them).
# The bmv2 target writes no registers in any format: its registers start at 0, as BMv2's do. Its PTF tests go
# through P4Runtime, as the replay on BMv2 does; the replay has ports 0-7 (input and output, --port-ranges) and
# frames of at most 1500 bytes (veth MTU; --packet-size-range is in bits). The v1model program's paths do not end
# in depth-first order (its constant tables multiply them), and greedy search stops early: random backtracking.
# Two runs: "all" without preconditions (with the registers at 0, only admission entries no controller writes,
# epoch 0, reach the paths of a round under way, which BMv2 must run as P4Testgen expects all the same; the
# checker counts such vectors as outside the protocol), and "in_domain" with them, for the checker.
_TNA_SEARCH = ("--path-selection", "GREEDY_STATEMENT_SEARCH", "--only-covering-tests",
               "--port-ranges", "0:63,68:68")
_V1MODEL_SEARCH = ("--path-selection", "RANDOM_BACKTRACK", "--port-ranges", "0:7", "--packet-size-range", "0:12000")
PROGRAMS = {
    "tna": Program("tna", "p4/tna/passing.p4", "p4/tna/testgen.json", "tofino", "tna", "PTF", "TnaIngressDeparser",
                   (Run("first_pass", {"PASSING_TESTGEN": 1, "PASSING_TESTGEN_DATA": 1}, _TNA_SEARCH),
                    Run("second_pass", {"PASSING_TESTGEN": 2, "PASSING_TESTGEN_DATA": 1}, _TNA_SEARCH)),
                   sequences=True),
    # Tofino 2: one pass (no recirculation), so one run over any port
    "t2na": Program("t2na", "p4/t2na/passing.p4", "p4/t2na/testgen.json", "tofino2", "t2na", "PTF",
                    "TnaIngressDeparser",
                    (Run("first_pass", {"PASSING_TESTGEN": 1, "PASSING_TESTGEN_DATA": 1},
                         ("--path-selection", "GREEDY_STATEMENT_SEARCH", "--only-covering-tests",
                          "--port-ranges", "0:63")),),
                    sequences=True),
    "v1model": Program("v1model", "p4/v1model/passing.p4", "p4/v1model/testgen.json", "bmv2", "v1model", "PTF", None,
                       (Run("all", {}, _V1MODEL_SEARCH), Run("in_domain", {"PASSING_TESTGEN": 1}, _V1MODEL_SEARCH))),
}
# p4c-barefoot defines it for tna.p4 and t2na.p4; p4testgen does not
TARGET_DEFINES = {"tofino": {"__TARGET_TOFINO__": 1}, "tofino2": {"__TARGET_TOFINO__": 2}}
# tna.p4, t2na.p4 and their Tofino includes come with the Tofino backend's sources (docs/tofino.md)
TARGET_INCLUDES = {"tofino": ("backends/tofino/bf-p4c/p4include",), "tofino2": ("backends/tofino/bf-p4c/p4include",)}
P4C_SOURCE = Path(os.environ.get("P4C_SOURCE", "/opt/src/p4c"))  # the p4c checkout P4Testgen was built from

PIN_FILE = "passing_pin.p4"
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def sources_of(program: Path) -> list[Path]:
    """The program and every file it includes with ``#include "..."``, transitively, in a fixed order."""
    seen: list[Path] = []
    todo = [program.resolve()]
    while todo:
        path = todo.pop(0)
        if path in seen:
            continue
        seen.append(path)
        todo += [(path.parent / name).resolve() for name in _INCLUDE.findall(path.read_text())
                 if name != PIN_FILE]  # written for each pinned run (p4/include/testgen.p4), not part of the program
    return seen


_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.DOTALL)


def program_sha256(program: Path) -> str:
    """What a vector file is stale against: the program and everything it includes, without comments and with
    runs of white space as one (a comment or a re-indented line changes no test)."""
    digest = hashlib.sha256()
    for path in sources_of(program):
        name = os.path.relpath(path, program.resolve().parent)
        text = " ".join(_COMMENT.sub(" ", path.read_text()).split())
        digest.update(name.encode() + b"\0" + text.encode() + b"\0")
    return digest.hexdigest()


# ---- P4Testgen's PTF output -> vectors ---------------------------------------------------------------------


def _value(node: ast.expr) -> object:
    return ast.literal_eval(node)


def _call_name(node: ast.expr) -> str:
    """'insertTableEntry' for self.insertTableEntry(...), 'KeyTuple' for gc.KeyTuple(...)."""
    if isinstance(node, ast.Call):
        node = node.func
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def _key(node: ast.Call) -> tuple[str, dict]:
    """tofino: gc.KeyTuple(name, value[, mask] | low=, high= | prefix_len=); bmv2: self.Exact(name, value),
    self.Ternary(name, value, mask), self.Lpm(name, value, prefix_len), self.Range(name, low, high)."""
    name, *args = (_value(a) for a in node.args)
    kw = {k.arg: _value(k.value) for k in node.keywords}
    kind = _call_name(node)
    if kind == "Optional":
        raise ValueError(f"key {name}: optional matches are not kept in vectors")
    if kind == "Range":
        return name, {"low": args[0], "high": args[1]}
    if "low" in kw:
        return name, {"low": kw["low"], "high": kw["high"]}
    if kind == "Lpm":
        return name, {"value": args[0], "prefix_len": args[1]}
    if "prefix_len" in kw:
        return name, {"value": args[0], "prefix_len": kw["prefix_len"]}
    if len(args) == 2:
        return name, {"value": args[0], "mask": args[1]}
    return name, {"value": args[0]}


def _table_call(call: ast.Call) -> dict:
    kind = _call_name(call)
    if kind == "table_add":  # bmv2: ((table, [keys]), (action, [(param, value)]), priority)
        (table, keys), (action, data) = (arg.elts for arg in call.args[:2])
        entry = {"table": _value(table), "key": dict(_key(k) for k in keys.elts), "action": _value(action),
                 "params": {_value(d.elts[0]): _value(d.elts[1]) for d in data.elts}}
        priority = _value(call.args[2]) if len(call.args) > 2 else None
        return entry if priority is None else {**entry, "priority": priority}
    if kind == "insertTableEntry":
        table, keys, action, data = call.args
        return {"table": _value(table), "key": dict(_key(k) for k in keys.elts),
                "action": _value(action), "params": {_value(d.args[0]): _value(d.args[1]) for d in data.elts}}
    table, action, data = call.args  # overrideDefaultEntry
    return {"table": _value(table), "default": True, "action": _value(action),
            "params": {_value(d.args[0]): _value(d.args[1]) for d in data.elts}}


def _register_call(call: ast.Call) -> dict:
    name, value, index = call.args
    raw = _value(value)
    if isinstance(raw, list):  # a struct register: [('reg.field', value), ...]
        raw = {field.rsplit(".", 1)[1]: v for field, v in raw}
    return {"register": _value(name), "index": _value(index), "value": raw}


def _assignments(body: list[ast.stmt]) -> dict[str, object]:
    out: dict[str, object] = {}
    for stmt in body:
        if isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Name):
            value = stmt.value
            if _call_name(value) == "Mask" and isinstance(value, ast.Call):
                value = value.args[0]  # bmv2: exp_pkt = Mask(b'...'); tofino: exp_pkt = b'...', then Mask(exp_pkt)
            try:
                out[stmt.targets[0].id] = _value(value)
            except ValueError:
                pass  # exp_pkt = Mask(exp_pkt)
    return out


def _dont_care(body: list[ast.stmt]) -> list[list[int]]:
    return [[_value(s.value.args[0]), _value(s.value.args[1])] for s in body
            if isinstance(s, ast.Expr) and _call_name(s.value) == "set_do_not_care"]


_EMIT_CALL = re.compile(r"\[MethodCall\]: \w+\.emit<(\w+)>")
_FIELD = re.compile(r"(\w+):([^;]*);")


def ingress_of(trace: str, deparser: str) -> dict | None:
    """From a test's path trace: what the ingress deparser emitted (each valid header and its fields, in order)
    and what the traffic manager was told: ``port``, or ``dropped``. None when the path never left the ingress
    deparser. (P4Testgen's output packet is what its egress made of it; its egress parser does not read what
    the ingress deparser emitted: docs/tofino.md.)"""
    start = trace.find(f'copy_in("{deparser}")')
    if start < 0:
        return None
    emitted: list[dict] = []
    header = None
    port: int | str | None = None
    dropped = False
    for line in trace[start:].splitlines():
        line = line.strip()
        if (call := _EMIT_CALL.search(line)) is not None:
            header = call[1]
        elif line.startswith("[Emit]:") and header is not None:
            fields = {k: (int(v) if v.strip().lstrip("-").isdigit() else v.strip())
                      for k, v in _FIELD.findall(line) if k != "headerValid"}
            emitted.append({"header": header, "fields": fields})
            header = None
        elif line.startswith("[Invalid emit"):
            header = None
        elif "egress_port = " in line and port is None:
            value = line.rsplit("= ", 1)[1].rstrip(";").strip('"')
            port = int(value) if value.isdigit() else value
        elif line.startswith("[Packet marked dropped"):
            dropped = True
            break
        elif "StartEgress" in line:
            break
    return {"emit": emitted, "port": None if dropped else port, "dropped": dropped}


_COMPUTED = re.compile(r"\| Computed: ([\w./]+) = (-?\d+);")
_PAIR_ACTION = re.compile(r"\[MethodCall\]: lane_(?:write|add|max|harvest|read)_(\d+)\(\);")
_REGISTER_OF = {"tag": "slot_tag", "epoch": "slot_tag", "bitmap": "slot_bitmap", "psn": "slot_bitmap"}


def writes_of(trace: str, control: str) -> list[dict]:
    """What every RegisterAction of ``control`` wrote back on the path, from its trace: P4Testgen's tofino target
    executes a RegisterAction's apply on the register's initial value but does not store the result (its
    source: "writing to a register has no effect"). Its trace has each assignment the apply made, with the
    computed value: ``value.<field> = v`` (``value`` is the apply's register parameter in every RegisterAction
    of the program), so the value written back is the initial value with those fields replaced. The register
    is known by its fields (slot_tag: tag, epoch; slot_bitmap: bitmap, psn; slot_overflow: no field) and, for
    a lane pair, by the lane action that ran it; the index is ``meta.slot_set`` (slot_tag's hash-unit index
    has the same bits). One entry per register and index: {register, index, fields} (``fields`` of
    slot_overflow: {"value": v}), values as unsigned words like setRegisterValue's."""
    start = trace.find(f'copy_in("{control}")')
    if start < 0:
        return []
    end = trace.find(f'copy_out("{control}")', start)
    out: dict[tuple[str, int], dict[str, int]] = {}
    index, pair = 0, None
    for line in trace[start:end if end >= 0 else None].splitlines():
        if (action := _PAIR_ACTION.search(line)) is not None:
            pair = int(action[1])
            continue
        computed = _COMPUTED.search(line)
        if computed is None:
            continue
        target, value = computed[1], int(computed[2])
        if target == "meta.slot_set":
            index = value
        elif target == "value":
            out.setdefault(("slot_overflow", index), {})["value"] = value % 0x100
        elif target.startswith("value."):
            field = target.split(".", 1)[1]
            register = _REGISTER_OF.get(field) or (f"lane_pair_{pair}" if field in ("first", "second") else None)
            if register is None:
                raise ValueError(f"a register write to {target} this parser does not know")
            out.setdefault((register, index), {})[field] = value % (1 << 32)
    return [{"register": r, "index": i, "fields": f} for (r, i), f in out.items()]


_TABLE_CALLS = ("insertTableEntry", "overrideDefaultEntry", "table_add")


def without_traces(path: Path) -> str:
    """A PTF file without its tests' path traces (the triple-quoted blocks, megabytes per test), read line by
    line: a run of hundreds of bmv2 tests writes gigabytes."""
    kept, in_trace = [], False
    with path.open() as lines:
        for line in lines:
            if line.strip() == "'''":
                in_trace = not in_trace
            elif not in_trace:
                kept.append(line)
    return "".join(kept)


def parse_ptf(text: str, deparser: str | None = None) -> list[dict]:
    """Every test of a P4Testgen PTF file (of the tofino or the bmv2 target), in test order; with ``deparser``,
    each test also carries ``ingress`` (ingress_of) from its trace."""
    tests = []
    traces = {int(m[1]): m[2] for m in re.finditer(r"class Test(\d+)\(.*?'{3}(.*?)'{3}", text, flags=re.S)} \
        if deparser is not None else {}
    text = re.sub(r"'{3}.*?'{3}", "", text, flags=re.S)  # the path traces: megabytes each, not kept
    for cls in ast.parse(text).body:
        match = re.fullmatch(r"Test(\d+)", cls.name) if isinstance(cls, ast.ClassDef) else None
        if not match:
            continue
        methods = {f.name: f.body for f in cls.body if isinstance(f, ast.FunctionDef)}
        calls = [s.value for s in methods.get("setupCtrlPlane", []) if isinstance(s, ast.Expr)
                 and isinstance(s.value, ast.Call)]
        tables = [_table_call(c) for c in calls if _call_name(c) in _TABLE_CALLS]
        registers = [_register_call(c) for c in calls if _call_name(c) == "setRegisterValue"]
        unknown = sorted({_call_name(c) for c in calls} - {*_TABLE_CALLS, "setRegisterValue"})
        if unknown:
            raise ValueError(f"Test{match[1]}: control-plane calls this parser does not know: {unknown}")
        send = _assignments(methods.get("sendPacket", []))
        verify_body = methods.get("verifyPackets", [])
        verify = _assignments(verify_body)
        test: dict = {"id": int(match[1]), "tables": tables, "registers": registers,
                      "input": {"port": send["ig_port"], "packet": bytes(send["pkt"]).hex()}}
        if "eg_port" in verify:
            test["expect"] = {"port": verify["eg_port"], "packet": bytes(verify["exp_pkt"]).hex(),
                              "dont_care_bits": _dont_care(verify_body)}
        else:
            test["expect"] = None  # no packet leaves the switch
        if deparser is not None:
            test["ingress"] = ingress_of(traces.get(test["id"], ""), deparser)
            test["writes"] = writes_of(traces.get(test["id"], ""), "PassingIngress")
        tests.append(test)
    return sorted(tests, key=lambda t: t["id"])


# ---- sequences: packets chained through the registers, each executed by P4Testgen ---------------------------


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


_ZERO = {"slot_tag": {"tag": 0, "epoch": 0}, "slot_bitmap": {"bitmap": 0, "psn": 0}, "slot_overflow": 0}


def unwritten(name: str) -> object:
    """What an entry of register ``name`` holds before anything wrote it: 0 in every field."""
    return _ZERO.get(name, {"first": 0, "second": 0})


def written(name: str, old: object, fields: dict[str, int]) -> object:
    """An entry of register ``name`` after a RegisterAction wrote ``fields`` into it (a ``writes_of`` entry):
    slot_overflow's one value, or the struct with those fields replaced."""
    return fields["value"] if name == "slot_overflow" else {**old, **fields}


def _register(state: dict, name: str, index: int) -> object:
    return state.get((name, index), unwritten(name))


def signed32(value: int) -> int:
    """An int32 held as an unsigned word (setRegisterValue's, the lanes') as its signed value."""
    return value - (1 << 32) if value & (1 << 31) else value


def pin_source(inp: dict, admit: dict | None, state: dict, index: int, lanes: int) -> str:
    """passing_pin.p4 (p4/include/testgen.p4): the input's port and every header field, the admission entry's
    parameters (``false``: no entry of the controller matches), and the registers of the slot/set ``index``."""
    conds = [f"ig_intr_md.ingress_port == {inp['port']}"]
    for header, fields in inp["headers"].items():
        var = f"hdr.{HEADER_VARIABLES[header]}"
        conds.append(f"{var}.isValid()")
        conds += [f"{var}.{name} == {value}" for name, value in fields.items()]
    admitted = " && ".join(f"({name}) == {value}" for name, value in admit.items()) if admit else "false"
    tag, bitmap = _register(state, "slot_tag", index), _register(state, "slot_bitmap", index)
    lines = [f"#define PASSING_PIN_INPUT ({' && '.join(conds)})",
             f"#define PASSING_PIN_ADMIT(base, pool, full, epoch, group) ({admitted})",
             f"#define PASSING_PIN_ROUND(value) ((value).tag == {tag['tag']} && (value).epoch == {tag['epoch']})",
             f"#define PASSING_PIN_CONTRIBUTORS(value) ((value).bitmap == {bitmap['bitmap']} "
             f"&& (value).psn == {bitmap['psn']})",
             f"#define PASSING_PIN_OVERFLOW(value) ((value) == {_register(state, 'slot_overflow', index)})"]
    for k in range(lanes // 2):
        pair = _register(state, f"lane_pair_{k}", index)
        lines.append(f"#define PASSING_PIN_PAIR_{k}(value) ((value).first == {signed32(pair['first'])} "
                     f"&& (value).second == {signed32(pair['second'])})")
    lines.append("#define PASSING_PIN_PAIR(k, value) PASSING_PIN_PAIR_##k(value)")
    return "\n".join(lines) + "\n"


def _admission_hit(test: dict) -> dict | None:
    for entry in test["tables"]:
        if entry["table"].endswith(".admission") and not entry.get("default"):
            return {k.split(".")[-1]: int(v) for k, v in entry["params"].items()}
    return None


def _has(test: dict, table: str) -> bool:
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
                state[key] = written(write["register"], _register(state, *key), write["fields"])
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
        hit = _admission_hit(test)
        if hit == admit and not _has(test, "l2_forward") and (which == 2 or _has(test, "aggregator_address")):
            return test
    raise SystemExit(f"no path of the pinned packet has the controller's tables: {inp}")


# ---- the vector files ----------------------------------------------------------------------------------------


def write_vectors(path: Path, meta: dict, tests: list[dict]) -> None:
    """JSON with one test a line, so that a regeneration diffs test by test."""
    lines = ["{", *[f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in meta.items()], '  "tests": [']
    lines += [f"    {json.dumps(t, sort_keys=True)}{',' if i < len(tests) - 1 else ''}" for i, t in enumerate(tests)]
    lines += ["  ]", "}", ""]
    path.write_text("\n".join(lines))


def load_vectors(program: Program) -> dict:
    return json.loads((ROOT / program.vectors).read_text())


def stale(program: Program) -> str | None:
    """Why the program's vectors are stale, or None when they were generated from the program as it is."""
    path = ROOT / program.vectors
    if not path.exists():
        return f"{program.vectors} is missing: run make p4-testgen"
    want = program_sha256(ROOT / program.source)
    have = load_vectors(program).get("program_sha256")
    if have != want:
        return f"{program.vectors} was generated from another {program.source} (sha256 {have}, now {want}): " \
               "run make p4-testgen"
    return None


# ---- generation -------------------------------------------------------------------------------------------


_COVERAGE = re.compile(r"Nodes covered: ([0-9.]+) \((\d+)/(\d+)\)")  # p4testgen's line after each test


def _uncovered(log: str) -> list[str]:
    """The statements of the last "Not covered program nodes" list p4testgen printed (--print-coverage)."""
    blocks = log.split("Not covered program nodes:")
    if len(blocks) < 2:
        return []
    lines = []
    for line in blocks[-1].splitlines()[1:]:
        if not line.startswith("\t"):
            break
        lines.append(line.strip().replace(str(ROOT) + "/", ""))
    return lines


def run_p4testgen(program: Program, run: Run, max_tests: int, seed: int, defines: dict[str, int],
                  extra: list[str], log_file: Path | None, source: Path | None = None,
                  coverage: bool = True) -> tuple[list[dict], dict]:
    """One p4testgen run of ``run`` over the program (or ``source``, a variant of it: a mutant)."""
    tool = shutil.which("p4testgen")
    if tool is None:
        sys.exit("make p4-testgen: p4testgen not found; build p4c with its test tools (docs/tofino.md)")
    includes = [f"-I{P4C_SOURCE / d}" for d in TARGET_INCLUDES.get(program.target, ())]
    with tempfile.TemporaryDirectory(prefix="passing-testgen-") as out:
        args = [tool, "--target", program.target, "--arch", program.arch, "--std", "p4-16", *includes,
                *[f"-D{k}={v}" for k, v in {**TARGET_DEFINES.get(program.target, {}), **defines,
                                            **run.defines}.items()],
                "--test-backend", program.test_backend, "--seed", str(seed), "--max-tests", str(max_tests),
                *(("--track-coverage", "STATEMENTS", "--print-coverage") if coverage else ()), *run.args, *extra,
                "--out-dir", out, str(source or ROOT / program.source)]
        started = time.monotonic()
        done = subprocess.run(args, capture_output=True, text=True)
        seconds = time.monotonic() - started
        log = done.stdout + done.stderr
        if log_file is not None:
            log_file.write_text(log)
        if done.returncode != 0:
            sys.exit(f"p4testgen failed ({done.returncode}):\n{log[-5000:]}")
        # the tofino target's traces give each test's ingress output; the bmv2 target's are gigabytes
        tests = [t for f in sorted(Path(out).glob("*.py")) for t in
                 (parse_ptf(f.read_text(), program.ingress_deparser) if program.ingress_deparser
                  else parse_ptf(without_traces(f)))]
    for t in tests:
        t["run"] = run.name
    coverage = _COVERAGE.findall(log)
    meta = {"defines": run.defines,
            "args": [a if a != out else "<out>" for a in args[1:-1] if not a.startswith("-I")],
            "seconds": round(seconds, 1), "tests": len(tests),
            "node_coverage": {"fraction": float(coverage[-1][0]), "covered": int(coverage[-1][1]),
                              "nodes": int(coverage[-1][2])} if coverage else None,
            "uncovered": _uncovered(log)}
    return tests, meta


def generate(program: Program, max_tests: int, seed: int, defines: dict[str, int], extra: list[str],
             log_file: Path | None = None, source: Path | None = None, out: Path | None = None,
             only_sequences: bool = False) -> dict:
    """Every run of the program, then (Tofino) its sequences, into its vector file; ``source`` and ``out``: a
    variant of the program (a mutant, tests/conformance/mutants.py) and where its vectors go."""
    runs: dict[str, dict] = {}
    tests: list[dict] = []
    if only_sequences:  # the runs' vectors as they are in the file, the sequences made again
        kept = json.loads((out or ROOT / program.vectors).read_text())
        if kept["program_sha256"] != program_sha256(source or ROOT / program.source):
            sys.exit("--only-sequences: the vector file is of another program: generate it whole")
        runs = kept["p4testgen"]["runs"]
        tests = [t for t in kept["tests"] if t["run"] != "sequence"]
    for run in program.runs if not only_sequences else ():
        log = log_file.with_name(f"{log_file.name}.{run.name}") if log_file and len(program.runs) > 1 else log_file
        found, runs[run.name] = run_p4testgen(program, run, max_tests, seed, defines, extra, log, source)
        tests += found
    sequences: dict[str, dict] = {}
    if program.sequences:
        for name, events in SEQUENCES.items():
            started, steps = time.monotonic(), []
            found = run_sequence(program, name, events, defines["PASSING_LANES"], source or ROOT / program.source,
                                 steps)
            sequences[name] = {"vectors": len(found), "seconds": round(time.monotonic() - started, 1)}
            tests += found
    # statements no run covered: what stays uncovered in the union
    left = Counter(runs[program.runs[0].name]["uncovered"])
    for run in program.runs[1:]:
        left &= Counter(runs[run.name]["uncovered"])
    nodes = max((r["node_coverage"] or {}).get("nodes", 0) for r in runs.values())
    meta = {
        "program": program.source,
        "program_sha256": program_sha256(source or ROOT / program.source),
        "target": program.target,
        "arch": program.arch,
        "defines": defines,
        "p4testgen": {"version": _version(shutil.which("p4testgen") or "p4testgen", program),
                      "p4c_commit": _p4c_commit(),
                      "seconds": round(sum(r["seconds"] for r in runs.values()), 1), "runs": runs},
        "statement_coverage": {"nodes": nodes, "covered": nodes - sum(left.values()),
                               "uncovered": sorted(left.elements())},
        "sequences": sequences,
    }
    write_vectors(out or ROOT / program.vectors, meta, tests)
    return meta


def _p4c_commit() -> str | None:
    """The p4c checkout P4Testgen was built from (its --version says "<null>")."""
    done = subprocess.run(["git", "-C", str(P4C_SOURCE), "rev-parse", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or None


def _version(tool: str, program: Program) -> str:
    run = subprocess.run([tool, "--target", program.target, "--arch", program.arch, "--version"],
                         capture_output=True, text=True)
    return (run.stdout or run.stderr).strip().splitlines()[-1] if (run.stdout or run.stderr) else "?"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="run p4testgen on a program and write its vectors")
    gen.add_argument("program", choices=sorted(PROGRAMS))
    gen.add_argument("--max-tests", type=int, default=0, help="0: until every path is explored")
    gen.add_argument("--seed", type=int, default=1)
    gen.add_argument("--lanes", type=int, default=64, help="PASSING_LANES of the program")
    gen.add_argument("--source", type=Path, help="a variant of the program (a mutant) instead of it")
    gen.add_argument("--out", type=Path, help="write the vectors there instead of beside the program")
    gen.add_argument("--only-sequences", action="store_true",
                     help="make the sequences again, keep the runs' vectors of the file (same program)")
    gen.add_argument("--log", type=Path,
                     help="write p4testgen's whole output there (LOG.<run> for each run of a program of several)")
    sub.add_parser("check", help="exit 1 when a vector file is missing or stale")
    args, extra = parser.parse_known_args(argv)  # generate: what this parser does not know goes to p4testgen
    extra = [a for a in extra if a != "--"]
    if extra and args.command != "generate":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "generate":
        meta = generate(PROGRAMS[args.program], args.max_tests, args.seed, {"PASSING_LANES": args.lanes}, extra,
                        args.log, args.source, args.out, args.only_sequences)
        summary = {"program": meta["program"], "seconds": meta["p4testgen"]["seconds"],
                   "tests": {name: r["tests"] for name, r in meta["p4testgen"]["runs"].items()},
                   "covered": f'{meta["statement_coverage"]["covered"]}/{meta["statement_coverage"]["nodes"]}'}
        print(json.dumps(summary, indent=2))
        return 0
    problems = [p for p in (stale(prog) for prog in PROGRAMS.values()) if p]
    for p in problems:
        print(p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
