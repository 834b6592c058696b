"""The tree roles in P4Testgen's vectors (docs/tofino.md, "Executed by P4Testgen"; docs/protocol.md, "Trees across
racks"): a vector whose table entries make its job a leaf (``tree_role``'s ``leaf``, with its uplink) or a root
(``root``), or whose packet comes down an ``uplink`` entry from a root, is held against the reference engine's
roles (``passing.aggregator.engine`` with the ``JobSpec`` of that role), not against the flat job alone.

The tables are found by the last part of their names and read as the controller writes them on every target
(controller/passing_controller/tree_roles.py: ``leaf_entries``, ``root_entries``, ``owner_entries``), so the same
functions read the Tofino programs' vectors once those carry the roles. An entry no controller writes (an uplink
on a server's port, an owner map naming no worker of the job, an ``owner_up`` at a root) makes the vector
*outside*, as an admission entry of that kind does (``testgen.Outside``).

What the reference emits becomes what a switch sends:

* a replica of a completion or of a relay (``multicast``): the job's multicast group, which P4Testgen's models do
  not replicate (a drop in a vector); a leaf's GATHER goes up by its group's uplink replica, so it is one too;
* a packet up to the root (a leaf's partial, first or re-sent, or a NACK to another rack's server): unicast out
  of the uplink's port, the PASSING datagram as the reference made it, in a frame from the address the packet
  came to (Ethernet and IPv4) to the root's, both UDP ports PASSING's, UDP checksum 0 (``up_frame``);
* an answer to one worker: its port, the frame's addresses swapped.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from passing import wire
from passing.aggregator import engine as reference
from passing.aggregator.engine import ConfigError, JobSpec, Uplink
from passing.aggregator.jobs import NOT_OWNER, OWNERS, UP

from . import vector_tool

tool = vector_tool.load()

SLOTS = 1024  # PASSING_SLOTS
MAX_JOBS = 1024  # PASSING_MAX_JOBS
ETH, IPV4, UDP = 14, 20, 8
DROP_PORT = 511
OTHER_WORKER = 0x10000  # the origin of a worker whose packet no vector plays: no port


class Outside(Exception):
    """The vector's entries are none a controller writes (testgen.Outside is this class)."""


class Divergence(AssertionError):
    """The program does what no protocol rule says (testgen.Divergence is this class)."""


@dataclass(frozen=True)
class UpAddress:
    """Where a leaf's packets up go: the switch port toward the root and the root's aggregation addresses."""

    port: int
    mac: int
    ip: int


@dataclass
class TreeJob:
    """A job as the reference takes it, with the tree's addresses (None: a flat job, or a root)."""

    spec: JobSpec
    up: UpAddress | None
    group: int


def _name(entry: dict) -> str:
    return entry.get("table", entry.get("register", "")).split(".")[-1]


def key_value(entry: dict, name: str) -> int:
    """An entry's exact key field ``name`` (by its last dotted part)."""
    for key, match in entry["key"].items():
        if key.split(".")[-1] == name:
            return int(match["value"])
    raise KeyError(name)


def params_of(entry: dict) -> dict[str, int]:
    """An entry's action parameters by their last dotted part."""
    return {k.split(".")[-1]: int(v) for k, v in entry["params"].items()}


def _hit(vector: dict, table: str, job: int) -> dict | None:
    for entry in vector["tables"]:
        if _name(entry) == table and not entry.get("default") and key_value(entry, "job") == job:
            return entry
    return None


def _action(entry: dict) -> str:
    return entry["action"].split(".")[-1]


def owner_map(vector: dict, job: int, role: str, workers: int) -> list[int] | None:
    """The job's owner map from its ``owner_map`` entries (owner -> ``owner_worker(worker)`` or ``owner_up``), as the
    reference's ``JobSpec.owners``; None for a flat job (the identity: a flat job's map has no entries)."""
    if role == "flat":
        return None
    owners = [NOT_OWNER] * OWNERS
    for entry in vector["tables"]:
        if _name(entry) != "owner_map" or entry.get("default") or key_value(entry, "job") != job:
            continue
        owner, action = key_value(entry, "owner"), _action(entry)
        if owner >= OWNERS:
            raise Outside(f"owner_map of job {job}: owner {owner} past the wire's 7 bits")
        if action == "owner_up":
            if role != "leaf":
                raise Outside(f"owner_map of root job {job}: owner {owner} up (no controller writes it at a root)")
            owners[owner] = UP
        elif action == "owner_worker":
            worker = params_of(entry)["worker"]
            if worker >= workers:
                raise Outside(f"owner_map of job {job}: owner {owner} -> worker {worker} of {workers}")
            owners[owner] = worker
    return owners


def _up_shaped(job: int, p: dict[str, int], ports: set[int]) -> None:
    """A leaf's uplink as tree_roles.leaf_entries writes it: the root's job id and generation, a worker of the
    root's job, a port toward the root that is none of the job's servers' (and no drop port)."""
    if not 1 <= p["up_job"] < MAX_JOBS or p["up_generation"] >= wire.GENERATIONS \
            or p["up_worker"] >= wire.MAX_WORKERS or p["port"] in ports or p["port"] == DROP_PORT:
        raise Outside(f"tree_role leaf of job {job} {p}: no controller writes it")


def tree_job(vector: dict, spec: JobSpec, group: int) -> TreeJob:
    """The admitted flat ``spec`` with the role the vector's ``tree_role`` entry gives its job (a miss: flat) and
    its owner map; raises Outside for entries no controller writes."""
    entry = _hit(vector, "tree_role", spec.job)
    action = _action(entry) if entry else "flat"
    up = None
    if action == "leaf":
        p = params_of(entry)
        _up_shaped(spec.job, p, set(spec.sources))
        up = UpAddress(p["port"], p["mac"], p["ip"])
        spec.up = Uplink(p["up_job"], p["up_generation"], p["up_worker"], p["port"])
        spec.role = "leaf"
    elif action == "root":
        spec.role = "root"
    elif action != "flat":
        raise Outside(f"tree_role action {action}")
    spec.owners = owner_map(vector, spec.job, spec.role, spec.workers)
    return TreeJob(spec, up, group)


def down_job(vector: dict, hdr: dict | None, port: int) -> TreeJob | None:
    """What comes down from a root: a RESULT or ACK of a job id an ``uplink`` entry holds, or a GATHER or NACK of
    it on that entry's port; the leaf job it answers (from the entry: the controller writes the leaf's allocation
    there) with its uplink. None for any other packet; raises Outside for an entry no controller writes."""
    if hdr is None or hdr["version"] != wire.VERSION or \
            hdr["type"] not in (wire.RESULT, wire.ACK, wire.GATHER, wire.NACK):
        return None
    entry = _hit(vector, "uplink", hdr["job"])
    if entry is None or _action(entry) != "from_uplink":
        return None
    u = params_of(entry)
    if hdr["type"] in (wire.GATHER, wire.NACK) and port != u["port"]:
        return None  # a server's own GATHER or NACK of that job id: the flat path
    workers = u["full"].bit_length()
    if not 1 <= u["leaf_job"] < MAX_JOBS or u["epoch"] != u["leaf_job"] << 16 | u["leaf_generation"] \
            or u["group"] != u["leaf_job"] + 1 or workers == 0 or u["full"] != (1 << workers) - 1 \
            or not 1 <= u["pool"] or u["base"] + u["pool"] > SLOTS or u["port"] == DROP_PORT \
            or u["generation"] >= wire.GENERATIONS or u["worker"] >= wire.MAX_WORKERS:
        raise Outside(f"uplink of job {hdr['job']} {u}: no controller writes it")
    spec = JobSpec(u["leaf_job"], u["base"], u["pool"], [OTHER_WORKER + w for w in range(workers)],
                   generation=u["leaf_generation"], lanes=None, role="leaf",
                   up=Uplink(hdr["job"], u["generation"], u["worker"], u["port"]))
    spec.owners = owner_map(vector, spec.job, "leaf", workers)
    return TreeJob(spec, None, u["group"])


def engine_of(jobs: list[JobSpec], lanes: int) -> reference.AggregationEngine:
    """A reference engine of the switch's size with ``jobs`` admitted; a set no controller writes is Outside."""
    engine = reference.AggregationEngine(SLOTS, lanes, MAX_JOBS)
    for spec in jobs:
        try:
            engine.add_job(spec)
        except ConfigError as e:
            raise Outside(f"no controller admits it: {e}") from e
    return engine


def run(engine: reference.AggregationEngine, datagram: bytes, port: int,
        lanes: int) -> list[tuple[int, bytes, bool]]:
    """One datagram through ``engine`` from origin ``port``: its emissions as (origin, bytes, multicast)."""
    row = wire.packet_dtype(lanes).itemsize
    batch = np.zeros(1, wire.packet_dtype(lanes))
    batch.view(np.uint8)[: min(len(datagram), row)] = np.frombuffer(datagram[:row], dtype=np.uint8)
    out = engine.process(batch, np.array([port]), np.array([len(datagram)]))
    return [(int(d), p.tobytes()[:n], bool(m)) for d, p, n, m in zip(out.dest, out.packets, out.lengths,
                                                                      out.multicast)]


def verdict(engine: reference.AggregationEngine, job: int, before: dict[str, int] | None = None) -> list[str]:
    """The job's counters a packet moved (all but received and results_sent)."""
    before = before or {}
    return [name for name, n in engine.counters(job).items()
            if n != before.get(name, 0) and name not in ("received", "results_sent")]


def _checksummed(frame: bytearray) -> bytes:
    frame[ETH + 10:ETH + 12] = b"\0\0"
    frame[ETH + 10:ETH + 12] = struct.pack(">H", tool.ipv4_checksum(bytes(frame[ETH:ETH + IPV4])))
    return bytes(frame)


def up_frame(raw: bytes, datagram: bytes, up: UpAddress) -> bytes:
    """The frame a leaf sends up (go_up of p4/v1model/passing.p4): the input frame with the reference's datagram
    in place of its own, from the address it came to, to the root's, UDP ports PASSING's, UDP checksum 0."""
    frame = bytearray(raw)
    frame[6:12], frame[0:6] = raw[0:6], up.mac.to_bytes(6, "big")
    frame[ETH + 12:ETH + 16], frame[ETH + 16:ETH + 20] = raw[ETH + 16:ETH + 20], up.ip.to_bytes(4, "big")
    at = ETH + IPV4
    frame[at:at + 4] = struct.pack(">HH", wire.UDP_PORT, wire.UDP_PORT)
    frame[at + 6:at + 8] = b"\0\0"
    frame[at + UDP:at + UDP + len(datagram)] = datagram
    return _checksummed(frame)


def answer_frame(raw: bytes, datagram: bytes) -> bytes:
    """An answer to the worker that sent ``raw`` (a retransmission): the frame's addresses swapped, from PASSING's
    UDP port to the worker's, UDP checksum 0, the reference's datagram (an ACK: the header alone, the lengths
    shortened)."""
    at = ETH + IPV4
    frame = bytearray(raw)
    frame[0:6], frame[6:12] = raw[6:12], raw[0:6]
    frame[ETH + 12:ETH + 16], frame[ETH + 16:ETH + 20] = raw[ETH + 16:ETH + 20], raw[ETH + 12:ETH + 16]
    frame[at:at + 4] = struct.pack(">H", wire.UDP_PORT) + raw[at:at + 2]
    frame[at + 6:at + 8] = b"\0\0"
    total, length = struct.unpack_from(">H", raw, ETH + 2)[0], struct.unpack_from(">H", raw, at + 4)[0]
    whole = length - UDP  # the datagram's PASSING header and lanes (what follows them stays as it came)
    frame[at + UDP:at + UDP + len(datagram)] = datagram
    if len(datagram) < whole:  # an ACK: the lanes go, and the lengths with them
        cut = whole - len(datagram)
        del frame[at + UDP + len(datagram):at + UDP + whole]
        frame[ETH + 2:ETH + 4] = struct.pack(">H", total - cut)
        frame[at + 4:at + 6] = struct.pack(">H", length - cut)
    return _checksummed(frame)
