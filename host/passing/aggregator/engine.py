"""The aggregation state machine (docs/protocol.md), one target-independent implementation.

Besides DATA rounds it relays the stateless kinds (docs/protocol.md, Kinds): a GATHER goes
unchanged to every other worker of its job, a NACK to its owner; and an OWNER_ONLY round's
completion is a RESULT for its owner and a header-only ACK for every other worker.

The software aggregator (PS fallback) runs it behind UDP sockets, the tests run it
directly, and the P4 programs implement the very same rules in switch registers.

State per slot and set: the ``epoch`` of the allocation that wrote it (job id and
generation), a round ``tag`` (the psn being aggregated), a worker ``bitmap``, an
``overflow`` bit and ``lanes`` accumulators. ``lanes`` is the engine's width, the largest
packet a job may use; each job has a lane count of its own, at most that, and uses the
first that many accumulators of its slots (its packets and RESULTs are that long).
A batch of DATA packets is processed in arrival order with numpy: packets that hit
distinct slot/sets are independent, so the batch is split into waves in which every
slot/set occurs at most once (the k-th packet for a slot/set goes to wave k), and each
wave is one set of vectorised array operations. RESULTs come out in the arrival order of the
packets that caused them (a completion's replicas in worker order): the order a switch or a
packet-by-packet engine emits them in, so a host sees rounds complete in the order its peers
sent them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from .. import wire

COUNTERS = (
    "received",  # PASSING packets: every datagram looked at but the malformed ones (as a switch counts)
    "malformed",  # wrong length, version or type (one a host does not send)
    "rejected",  # unknown job, another generation, worker not from its origin, slot out of range, not the job's
    #              lanes, an owner that is not a worker (OWNER_ONLY, NACK) or not the sender (GATHER)
    "aggregated",  # payload written or added into a slot
    "completed",  # rounds whose bitmap became full (a RESULT multicast)
    "duplicate",  # retransmission of a contribution to a round still incomplete: dropped
    "duplicate_answered",  # retransmission to a completed round: RESULT unicast to the sender
    "stale",  # packet older than the round its slot/set holds: dropped
    "overflow",  # contributions that saturated a lane or arrived flagged OVERFLOW
    "results_sent",  # packets emitted: RESULTs and ACKs (multicast replicas + unicast answers), relayed replicas
    "relayed",  # GATHER and NACK packets admitted and replicated (no state touched)
)
_C = {name: i for i, name in enumerate(COUNTERS)}
NO_SOURCE = -1


class ConfigError(ValueError):
    """An admission request that cannot be honoured (bad range, duplicate job, ...)."""


@dataclass
class JobSpec:
    """One job's allocation at an aggregator.

    ``sources[w]`` identifies worker w's admitted origin: for the software aggregator
    its packed IPv4 address and UDP port (see ``transport.pack_address``), for a switch
    the ingress port. RESULTs for worker w go back to that origin.
    """

    job: int
    base: int
    pool: int
    sources: list[int]
    generation: int | None = None  # which allocation of this job id; the engine assigns one when None
    lanes: int | None = None  # int32 values per packet of this job, at most the engine's; None: the engine's

    @property
    def workers(self) -> int:
        return len(self.sources)

    @property
    def epoch(self) -> int:
        """What a slot/set records of the allocation that wrote it: (job, generation) as one number."""
        assert self.generation is not None
        return self.job << 16 | self.generation

    @property
    def full(self) -> int:
        return (1 << self.workers) - 1


@dataclass
class Emission:
    """Packets to send: the first ``lengths[i]`` bytes of ``packets[i]`` go to origin ``dest[i]``.

    ``packets`` has the engine's width (its lanes); a RESULT of a job with fewer lanes is as long as
    that job's packets, an ACK is its header alone, and the bytes of a row past its length are not
    part of it."""

    packets: np.ndarray
    dest: np.ndarray
    multicast: np.ndarray  # True for a replica of a completion, False for a unicast answer
    lengths: np.ndarray  # bytes of each RESULT: its job's packet size

    def __len__(self) -> int:
        return len(self.packets)


def check_admission(spec: JobSpec, admitted: Mapping[int, JobSpec], slots: int, lanes: int, max_jobs: int,
                    last_generation: dict[int, int]) -> None:
    """The admission rules of both engines, in order. Gives ``spec`` its lanes when it has none (the
    engine's ``lanes``) and its generation when it has none (standalone: the next one of its job id
    here, 0 first) and records it as the job id's latest; raises ConfigError for a request that
    cannot be honoured."""
    if spec.lanes is None:
        spec.lanes = lanes
    if not 0 <= spec.job < 1 << 16:
        raise ConfigError(f"job id {spec.job} outside 0..65535")
    if spec.job in admitted:
        raise ConfigError(f"job {spec.job} is already admitted")
    if not 1 <= spec.workers <= wire.MAX_WORKERS:
        raise ConfigError(f"job {spec.job}: {spec.workers} workers, must be 1..{wire.MAX_WORKERS}")
    if len(set(spec.sources)) != len(spec.sources) or min(spec.sources) < 0:
        raise ConfigError(f"job {spec.job}: worker sources must be distinct and non-negative")
    if not 1 <= spec.lanes <= lanes:
        raise ConfigError(f"job {spec.job}: {spec.lanes} lanes, this aggregator takes 1..{lanes}")
    if spec.pool < 1 or spec.base < 0 or spec.base + spec.pool > slots:
        raise ConfigError(f"job {spec.job}: slots {spec.base}..{spec.base + spec.pool - 1} outside 0..{slots - 1}")
    for other in admitted.values():
        if spec.base < other.base + other.pool and other.base < spec.base + spec.pool:
            raise ConfigError(f"job {spec.job}: slot range overlaps job {other.job}")
    if len(admitted) >= max_jobs:
        raise ConfigError(f"no room for job {spec.job}: {max_jobs} jobs admitted already")
    if spec.generation is None:  # standalone: the next generation of this job id here
        spec.generation = (last_generation.get(spec.job, -1) + 1) % wire.GENERATIONS
    if not 0 <= spec.generation < wire.GENERATIONS:
        raise ConfigError(f"job {spec.job}: generation {spec.generation} outside 0..{wire.GENERATIONS - 1}")
    last_generation[spec.job] = spec.generation


@dataclass
class _Jobs:
    """Dense per-job admission arrays (index = job's dense id)."""

    capacity: int
    by_id: dict[int, JobSpec] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.index = np.full(1 << 16, -1, dtype=np.int64)  # job id -> dense id
        self.base = np.zeros(self.capacity, dtype=np.int64)
        self.pool = np.zeros(self.capacity, dtype=np.int64)
        self.full = np.zeros(self.capacity, dtype=np.int64)
        self.workers = np.zeros(self.capacity, dtype=np.int64)
        self.generation = np.zeros(self.capacity, dtype=np.int64)
        self.lanes = np.zeros(self.capacity, dtype=np.int64)
        self.epoch = np.zeros(self.capacity, dtype=np.int64)
        self.sources = np.full((self.capacity, wire.MAX_WORKERS), NO_SOURCE, dtype=np.int64)
        self.counters = np.zeros((self.capacity, len(COUNTERS)), dtype=np.int64)
        self.free = list(range(self.capacity - 1, -1, -1))


class AggregationEngine:
    """Slots x 2 sets x lanes of integer accumulators shared by several jobs (``lanes``: the
    widest packet a job may use; each job uses its own lane count's worth of each slot)."""

    def __init__(self, slots: int, lanes: int = wire.DEFAULT_LANES, max_jobs: int = 1024) -> None:
        if slots < 1 or lanes < 1 or max_jobs < 1:
            raise ConfigError("slots, lanes and max_jobs must be >= 1")
        self.slots = slots
        self.lanes = lanes
        n = slots * 2  # flat index = slot * 2 + set
        self.acc = np.zeros((n, lanes), dtype=np.int32)
        self.tag = np.zeros(n, dtype=np.int64)
        self.bitmap = np.zeros(n, dtype=np.int64)
        self.state_epoch = np.full(n, -1, dtype=np.int64)  # -1: never used
        self.overflow = np.zeros(n, dtype=bool)
        self.totals = np.zeros(len(COUNTERS), dtype=np.int64)
        self._jobs = _Jobs(max_jobs)
        self._last_generation: dict[int, int] = {}  # job id -> generation of its latest allocation here

    # ---- admission -------------------------------------------------------------

    def add_job(self, spec: JobSpec) -> JobSpec:
        jobs = self._jobs
        check_admission(spec, jobs.by_id, self.slots, self.lanes, jobs.capacity, self._last_generation)
        d = jobs.free.pop()
        jobs.index[spec.job] = d
        jobs.base[d], jobs.pool[d], jobs.full[d], jobs.lanes[d] = spec.base, spec.pool, spec.full, spec.lanes
        jobs.workers[d], jobs.generation[d], jobs.epoch[d] = spec.workers, spec.generation, spec.epoch
        jobs.sources[d] = NO_SOURCE
        jobs.sources[d, : spec.workers] = spec.sources
        jobs.counters[d] = 0
        jobs.by_id[spec.job] = spec
        return spec

    def remove_job(self, job: int) -> JobSpec:
        jobs = self._jobs
        if job not in jobs.by_id:
            raise ConfigError(f"job {job} is not admitted")
        d = int(jobs.index[job])
        jobs.index[job] = -1
        jobs.sources[d] = NO_SOURCE
        jobs.free.append(d)
        return jobs.by_id.pop(job)

    def jobs(self) -> list[JobSpec]:
        return sorted(self._jobs.by_id.values(), key=lambda s: s.job)

    def counters(self, job: int | None = None) -> dict[str, int]:
        """Totals, or one admitted job's counters (unattributable drops are in totals only)."""
        if job is None:
            row = self.totals
        else:
            if job not in self._jobs.by_id:
                raise ConfigError(f"job {job} is not admitted")
            row = self._jobs.counters[self._jobs.index[job]]
        return {name: int(row[i]) for i, name in enumerate(COUNTERS)}

    # ---- data path ---------------------------------------------------------------

    def process(self, batch: np.ndarray, sources: np.ndarray, lengths: np.ndarray | None = None) -> Emission:
        """Apply a batch of received packets in order; return the RESULTs to send.

        ``batch`` is a packet array of any lane count up to this engine's, one row per
        datagram, ``sources`` the origin of each packet, ``lengths`` the received datagram
        sizes (default: the row size). A datagram is as many lanes long as its length says
        (the rest of its row is not read); its job must have that many.
        """
        n = len(batch)
        sources = np.asarray(sources, dtype=np.int64)
        row = batch.dtype.itemsize
        if lengths is None:
            lengths = np.full(n, row)
        lengths = np.asarray(lengths, dtype=np.int64)
        hdr = batch["hdr"]
        # framing: a whole packet of a kind hosts send, 1..lanes lanes, that fits its row (a longer one was cut short)
        lanes = np.where(lengths <= row, wire.lanes_of(lengths, self.lanes), 0)
        kind = hdr["type"]
        is_data = kind == wire.DATA
        relay = (kind == wire.GATHER) | (kind == wire.NACK)
        ok = (lanes > 0) & (hdr["version"] == wire.VERSION) & (is_data | relay)
        jobs = self._jobs
        worker = hdr["worker"].astype(np.int64)
        owner = wire.owner_of(hdr["set"])
        slot = hdr["slot"].astype(np.int64)
        d = jobs.index[hdr["job"]]
        known = ok & (d >= 0)
        dc = np.where(known, d, 0)
        owner_only = is_data & ((hdr["flags"] & wire.FLAG_OWNER_ONLY) != 0)
        admitted = (
            known
            & (hdr["generation"] == jobs.generation[dc])  # a late packet of an earlier allocation: rejected
            & (worker < jobs.workers[dc])
            & (jobs.sources[dc, np.minimum(worker, wire.MAX_WORKERS - 1)] == sources)
            & (lanes == jobs.lanes[dc])  # as long as the job's packets
            & (~is_data | (slot < jobs.pool[dc]))  # a relayed kind's slot is no slot
            & (~owner_only | (owner < jobs.workers[dc]))
            & ((kind != wire.GATHER) | (owner == worker))  # a piece of the sender's own
            & ((kind != wire.NACK) | ((owner < jobs.workers[dc]) & (owner != worker)))
        )
        tally = _Tally(self)
        tally.total("received", int(ok.sum()))
        tally.total("malformed", n - int(ok.sum()))
        tally.total("rejected", int((ok & ~known).sum()))  # no job to charge them to
        tally.jobs("rejected", d[known & ~admitted])

        out: list[Emission] = []
        causes: list[np.ndarray] = []  # per RESULT, the batch index of the packet that caused it
        # Jobs of one lane count at a time: a job's packets all have its lane count, and jobs share no
        # slot, so this is arrival order per slot.
        relayed = np.flatnonzero(admitted & relay)
        if relayed.size:
            emitted, cause = self._relay(batch[relayed], d[relayed], worker[relayed], owner[relayed], lanes[relayed],
                                         tally)
            out.append(emitted)
            causes.append(relayed[cause])
        aggregating = admitted & is_data
        for count in np.unique(lanes[aggregating]):
            idx = np.flatnonzero(aggregating & (lanes == count))
            key = (jobs.base[d[idx]] + slot[idx]) * 2 + (hdr["set"][idx] & 1)
            # Rank of each packet among those for the same slot/set, in arrival order.
            order = np.argsort(key, kind="stable")
            sorted_key = key[order]
            first = np.r_[True, sorted_key[1:] != sorted_key[:-1]]
            position = np.arange(order.size)
            rank = np.empty_like(order)
            rank[order] = position - np.maximum.accumulate(np.where(first, position, 0))
            for r in range(int(rank.max()) + 1):
                in_wave = rank == r
                wave = idx[in_wave]  # ascending = arrival order
                emitted, cause = self._wave(batch[wave], d[wave], worker[wave], owner[wave], key[in_wave], tally,
                                            int(count))
                out.append(emitted)
                causes.append(wave[cause])
        tally.commit()
        if not out:
            return self._empty_emission()
        emission = _concat(out, self.lanes)
        order = np.argsort(np.concatenate(causes), kind="stable")  # arrival order of the causing packets
        return Emission(emission.packets[order], emission.dest[order], emission.multicast[order],
                        emission.lengths[order])

    def _relay(self, pkts: np.ndarray, d: np.ndarray, worker: np.ndarray, owner: np.ndarray, lanes: np.ndarray,
               tally: _Tally) -> tuple[Emission, np.ndarray]:
        """Admitted GATHER and NACK packets: no state, one replica per receiver (a GATHER's: every worker
        but its sender, in worker order; a NACK's: its owner), each with ``worker`` = its receiver and
        otherwise the packet as sent. Returns them and, for each, the index of its packet in ``pkts``."""
        jobs = self._jobs
        gather = pkts["hdr"]["type"] == wire.GATHER
        receivers = [np.flatnonzero(np.arange(jobs.workers[j]) != w) if g else np.array([o])
                     for j, w, o, g in zip(d.tolist(), worker.tolist(), owner.tolist(), gather.tolist())]
        counts = np.array([r.size for r in receivers], dtype=np.int64)
        src = np.repeat(np.arange(len(pkts)), counts)
        dest_worker = np.concatenate(receivers).astype(np.int64)
        out = wire.empty(src.size, self.lanes)
        out["hdr"] = pkts["hdr"][src]
        out["hdr"]["worker"] = dest_worker
        width = pkts["payload"].shape[1]  # the batch's rows may be narrower than the engine's
        out["payload"][:, :width] = pkts["payload"][src]
        tally.jobs("relayed", d)
        tally.jobs("results_sent", d[src])
        return Emission(
            packets=out,
            dest=jobs.sources[d[src], dest_worker],
            multicast=np.ones(src.size, dtype=bool),
            lengths=(wire.HEADER_SIZE + 4 * lanes[src]).astype(np.int64),
        ), src

    def _wave(self, pkts: np.ndarray, d: np.ndarray, worker: np.ndarray, owner: np.ndarray, k: np.ndarray,
              tally: _Tally, lanes: int) -> tuple[Emission, np.ndarray]:
        """Packets of jobs of ``lanes`` lanes that all hit distinct slot/sets: one vectorised step of the
        state machine, on their first ``lanes`` accumulators. Returns the RESULTs and, for each, the index
        in ``pkts`` of the packet that caused it."""
        jobs = self._jobs
        hdr = pkts["hdr"]
        payload = pkts["payload"][:, :lanes]
        acc = self.acc[:, :lanes]
        psn = hdr["psn"].astype(np.int64)
        wbit = np.left_shift(1, worker)
        job_epoch = jobs.epoch[d]
        bitmap = self.bitmap[k]
        same_epoch = self.state_epoch[k] == job_epoch
        ahead = (psn - self.tag[k]) & 0xFFFFFFFF  # serial-number distance to the slot's round
        fresh = ~same_epoch | ((ahead != 0) & (ahead < 1 << 31))
        same_round = same_epoch & (ahead == 0)
        has_bit = (bitmap & wbit) != 0
        contrib = same_round & ~has_bit
        dup = same_round & has_bit
        answered = dup & (bitmap == jobs.full[d])
        flagged = (hdr["flags"] & wire.FLAG_OVERFLOW) != 0

        # A new round: the first write resets the slot/set, no separate clearing pass.
        fk = k[fresh]
        acc[fk] = payload[fresh]
        self.tag[fk] = psn[fresh]
        self.state_epoch[fk] = job_epoch[fresh]
        self.bitmap[fk] = wbit[fresh]
        self.overflow[fk] = flagged[fresh]

        # A contribution to the current round: saturating add (SUM) or max (MAX), in int32.
        ck = k[contrib]
        current = acc[ck]
        incoming = payload[contrib].astype(np.int32)
        lane_overflow = flagged[contrib]
        is_max = hdr["op"][contrib] == wire.MAX
        if is_max.all():
            combined = np.maximum(current, incoming)
        else:
            with np.errstate(over="ignore"):
                combined = current + incoming  # wraps: a wrap is a sign that neither input has
            wrapped = ((current ^ combined) & (incoming ^ combined)) < 0
            if wrapped.any():
                combined[wrapped] = np.where(current[wrapped] < 0, wire.INT32_MIN, wire.INT32_MAX)
                lane_overflow = lane_overflow | (wrapped.any(axis=1) & ~is_max)
            if is_max.any():
                combined[is_max] = np.maximum(current[is_max], incoming[is_max])
        acc[ck] = combined
        self.bitmap[ck] |= wbit[contrib]
        self.overflow[ck] |= lane_overflow

        done = (fresh | contrib) & (self.bitmap[k] == jobs.full[d])
        tally.jobs("aggregated", d[fresh | contrib])
        tally.jobs("completed", d[done])
        tally.jobs("duplicate", d[dup & ~answered])
        tally.jobs("duplicate_answered", d[answered])
        tally.jobs("stale", d[~fresh & ~same_round])
        tally.jobs("overflow", d[fresh & flagged])
        tally.jobs("overflow", d[contrib][lane_overflow])

        # Completion: one replica per worker of the job (replication id = worker).
        done_i = np.flatnonzero(done)
        ans_i = np.flatnonzero(answered)
        if done_i.size + ans_i.size == 0:
            return self._empty_emission(), np.zeros(0, np.int64)
        reps = jobs.workers[d[done_i]]
        src = np.r_[np.repeat(done_i, reps), ans_i]
        dest_worker = np.r_[np.arange(reps.sum()) - np.repeat(np.cumsum(reps) - reps, reps), worker[ans_i]]
        res = wire.empty(src.size, self.lanes)
        rh = res["hdr"]
        for name in ("op", "job", "generation", "slot", "set", "psn"):
            rh[name] = hdr[name][src]
        # An OWNER_ONLY round's sums go to its owner; every other worker gets the header alone, an ACK.
        ack = ((hdr["flags"][src] & wire.FLAG_OWNER_ONLY) != 0) & (dest_worker != owner[src])
        rh["type"] = np.where(ack, wire.ACK, wire.RESULT)
        rh["worker"] = dest_worker
        rh["flags"] = self.overflow[k[src]] * wire.FLAG_OVERFLOW
        res["payload"][:, :lanes] = np.where(ack[:, None], 0, acc[k[src]])
        tally.jobs("results_sent", d[src])
        return Emission(
            packets=res,
            dest=jobs.sources[d[src], dest_worker],
            multicast=np.arange(src.size) < src.size - ans_i.size,
            lengths=np.where(ack, wire.HEADER_SIZE, wire.packet_size(lanes)).astype(np.int64),
        ), src

    def _empty_emission(self) -> Emission:
        return Emission(wire.empty(0, self.lanes), np.zeros(0, np.int64), np.zeros(0, bool), np.zeros(0, np.int64))


class _Tally:
    """Counter updates of one batch, applied with a single bincount."""

    def __init__(self, engine: AggregationEngine) -> None:
        self.engine = engine
        self.parts: list[np.ndarray] = []

    def total(self, name: str, count: int) -> None:
        self.engine.totals[_C[name]] += count

    def jobs(self, name: str, dense: np.ndarray) -> None:
        if dense.size:
            self.parts.append(dense * len(COUNTERS) + _C[name])

    def commit(self) -> None:
        if not self.parts:
            return
        counters = self.engine._jobs.counters
        flat = np.bincount(np.concatenate(self.parts), minlength=counters.size).reshape(counters.shape)
        counters += flat
        self.engine.totals += flat.sum(axis=0)


def _concat(parts: list[Emission], lanes: int) -> Emission:
    parts = [p for p in parts if len(p)] or parts[:1]
    if len(parts) == 1:
        return parts[0]
    # Not np.concatenate: numpy promotes structured dtypes to native byte order.
    packets = wire.empty(sum(len(p) for p in parts), lanes)
    at = 0
    for p in parts:
        packets[at : at + len(p)] = p.packets
        at += len(p)
    return Emission(
        packets=packets,
        dest=np.concatenate([p.dest for p in parts]),
        multicast=np.concatenate([p.multicast for p in parts]),
        lengths=np.concatenate([p.lengths for p in parts]),
    )
