"""P4Testgen's vectors of the TNA program held against the protocol (docs/tofino.md, "Executed by P4Testgen").

A vector (p4/testgen_vectors.py) is one path through ``p4/tna/passing.p4`` in P4Testgen's model of Tofino: table
entries, initial registers, an input packet and port, and, from the path's trace, what the ingress deparser
emitted and where the traffic manager was told to send it (``ingress``). The model's egress parser does not read
what the ingress deparser emitted (docs/tofino.md), so the comparison is made there, at the traffic manager: every
header field the ingress emits, every lane, and the port, multicast or drop.

For each vector, ``expect`` works out what the protocol makes of it:

1. the input as the shared parser (p4/include/parser.p4) sees it: a frame it rejects, plain L2 forwarding, a
   malformed PASSING datagram, a relayed kind (GATHER, NACK) or a DATA packet for the state machine;
2. for DATA, the **abstraction function** maps the admission entry onto the reference's ``JobSpec``
   (``job_view``) and the registers of the packet's slot/set onto the reference's slot (``slot_view``); the
   input goes through the reference engine (``passing.aggregator.engine.AggregationEngine``, the executable
   specification); its verdict becomes what the first pass must hand the traffic manager: the round's RESULT
   on its way to the recirculation port, with lanes 2k + 1 summed (the second pass fills lanes 2k), or a drop;
3. a recirculated packet (port 68) is the second pass of a round (``second_pass``).

A vector whose registers are no state the protocol reaches (a round's bitmap without the bit of a worker that
started it, a contributors' psn that is not the round's, ...) is *outside*: counted with the reason and not
compared. P4Testgen's preconditions (p4/include/testgen.p4) keep table entries to what the controller installs.
Everything else is compared, and any difference is a divergence.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np

from passing import wire
from passing.aggregator.engine import AggregationEngine, JobSpec

SLOTS = 1024  # PASSING_SLOTS
MAX_JOBS = 1024  # PASSING_MAX_JOBS
RECIRCULATION_PORT = 68  # of each pipe: the pipe is the port's top two bits
ETH, IPV4, UDP = 14, 20, 8
INT32 = 1 << 32
DROP_PORT = 511  # both targets (and their P4Testgen models) drop a packet sent to port 511
FLOOD_GROUP = 1  # PASSING_FLOOD_GROUP


class Outside(Exception):
    """The vector's state is none the protocol reaches."""


class Divergence(AssertionError):
    """The program does what no protocol rule says."""


# ---- the input, as the shared parser sees it -----------------------------------------------------------------


HEADER_FIELDS = {  # p4/include/headers.p4, in wire order: (name, bits)
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


def unpack(header: str, raw: bytes) -> dict[str, int]:
    fields = HEADER_FIELDS[header]
    width = sum(bits for _, bits in fields)
    value = int.from_bytes(raw[:width // 8], "big")
    out = {}
    for name, bits in fields:
        width -= bits
        out[name] = value >> width & ((1 << bits) - 1)
    return out


def header_size(header: str) -> int:
    return sum(bits for _, bits in HEADER_FIELDS[header]) // 8


@dataclass
class Parsed:
    """The headers the shared parser extracts from a frame (None: not extracted), or ``error``."""

    headers: dict[str, dict[str, int]] = field(default_factory=dict)
    lanes: list[int] | None = None  # unsigned, as the lanes_h fields
    error: bool = False


def parse(raw: bytes, lanes: int) -> Parsed:
    """p4/include/parser.p4 with lanes: a header the frame is too short for is a parser error."""
    out = Parsed()
    at = 0

    def take(header: str) -> dict[str, int] | None:
        nonlocal at
        size = header_size(header)
        if len(raw) < at + size:
            out.error = True
            return None
        out.headers[header] = unpack(header, raw[at:])
        at += size
        return out.headers[header]

    eth = take("ethernet_h")
    if eth is None or eth["ether_type"] != 0x0800:
        return out
    ip = take("ipv4_h")
    if ip is None or (ip["ihl"], ip["frag_offset"], ip["protocol"]) != (5, 0, 17):
        return out
    udp = take("udp_h")
    if udp is None or udp["dst_port"] != wire.UDP_PORT or udp["length"] != UDP + wire.packet_size(lanes):
        return out
    if take("passing_h") is None:
        return out
    if len(raw) < at + 4 * lanes:
        out.error = True
        return out
    out.lanes = list(struct.unpack_from(f">{lanes}I", raw, at))
    return out


# ---- the abstraction function -------------------------------------------------------------------------------


def _named(entries: list[dict], suffix: str) -> list[dict]:
    return [e for e in entries if e.get("table", e.get("register", "")).split(".")[-1] == suffix]


def _exact(entry: dict, name: str) -> int:
    for key, match in entry["key"].items():
        if key.split(".")[-1] == name:
            return int(match["value"])
    raise KeyError(name)


def _params(entry: dict) -> dict[str, int]:
    return {k.split(".")[-1]: int(v) for k, v in entry["params"].items()}


@dataclass
class JobView:
    """The admission entry that matched, as the reference's job. ``admit(base, pool, full, epoch, group)``:
    ``full = 2^n - 1`` is a job of n workers; ``epoch`` is what slot_tag records of this allocation (the
    reference's ``JobSpec.epoch``); ``group`` its multicast group. The other workers' origins are ports no
    vector uses: only this worker's packet is played."""

    spec: JobSpec
    epoch: int
    group: int


def job_view(vector: dict, job: int, generation: int, worker: int, port: int) -> JobView | None:
    """The admitted job of this packet, or None when no admission entry matches (the default: reject)."""
    for entry in _named(vector["tables"], "admission"):
        if entry.get("default") or entry["action"].split(".")[-1] != "admit":
            continue
        if (_exact(entry, "job"), _exact(entry, "generation"), _exact(entry, "worker"),
                _exact(entry, "ingress_port")) != (job, generation, worker, port):
            continue
        p = _params(entry)
        workers = p["full"].bit_length()
        # what the controller installs (p4/include/testgen.p4 keeps the TNA program's P4Testgen runs to it)
        if p["full"] != (1 << workers) - 1 or worker >= workers or not 1 <= p["pool"] \
                or p["base"] + p["pool"] > SLOTS:
            raise Outside(f"admission {p}: no allocation the controller installs for worker {worker}")
        sources = [port if w == worker else 0x10000 + w for w in range(workers)]
        spec = JobSpec(job, p["base"], p["pool"], sources, generation=generation, lanes=None)
        return JobView(spec, p["epoch"], p["group"])
    return None


def registers(vector: dict, name: str) -> dict[int, object]:
    return {int(r["index"]): r["value"] for r in _named(vector["registers"], name)}


def _signed(value: int) -> int:
    return value - INT32 if value & (1 << 31) else value


@dataclass
class SlotView:
    """One slot/set as the reference holds it."""

    epoch: int  # the allocation's epoch, or -1: another allocation's round (or none)
    tag: int
    bitmap: int
    overflow: bool
    lanes: np.ndarray  # int32


def slot_tag_of(vector: dict, index: int) -> dict:
    """slot_tag is addressed through the hash unit (Hash<IDENTITY>), whose value P4Testgen works out only after
    the path is solved: the register entry it writes carries the index it had before (0), not the packet's. A
    path reads slot_tag once, so the one entry a vector sets is the packet's."""
    entries = registers(vector, "slot_tag")
    if index in entries:
        return entries[index]
    if len(entries) == 1:
        return next(iter(entries.values()))
    return {"tag": 0, "epoch": 0}


def slot_view(vector: dict, job: JobView, index: int, lanes: int, psn: int) -> SlotView:
    """The abstraction of TNA's per slot/set state (index = set * 1024 + base + slot) onto the reference's:
    ``slot_tag = (tag, epoch)``: the round's psn and allocation (``epoch`` equal to the admission's is this
    allocation); ``slot_bitmap = (bitmap, psn)``: its contributors and the psn again; ``slot_overflow``: the OR
    of its contributions' OVERFLOW flags; ``lane_pair_<k> = (first, second)``: the sums of lanes 2k and 2k + 1.
    An entry P4Testgen does not set holds 0."""
    tag = slot_tag_of(vector, index)
    contributors = registers(vector, "slot_bitmap").get(index, {"bitmap": 0, "psn": 0})
    overflow = int(registers(vector, "slot_overflow").get(index, 0))
    acc = np.zeros(lanes, dtype=np.int64)
    for k in range(lanes // 2):
        pair = registers(vector, f"lane_pair_{k}").get(index, {"first": 0, "second": 0})
        acc[2 * k], acc[2 * k + 1] = _signed(int(pair["first"])), _signed(int(pair["second"]))
    current = int(tag["epoch"]) == job.epoch
    ahead = (psn - int(tag["tag"])) % INT32
    if current and not 0 < ahead < 1 << 31:  # a round of this allocation that the packet reads: its invariants
        if int(contributors["psn"]) != int(tag["tag"]):
            raise Outside(f"slot_bitmap.psn {int(contributors['psn'])} is not the round's (slot_tag.tag "
                          f"{int(tag['tag'])})")
        bitmap = int(contributors["bitmap"])
        if bitmap == 0 or bitmap & ~job.spec.full:
            raise Outside(f"bitmap {bitmap:#x} is no set of contributors of a job of {job.spec.workers} workers")
        if overflow not in (0, 1):
            raise Outside(f"slot_overflow {overflow}: the flag is 0 or 1")
    return SlotView(job.spec.epoch if current else -1, int(tag["tag"]), int(contributors["bitmap"]) if current else 0,
                    bool(overflow) if current else False, acc.astype(np.int32))


def run_reference(job: JobView, index: int, state: SlotView, datagram: bytes, port: int,
                  lanes: int) -> tuple[list, list[str]]:
    """The reference engine on one packet from a slot/set in ``state``: its emissions as (worker, bytes,
    multicast), and the job's counters it moved (its verdict)."""
    engine = AggregationEngine(SLOTS, lanes, MAX_JOBS)
    engine.add_job(job.spec)
    flat = (index % SLOTS) * 2 + index // SLOTS
    engine.state_epoch[flat] = state.epoch
    engine.tag[flat] = state.tag
    engine.bitmap[flat] = state.bitmap
    engine.overflow[flat] = state.overflow
    engine.acc[flat] = state.lanes
    batch = np.zeros(1, wire.packet_dtype(lanes))
    batch.view(np.uint8)[:] = np.frombuffer(datagram, dtype=np.uint8)
    out = engine.process(batch, np.array([port]), np.array([len(datagram)]))
    by_source = {s: w for w, s in enumerate(job.spec.sources)}
    verdict = [name for name, n in engine.counters(job.spec.job).items()
               if n and name not in ("received", "results_sent")]
    return [(by_source[int(d)], p.tobytes()[:n], bool(m))
            for d, p, n, m in zip(out.dest, out.packets, out.lengths, out.multicast)], verdict


# ---- what the ingress must hand the traffic manager ---------------------------------------------------------


@dataclass
class Expected:
    rule: str  # the protocol rule that decides the vector
    to: str  # "drop", "port" or "multicast"
    port: int | None = None
    headers: dict[str, dict[str, int]] | None = None  # compared when not dropped
    lanes: list[int] | None = None


def _bridged(ingress_port: int, **flags: int) -> dict[str, int]:
    """The bridged header a first pass emits. Its slot_set is meaningful on the way to the second pass only (the
    program writes it in stage 0 for every packet, from whatever admission gave): not compared otherwise."""
    b = {name: 0 for name, _ in HEADER_FIELDS["bridged_h"] if name != "slot_set"}
    b["ingress_port"] = ingress_port
    b.update(flags)
    return b


def _table_hit(vector: dict, table: str, key: str, value: int) -> dict | None:
    for entry in _named(vector["tables"], table):
        if not entry.get("default") and _exact(entry, key) == value:
            return entry
    return None


def _to_aggregator(vector: dict, p: Parsed) -> bool:
    """A UDP datagram to PASSING's port at an address the aggregator_address table holds."""
    udp, ip = p.headers.get("udp_h"), p.headers.get("ipv4_h")
    return udp is not None and udp["dst_port"] == wire.UDP_PORT \
        and _table_hit(vector, "aggregator_address", "ip", ip["dst_addr"]) is not None


def _l2(vector: dict, p: Parsed) -> tuple[str, int | None]:
    """What l2_forward does with a frame: ("forward", port), ("flood", None) or ("drop", None); a miss is
    its default drop, a forward to port 511 a drop on both targets."""
    entry = _table_hit(vector, "l2_forward", "dst_addr", p.headers["ethernet_h"]["dst_addr"])
    action = entry["action"].split(".")[-1] if entry else "drop"
    if action == "forward" and _params(entry)["port"] != DROP_PORT:
        return "forward", _params(entry)["port"]
    return ("flood" if action == "flood" else "drop"), None


def _aggregated_kind(hdr: dict | None) -> bool:
    """A whole DATA, GATHER or NACK of this version: what the aggregator takes (anything else is malformed)."""
    return hdr is not None and hdr["version"] == wire.VERSION and hdr["type"] in (wire.DATA, wire.GATHER, wire.NACK)


def first_pass(vector: dict, lanes: int) -> Expected:
    raw = bytes.fromhex(vector["input"]["packet"])
    port = int(vector["input"]["port"])
    p = parse(raw, lanes)
    if p.error:
        return Expected("parser error: malformed, dropped", "drop")
    headers = dict(p.headers)
    headers["bridged_h"] = _bridged(port)
    if not _to_aggregator(vector, p):
        action, out = _l2(vector, p)
        if action == "forward":
            return Expected("l2: forwarded", "port", out, headers, p.lanes)
        if action == "flood":
            headers["bridged_h"]["flood"] = 1
            return Expected("l2: flooded", "multicast", None, headers, p.lanes)
        return Expected("l2: dropped", "drop")
    hdr = p.headers.get("passing_h")
    if not _aggregated_kind(hdr):
        return Expected("malformed: not a whole DATA, GATHER or NACK of the program's lanes", "drop")
    job = job_view(vector, hdr["job"], hdr["generation"], hdr["worker"], port)
    if hdr["type"] != wire.DATA:
        return relay(job, hdr, headers, p.lanes, port)
    if job is None or hdr["slot"] >= job.spec.pool:
        return Expected("rejected: not admitted, or a slot outside the job's pool", "drop")
    datagram = raw[ETH + IPV4 + UDP:ETH + IPV4 + UDP + wire.packet_size(lanes)]
    if hdr["flags"] & wire.FLAG_OWNER_ONLY and hdr["owner"] >= job.spec.workers:
        # TNA does not check an OWNER_ONLY round's owner (it would take a stage: docs/protocol.md, docs/tofino.md):
        # it runs the round as any. The reference rejects the packet.
        datagram = datagram[:3] + bytes([hdr["flags"] & ~wire.FLAG_OWNER_ONLY]) + datagram[4:]
    index = (hdr["set"] & 1) * SLOTS + job.spec.base + hdr["slot"]
    state = slot_view(vector, job, index, lanes, hdr["psn"])
    results, verdict = run_reference(job, index, state, datagram, port, lanes)
    if not results:
        return Expected(f"the state machine drops it ({', '.join(verdict)})", "drop")
    multicast = results[0][2]
    _, result, _ = next(r for r in results if r[1][1] == wire.RESULT or not r[2])
    sums = list(struct.unpack_from(f">{lanes}I", result, wire.HEADER_SIZE)) if len(result) > wire.HEADER_SIZE \
        else None
    same_round = state.epoch == job.spec.epoch and state.tag == hdr["psn"]
    flagged = hdr["flags"] & wire.FLAG_OVERFLOW
    # TNA's round flag is the OR of its contributions' flags; a saturated lane shows at its bound alone
    round_flag = (int(state.overflow) | flagged) if same_round else flagged
    if multicast:
        rule = "a completed round: the first pass, to the recirculation port"
        if sums is None:  # every replica is an ACK (an OWNER_ONLY round whose owner is no worker)
            raise Divergence("the reference's completion carries no sums")
        out_lanes = [sums[i] if i % 2 else p.lanes[i] for i in range(lanes)]
        group, answer = job.group, 0
    else:
        rule = "a retransmission to a completed round: the first pass of its answer"
        if not state.overflow and flagged:
            raise Outside("a retransmission flagged OVERFLOW to a round none of whose contributions was")
        stored = [int(v) % INT32 for v in state.lanes]
        out_lanes = [stored[i] if i % 2 else 0 for i in range(lanes)]
        group, answer = 0, 1
    if (result[3] & wire.FLAG_OVERFLOW) != round_flag and not _saturated(sums):
        raise Divergence(f"the reference's RESULT flags {result[3]:#x}, the round's flag {round_flag}")
    headers["passing_h"] = {**hdr, "type": wire.RESULT, "flags": round_flag}
    headers["bridged_h"] = _bridged(port, second_pass=1, slot_set=index, group=group, answer=answer)
    return Expected(rule, "port", (port & 0x180) | RECIRCULATION_PORT, headers, out_lanes)


def _saturated(sums: list[int] | None) -> bool:
    return sums is not None and any(v in (0x7FFFFFFF, 0x80000000) for v in sums)


def relay(job: JobView | None, hdr: dict, headers: dict, lanes: list[int] | None, port: int) -> Expected:
    """GATHER and NACK: admitted and addressed right (a GATHER of the sender's own piece, a NACK to another
    worker of the job), they go to the job's multicast group with the bridged relay flag, untouched."""
    ok = job is not None and (
        hdr["owner"] == hdr["worker"] if hdr["type"] == wire.GATHER
        else hdr["owner"] != hdr["worker"] and hdr["owner"] < job.spec.workers)
    if not ok:
        return Expected("rejected: a relayed kind not admitted or not addressed to the job", "drop")
    headers["bridged_h"] = _bridged(port, relay=1)
    return Expected("relayed: to the job's multicast group", "multicast", None, headers, lanes)


def second_pass(vector: dict, lanes: int) -> Expected:
    """A packet back from the recirculation port with the bridged header a first pass wrote (the preconditions):
    every lane 2k is read from lane_pair_<k>.first of its slot/set; then it is multicast to its group, or an
    answer goes back to the worker's port."""
    raw = bytes.fromhex(vector["input"]["packet"])
    size = header_size("bridged_h")
    bridged = unpack("bridged_h", raw)
    p = parse(raw[size:], lanes)
    if p.error or p.lanes is None:
        raise Outside("a recirculated packet that is no whole RESULT: no first pass sends one")
    out_lanes = list(p.lanes)
    for k in range(lanes // 2):
        pair = registers(vector, f"lane_pair_{k}").get(bridged["slot_set"], {"first": 0, "second": 0})
        out_lanes[2 * k] = int(pair["first"]) % INT32
    headers = dict(p.headers)
    if bridged["group"] != 0:
        headers["bridged_h"] = {**bridged, "second_pass": 0, "result_multicast": 1}
        return Expected(f"the second pass of a completed round: multicast to group {bridged['group']}",
                        "multicast", None, headers, out_lanes)
    if bridged["ingress_port"] == DROP_PORT:
        return Expected("the second pass of an answer to port 511: a drop", "drop")
    headers["bridged_h"] = {**bridged, "second_pass": 0}
    return Expected("the second pass of an answer: to the worker's port", "port", bridged["ingress_port"], headers,
                    out_lanes)


def expect(vector: dict, lanes: int) -> Expected:
    if int(vector["input"]["port"]) & 0x7F == RECIRCULATION_PORT:
        return second_pass(vector, lanes)
    return first_pass(vector, lanes)


# ---- the comparison -------------------------------------------------------------------------------------------


def compare(vector: dict, want: Expected) -> None:
    """The ingress's output in the vector against the protocol's. The model sends no packet anywhere without
    a unicast port (multicast is not modelled): a multicast shows as a drop, with the headers it was given."""
    got = vector.get("ingress")
    if got is None:
        raise Divergence("the vector has no ingress output (generated without its trace)")
    what = want.rule
    if want.to == "drop":
        if not got["dropped"]:
            raise Divergence(f"{what}: the program sends it to port {got['port']}")
        return
    if want.to == "port":
        if got["dropped"] or got["port"] != want.port:
            raise Divergence(f"{what}: to port {want.port}, the program " +
                             ("drops it" if got["dropped"] else f"sends it to port {got['port']}"))
    elif not got["dropped"]:
        raise Divergence(f"{what}: multicast, the program sends it to port {got['port']}")
    emitted = {e["header"]: e["fields"] for e in got["emit"]}
    for header, fields in (want.headers or {}).items():
        if header not in emitted:
            raise Divergence(f"{what}: {header} not emitted")
        for name, value in fields.items():
            if emitted[header].get(name) != value:
                raise Divergence(f"{what}: {header}.{name} is {emitted[header].get(name)}, the protocol says "
                                 f"{value}")
    if want.lanes is not None:
        if "lanes_h" not in emitted:
            raise Divergence(f"{what}: the lanes not emitted")
        for i, value in enumerate(want.lanes):
            if emitted["lanes_h"].get(f"value_{i}") != value:
                raise Divergence(f"{what}: lane {i} is {emitted['lanes_h'].get(f'value_{i}')}, the protocol "
                                 f"says {value}")
    extra = set(emitted) - set(want.headers or {}) - {"lanes_h"}
    if extra:
        raise Divergence(f"{what}: emits {sorted(extra)} too")


def check(vector: dict, lanes: int) -> str:
    """The rule that decides the vector, after comparing; raises Outside or Divergence."""
    want = expect(vector, lanes)
    compare(vector, want)
    return want.rule


# ---- the v1model program's vectors (P4Testgen's bmv2 target) --------------------------------------------------


def ipv4_checksum(header: bytes) -> int:
    words = struct.unpack(">10H", header[:10] + b"\0\0" + header[12:20])
    total = sum(words)
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def v1model_expect(vector: dict, lanes: int) -> tuple[str, int | None, bytes | None]:
    """What p4/v1model/passing.p4 sends for a vector of P4Testgen's bmv2 target: (rule, port, packet), or a drop
    (None, None). That model starts every register at 0 (a slot of no allocation: a round there is new) and
    drops a multicast (a completed round, a relayed kind, a flood), as its Tofino model does."""
    raw = bytes.fromhex(vector["input"]["packet"])
    port = int(vector["input"]["port"])
    p = parse(raw, lanes)
    if p.error:
        return "parser error: malformed, dropped", None, None
    if not _to_aggregator(vector, p):
        action, out = _l2(vector, p)
        if action != "forward":
            return f"l2: {action}, no unicast port", None, None
        packet = raw
        if "ipv4_h" in p.headers:  # the deparser writes the IPv4 checksum of every IPv4 packet
            header = raw[ETH:ETH + IPV4]
            packet = raw[:ETH + 10] + struct.pack(">H", ipv4_checksum(header)) + raw[ETH + 12:]
        return "l2: forwarded", out, packet
    hdr = p.headers.get("passing_h")
    if not _aggregated_kind(hdr):
        return "malformed: dropped", None, None
    job = job_view(vector, hdr["job"], hdr["generation"], hdr["worker"], port)
    # v1model multicasts in the pass that decides: with group 0 a relay or a completion goes to port 0
    no_group = Outside(f"admission group {job.group if job else None}: no job's multicast group (job id + 1 >= 2)")
    if hdr["type"] != wire.DATA:
        relayed = relay(job, hdr, {}, None, port)
        if relayed.to == "multicast" and job is not None and job.group <= FLOOD_GROUP:
            raise no_group
        return relayed.rule + " (no unicast port)", None, None
    if job is None or hdr["slot"] >= job.spec.pool:
        return "rejected: not admitted, or a slot outside the job's pool", None, None
    if job.epoch == 0:
        raise Outside("admission epoch 0 is the registers' initial value: a round of this allocation with no "
                      "contributor, which the protocol never holds")
    datagram = raw[ETH + IPV4 + UDP:ETH + IPV4 + UDP + wire.packet_size(lanes)]
    index = (hdr["set"] & 1) * SLOTS + job.spec.base + hdr["slot"]
    empty = SlotView(-1, 0, 0, False, np.zeros(lanes, np.int32))
    results, verdict = run_reference(job, index, empty, datagram, port, lanes)
    if any(not multicast for _, _, multicast in results):
        raise Divergence("a round new at every slot answered a retransmission")
    if results and job.group <= FLOOD_GROUP:
        raise no_group
    return ("a completed round: multicast, no unicast port" if results else
            f"the state machine drops it ({', '.join(verdict)})"), None, None


def v1model_check(vector: dict, lanes: int) -> str:
    """The rule that decides a v1model vector, after comparing P4Testgen's output with it."""
    rule, port, packet = v1model_expect(vector, lanes)
    got = vector["expect"]
    if packet is None:
        if got is not None:
            raise Divergence(f"{rule}: the program sends it to port {got['port']}")
        return rule
    if got is None:
        raise Divergence(f"{rule}: to port {port}, the program drops it")
    if got["port"] != port:
        raise Divergence(f"{rule}: to port {port}, the program sends it to port {got['port']}")
    difference = masked_difference(packet, bytes.fromhex(got["packet"]), got["dont_care_bits"])
    if difference is not None:
        raise Divergence(f"{rule}: the program's packet, against the protocol's: {difference}")
    return rule


def masked_difference(expected: bytes, got: bytes, dont_care: list[list[int]]) -> str | None:
    """Where ``got`` differs from ``expected`` outside the don't-care bits ([first bit, bits] each, as P4Testgen
    writes them), or None."""
    if len(got) != len(expected):
        return f"{len(got)} bytes, expected {len(expected)}"
    care = np.ones(len(expected) * 8, dtype=bool)
    for first, width in dont_care:
        care[first:first + width] = False
    wrong = np.flatnonzero(care & (np.unpackbits(np.frombuffer(got, np.uint8))
                                   != np.unpackbits(np.frombuffer(expected, np.uint8))))
    if not wrong.size:
        return None
    i = int(wrong[0]) // 8
    return (f"{len(np.unique(wrong // 8))} bytes differ, first at byte {i}: got {got[i:i + 16].hex()}, "
            f"expected {expected[i:i + 16].hex()}")
