"""The aggregation state machine (design §4), one target-independent implementation.

The software aggregator (PS fallback) runs it behind UDP sockets, the tests run it
directly, and the P4 programs implement the very same rules in switch registers.

State per slot and set: an allocation ``epoch``, a round ``tag`` (the psn being
aggregated), a worker ``bitmap``, an ``overflow`` bit and ``lanes`` accumulators.
A batch of DATA packets is processed in arrival order with numpy: packets that hit
distinct slot/sets are independent, so the batch is split into waves in which every
slot/set occurs at most once (the k-th packet for a slot/set goes to wave k), and each
wave is one set of vectorised array operations.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import wire

COUNTERS = (
    "received",  # DATA packets looked at
    "malformed",  # wrong length, version or type
    "rejected",  # unknown job, worker not admitted from this source, slot out of range
    "aggregated",  # payload written or added into a slot
    "completed",  # rounds whose bitmap became full (a RESULT multicast)
    "duplicate",  # retransmission of a contribution to a round still incomplete: dropped
    "duplicate_answered",  # retransmission to a completed round: RESULT unicast to the sender
    "stale",  # packet older than the round its slot/set holds: dropped
    "overflow",  # contributions that saturated a lane or arrived flagged OVERFLOW
    "results_sent",  # RESULT packets emitted (multicast replicas + unicast answers)
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
    epoch: int | None = None  # unique per allocation; the engine assigns one when None

    @property
    def workers(self) -> int:
        return len(self.sources)

    @property
    def full(self) -> int:
        return (1 << self.workers) - 1


@dataclass
class Emission:
    """RESULT packets to send: ``packets[i]`` goes to origin ``dest[i]``."""

    packets: np.ndarray
    dest: np.ndarray
    multicast: np.ndarray  # True for a replica of a completion, False for a unicast answer

    def __len__(self) -> int:
        return len(self.packets)


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
        self.epoch = np.zeros(self.capacity, dtype=np.int64)
        self.sources = np.full((self.capacity, wire.MAX_WORKERS), NO_SOURCE, dtype=np.int64)
        self.counters = np.zeros((self.capacity, len(COUNTERS)), dtype=np.int64)
        self.free = list(range(self.capacity - 1, -1, -1))


class AggregationEngine:
    """Slots x 2 sets x lanes of integer accumulators shared by several jobs."""

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
        self._next_epoch = 0

    # ---- admission -------------------------------------------------------------

    def add_job(self, spec: JobSpec) -> JobSpec:
        jobs = self._jobs
        if not 0 <= spec.job < 1 << 16:
            raise ConfigError(f"job id {spec.job} outside 0..65535")
        if spec.job in jobs.by_id:
            raise ConfigError(f"job {spec.job} is already admitted")
        if not 1 <= spec.workers <= wire.MAX_WORKERS:
            raise ConfigError(f"job {spec.job}: {spec.workers} workers, must be 1..{wire.MAX_WORKERS}")
        if len(set(spec.sources)) != len(spec.sources) or min(spec.sources) < 0:
            raise ConfigError(f"job {spec.job}: worker sources must be distinct and non-negative")
        if spec.pool < 1 or spec.base < 0 or spec.base + spec.pool > self.slots:
            raise ConfigError(
                f"job {spec.job}: slots {spec.base}..{spec.base + spec.pool - 1} outside 0..{self.slots - 1}"
            )
        for other in jobs.by_id.values():
            if spec.base < other.base + other.pool and other.base < spec.base + spec.pool:
                raise ConfigError(f"job {spec.job}: slot range overlaps job {other.job}")
        if not jobs.free:
            raise ConfigError(f"no room for job {spec.job}: {jobs.capacity} jobs admitted already")
        if spec.epoch is None:
            spec.epoch = self._next_epoch
        self._next_epoch = max(self._next_epoch, spec.epoch) + 1
        d = jobs.free.pop()
        jobs.index[spec.job] = d
        jobs.base[d], jobs.pool[d], jobs.full[d] = spec.base, spec.pool, spec.full
        jobs.workers[d], jobs.epoch[d] = spec.workers, spec.epoch
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

        ``batch`` is a packet array of this engine's lane count, ``sources`` the origin
        of each packet, ``lengths`` the received datagram sizes (default: exact size).
        """
        n = len(batch)
        sources = np.asarray(sources, dtype=np.int64)
        if lengths is None:
            lengths = np.full(n, wire.packet_size(self.lanes))
        self.totals[_C["received"]] += n
        ok = wire.well_formed(batch, np.asarray(lengths), self.lanes, wire.DATA)
        self.totals[_C["malformed"]] += n - int(ok.sum())
        hdr = batch["hdr"]
        jobs = self._jobs
        job = hdr["job"].astype(np.int64)
        worker = hdr["worker"].astype(np.int64)
        slot = hdr["slot"].astype(np.int64)
        d = jobs.index[job]
        known = ok & (d >= 0)
        dc = np.where(known, d, 0)
        wc = np.minimum(worker, wire.MAX_WORKERS - 1)
        admitted = (
            known
            & (worker < jobs.workers[dc])
            & (jobs.sources[dc, wc] == sources)
            & (slot < jobs.pool[dc])
        )
        rejected = ok & ~admitted
        self.totals[_C["rejected"]] += int((rejected & ~known).sum())  # no job to charge them to
        self._count_jobs(d[rejected & known], "rejected")

        idx = np.flatnonzero(admitted)
        if idx.size == 0:
            return self._empty_emission()
        key = (jobs.base[d[idx]] + slot[idx]) * 2 + hdr["set"][idx].astype(np.int64) % 2
        # Rank of each packet among those for the same slot/set, in arrival order.
        order = np.argsort(key, kind="stable")
        sorted_key = key[order]
        starts = np.flatnonzero(np.r_[True, sorted_key[1:] != sorted_key[:-1]])
        group_start = np.repeat(starts, np.diff(np.r_[starts, sorted_key.size]))
        rank = np.empty_like(order)
        rank[order] = np.arange(order.size) - group_start
        out: list[Emission] = []
        for r in range(int(rank.max()) + 1):
            wave = idx[rank == r]  # ascending = arrival order
            out.append(self._wave(batch[wave], d[wave], worker[wave], key[rank == r]))
        return _concat(out, self.lanes)

    def _wave(self, pkts: np.ndarray, d: np.ndarray, worker: np.ndarray, k: np.ndarray) -> Emission:
        jobs = self._jobs
        hdr = pkts["hdr"]
        psn = hdr["psn"].astype(np.int64)
        wbit = np.left_shift(1, worker)
        job_epoch = jobs.epoch[d]
        full = jobs.full[d]
        same_epoch = self.state_epoch[k] == job_epoch
        tag = self.tag[k]
        fresh = ~same_epoch | wire.newer(psn, tag)
        same_round = same_epoch & (tag == psn)
        stale = ~fresh & ~same_round
        has_bit = (self.bitmap[k] & wbit) != 0
        contrib = same_round & ~has_bit
        dup = same_round & has_bit
        answered = dup & (self.bitmap[k] == full)
        flagged = (hdr["flags"] & wire.FLAG_OVERFLOW) != 0

        # A new round: the first write resets the slot/set, no separate clearing pass.
        fk = k[fresh]
        self.acc[fk] = pkts["payload"][fresh]
        self.tag[fk] = psn[fresh]
        self.state_epoch[fk] = job_epoch[fresh]
        self.bitmap[fk] = wbit[fresh]
        self.overflow[fk] = flagged[fresh]

        # A contribution to the current round: saturating add (SUM) or max (MAX).
        ck = k[contrib]
        current = self.acc[ck].astype(np.int64)
        incoming = pkts["payload"][contrib].astype(np.int64)
        summed = current + incoming
        saturated = ((summed > wire.INT32_MAX) | (summed < wire.INT32_MIN)).any(axis=1)
        is_max = hdr["op"][contrib] == wire.MAX
        clipped = np.clip(summed, wire.INT32_MIN, wire.INT32_MAX)
        combined = np.where(is_max[:, None], np.maximum(current, incoming), clipped)
        lane_overflow = (saturated & ~is_max) | flagged[contrib]
        self.acc[ck] = combined
        self.bitmap[ck] |= wbit[contrib]
        self.overflow[ck] |= lane_overflow

        done = (fresh | contrib) & (self.bitmap[k] == full)
        self._count_jobs(d[fresh | contrib], "aggregated")
        self._count_jobs(d[done], "completed")
        self._count_jobs(d[dup & ~answered], "duplicate")
        self._count_jobs(d[answered], "duplicate_answered")
        self._count_jobs(d[stale], "stale")
        self._count_jobs(np.r_[d[fresh & flagged], d[contrib][lane_overflow]], "overflow")

        # Completion: one replica per worker of the job (replication id = worker).
        done_i = np.flatnonzero(done)
        reps = jobs.workers[d[done_i]]
        m_src = np.repeat(done_i, reps)
        m_worker = np.arange(reps.sum()) - np.repeat(np.cumsum(reps) - reps, reps)
        ans_i = np.flatnonzero(answered)
        src = np.r_[m_src, ans_i]
        dest_worker = np.r_[m_worker, worker[ans_i]]
        res = wire.empty(src.size, self.lanes)
        rh = res["hdr"]
        rh["type"] = wire.RESULT
        for name in ("op", "job", "slot", "set", "psn"):
            rh[name] = hdr[name][src]
        rh["worker"] = dest_worker
        rh["flags"] = np.where(self.overflow[k[src]], wire.FLAG_OVERFLOW, 0)
        res["payload"] = self.acc[k[src]]
        self._count_jobs(d[src], "results_sent")
        return Emission(
            packets=res,
            dest=jobs.sources[d[src], dest_worker],
            multicast=np.r_[np.ones(m_src.size, bool), np.zeros(ans_i.size, bool)],
        )

    def _count_jobs(self, dense: np.ndarray, name: str) -> None:
        if dense.size:
            c = _C[name]
            np.add.at(self._jobs.counters[:, c], dense, 1)
            self.totals[c] += dense.size

    def _empty_emission(self) -> Emission:
        return Emission(wire.empty(0, self.lanes), np.zeros(0, np.int64), np.zeros(0, bool))


def _concat(parts: list[Emission], lanes: int) -> Emission:
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
    )
