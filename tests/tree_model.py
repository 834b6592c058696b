"""An independent model of one aggregator of docs/protocol.md, written from the document packet by packet
with Python ints and dicts (no numpy, nothing of passing.aggregator's code but its JobSpec as the config
record): a flat job, a leaf job and a root job ("Trees across racks"). tests/test_tree.py plays random
streams through it and the engines side by side and compares every packet and counter."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from passing.aggregator.jobs import COUNTERS, NOT_OWNER, UP, JobSpec

VERSION, DATA, RESULT, ACK, GATHER, NACK = 3, 1, 2, 3, 4, 5
OVERFLOW, RETRANSMIT, OWNER_ONLY = 1, 2, 4
MAX_OP = 1
HEADER = struct.Struct(">BBBBHHBBHI")  # version type op flags job slot worker owner·set generation psn
I32_MIN, I32_MAX = -(1 << 31), (1 << 31) - 1


@dataclass
class Header:
    version: int
    type: int
    op: int
    flags: int
    job: int
    slot: int
    worker: int
    owner_set: int
    generation: int
    psn: int

    @property
    def owner(self) -> int:
        return self.owner_set >> 1

    @property
    def set(self) -> int:
        return self.owner_set & 1

    def pack(self, lanes: list[int] | None) -> bytes:
        fields = (self.version, self.type, self.op, self.flags, self.job, self.slot, self.worker, self.owner_set,
                  self.generation, self.psn)
        return HEADER.pack(*fields) + (b"" if lanes is None else struct.pack(f">{len(lanes)}i", *lanes))


@dataclass
class SlotSet:
    epoch: int = -1
    tag: int = 0
    bitmap: int = 0
    overflow: bool = False
    acc: list[int] = field(default_factory=list)
    answered: int = 0  # 0 no, 1 with the sums here, 2 by an ACK from the root (a partial here)


Out = tuple[bytes, int, bool]  # datagram, destination origin, multicast replica


class Model:
    """One aggregator: jobs, slot/sets, counters; ``process`` takes (datagram, origin) pairs in order."""

    def __init__(self, max_lanes: int) -> None:
        self.max_lanes = max_lanes
        self.jobs: dict[int, JobSpec] = {}
        self.state: dict[tuple[int, int], SlotSet] = {}
        self.totals = dict.fromkeys(COUNTERS, 0)
        self.per_job: dict[int, dict[str, int]] = {}

    def add_job(self, spec: JobSpec) -> None:
        self.jobs[spec.job] = spec
        self.per_job[spec.job] = dict.fromkeys(COUNTERS, 0)

    def counters(self, job: int | None = None) -> dict[str, int]:
        return dict(self.totals if job is None else self.per_job[job])

    # ---- helpers --------------------------------------------------------------------------

    def count(self, job: JobSpec | None, name: str, n: int = 1) -> None:
        self.totals[name] += n
        if job is not None:
            self.per_job[job.job][name] += n

    @staticmethod
    def owner_of(job: JobSpec, value: int) -> int:
        if job.owners is None:  # a flat job's identity; a tree job without a map names no owner
            return value if value < job.workers and job.role == "flat" else NOT_OWNER
        return job.owners[value] if value < len(job.owners) else NOT_OWNER

    def lanes_of(self, length: int) -> int:
        if length < 20 or (length - 16) % 4 or (length - 16) // 4 > self.max_lanes:
            return 0
        return (length - 16) // 4

    def leaf_of_up(self, up_job: int) -> JobSpec | None:
        return next((j for j in self.jobs.values() if j.up is not None and j.up.job == up_job), None)

    # ---- the packet -----------------------------------------------------------------------

    def process(self, datagrams: list[tuple[bytes, int]]) -> list[Out]:
        out: list[Out] = []
        for data, origin in datagrams:
            self.one(data, origin, out)
        return out

    def one(self, data: bytes, origin: int, out: list[Out]) -> None:
        if len(data) < 16:
            self.count(None, "malformed")
            return
        h = Header(*HEADER.unpack(data[:16]))
        lanes = self.lanes_of(len(data))
        leaf = self.leaf_of_up(h.job)
        from_root = leaf is not None and leaf.up is not None and leaf.up.source == origin
        if h.type in (RESULT, ACK) or (h.type in (GATHER, NACK) and from_root):
            framed = leaf is not None and (len(data) == 16 if h.type == ACK else lanes > 0)
            if not framed or h.version != VERSION:
                self.count(None, "malformed")
                return
            self.count(None, "received")  # a job's arrivals are its outcomes: totals only
            self.down(leaf, h, data, lanes, origin, out)
            return
        if lanes == 0 or h.type not in (DATA, GATHER, NACK) or h.version != VERSION:
            self.count(None, "malformed")
            return
        job = self.jobs.get(h.job)
        if job is None:
            self.count(None, "received")
            self.count(None, "rejected")
            return
        self.count(None, "received")
        owner = self.owner_of(job, h.owner)
        ok = (h.generation == job.generation and h.worker < job.workers and job.sources[h.worker] == origin
              and lanes == job.lanes)
        if h.type == DATA:
            ok = ok and h.slot < job.pool and (not h.flags & OWNER_ONLY or owner >= 0 or owner == UP)
        elif h.type == GATHER:
            ok = ok and owner == h.worker
        else:
            ok = ok and owner != h.worker and (owner >= 0 or owner == UP)
        if not ok:
            self.count(job, "rejected")
            return
        lanes_values = list(struct.unpack(f">{lanes}i", data[16:]))
        if h.type == DATA:
            self.data(job, h, lanes_values, out)
        else:
            self.relay(job, h, data, owner, up_too=job.up is not None, out=out)

    def relay(self, job: JobSpec, h: Header, data: bytes, owner: int, up_too: bool, out: list[Out],
              sender: int | None = None) -> None:
        """A GATHER to every worker but its sender, a NACK to its owner's worker; at a leaf a host's GATHER
        and a NACK to another rack also go up."""
        self.count(job, "relayed")
        sender = h.worker if sender is None else sender
        receivers = [w for w in range(job.workers) if w != sender] if h.type == GATHER else \
            ([owner] if owner >= 0 else [])
        for w in receivers:
            r = Header(**{**h.__dict__, "job": job.job, "generation": job.generation, "worker": w})
            out.append((r.pack(None) + data[16:], job.sources[w], True))
            self.count(job, "results_sent")
        if up_too and (h.type == GATHER or owner == UP):
            assert job.up is not None
            r = Header(**{**h.__dict__, "job": job.up.job, "generation": job.up.generation, "worker": job.up.worker})
            out.append((r.pack(None) + data[16:], job.up.source, False))
            self.count(job, "sent_up")

    def slot_set(self, job: JobSpec, h: Header) -> SlotSet:
        return self.state.setdefault((job.base + h.slot, h.set), SlotSet())

    def data(self, job: JobSpec, h: Header, values: list[int], out: list[Out]) -> None:
        s = self.slot_set(job, h)
        epoch = job.job << 16 | (job.generation or 0)
        bit = 1 << h.worker
        full = (1 << job.workers) - 1
        ahead = (h.psn - s.tag) % (1 << 32)
        if s.epoch != epoch or 0 < ahead < 1 << 31:  # a new round
            s.epoch, s.tag, s.bitmap, s.overflow, s.acc, s.answered = epoch, h.psn, bit, bool(h.flags & OVERFLOW), \
                list(values), 0
            self.count(job, "aggregated")
            if h.flags & OVERFLOW:
                self.count(job, "overflow")
        elif ahead != 0:
            self.count(job, "stale")
            return
        elif s.bitmap & bit:  # a duplicate
            if s.bitmap != full:
                self.count(job, "duplicate")
            elif s.answered:
                self.count(job, "duplicate_answered")
                self.emit(job, h, s, h.worker, False, out)
            else:  # a leaf's round waiting for its root: the partial goes up again
                self.count(job, "duplicate")
                self.up(job, h, s, True, out)
            return
        else:
            saturated = False
            for i, v in enumerate(values):
                if h.op == MAX_OP:
                    s.acc[i] = max(s.acc[i], v)
                else:
                    total = s.acc[i] + v
                    saturated |= not I32_MIN <= total <= I32_MAX
                    s.acc[i] = min(max(total, I32_MIN), I32_MAX)
            s.bitmap |= bit
            s.overflow |= bool(h.flags & OVERFLOW) or saturated
            self.count(job, "aggregated")
            if h.flags & OVERFLOW or saturated:
                self.count(job, "overflow")
        if s.bitmap == full:
            self.count(job, "completed")
            if job.up is not None:
                self.up(job, h, s, False, out)
            else:
                s.answered = 1
                for w in range(job.workers):
                    self.emit(job, h, s, w, True, out)

    def up(self, job: JobSpec, h: Header, s: SlotSet, resent: bool, out: list[Out]) -> None:
        assert job.up is not None
        flags = (OVERFLOW if s.overflow else 0) | (h.flags & OWNER_ONLY) | (RETRANSMIT if resent else 0)
        r = Header(VERSION, DATA, h.op, flags, job.up.job, h.slot, job.up.worker, h.owner_set, job.up.generation,
                   h.psn)
        out.append((r.pack(s.acc), job.up.source, False))
        self.count(job, "sent_up")

    def emit(self, job: JobSpec, h: Header, s: SlotSet, w: int, multicast: bool, out: list[Out]) -> None:
        """The answer of the round in ``s`` for worker w, caused by packet ``h``."""
        owner_only = bool(h.flags & OWNER_ONLY)
        ack = (owner_only and w != self.owner_of(job, h.owner)) or s.answered == 2
        flags = (OVERFLOW if s.overflow else 0) | (OWNER_ONLY if owner_only and job.role == "root" else 0)
        r = Header(VERSION, ACK if ack else RESULT, h.op, flags, job.job, h.slot, w, h.owner_set,
                   job.generation or 0, h.psn)
        out.append((r.pack(None if ack else s.acc), job.sources[w], multicast))
        self.count(job, "results_sent")

    def down(self, leaf: JobSpec, h: Header, data: bytes, lanes: int, origin: int, out: list[Out]) -> None:
        """What comes down from the root to ``leaf``."""
        assert leaf.up is not None
        owner = self.owner_of(leaf, h.owner)
        ok = (h.generation == leaf.up.generation and h.worker == leaf.up.worker and origin == leaf.up.source
              and (h.type == ACK or lanes == leaf.lanes))
        if h.type in (RESULT, ACK):
            ok = ok and h.slot < leaf.pool
        if h.type == GATHER:
            ok = ok and owner == UP
        if h.type == NACK or (h.type == RESULT and h.flags & OWNER_ONLY):
            ok = ok and owner >= 0
        if not ok:
            self.count(leaf, "rejected")
            return
        if h.type in (GATHER, NACK):
            self.relay(leaf, h, data, owner, up_too=False, out=out, sender=-1)
            return
        s = self.slot_set(leaf, h)
        epoch = leaf.job << 16 | (leaf.generation or 0)
        if s.epoch != epoch or s.tag != h.psn or s.bitmap != (1 << leaf.workers) - 1 or s.answered:
            self.count(leaf, "late_answer")
            return
        self.count(leaf, "answered")
        s.overflow = bool(h.flags & OVERFLOW)  # either answer's flag is the whole round's
        if h.type == RESULT:
            s.acc = list(struct.unpack(f">{lanes}i", data[16:]))
            s.answered = 1
        else:
            s.answered = 2
        for w in range(leaf.workers):
            self.emit(leaf, h, s, w, True, out)
