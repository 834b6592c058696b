"""What an aggregation engine admits: job allocations, their roles in a tree, the admission rules and
the counters (docs/protocol.md, "The aggregation state machine" and "Trees across racks").

Both engines (passing.aggregator.engine in numpy, host/csrc/engine.c through native_engine) check a
job here first, so a refusal reads the same from either.
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
    "completed",  # rounds whose bitmap became full (a RESULT multicast; at a leaf: the partial sent up)
    "duplicate",  # retransmission of a contribution to a round still unanswered: dropped (a leaf re-sends up)
    "duplicate_answered",  # retransmission to a completed round: RESULT unicast to the sender
    "stale",  # packet older than the round its slot/set holds: dropped
    "overflow",  # contributions that saturated a lane or arrived flagged OVERFLOW
    "results_sent",  # packets emitted: RESULTs and ACKs (multicast replicas + unicast answers), relayed replicas
    "relayed",  # GATHER and NACK packets admitted and replicated (no state touched)
    "sent_up",  # a leaf's packets to its root: partials (first and re-sent), GATHER and NACK copies
    "answered",  # a RESULT or ACK from the root that answered a round complete at this leaf
    "late_answer",  # a RESULT or ACK from the root for a round that is not waiting for one here: dropped
)
C = {name: i for i, name in enumerate(COUNTERS)}
NO_SOURCE = -1

ROLES = ("flat", "leaf", "root")
OWNERS = wire.MAX_OWNER + 1  # owner values: the 7 bits of byte 9
NOT_OWNER = -1  # an owner map's entry for a value that names no server of the job
UP = -2  # a leaf's owner map: a server of another rack (its data and its NACKs are the root's)


class ConfigError(ValueError):
    """An admission request that cannot be honoured (bad range, duplicate job, ...)."""


@dataclass
class Uplink:
    """A leaf job's way up: the root's job id and generation for it, the leaf's worker (bit) there, and the
    root's origin (as a worker's ``sources`` entry: where partials go, and the only origin answers come from)."""

    job: int
    generation: int
    worker: int
    source: int


@dataclass
class JobSpec:
    """One job's allocation at an aggregator.

    ``sources[w]`` identifies worker w's admitted origin: for the software aggregator
    its packed IPv4 address and UDP port (see ``transport.pack_address``), for a switch
    the ingress port. RESULTs for worker w go back to that origin.

    In a tree (docs/protocol.md, "Trees across racks") a ``leaf`` job has an ``up`` link and its workers
    are its rack's servers; a ``root`` job's workers are the leaves. ``owners`` maps an owner value (a
    server's number in the whole job) to a worker here (``UP`` at a leaf: another rack's server;
    ``NOT_OWNER``); None is the identity of a flat job, and no owner at all for a leaf or a root.
    """

    job: int
    base: int
    pool: int
    sources: list[int]
    generation: int | None = None  # which allocation of this job id; the engine assigns one when None
    lanes: int | None = None  # int32 values per packet of this job, at most the engine's; None: the engine's
    role: str = "flat"
    owners: list[int] | None = None
    up: Uplink | None = None

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

    def owner_map(self) -> np.ndarray:
        """The owner map as OWNERS entries (values past the given list name no server). None: a flat job's
        identity; a leaf or root job without one names no owner (its tree carries SUM and MAX rounds only)."""
        out = np.full(OWNERS, NOT_OWNER, dtype=np.int64)
        if self.owners is None:
            if self.role == "flat":
                out[: self.workers] = np.arange(self.workers)
        else:
            out[: len(self.owners)] = self.owners
        return out


def _check_tree(spec: JobSpec, admitted: Mapping[int, JobSpec]) -> None:
    """The tree's rules: a role, an uplink exactly for a leaf, an owner map of workers (and UP at a leaf)."""
    if spec.role not in ROLES:
        raise ConfigError(f"job {spec.job}: role {spec.role!r}, must be one of {ROLES}")
    if (spec.role == "leaf") != (spec.up is not None):
        raise ConfigError(f"job {spec.job}: a leaf job needs an uplink ('up'), and only a leaf job has one")
    if spec.owners is not None:
        if len(spec.owners) > OWNERS:
            raise ConfigError(f"job {spec.job}: an owner map of {len(spec.owners)} entries, at most {OWNERS}")
        allowed = {NOT_OWNER, *range(spec.workers), *([UP] if spec.role == "leaf" else [])}
        if not all(isinstance(o, int) and o in allowed for o in spec.owners):
            raise ConfigError(f"job {spec.job}: owner map entries must be workers 0..{spec.workers - 1}, "
                              f"{NOT_OWNER} (no server){' or -2 (another rack)' if spec.role == 'leaf' else ''}")
    up = spec.up
    if up is None:
        return
    if not 0 <= up.job < 1 << 16 or not 0 <= up.generation < wire.GENERATIONS:
        raise ConfigError(f"job {spec.job}: uplink job {up.job} or generation {up.generation} out of range")
    if not 0 <= up.worker < wire.MAX_WORKERS:
        raise ConfigError(f"job {spec.job}: uplink worker {up.worker} outside 0..{wire.MAX_WORKERS - 1}")
    if up.source < 0 or up.source in spec.sources:
        raise ConfigError(f"job {spec.job}: the root's origin must be non-negative and none of the job's workers")
    for other in admitted.values():
        if other.up is not None and other.up.job == up.job:
            raise ConfigError(f"job {spec.job}: job {other.job} already goes up to job {up.job}")


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
    _check_tree(spec, admitted)
    if len(admitted) >= max_jobs:
        raise ConfigError(f"no room for job {spec.job}: {max_jobs} jobs admitted already")
    if spec.generation is None:  # standalone: the next generation of this job id here
        spec.generation = (last_generation.get(spec.job, -1) + 1) % wire.GENERATIONS
    if not 0 <= spec.generation < wire.GENERATIONS:
        raise ConfigError(f"job {spec.job}: generation {spec.generation} outside 0..{wire.GENERATIONS - 1}")
    last_generation[spec.job] = spec.generation


@dataclass
class JobTable:
    """Dense per-job admission arrays (index = job's dense id), what a switch's tables hold."""

    capacity: int
    by_id: dict[int, JobSpec] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.index = np.full(1 << 16, -1, dtype=np.int64)  # job id -> dense id
        self.up_index = np.full(1 << 16, -1, dtype=np.int64)  # a leaf's uplink job id -> its dense id
        self.job_id = np.zeros(self.capacity, dtype=np.int64)
        self.base = np.zeros(self.capacity, dtype=np.int64)
        self.pool = np.zeros(self.capacity, dtype=np.int64)
        self.full = np.zeros(self.capacity, dtype=np.int64)
        self.workers = np.zeros(self.capacity, dtype=np.int64)
        self.generation = np.zeros(self.capacity, dtype=np.int64)
        self.lanes = np.zeros(self.capacity, dtype=np.int64)
        self.epoch = np.zeros(self.capacity, dtype=np.int64)
        self.sources = np.full((self.capacity, wire.MAX_WORKERS), NO_SOURCE, dtype=np.int64)
        self.owners = np.full((self.capacity, OWNERS), NOT_OWNER, dtype=np.int64)
        self.leaf = np.zeros(self.capacity, dtype=bool)
        self.root = np.zeros(self.capacity, dtype=bool)
        self.up_job = np.zeros(self.capacity, dtype=np.int64)
        self.up_generation = np.zeros(self.capacity, dtype=np.int64)
        self.up_worker = np.zeros(self.capacity, dtype=np.int64)
        self.up_source = np.full(self.capacity, NO_SOURCE, dtype=np.int64)
        self.counters = np.zeros((self.capacity, len(COUNTERS)), dtype=np.int64)
        self.free = list(range(self.capacity - 1, -1, -1))
        self.leaves = self.roots = 0  # leaf and root jobs admitted: without any, nothing of a tree is done

    def add(self, spec: JobSpec) -> None:
        """Enter an admitted ``spec`` (check_admission passed)."""
        d = self.free.pop()
        self.index[spec.job] = d
        self.job_id[d], self.base[d], self.pool[d], self.full[d] = spec.job, spec.base, spec.pool, spec.full
        self.lanes[d], self.workers[d], self.generation[d], self.epoch[d] = (spec.lanes, spec.workers,
                                                                            spec.generation, spec.epoch)
        self.sources[d] = NO_SOURCE
        self.sources[d, : spec.workers] = spec.sources
        self.owners[d] = spec.owner_map()
        self.leaf[d], self.root[d] = spec.role == "leaf", spec.role == "root"
        self.roots += spec.role == "root"
        up = spec.up or Uplink(0, 0, 0, NO_SOURCE)
        self.up_job[d], self.up_generation[d], self.up_worker[d], self.up_source[d] = (up.job, up.generation,
                                                                                      up.worker, up.source)
        if spec.up is not None:
            self.up_index[up.job] = d
            self.leaves += 1
        self.counters[d] = 0
        self.by_id[spec.job] = spec

    def remove(self, job: int) -> JobSpec:
        if job not in self.by_id:
            raise ConfigError(f"job {job} is not admitted")
        d = int(self.index[job])
        self.index[job] = -1
        spec = self.by_id.pop(job)
        if spec.up is not None:
            self.up_index[spec.up.job] = -1
            self.leaves -= 1
        self.roots -= spec.role == "root"
        self.leaf[d] = self.root[d] = False  # (a dense id's roles are read only while it is admitted)
        self.sources[d] = NO_SOURCE
        self.up_source[d] = NO_SOURCE
        self.free.append(d)
        return spec
