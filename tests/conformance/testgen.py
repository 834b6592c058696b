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
3. a recirculated packet (port 68) is the second pass of a round (``second_pass``);
4. what the packet's RegisterActions wrote back (``writes``, read from the path's trace) must leave its slot/set
   as the reference leaves its own, through the same abstraction (``compare_registers``); a packet with no slot/set
   writes none;
5. the vectors of a sequence (pinned P4Testgen runs, one per packet) chain: each starts from the registers the
   earlier ones left (``check_chain``);
6. the sequences' packets, interleaved, give as batches of one engine what they give one at a time
   (``check_batches``): the engine's waves and its waves of SUM and MAX rounds together, which no vector of one
   packet reaches.

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
from passing.aggregator import engine as reference
from passing.aggregator.engine import JobSpec

from . import tree_vectors, vector_tool

tool = vector_tool.load()  # p4/testgen_vectors.py: the P4 header layout is defined there once (testgen_programs.py)

SLOTS = 1024  # PASSING_SLOTS
MAX_JOBS = 1024  # PASSING_MAX_JOBS
RECIRCULATION_PORT = 68  # of each pipe: the pipe is the port's top two bits
ETH, IPV4, UDP = 14, 20, 8
INT32 = 1 << 32
DROP_PORT = 511  # both targets (and their P4Testgen models) drop a packet sent to port 511
FLOOD_GROUP = 1  # PASSING_FLOOD_GROUP


# Outside: the vector's state is none the protocol reaches; Divergence: the program does what no protocol rule
# says (defined with the tree's reading of the vectors, which raises them too)
Outside, Divergence = tree_vectors.Outside, tree_vectors.Divergence


# ---- the input, as the shared parser sees it -----------------------------------------------------------------


HEADER_FIELDS, unpack, header_size = tool.HEADER_FIELDS, tool.unpack, tool.header_size


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


_exact, _params = tree_vectors.key_value, tree_vectors.params_of  # an entry's key field, its action's parameters


@dataclass
class JobView:
    """The admission entry that matched, as the reference's job. ``admit(base, pool, full, epoch, group)``:
    ``full = 2^n - 1`` is a job of n workers; ``epoch`` is what slot_tag records of this allocation (the
    reference's ``JobSpec.epoch``); ``group`` its multicast group. The other workers' origins are ports no
    vector uses: only this worker's packet is played."""

    spec: JobSpec
    epoch: int
    group: int


def _controller_shaped(job: int, generation: int, p: dict[str, int]) -> None:
    """An admission entry as controller/passing_controller/allocation.py writes it: job ids 1..1023, epoch =
    job << 16 | generation, group = job + 1."""
    if not 1 <= job < MAX_JOBS or p["epoch"] != job << 16 | generation or p["group"] != job + 1:
        raise Outside(f"admission of job {job} generation {generation} {p}: no controller writes it")


def job_view(vector: dict, job: int, generation: int, worker: int, port: int) -> JobView | None:
    """The admitted job of this packet, or None when no admission entry matches (the default: reject). A vector of
    a sequence carries the controller's allocations live at its packet: the job is the live allocation of the
    packet's job id, whatever its generation, worker and port say, so that the reference sees a late packet of an
    earlier allocation, or a worker on another's port, against the entries it fails to match."""
    if "allocations" in vector:
        for a in vector["allocations"]:
            if a["job"] == job:
                _controller_shaped(job, a["generation"], a)
                spec = JobSpec(job, a["base"], a["pool"], list(a["ports"]), generation=a["generation"], lanes=None)
                return JobView(spec, a["epoch"], a["group"])
        return None
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
        _controller_shaped(job, generation, p)
        sources = [port if w == worker else 0x10000 + w for w in range(workers)]
        spec = JobSpec(job, p["base"], p["pool"], sources, generation=generation, lanes=None)
        return JobView(spec, p["epoch"], p["group"])
    return None


def registers(vector: dict, name: str) -> dict[int, object]:
    return {int(r["index"]): r["value"] for r in _named(vector["registers"], name)}


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
    return tool.unwritten("slot_tag")


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
        acc[2 * k], acc[2 * k + 1] = tool.signed32(int(pair["first"])), tool.signed32(int(pair["second"]))
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
                  lanes: int) -> tuple[list, list[str], SlotView]:
    """The reference engine on one packet from a slot/set in ``state``: its emissions as (worker, bytes,
    multicast), the job's counters it moved (its verdict), and the slot/set after it."""
    engine = reference.AggregationEngine(SLOTS, lanes, MAX_JOBS)
    engine.add_job(job.spec)
    # base + slot past the table (a slot outside the pool, which the reference refuses): no entry to set up
    flat = (index % SLOTS) * 2 + index // SLOTS if index < 2 * SLOTS else 0
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
    after = SlotView(int(engine.state_epoch[flat]), int(engine.tag[flat]), int(engine.bitmap[flat]),
                     bool(engine.overflow[flat]), engine.acc[flat].copy())
    return [(by_source[int(d)], p.tobytes()[:n], bool(m))
            for d, p, n, m in zip(out.dest, out.packets, out.lengths, out.multicast)], verdict, after


def _same(a: SlotView, b: SlotView) -> bool:
    return (a.epoch, a.tag, a.bitmap, a.overflow) == (b.epoch, b.tag, b.bitmap, b.overflow) \
        and np.array_equal(a.lanes, b.lanes)


def tna_state(vector: dict, index: int, lanes: int) -> dict[str, object]:
    """The registers of slot/set ``index`` before the packet, as the vector sets them (0 where it does not)."""
    names = ("slot_bitmap", "slot_overflow", *(f"lane_pair_{k}" for k in range(lanes // 2)))
    state: dict[str, object] = {"slot_tag": slot_tag_of(vector, index),
                                **{name: registers(vector, name).get(index, tool.unwritten(name)) for name in names}}
    return {name: ({f: int(v) for f, v in value.items()} if isinstance(value, dict) else int(value))
            for name, value in state.items()}


def concretize(view: SlotView, epoch: int, flag: int, lanes: int) -> dict[str, object]:
    """The inverse of slot_view for a round of the allocation of ``epoch``: the TNA registers of a reference
    slot/set (with TNA's round flag ``flag``, the OR of the contributions' flags: TNA flags no saturated lane)."""
    out: dict[str, object] = {"slot_tag": {"tag": view.tag, "epoch": epoch},
                              "slot_bitmap": {"bitmap": view.bitmap, "psn": view.tag}, "slot_overflow": flag}
    for k in range(lanes // 2):
        out[f"lane_pair_{k}"] = {"first": int(view.lanes[2 * k]) % INT32, "second": int(view.lanes[2 * k + 1]) % INT32}
    return out


# ---- what the ingress must hand the traffic manager ---------------------------------------------------------


@dataclass
class Expected:
    rule: str  # the protocol rule that decides the vector
    to: str  # "drop", "port" or "multicast"
    port: int | None = None
    headers: dict[str, dict[str, int]] | None = None  # compared when not dropped
    lanes: list[int] | None = None
    index: int | None = None  # the slot/set whose registers the packet may write
    after: dict[str, object] | None = None  # their values after it; None: the packet writes no register


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


def first_pass(vector: dict, lanes: int, chip: str = "tofino") -> Expected:
    """What the ingress hands the traffic manager for a packet from a port. ``chip``: "tofino" (the TNA program:
    a completion and an answer go round again for their lanes 2k) or "tofino2" (the T2NA program: one pass,
    every lane from its pair's SALU, the OWNER_ONLY owner checked)."""
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
    job = job_view(vector, hdr["job"], hdr["generation"], hdr["worker"], port) if hdr is not None else None
    datagram = raw[ETH + IPV4 + UDP:ETH + IPV4 + UDP + wire.packet_size(lanes)]
    if not _aggregated_kind(hdr):
        if job is not None and p.lanes is not None:  # the reference must not take it either
            empty = SlotView(-1, 0, 0, False, np.zeros(lanes, np.int32))
            results, verdict, _ = run_reference(job, 0, empty, datagram, port, lanes)
            if results or verdict:
                raise Divergence(f"the reference takes a packet of version {hdr['version']} type {hdr['type']}: "
                                 f"{verdict}")
        return Expected("malformed: not a whole DATA, GATHER or NACK of the program's lanes", "drop")
    if hdr["type"] != wire.DATA:
        return relay(job, hdr, headers, p.lanes, port, datagram, lanes)
    if job is None:
        return Expected("rejected: not admitted", "drop")
    if chip == "tofino" and hdr["flags"] & wire.FLAG_OWNER_ONLY and hdr["owner"] >= job.spec.workers:
        # TNA does not check an OWNER_ONLY round's owner (it would take a stage: docs/protocol.md, docs/tofino.md):
        # it runs the round as any. The reference rejects the packet.
        datagram = datagram[:3] + bytes([hdr["flags"] & ~wire.FLAG_OWNER_ONLY]) + datagram[4:]
    index = (hdr["set"] & 1) * SLOTS + job.spec.base + hdr["slot"]
    state = slot_view(vector, job, index, lanes, hdr["psn"])
    results, verdict, after = run_reference(job, index, state, datagram, port, lanes)
    same_round = state.epoch == job.spec.epoch and state.tag == hdr["psn"]
    flagged = hdr["flags"] & wire.FLAG_OVERFLOW
    if same_round and flagged and not state.overflow and "aggregated" not in verdict:
        raise Outside("a retransmission flagged OVERFLOW to a round none of whose contributions was")
    # TNA's round flag is the OR of its contributions' flags; a saturated lane shows at its bound alone
    round_flag = (int(state.overflow) | flagged) if same_round else flagged
    # what the packet leaves in the registers: the reference's slot/set after it, or nothing changed
    if _same(state, after):
        effect = tna_state(vector, index, lanes)
    else:
        if after.epoch != job.spec.epoch:
            raise Divergence(f"the reference left the slot/set to epoch {after.epoch}, not the job's")
        saturated = same_round and hdr["op"] == wire.SUM and "aggregated" in verdict and any(
            not wire.INT32_MIN <= int(a) + tool.signed32(b) <= wire.INT32_MAX for a, b in zip(state.lanes, p.lanes))
        if after.overflow != (bool(round_flag) or saturated):
            raise Divergence(f"the reference's round overflow is {after.overflow}: the contributions' flags "
                             f"{round_flag}, a lane saturated: {saturated}")
        effect = concretize(after, job.epoch, round_flag, lanes)
    if not results:
        return Expected(f"the state machine drops it ({', '.join(verdict)})", "drop", index=index, after=effect)
    multicast = results[0][2]
    _, result, _ = next(r for r in results if r[1][1] == wire.RESULT or not r[2])
    sums = list(struct.unpack_from(f">{lanes}I", result, wire.HEADER_SIZE)) if len(result) > wire.HEADER_SIZE \
        else None
    if multicast:
        rule = "a completed round: the first pass, to the recirculation port"
        if sums is None:  # every replica is an ACK (an OWNER_ONLY round whose owner is no worker)
            raise Divergence("the reference's completion carries no sums")
        out_lanes = [sums[i] if i % 2 else p.lanes[i] for i in range(lanes)]
        group, answer = job.group, 0
    else:
        rule = "a retransmission to a completed round: the first pass of its answer"
        if sums is None:  # an ACK to a worker that is not the round's owner: TNA answers with the RESULT
            sums = [int(v) % INT32 for v in state.lanes]
        out_lanes = [sums[i] if i % 2 else 0 for i in range(lanes)]
        group, answer = 0, 1
    if (result[3] & wire.FLAG_OVERFLOW) != round_flag and not _saturated(sums):
        raise Divergence(f"the reference's RESULT flags {result[3]:#x}, the round's flag {round_flag}")
    if chip == "tofino2":
        # one pass: every lane from its pair; the RESULT keeps OWNER_ONLY for the egress, which makes ACKs of it
        flags = round_flag | (hdr["flags"] & wire.FLAG_OWNER_ONLY)
        headers["passing_h"] = {**hdr, "type": wire.RESULT, "flags": flags}
        if multicast:
            headers["bridged_h"] = _bridged(port, result_multicast=1)
            return Expected("a completed round: to the job's multicast group", "multicast", None, headers, sums,
                            index, effect)
        headers["bridged_h"] = _bridged(port, answer=1)
        return Expected("a retransmission to a completed round: answered to its port", "port", port, headers,
                        sums, index, effect)
    headers["passing_h"] = {**hdr, "type": wire.RESULT, "flags": round_flag}
    headers["bridged_h"] = _bridged(port, second_pass=1, slot_set=index, group=group, answer=answer)
    return Expected(rule, "port", (port & 0x180) | RECIRCULATION_PORT, headers, out_lanes, index, effect)


def _saturated(sums: list[int] | None) -> bool:
    return sums is not None and any(v in (0x7FFFFFFF, 0x80000000) for v in sums)


def relay(job: JobView | None, hdr: dict, headers: dict, lanes: list[int] | None, port: int, datagram: bytes,
          width: int) -> Expected:
    """GATHER and NACK: what the reference admits and relays (a GATHER of the sender's own piece, a NACK to another
    worker of the job) goes to the job's multicast group with the bridged relay flag, untouched; the rest is
    dropped. Which replicas leave is the egress's (not modelled)."""
    if job is not None:
        empty = SlotView(-1, 0, 0, False, np.zeros(width, np.int32))
        _, verdict, _ = run_reference(job, 0, empty, datagram, port, width)
        if "relayed" in verdict:
            headers["bridged_h"] = _bridged(port, relay=1)
            return Expected("relayed: to the job's multicast group", "multicast", None, headers, lanes)
    return Expected("rejected: a relayed kind not admitted or not addressed to the job", "drop")


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


# The Tofino 2 program's bridged tree header (p4/include/tofino_tree_common.p4), as a flat job's packet leaves the
# ingress: no owner (PASSING_NO_RID), no uplink, no flag. Its vectors are of flat jobs (p4/testgen_programs.py,
# FLAT_ONLY); the tree roles are held to the reference on BMv2.
FLAT_TREE_BRIDGED = {"owner_rid": 0xFFFF, "up_job": 0, "up_generation": 0, "up_worker": 0, "up_mac": 0, "up_ip": 0,
                     "pad": 0, "resend": 0, "tree": 0, "relay_up": 0, "owner_only": 0, "ack": 0}


def expect(vector: dict, lanes: int, chip: str = "tofino") -> Expected:
    if chip == "tofino" and int(vector["input"]["port"]) & 0x7F == RECIRCULATION_PORT:
        return second_pass(vector, lanes)
    want = first_pass(vector, lanes, chip)
    if chip == "tofino2" and want.headers is not None:
        want.headers["tree_bridged_h"] = dict(FLAT_TREE_BRIDGED)
    return want


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
        # the model drops a multicast too: a packet the ingress marked for replication is none
        bridged = next((e["fields"] for e in got["emit"] if e["header"] == "bridged_h"), {})
        marked = [flag for flag in ("result_multicast", "relay", "flood") if bridged.get(flag)]
        if marked:
            raise Divergence(f"{what}: the program multicasts it ({', '.join(marked)})")
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


def compare_registers(vector: dict, want: Expected, lanes: int) -> None:
    """What the packet's RegisterActions wrote back (the vector's ``writes``, from P4Testgen's trace) against
    what the protocol leaves in the slot/set: the registers after the packet are the vector's initial values
    with its writes, and must be ``want.after``; a packet the protocol gives no slot/set writes none."""
    writes = vector.get("writes")
    if writes is None:
        raise Divergence("the vector has no register writes (generated without its trace)")
    if want.after is None:
        if writes:
            raise Divergence(f"{want.rule}: the program writes {sorted({w['register'] for w in writes})}")
        return
    elsewhere = sorted({(w["register"], w["index"]) for w in writes if w["index"] != want.index})
    if elsewhere:
        raise Divergence(f"{want.rule}: the program writes {elsewhere}, not slot/set {want.index}")
    # slot_phase (the tree roles, Tofino 2) means nothing to a flat job, whose new round sets it to 0
    phase = [w["fields"].get("value") for w in writes if w["register"] == "slot_phase"]
    if any(value != 0 for value in phase):
        raise Divergence(f"{want.rule}: a flat job's round sets slot_phase to {phase}")
    writes = [w for w in writes if w["register"] != "slot_phase"]
    now = tna_state(vector, want.index, lanes)
    for w in writes:
        now[w["register"]] = tool.written(w["register"], now[w["register"]], w["fields"])
    for name, value in want.after.items():
        if now[name] != value:
            raise Divergence(f"{want.rule}: {name} after the packet is {now[name]}, the protocol says {value}")


def check(vector: dict, lanes: int, chip: str = "tofino") -> str:
    """The rule that decides the vector, after comparing its output and its register effects; raises Outside or
    Divergence. ``chip``: the vector file's target (first_pass)."""
    want = expect(vector, lanes, chip)
    compare(vector, want)
    compare_registers(vector, want, lanes)
    return want.rule


# ---- sequences: vectors chained through the registers --------------------------------------------------------


def _packet_index(vector: dict, lanes: int) -> int | None:
    """The slot/set a sequence's packet reads: the bridged slot/set of a second pass, set * 1024 + base + slot of
    a first pass whose job is live (None otherwise)."""
    raw = bytes.fromhex(vector["input"]["packet"])
    if int(vector["input"]["port"]) & 0x7F == RECIRCULATION_PORT:
        return unpack("bridged_h", raw)["slot_set"]
    hdr = parse(raw, lanes).headers.get("passing_h")
    for a in vector["allocations"]:
        if hdr is not None and a["job"] == hdr["job"] and a["generation"] == hdr["generation"]:
            return (hdr["set"] & 1) * SLOTS + a["base"] + hdr["slot"]
    return None


def check_chain(vectors: list[dict], lanes: int) -> None:
    """The vectors of one sequence, in order, are one run of the program: each starts from the registers the
    earlier ones left (its initial values are what they wrote, or 0 where nothing was), and a second pass's
    input is what the first pass before it emitted. With each vector checked alone (check), this holds the
    program to the protocol over the whole sequence."""
    state: dict[tuple[str, int], object] = {}
    emitted: dict[str, dict] | None = None
    for v in vectors:
        what = f"{v['sequence']} step {v['step']}"
        index = _packet_index(v, lanes)
        if index is not None:
            present = {r["register"].split(".")[-1] for r in v["registers"]}  # what the path reads
            for name, value in tna_state(v, index, lanes).items():
                if name not in present:
                    continue
                before = state.get((name, index), tool.unwritten(name))
                if value != before:
                    raise Divergence(f"{what}: {name} starts at {value}, the sequence left {before}")
        if int(v["input"]["port"]) & 0x7F == RECIRCULATION_PORT:
            raw = bytes.fromhex(v["input"]["packet"])
            got = {"bridged_h": unpack("bridged_h", raw), **parse(raw[header_size("bridged_h"):], lanes).headers}
            if emitted is None or any(got.get(h) != f for h, f in emitted.items() if h != "lanes_h"):
                raise Divergence(f"{what}: a second pass that is not what the first pass emitted")
            lanes_in = parse(raw[header_size("bridged_h"):], lanes).lanes
            if lanes_in != [emitted["lanes_h"][f"value_{i}"] for i in range(lanes)]:
                raise Divergence(f"{what}: a second pass whose lanes are not those the first pass emitted")
        for w in v["writes"]:
            key = (w["register"], w["index"])
            state[key] = tool.written(w["register"], state.get(key, tool.unwritten(w["register"])), w["fields"])
        got = v["ingress"]
        emitted = {e["header"]: e["fields"] for e in got["emit"]} if got and not got["dropped"] else None


# ---- batches: the sequences' packets several at a time through one engine -----------------------------------


def _allocation(a: dict) -> tuple[int, int, int, int, tuple[int, ...]]:
    return a["job"], a["generation"], a["base"], a["pool"], tuple(a["ports"])


def sequence_stream(vectors: dict) -> list[tuple[bytes, int, frozenset]]:
    """The frames the sequences of a vector file send from the workers' ports (a Tofino 1's second passes are the
    switch's own), the sequences interleaved: the first packet of each, then the second of each, and so on. Each
    with its port and the allocations live then, those of every sequence (as ``_allocation`` tuples)."""
    chains: dict[str, list[dict]] = {}
    for v in vectors["tests"]:
        if v.get("run") == "sequence" and int(v["input"]["port"]) & 0x7F != RECIRCULATION_PORT:
            chains.setdefault(v["sequence"], []).append(v)
    for chain in chains.values():
        chain.sort(key=lambda v: v["step"])
    # a sequence's allocations are live from the start (its first packet's) until it changes them
    live = {name: frozenset(_allocation(a) for a in chain[0]["allocations"]) for name, chain in chains.items()}
    out = []
    for i in range(max(map(len, chains.values()), default=0)):
        for name in sorted(chains):
            if i < len(chains[name]):
                v = chains[name][i]
                live[name] = frozenset(_allocation(a) for a in v["allocations"])
                everyone = frozenset().union(*live.values())
                out.append((bytes.fromhex(v["input"]["packet"]), int(v["input"]["port"]), everyone))
    return out


def _admit(engine: reference.AggregationEngine, allocations: frozenset) -> None:
    """The engine's jobs made ``allocations``: the others removed, the missing ones admitted."""
    for spec in engine.jobs():
        if (spec.job, spec.generation, spec.base, spec.pool, tuple(spec.sources)) not in allocations:
            engine.remove_job(spec.job)
    admitted = {spec.job for spec in engine.jobs()}
    for job, generation, base, pool, ports in sorted(allocations):
        if job not in admitted:
            engine.add_job(JobSpec(job, base, pool, list(ports), generation=generation, lanes=None))


def _process(engine: reference.AggregationEngine, frames: list[tuple[bytes, int]], lanes: int) -> list[tuple]:
    """``frames`` (frame, port) as one batch of datagrams; what the engine emits: (origin, bytes, multicast) each."""
    batch = np.zeros(len(frames), wire.packet_dtype(lanes))
    rows, lengths = batch.view(np.uint8).reshape(len(frames), -1), []
    for row, (raw, _) in zip(rows, frames):
        datagram = raw[ETH + IPV4 + UDP:ETH + IPV4 + UDP + wire.packet_size(lanes)]
        row[:len(datagram)] = np.frombuffer(datagram, dtype=np.uint8)
        lengths.append(len(datagram))
    out = engine.process(batch, np.array([port for _, port in frames]), np.array(lengths))
    return [(int(d), p.tobytes()[:n], bool(m)) for d, p, n, m in zip(out.dest, out.packets, out.lengths, out.multicast)]


def _shown(emissions: list[tuple], at: int) -> str:
    if at >= len(emissions):
        return "none"
    origin, datagram, multicast = emissions[at]
    h = unpack("passing_h", datagram)
    return (f"type {h['type']} of job {h['job']} psn {h['psn']} to origin {origin} "
            f"({'multicast' if multicast else 'unicast'}, lanes {datagram[wire.HEADER_SIZE:][:8].hex()}...)")


def check_batches(vectors: dict, lanes: int) -> None:
    """The sequences' packets, interleaved (``sequence_stream``), through two reference engines: one packet at a
    time, and in batches (every packet from one change of the live allocations to the next in one). One at a time
    is what each vector holds the program to (``check``, ``check_chain``); a batch runs what no single packet
    reaches: the engine's waves (the k-th packet of a slot/set goes to wave k) and a wave that holds SUM and MAX
    contributions (the "max" sequence's beside the others'). Each batch must give what its packets give one at a
    time: the same emissions in the same order, and the same slot/sets and counters after it."""
    single = reference.AggregationEngine(SLOTS, lanes, MAX_JOBS)
    batched = reference.AggregationEngine(SLOTS, lanes, MAX_JOBS)
    stream = sequence_stream(vectors)
    starts = [i for i in range(len(stream)) if i == 0 or stream[i][2] != stream[i - 1][2]]
    for number, (start, end) in enumerate(zip(starts, starts[1:] + [len(stream)])):
        frames = [(raw, port) for raw, port, _ in stream[start:end]]
        for engine in (single, batched):
            _admit(engine, stream[start][2])
        one = [emitted for frame in frames for emitted in _process(single, [frame], lanes)]
        together = _process(batched, frames, lanes)
        what = f"batch {number} ({len(frames)} packets)"
        if together != one:
            at = next((i for i, (a, b) in enumerate(zip(together, one)) if a != b), min(len(one), len(together)))
            raise Divergence(f"{what}: emission {at} is {_shown(together, at)}, one packet at a time "
                             f"{_shown(one, at)} ({len(together)} emissions against {len(one)})")
        for name in ("state_epoch", "tag", "bitmap", "overflow", "acc"):
            if not np.array_equal(getattr(batched, name), getattr(single, name)):
                raise Divergence(f"{what}: the slot/sets' {name} after the batch is not what one packet at a time "
                                 "leaves")
        for spec in single.jobs():
            if batched.counters(spec.job) != single.counters(spec.job):
                raise Divergence(f"{what}: job {spec.job}'s counters {batched.counters(spec.job)}, one packet at a "
                                 f"time {single.counters(spec.job)}")


# ---- the v1model program's vectors (P4Testgen's bmv2 target) --------------------------------------------------


def header_only(raw: bytes) -> dict[str, int] | None:
    """The PASSING header of a header-only datagram (UDP length 8 + 16: a root's ACK coming down), which the
    v1model parser extracts after the shared parser (that leaves it as payload); None for any other frame."""
    at = ETH + IPV4 + UDP
    size = header_size("passing_h")
    if len(raw) < at + size:
        return None
    udp = unpack("udp_h", raw[ETH + IPV4:])
    if udp["dst_port"] != wire.UDP_PORT or udp["length"] != UDP + size:
        return None
    return unpack("passing_h", raw[at:])


def v1model_expect(vector: dict, lanes: int,
                   engine: reference.AggregationEngine | None = None) -> tuple[str, int | None, bytes | None]:
    """What p4/v1model/passing.p4 sends for a vector of P4Testgen's bmv2 target: (rule, port, packet), or a drop
    (None, None). That model starts every register at 0 (a slot of no allocation: a round there is new) and
    drops a multicast (a completed round, a relayed kind, a flood), as its Tofino model does. A job with a tree
    role, and what comes down from a root, go through the reference's roles (tree_vectors)."""
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
            packet = raw[:ETH + 10] + struct.pack(">H", tool.ipv4_checksum(header)) + raw[ETH + 12:]
        return "l2: forwarded", out, packet
    at = ETH + IPV4 + UDP
    hdr = p.headers.get("passing_h")
    only = header_only(raw)
    down = tree_vectors.down_job(vector, hdr or only, port)
    if down is not None:  # the root's answer or relay to a leaf job
        datagram = raw[at:at + (wire.HEADER_SIZE if hdr is None else wire.packet_size(lanes))]
        return v1model_outcome(vector, raw, down, datagram, port, lanes, "down: ", engine)
    if not _aggregated_kind(hdr):
        return "malformed: dropped", None, None
    job = job_view(vector, hdr["job"], hdr["generation"], hdr["worker"], port)
    if job is None:
        return "rejected: not admitted", None, None
    if hdr["type"] == wire.DATA and job.epoch == 0:
        raise Outside("admission epoch 0 is the registers' initial value: a round of this allocation with no "
                      "contributor, which the protocol never holds")
    tree = tree_vectors.tree_job(vector, job.spec, job.group)
    return v1model_outcome(vector, raw, tree, raw[at:at + wire.packet_size(lanes)], port, lanes,
                           "" if tree.spec.role == "flat" else f"{tree.spec.role}: ", engine)


def v1model_outcome(vector: dict, raw: bytes, tree: tree_vectors.TreeJob, datagram: bytes, port: int, lanes: int,
                    role: str, engine: reference.AggregationEngine | None = None) -> tuple[str, int | None,
                                                                                        bytes | None]:
    """The reference's verdict on one packet of a (flat or tree) job as what the v1model program sends: a
    multicast (a completion, a relay, a leaf's GATHER with its uplink replica) is a drop in P4Testgen's model; a
    packet up leaves by the uplink's port; an answer by the worker's. ``engine``: one that holds the job and the
    registers the earlier packets of a sequence left (default: a fresh one, every slot/set unused)."""
    hdr = unpack("passing_h", datagram)
    if engine is None:
        engine = tree_vectors.engine_of([tree.spec], lanes)
    before = engine.counters(tree.spec.job)
    emitted = tree_vectors.run(engine, datagram, port, lanes)
    verdict = tree_vectors.verdict(engine, tree.spec.job, before)
    kind = {wire.DATA: "DATA", wire.RESULT: "RESULT", wire.ACK: "ACK", wire.GATHER: "GATHER",
            wire.NACK: "NACK"}.get(hdr["type"], "?")
    if any(multicast for _, _, multicast in emitted):
        if tree.group <= FLOOD_GROUP:  # v1model multicasts in the pass that decides: group 0 goes to port 0
            raise Outside(f"group {tree.group}: no job's multicast group (job id + 1 >= 2)")
        rule = "a completed round: multicast" if "completed" in verdict or "answered" in verdict else "relayed"
        return f"{role}{rule} ({kind}; {', '.join(verdict)}), no unicast port", None, None
    if not emitted:
        if hdr["type"] != wire.DATA and not role.startswith("down") and "rejected" in verdict:
            return f"{role}rejected: a relayed kind not admitted or not addressed to the job", None, None
        return f"{role}the state machine drops it ({', '.join(verdict)})", None, None
    if len(emitted) != 1:
        raise Divergence(f"{role}the reference sends {len(emitted)} unicast packets for one")
    dest, packet, _ = emitted[0]
    spec = tree.spec
    if spec.up is not None and dest == spec.up.source and tree.up is not None:
        rule = "a leaf's partial up" if hdr["type"] == wire.DATA else f"a leaf's {kind} up"
        return f"{role}{rule} ({', '.join(verdict)}): to the uplink's port", tree.up.port, \
            tree_vectors.up_frame(raw, packet, tree.up)
    if dest != port:
        raise Divergence(f"{role}the reference answers origin {dest}, not the sender's port {port}")
    return f"{role}a retransmission to a completed round: answered ({', '.join(verdict)})", port, \
        tree_vectors.answer_frame(raw, packet)


def v1model_check(vector: dict, lanes: int, engine: reference.AggregationEngine | None = None) -> str:
    """The rule that decides a v1model vector, after comparing P4Testgen's output with it (``engine``: as
    v1model_expect's)."""
    rule, port, packet = v1model_expect(vector, lanes, engine)
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
