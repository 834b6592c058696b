"""A two-level aggregation tree in one process (docs/protocol.md, "Trees across racks"): a root, leaves, and
hosts that follow the stream's rules (self-clocked window, retransmission of what is unanswered when the
network falls silent, no timers), over a network that loses, duplicates and reorders, with hostile
datagrams at both levels. Every aggregator is a ``Node`` of several implementations fed the same
datagrams, which must answer byte for byte alike (the model of tests/tree_model.py, the numpy engine,
the C engine); every answer a host takes is held against the exact sum (or max) of the round."""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from passing import wire
from passing.aggregator.engine import AggregationEngine
from passing.aggregator.jobs import COUNTERS, UP, JobSpec, Uplink
from tests.tree_model import HEADER, Header, Model

ROOT = 400  # origins: the root, leaf i at LEAF + i, host (i, w) at HOST + 32 i + w, a stranger
LEAF = 500
HOST = 1000
STRANGER = 99_999
OUTCOMES = ("rejected", "aggregated", "duplicate", "duplicate_answered", "stale", "relayed", "answered",
            "late_answer")


def make(kind: str, slots: int, lanes: int) -> Any:
    if kind == "model":
        return Model(lanes)
    if kind == "numpy":
        return AggregationEngine(slots, lanes, max_jobs=4)
    from passing.aggregator.native_engine import NativeAggregationEngine
    return NativeAggregationEngine(slots, lanes, max_jobs=4)


class Node:
    """One aggregator, as every implementation in ``kinds`` at once: each datagram batch goes to all, and
    their packets out (bytes, destination, multicast or not, in order) and counters must be the same."""

    def __init__(self, kinds: tuple[str, ...], slots: int, lanes: int) -> None:
        self.lanes = lanes
        self.impls = [make(k, slots, lanes) for k in kinds]
        self.specs: list[JobSpec] = []

    def add_job(self, spec: JobSpec) -> None:
        for impl in self.impls:
            copy = dataclasses.replace(spec, sources=list(spec.sources))
            if isinstance(impl, Model):
                impl.add_job(copy)
            else:
                impl.add_job(copy)
        self.specs.append(spec)

    def process(self, datagrams: list[tuple[bytes, int]]) -> list[tuple[bytes, int, bool]]:
        answers = [self._run(impl, datagrams) for impl in self.impls]
        for other in answers[1:]:
            assert other == answers[0], "implementations answer differently"
        for impl in self.impls[1:]:
            assert impl.counters() == self.impls[0].counters()
            for spec in self.specs:
                assert impl.counters(spec.job) == self.impls[0].counters(spec.job), f"job {spec.job}"
        return answers[0]

    def _run(self, impl: Any, datagrams: list[tuple[bytes, int]]) -> list[tuple[bytes, int, bool]]:
        if isinstance(impl, Model):
            return impl.process(datagrams)
        if not datagrams:
            return []
        row = wire.packet_size(self.lanes)
        batch = wire.empty(len(datagrams), self.lanes)
        raw = batch.view(np.uint8).reshape(len(datagrams), row)
        for i, (data, _) in enumerate(datagrams):
            raw[i, : len(data)] = np.frombuffer(data[:row], dtype=np.uint8)
        lengths = np.array([len(d) for d, _ in datagrams], dtype=np.int64)
        out = impl.process(batch, np.array([s for _, s in datagrams], dtype=np.int64), lengths)
        return [(p.tobytes()[:n], int(dest), bool(m))
                for p, dest, m, n in zip(out.packets, out.dest, out.multicast, out.lengths)]

    def check_outcomes(self) -> None:
        """Every packet of a job ends in exactly one outcome; the totals are the jobs' and the unnamed drops."""
        impl = self.impls[0]
        totals = impl.counters()
        per_job = [impl.counters(s.job) for s in self.specs]
        unnamed = totals["rejected"] - sum(c["rejected"] for c in per_job)
        assert unnamed >= 0
        assert totals["received"] == sum(c[o] for c in per_job for o in OUTCOMES) + unnamed
        for name in COUNTERS:
            if name not in ("received", "malformed", "rejected"):
                assert totals[name] == sum(c[name] for c in per_job), name


@dataclass
class Round:
    op: int
    owner: int | None  # an OWNER_ONLY round's owner (global number), or None
    values: np.ndarray  # (servers, lanes) int64


@dataclass
class Host:
    leaf: int
    worker: int
    number: int  # global
    job: int
    generation: int
    sent: dict[int, bytes] = field(default_factory=dict)  # psn -> packet, unanswered
    answered: set[int] = field(default_factory=set)
    history: list[bytes] = field(default_factory=list)  # every packet sent: the pool of late copies
    next: int = 0

    @property
    def origin(self) -> int:
        return HOST + 32 * self.leaf + self.worker


class Tree:
    """Root job ``root_job`` over leaves of ``sizes`` servers each; the same ``pool`` and lanes everywhere."""

    def __init__(self, kinds: tuple[str, ...], sizes: list[int], lanes: int, pool: int, rng: np.random.Generator,
                 same_ids: bool = False) -> None:
        self.lanes, self.pool, self.sizes = lanes, pool, sizes
        slots = 3 * pool + 4
        total = sum(sizes)
        firsts = np.r_[0, np.cumsum(sizes)[:-1]].tolist()
        self.root_job, root_gen = 7, int(rng.integers(0, wire.GENERATIONS))
        self.root = Node(kinds, slots, lanes)
        self.root.add_job(JobSpec(self.root_job, int(rng.integers(0, slots - pool)), pool,
                                  [LEAF + i for i in range(len(sizes))], root_gen, lanes, role="root",
                                  owners=[i for i, k in enumerate(sizes) for _ in range(k)]))
        self.leaves: list[Node] = []
        self.hosts: list[Host] = []
        for i, k in enumerate(sizes):
            job = self.root_job if same_ids else 20 + i
            gen = int(rng.integers(0, wire.GENERATIONS))
            node = Node(kinds, slots, lanes)
            owners = [g - firsts[i] if firsts[i] <= g < firsts[i] + k else UP for g in range(total)]
            node.add_job(JobSpec(job, int(rng.integers(0, slots - pool)), pool,
                                 [HOST + 32 * i + w for w in range(k)], gen, lanes, role="leaf", owners=owners,
                                 up=Uplink(self.root_job, root_gen, i, ROOT)))
            self.leaves.append(node)
            self.hosts += [Host(i, w, firsts[i] + w, job, gen) for w in range(k)]
        self.nodes = {ROOT: self.root, **{LEAF + i: n for i, n in enumerate(self.leaves)}}
        self.by_origin = {h.origin: h for h in self.hosts}

    def packet(self, h: Host, psn: int, r: Round, flags: int = 0) -> bytes:
        owner = 0 if r.owner is None else r.owner
        if r.owner is not None:
            flags |= wire.FLAG_OWNER_ONLY
        hdr = Header(wire.VERSION, wire.DATA, r.op, flags, h.job, psn % self.pool, h.worker,
                     owner << 1 | (psn // self.pool) % 2, h.generation, psn)
        return hdr.pack([int(v) for v in r.values[h.number]])


def expected(r: Round) -> tuple[list[int], bool]:
    """The round's exact lanes and whether any lane leaves int32 (then OVERFLOW must come)."""
    exact = r.values.max(axis=0) if r.op == wire.MAX else r.values.sum(axis=0)
    return exact.tolist(), bool(((exact > wire.INT32_MAX) | (exact < wire.INT32_MIN)).any())


def check_answer(tree: Tree, h: Host, data: bytes, rounds: list[Round]) -> None:
    """What a host receives: its own job, generation and worker; an answer of a round it sent that is the
    round's exact result unless flagged, flagged when the exact result leaves int32, an ACK only for a
    non-owner of an OWNER_ONLY round; a relayed GATHER or NACK as addressed."""
    hdr = Header(*HEADER.unpack(data[:16]))
    assert (hdr.job, hdr.generation, hdr.worker) == (h.job, h.generation, h.worker), hdr
    if hdr.type in (wire.GATHER, wire.NACK):
        assert hdr.owner != h.number if hdr.type == wire.GATHER else hdr.owner == h.number
        return
    p = hdr.psn
    assert p < h.next, f"an answer to psn {p} that host {h.number} never sent"
    r = rounds[p]
    if hdr.type == wire.ACK:
        assert len(data) == 16 and r.owner is not None and r.owner != h.number
    else:
        assert hdr.type == wire.RESULT and (r.owner is None or r.owner == h.number), hdr
        lanes = list(struct.unpack(f">{tree.lanes}i", data[16:]))
        exact, out_of_range = expected(r)
        if not hdr.flags & wire.FLAG_OVERFLOW:
            assert lanes == exact, f"round {p}: {lanes} != {exact}"
        assert hdr.flags & wire.FLAG_OVERFLOW or not out_of_range
    assert hdr.flags & ~wire.FLAG_OVERFLOW == 0
    h.answered.add(p)
    h.sent.pop(p, None)


Hostile = Callable[[Tree, np.random.Generator], list[tuple[bytes, int, int]]]


def hostile(tree: Tree, rng: np.random.Generator) -> list[tuple[bytes, int, int]]:
    """Datagrams that must change nothing: (bytes, origin, destination)."""
    out = []
    h = tree.hosts[int(rng.integers(len(tree.hosts)))]
    r = Round(wire.SUM, None, np.full((len(tree.hosts), tree.lanes), 5, np.int64))
    psn = int(rng.integers(0, 4 * tree.pool))
    good = tree.packet(h, psn, r)
    leaf = LEAF + h.leaf
    late = bytearray(good)
    struct.pack_into(">H", late, 10, (h.generation + 1) % wire.GENERATIONS)  # another allocation
    out.append((bytes(late), h.origin, leaf))
    out.append((good, STRANGER, leaf))  # not admitted
    up = bytearray(good)
    struct.pack_into(">H", up, 4, tree.root_job)
    up[8] = h.leaf
    out.append((bytes(up), h.origin, ROOT))  # at the root from a host, not a leaf
    forged = bytearray(good)
    forged[1] = wire.RESULT
    struct.pack_into(">H", forged, 4, tree.root_job)
    out.append((bytes(forged), h.origin, leaf))  # a RESULT from a host
    ack = bytes(forged[:16])
    out.append((ack[:1] + bytes([wire.ACK]) + ack[2:], STRANGER, leaf))
    out.append((rng.integers(0, 256, int(rng.integers(0, 40)), dtype=np.uint8).tobytes(), h.origin,
                int(rng.choice([ROOT, leaf]))))
    if h.history:  # a late copy the network held back: stale, or a duplicate, where it lands
        out.append((h.history[int(rng.integers(len(h.history)))], h.origin, leaf))
    return [out[int(i)] for i in rng.choice(len(out), int(rng.integers(1, len(out) + 1)), replace=False)]


def run(tree: Tree, rounds: list[Round], rng: np.random.Generator, loss: float, dup: float,
        hostility: float = 0.0, gathers: float = 0.0, steps: int = 20_000) -> None:
    """Play every round to its end on every host; fail on a wrong answer or when it does not end."""
    inflight: list[tuple[bytes, int, int]] = []  # (datagram, origin, destination)

    def send_window(h: Host) -> None:
        while h.next < len(rounds) and (h.next < tree.pool or h.next - tree.pool in h.answered):
            data = tree.packet(h, h.next, rounds[h.next])
            h.sent[h.next] = data
            h.history.append(data)
            inflight.append((data, h.origin, LEAF + h.leaf))
            h.next += 1

    for h in tree.hosts:
        send_window(h)
    for _ in range(steps):
        if all(len(h.answered) == len(rounds) for h in tree.hosts):
            return
        if not inflight:  # silence: every host resends what it has outstanding (its probes)
            for h in tree.hosts:
                for _, data in sorted(h.sent.items()):
                    resend = bytearray(data)
                    resend[3] |= wire.FLAG_RETRANSMIT
                    inflight.append((bytes(resend), h.origin, LEAF + h.leaf))
            if rng.random() < hostility:
                inflight += hostile(tree, rng)
            if rng.random() < gathers:
                h = tree.hosts[int(rng.integers(len(tree.hosts)))]
                kind = int(rng.choice([wire.GATHER, wire.NACK]))
                owner = h.number if kind == wire.GATHER else int(rng.integers(len(tree.hosts)))
                if owner != h.number or kind == wire.GATHER:
                    hdr = Header(wire.VERSION, kind, 0, 0, h.job, 1, h.worker, owner << 1, h.generation,
                                 int(rng.integers(0, 1 << 32)))
                    inflight.append((hdr.pack([int(v) for v in rng.integers(-9, 9, tree.lanes)]), h.origin,
                                     LEAF + h.leaf))
            continue
        dest = inflight[int(rng.integers(len(inflight)))][2]
        mine = [i for i, (_, _, d) in enumerate(inflight) if d == dest]
        take = sorted(rng.choice(mine, int(rng.integers(1, len(mine) + 1)), replace=False).tolist())
        batch = [inflight[i] for i in take]
        if rng.random() < 0.3:
            batch = [batch[i] for i in rng.permutation(len(batch))]
        for i in reversed(take):
            inflight.pop(i)
        delivered = []
        for data, origin, _ in batch:
            if rng.random() < loss:
                continue
            delivered.append((data, origin))
            if rng.random() < dup:
                delivered.append((data, origin))
        if dest in tree.nodes:
            for data, to, _ in tree.nodes[dest].process(delivered):
                inflight.append((data, dest, to))
        else:
            h = tree.by_origin[dest]
            for data, _ in delivered:
                check_answer(tree, h, data, rounds)
            send_window(h)
    raise AssertionError("the tree did not finish its rounds")
