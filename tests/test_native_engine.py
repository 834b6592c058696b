"""The C aggregation engine against the numpy one (the specification), and the C data path.

Differential: both engines get the same random packet streams (loss, duplication,
reordering, late copies, hostile and malformed datagrams, job turnover) and must emit
byte-identical RESULTs in the same order, to the same destinations, and count the same.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import pytest

from passing import native, wire
from passing.aggregator.control_channel import ControlClient, job_from_json
from passing.aggregator.engine import COUNTERS, AggregationEngine, ConfigError, JobSpec
from passing.aggregator.native_engine import NativeAggregationEngine, make_engine
from passing.aggregator.server import Impairment, SoftwareAggregator
from passing.transport import TransportStats
from tests.cluster import start_aggregator
from tests.test_tree import play as tree_play

pytestmark = pytest.mark.skipif(not native.available(), reason="the native library is not built")

STRANGER = 999_999  # an origin no job admits
JOB_IDS = (0, 1, 2, 7, 65535)  # few ids, so that they are reused; both ends of the range


# ---- a random traffic generator ---------------------------------------------------------


@dataclass
class LiveJob:
    spec: JobSpec
    op: int
    next_psn: int
    history: list[bytes] = field(default_factory=list)  # packets sent: the pool of late copies


@dataclass
class Traffic:
    """Datagrams as the aggregator would receive them: rows of packet size, true lengths, origins."""

    lanes: int
    rows: list[bytes] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    sources: list[int] = field(default_factory=list)

    def add(self, data: bytes, source: int, length: int | None = None) -> None:
        size = wire.packet_size(self.lanes)
        self.rows.append(data[:size].ljust(size, b"\xa5"))  # past a short datagram: garbage
        self.lengths.append(len(data) if length is None else length)
        self.sources.append(source)

    def batches(self, rng: np.random.Generator):
        """The traffic cut into batches of random sizes (1 packet to a few hundred)."""
        dtype = wire.packet_dtype(self.lanes)
        at = 0
        while at < len(self.rows):
            n = int(rng.choice([1, 2, 5, 30, 300]))
            rows = self.rows[at : at + n]
            batch = np.frombuffer(b"".join(rows), dtype=dtype).copy()
            yield batch, np.array(self.sources[at : at + n], np.int64), np.array(self.lengths[at : at + n])
            at += n


def values(rng: np.random.Generator, lanes: int, op: int) -> np.ndarray:
    if op == wire.MAX or rng.random() < 0.15:  # extremes: saturation (SUM) and the whole range (MAX)
        return rng.integers(wire.INT32_MIN, wire.INT32_MAX, lanes, endpoint=True)
    return rng.integers(-1000, 1000, lanes)


def data_packet(job: LiveJob, worker: int, psn: int, rng: np.random.Generator, owner: int | None = None) -> bytes:
    """A DATA of the round psn; with an owner, an OWNER_ONLY round's."""
    pool, lanes = job.spec.pool, job.spec.lanes
    flags = int(rng.choice([0, 0, 0, 0, wire.FLAG_OVERFLOW, wire.FLAG_RETRANSMIT, 0xFF]))
    if owner is not None:
        flags |= wire.FLAG_OWNER_ONLY
    elif flags != 0xFF:
        owner = 0
        if rng.random() < 0.03:
            owner = int(rng.integers(0, 128))  # the owner bits of an ordinary round: carried into the RESULT
    else:  # every flag, OWNER_ONLY among them: a random owner, at times not a worker (rejected)
        owner = int(rng.integers(0, job.spec.workers + 2))
    op = job.op if rng.random() > 0.02 else int(rng.integers(2, 256))  # an unknown op sums
    return wire.encode(type=wire.DATA, job=job.spec.job, worker=worker, psn=psn & 0xFFFFFFFF, slot=psn % pool,
                       set=(psn // pool) % 2, owner=owner, op=op, flags=flags, generation=job.spec.generation,
                       payload=values(rng, lanes, op), lanes=lanes).tobytes()


def relayed_packet(job: LiveJob, worker: int, rng: np.random.Generator) -> bytes:
    """A GATHER of the sender's own piece or a NACK to another worker; now and then one with an owner
    admission refuses (another's piece, a NACK to itself or to no worker)."""
    kind = int(rng.choice([wire.GATHER, wire.GATHER, wire.NACK]))
    if kind == wire.GATHER:
        owner = worker if rng.random() > 0.05 else int(rng.integers(0, job.spec.workers + 1))
    else:
        owner = int(rng.integers(0, job.spec.workers + (1 if rng.random() < 0.05 else 0)))
    flags = int(rng.choice([0, 0, wire.FLAG_RETRANSMIT]))
    return wire.encode(type=kind, job=job.spec.job, worker=worker, psn=int(rng.integers(0, 1 << 32)),
                       slot=int(rng.integers(0, 65536)), set=int(rng.integers(0, 2)), owner=owner, flags=flags,
                       generation=job.spec.generation, lanes=job.spec.lanes,
                       payload=rng.integers(wire.INT32_MIN, wire.INT32_MAX, job.spec.lanes, endpoint=True)).tobytes()


def hostile(rng: np.random.Generator, jobs: dict[int, LiveJob], retired: list[LiveJob], lanes: int,
            traffic: Traffic) -> None:
    """One datagram that must be dropped (or, rarely for random bytes, parses as something)."""
    size = wire.packet_size(lanes)
    live = list(jobs.values())
    job = live[int(rng.integers(len(live)))] if live else None
    kind = int(rng.integers(13))
    good = data_packet(job, 0, job.next_psn, rng) if job else bytes(size)
    source = job.spec.sources[0] if job else STRANGER
    if kind == 0:
        traffic.add(rng.integers(0, 256, size, dtype=np.uint8).tobytes(), int(rng.integers(0, 50)))
    elif kind == 1:
        traffic.add(good[: int(rng.integers(0, size))], source)  # truncated, down to empty
    elif kind == 2:
        traffic.add(good + b"\x00" * int(rng.integers(1, 9)), source)  # too long
    elif kind == 3:
        traffic.add(good, source, length=int(rng.integers(size + 1, 70000)))  # oversized, e.g. a bad GRO buffer
    elif kind in (4, 5):
        bad = bytearray(good)
        bad[0 if kind == 4 else 1] = int(rng.choice([0, 1, 2, wire.RESULT, wire.ACK, 6, 255]))  # version / type
        if kind == 5 and bad[1] == wire.DATA:
            bad[1] = wire.RESULT
        traffic.add(bytes(bad), source)
    elif kind == 6:  # unknown job
        unknown = next(j for j in (3, 4, 5, 6, 40000) if j not in jobs)
        bad = bytearray(good)
        bad[4:6] = unknown.to_bytes(2, "big")
        traffic.add(bytes(bad), source)
    elif kind == 7 and job:  # another generation of a live job (an older allocation's late packet)
        bad = bytearray(good)
        bad[10:12] = ((job.spec.generation - int(rng.integers(1, 3))) % wire.GENERATIONS).to_bytes(2, "big")
        traffic.add(bytes(bad), source)
    elif kind == 8 and job:  # from another origin: a stranger, or another worker's
        traffic.add(good, int(rng.choice([STRANGER, *job.spec.sources[1:2]])))
    elif kind == 9 and job:  # slot out of the job's pool
        bad = bytearray(good)
        bad[6:8] = int(rng.integers(job.spec.pool, 65536)).to_bytes(2, "big")
        traffic.add(bytes(bad), source)
    elif kind == 10 and job:  # worker out of range (posing from a real origin)
        bad = bytearray(good)
        bad[8] = int(rng.integers(job.spec.workers, 256))
        traffic.add(bytes(bad), source)
    elif kind == 11 and retired:  # a late packet of a removed allocation
        old = retired[int(rng.integers(len(retired)))]
        if old.history:
            traffic.add(old.history[int(rng.integers(len(old.history)))], old.spec.sources[0])
    elif kind == 12 and job:  # a whole packet of another lane count than the job's: not the job's
        other = int(rng.integers(1, lanes + 1))
        if other != job.spec.lanes:
            h = wire.decode(good, job.spec.lanes)["hdr"]
            traffic.add(wire.encode(type=wire.DATA, job=job.spec.job, worker=0, psn=int(h["psn"][0]),
                                    slot=int(h["slot"][0]), set=int(h["set"][0]), generation=job.spec.generation,
                                    payload=values(rng, other, job.op), lanes=other).tobytes(), source)


def rounds(rng: np.random.Generator, jobs: dict[int, LiveJob], lanes: int, traffic: Traffic, count: int) -> None:
    """`count` rounds of honest traffic, impaired: loss, duplicates, late copies, local reordering."""
    start = len(traffic.rows)
    for _ in range(count):
        if not jobs:
            return
        job = list(jobs.values())[int(rng.integers(len(jobs)))]
        if rng.random() < 0.1:  # GATHER and NACK traffic of the job, relayed without state
            w = int(rng.integers(job.spec.workers))
            traffic.add(relayed_packet(job, w, rng), job.spec.sources[w])
            continue
        psn = job.next_psn
        job.next_psn += 1
        owner = int(rng.integers(job.spec.workers)) if rng.random() < 0.3 else None  # a reduce_scatter round
        for w in rng.permutation(job.spec.workers):
            pkt = data_packet(job, int(w), psn, rng, owner)
            job.history.append(pkt)
            source = job.spec.sources[int(w)]
            r = rng.random()
            if r < 0.08:
                continue  # lost
            traffic.add(pkt, source)
            if r > 0.9:
                traffic.add(pkt, source)  # duplicated
            if rng.random() < 0.05 and job.history:  # a late copy: stale, duplicate or answered
                traffic.add(job.history[int(rng.integers(max(0, len(job.history) - 200), len(job.history)))],
                            source)
    # reorder: swap some neighbours within a short distance
    end = len(traffic.rows)
    for _ in range((end - start) // 4):
        i = int(rng.integers(start, end))
        j = min(end - 1, i + int(rng.integers(1, 6)))
        for lst in (traffic.rows, traffic.lengths, traffic.sources):
            lst[i], lst[j] = lst[j], lst[i]


# ---- the differential harness --------------------------------------------------------------


class Pair:
    """The numpy engine and the C engine side by side: every call to both, every answer compared."""

    def __init__(self, slots: int, lanes: int, max_jobs: int = 4) -> None:
        self.lanes = lanes
        self.numpy = AggregationEngine(slots, lanes, max_jobs)
        self.native = NativeAggregationEngine(slots, lanes, max_jobs)
        self.results = 0
        self.kinds: dict[int, int] = {}  # packets emitted per type: RESULT, ACK, GATHER, NACK

    def add_job(self, spec: JobSpec) -> JobSpec:
        # each engine its own copy: admission fills in the generation and lanes
        a, b = (engine.add_job(dataclasses.replace(spec, sources=list(spec.sources)))
                for engine in (self.numpy, self.native))
        assert a == b
        return a

    def remove_job(self, job: int) -> None:
        assert self.numpy.remove_job(job) == self.native.remove_job(job)

    def process(self, batch: np.ndarray, sources: np.ndarray, lengths: np.ndarray) -> None:
        want = self.numpy.process(batch, sources, lengths)
        got = self.native.process(batch, sources, lengths)
        assert got.packets.dtype == want.packets.dtype
        assert got.lengths.tolist() == want.lengths.tolist(), "RESULT lengths or order differ"
        for a, b, n in zip(got.packets, want.packets, want.lengths):  # a RESULT is its row's first n bytes
            assert a.tobytes()[:n] == b.tobytes()[:n], "RESULT bytes or order differ"
        assert got.dest.tolist() == want.dest.tolist()
        assert got.multicast.tolist() == want.multicast.tolist()
        self.results += len(want)
        for kind in want.packets["hdr"]["type"].tolist():
            self.kinds[kind] = self.kinds.get(kind, 0) + 1
        self.check_counters()

    def check_counters(self) -> None:
        assert self.native.counters() == self.numpy.counters()
        assert [j.job for j in self.native.jobs()] == [j.job for j in self.numpy.jobs()]
        for j in self.numpy.jobs():
            assert self.native.counters(j.job) == self.numpy.counters(j.job), f"job {j.job}"


def free_range(rng: np.random.Generator, slots: int, jobs: dict[int, LiveJob]) -> tuple[int, int] | None:
    pool = int(rng.integers(1, 9))
    for _ in range(20):
        base = int(rng.integers(0, slots - pool + 1))
        if all(base + pool <= j.spec.base or j.spec.base + j.spec.pool <= base for j in jobs.values()):
            return base, pool
    return None


def admit(pair: Pair, rng: np.random.Generator, slots: int, jobs: dict[int, LiveJob], retired: list[LiveJob],
          origins: list[int]) -> None:
    free_ids = [j for j in JOB_IDS if j not in jobs]
    where = free_range(rng, slots, jobs)
    if not free_ids or where is None or len(jobs) >= pair.numpy._jobs.capacity:
        return
    job_id = int(rng.choice(free_ids))
    workers = int(rng.choice([1, 2, 3, 5, 8, 32]))
    if rng.random() < 0.5 and any(r.spec.job == job_id for r in retired):  # an elastic restart: same origins
        sources = next(r.spec.sources for r in reversed(retired) if r.spec.job == job_id)
        workers = len(sources)
    else:
        sources = [int(s) for s in rng.choice(origins, workers, replace=False)]
    generation = None if rng.random() < 0.7 else int(rng.integers(0, wire.GENERATIONS))
    lanes = None if rng.random() < 0.5 else int(rng.integers(1, pair.lanes + 1))  # None: the engine's width
    spec = pair.add_job(JobSpec(job_id, where[0], where[1], sources, generation, lanes))
    op = int(rng.choice([wire.SUM, wire.MAX]))
    start = 0 if rng.random() < 0.7 else int(rng.integers(0, 1 << 32))  # psns wrap around too
    jobs[job_id] = LiveJob(spec, op, start)


def play(seed: int, lanes: int, steps: int = 12) -> Pair:
    rng = np.random.default_rng(seed)
    slots = int(rng.integers(8, 40))
    pair = Pair(slots, lanes)
    jobs: dict[int, LiveJob] = {}
    retired: list[LiveJob] = []
    origins = list(range(100, 164))
    for _ in range(2):
        admit(pair, rng, slots, jobs, retired, origins)
    for _ in range(steps):
        traffic = Traffic(lanes)
        rounds(rng, jobs, lanes, traffic, int(rng.integers(5, 60)))
        for _ in range(int(rng.integers(0, 30))):
            hostile(rng, jobs, retired, lanes, traffic)
        # hostile packets land anywhere in the stream
        order = rng.permutation(len(traffic.rows)) if rng.random() < 0.3 else np.arange(len(traffic.rows))
        traffic.rows = [traffic.rows[i] for i in order]
        traffic.lengths = [traffic.lengths[i] for i in order]
        traffic.sources = [traffic.sources[i] for i in order]
        for batch, sources, lengths in traffic.batches(rng):
            pair.process(batch, sources, lengths)
        # job turnover: a job ends, its id comes back as a new allocation, or another job starts
        if jobs and rng.random() < 0.4:
            gone = jobs.pop(int(rng.choice(list(jobs))))
            pair.remove_job(gone.spec.job)
            retired.append(gone)
        if rng.random() < 0.6:
            admit(pair, rng, slots, jobs, retired, origins)
    return pair


@functools.cache
def played(seed: int) -> Pair:
    """The random stream of ``seed``, played once per session: the coverage test below reads the same plays."""
    return play(seed, lanes=[1, 4, 64][seed % 3])


@pytest.mark.parametrize("seed", range(40))
def test_random_streams_give_identical_results_and_counters(seed):
    totals = played(seed).numpy.counters()
    assert totals["received"] > 0


def test_the_random_streams_reach_every_outcome():
    """The generator is worth something only if it hits every branch of the state machine."""
    totals = dict.fromkeys(COUNTERS, 0)
    kinds = dict.fromkeys((wire.RESULT, wire.ACK, wire.GATHER, wire.NACK), 0)
    for seed in range(12):
        pair = played(seed)
        for name, value in pair.native.counters().items():
            totals[name] += value
        for kind, n in pair.kinds.items():
            kinds[kind] += n
    tree_only = ("sent_up", "answered", "late_answer")  # no tree here: tests/test_tree.py, below, reaches them
    assert all(v > 0 for k, v in totals.items() if k not in tree_only), totals
    assert all(v > 0 for v in kinds.values()), kinds  # and every kind an aggregator sends


@pytest.mark.parametrize("seed", range(12))
def test_two_level_trees_give_identical_results_and_counters(seed):
    """The C engine as leaves and root of a tree against the numpy one, on tests/test_tree.py's random streams
    (loss, duplication, reordering, late copies, hostile datagrams at both levels, every kind), every host's
    answer held against the exact sums."""
    tree = tree_play(seed, ("numpy", "native"))
    counters = [node.impls[1].counters() for node in tree.leaves]
    assert sum(c["sent_up"] for c in counters) > 0 and sum(c["answered"] for c in counters) > 0


def test_one_batch_with_every_slot_hit_many_times():
    """The numpy engine's wave order: a big batch with many packets per slot/set and answers mixed in."""
    rng = np.random.default_rng(5)
    lanes, workers, pool = 4, 3, 2
    pair = Pair(slots=4, lanes=lanes)
    pair.add_job(JobSpec(1, 0, pool, [10, 11, 12]))
    pair.add_job(JobSpec(2, 2, 1, [20]))
    rows, sources = [], []
    for psn in range(10):
        for w in range(workers):
            for _ in range(int(rng.integers(1, 4))):  # each packet up to three times: answers
                rows.append(wire.encode(type=wire.DATA, job=1, worker=w, psn=psn, pool=pool,
                                        payload=rng.integers(-9, 9, lanes), lanes=lanes))
                sources.append(10 + w)
        rows.append(wire.encode(type=wire.DATA, job=2, worker=0, psn=psn, pool=1, payload=[psn] * lanes,
                                lanes=lanes))
        sources.append(20)
    batch = np.frombuffer(b"".join(r.tobytes() for r in rows), dtype=wire.packet_dtype(lanes))
    pair.process(batch, np.array(sources), np.full(len(rows), wire.packet_size(lanes)))
    assert pair.numpy.counters()["duplicate_answered"] > 0 and pair.numpy.counters()["completed"] == 20


def test_saturation_and_max_and_flags():
    lanes = 3
    pair = Pair(slots=4, lanes=lanes)
    pair.add_job(JobSpec(1, 0, 2, [10, 11]))
    big, small = wire.INT32_MAX - 1, wire.INT32_MIN + 1
    cases = [
        (wire.SUM, [big, small, 5], [5, -5, 5], 0),  # saturates up and down
        (wire.SUM, [big, 0, 0], [1, 0, 0], 0),  # exactly the bound: no overflow
        (wire.SUM, [1, 2, 3], [4, 5, 6], wire.FLAG_OVERFLOW),  # flagged by a host
        (wire.MAX, [big, small, -1], [small, big, -2], 0),
    ]
    for psn, (op, a, b, flags) in enumerate(cases):
        for w, vals in enumerate((a, b)):
            pkt = wire.encode(type=wire.DATA, job=1, worker=w, psn=psn, pool=2, payload=vals, op=op,
                              flags=flags if w else 0, lanes=lanes)
            pair.process(pkt, np.array([10 + w]), np.array([wire.packet_size(lanes)]))
    assert pair.numpy.counters(1)["overflow"] == 2


@pytest.mark.parametrize("op", [wire.SUM, wire.MAX])
def test_wide_packets_near_the_int32_limits(op):
    """Enough lanes for the vectorized lane loops and their scalar tail (67 = 8 × 8 + 3), with
    values at and near the limits, so sums saturate up and down in any lane: byte for byte
    as the numpy engine (Pair checks every RESULT and counter)."""
    rng = np.random.default_rng(op + 11)
    lanes, workers = 67, 3
    pair = Pair(slots=4, lanes=lanes)
    pair.add_job(JobSpec(1, 0, 2, [10, 11, 12]))
    edges = np.array([wire.INT32_MAX, wire.INT32_MAX - 1, wire.INT32_MIN, wire.INT32_MIN + 1, 0, 1, -1,
                      1 << 30, -(1 << 30)], dtype=np.int64)
    for psn in range(40):
        for w in range(workers):
            values = np.where(rng.random(lanes) < 0.5, rng.choice(edges, lanes),
                              rng.integers(wire.INT32_MIN, wire.INT32_MAX, lanes, endpoint=True))
            pkt = wire.encode(type=wire.DATA, job=1, worker=w, psn=psn, pool=2, payload=values, op=op, lanes=lanes)
            pair.process(pkt, np.array([10 + w]), np.array([wire.packet_size(lanes)]))
    counters = pair.numpy.counters(1)
    assert counters["completed"] == 40
    assert (counters["overflow"] > 0) == (op == wire.SUM)


# ---- the same API ---------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ["numpy", "native"])
def test_admission_errors_read_the_same(engine):
    e = make_engine(slots=8, lanes=4, max_jobs=2, engine=engine)
    assert isinstance(e, NativeAggregationEngine if engine == "native" else AggregationEngine)
    bad = [
        (JobSpec(1, 0, 2, list(range(33))), "job 1: 33 workers, must be 1..32"),
        (JobSpec(1, 0, 2, []), "job 1: 0 workers, must be 1..32"),
        (JobSpec(1, 0, 2, [5, 5]), "job 1: worker sources must be distinct and non-negative"),
        (JobSpec(1, 0, 2, [-1]), "job 1: worker sources must be distinct and non-negative"),
        (JobSpec(1, 6, 4, [1]), "job 1: slots 6..9 outside 0..7"),
        (JobSpec(1, -1, 2, [1]), "job 1: slots -1..0 outside 0..7"),
        (JobSpec(1, 0, 0, [1]), "job 1: slots 0..-1 outside 0..7"),
        (JobSpec(70000, 0, 1, [1]), "job id 70000 outside 0..65535"),
        (JobSpec(-1, 0, 1, [1]), "job id -1 outside 0..65535"),
        (JobSpec(1, 0, 1, [1], generation=1 << 16), "job 1: generation 65536 outside 0..65535"),
    ]
    for spec, message in bad:
        with pytest.raises(ConfigError) as info:
            e.add_job(spec)
        assert str(info.value) == message
    e.add_job(JobSpec(1, 0, 4, [1]))
    for spec, message in [(JobSpec(1, 4, 1, [1]), "job 1 is already admitted"),
                          (JobSpec(2, 3, 2, [2]), "job 2: slot range overlaps job 1")]:
        with pytest.raises(ConfigError) as info:
            e.add_job(spec)
        assert str(info.value) == message
    e.add_job(JobSpec(2, 4, 2, [2]))
    with pytest.raises(ConfigError, match="^no room for job 3: 2 jobs admitted already$"):
        e.add_job(JobSpec(3, 6, 2, [3]))
    with pytest.raises(ConfigError, match="^job 9 is not admitted$"):
        e.remove_job(9)
    with pytest.raises(ConfigError, match="^job 9 is not admitted$"):
        e.counters(9)
    e.remove_job(1)
    e.add_job(JobSpec(3, 0, 4, [3]))
    assert [j.job for j in e.jobs()] == [2, 3]
    assert (e.slots, e.lanes) == (8, 4)
    with pytest.raises(ConfigError, match=">= 1"):
        make_engine(0, 4, engine=engine)


@pytest.mark.parametrize("engine", ["numpy", "native"])
def test_generations_follow_each_other_per_job_id(engine):
    e = make_engine(slots=8, lanes=4, engine=engine)
    sequence = []
    for generation in (None, None, 100, None, 65535, None):
        sequence.append(e.add_job(JobSpec(1, 0, 2, [1], generation=generation)).generation)
        e.remove_job(1)
    assert sequence == [0, 1, 100, 101, 65535, 0]
    assert e.add_job(JobSpec(2, 2, 2, [2])).generation == 0


def test_engine_option():
    assert isinstance(make_engine(4, 4, engine="auto"), NativeAggregationEngine)
    with pytest.raises(ValueError, match="engine"):
        make_engine(4, 4, engine="fast")


def test_bad_batch_shapes_are_errors_not_crashes():
    e = NativeAggregationEngine(4, 4)
    e.add_job(JobSpec(1, 0, 2, [1]))
    longer = wire.encode(type=wire.DATA, job=1, worker=0, psn=0, pool=2, payload=[1] * 8, lanes=8)
    assert len(e.process(longer, np.array([1]))) == 0 and e.counters()["malformed"] == 1  # wider than the engine
    with pytest.raises(ValueError, match="one entry per packet"):
        e.process(wire.empty(2, 4), np.array([1]))
    assert len(e.process(wire.empty(0, 4), np.zeros(0, np.int64))) == 0
    # lengths beyond uint32 and negative ones: malformed, as in numpy
    out = e.process(wire.empty(2, 4), np.array([1, 1]), np.array([1 << 40, -5]))
    assert len(out) == 0 and e.counters()["malformed"] == 3


def test_the_native_engine_is_thread_safe():
    """One thread processes while another admits and removes jobs: no crash, counters add up."""
    lanes = 4
    e = NativeAggregationEngine(slots=16, lanes=lanes)
    e.add_job(JobSpec(1, 0, 4, [10, 11]))
    stop = threading.Event()
    errors: list[BaseException] = []

    def churn() -> None:
        try:
            while not stop.is_set():
                e.add_job(JobSpec(2, 8, 4, [20, 21, 22]))
                e.counters(2)
                e.remove_job(2)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    t = threading.Thread(target=churn)
    t.start()
    rng = np.random.default_rng(0)
    try:
        for psn in range(2000):
            job, workers = (1, 2) if psn % 2 else (2, 3)
            rows = [wire.encode(type=wire.DATA, job=job, worker=w, psn=psn, pool=4, payload=[1] * lanes, lanes=lanes)
                    for w in range(workers)]
            batch = np.frombuffer(b"".join(r.tobytes() for r in rows), dtype=wire.packet_dtype(lanes))
            e.process(batch, np.array([job * 10 + w for w in rng.permutation(workers)]))
    finally:
        stop.set()
        t.join()
    assert not errors, errors
    c = e.counters()
    assert c["received"] == sum(c[k] for k in ("rejected", "aggregated", "duplicate", "duplicate_answered", "stale",
                                               "relayed"))


# ---- the service ---------------------------------------------------------------------------


def udp_socket() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    s.settimeout(5)
    return s


def run_rounds(agg: SoftwareAggregator, rounds_: int, lanes: int, workers: int = 3, pool: int = 4) -> list[bytes]:
    """Workers on real sockets send `rounds_` rounds without loss recovery; returns what worker 0 got."""
    socks = [udp_socket() for _ in range(workers)]
    spec = agg.add_job(job_from_json({"job": 5, "pool": pool, "workers": [
        "{}:{}".format(*s.getsockname()) for s in socks]}))
    got = []
    for psn in range(rounds_):
        for w, s in enumerate(socks):
            s.sendto(wire.encode(type=wire.DATA, job=5, worker=w, psn=psn, pool=pool, payload=[psn + w] * lanes,
                                 generation=spec.generation, lanes=lanes).tobytes(), agg.address)
        got.append(socks[0].recv(65536))
        for s in socks[1:]:
            s.recv(65536)
    for s in socks:
        s.close()
    return got


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", ["numpy", "native"])
def test_service_answers_and_reports_the_same_keys(engine):
    lanes = 8
    agg = SoftwareAggregator(listen=("127.0.0.1", 0), control="tcp://127.0.0.1:*", lanes=lanes, slots=64,
                             engine=engine)
    server = threading.Thread(target=agg.serve)
    server.start()
    try:
        client = ControlClient(agg.control_endpoint)
        assert client.request("ping")["engine"] == engine
        got = run_rounds(agg, 20, lanes)
        for psn, raw in enumerate(got):
            p = wire.decode(raw, lanes)[0]
            assert p["hdr"]["type"] == wire.RESULT and p["hdr"]["psn"] == psn
            assert (p["payload"] == 3 * psn + 3).all()
        stats = client.request("stats")
        assert stats["engine"] == engine
        assert stats["totals"]["completed"] == 20 and stats["jobs"]["5"]["results_sent"] == 60
        assert stats["transport"]["packets_received"] == 60 and stats["transport"]["packets_sent"] == 60
        assert stats["transport"]["bytes_sent"] == 60 * wire.packet_size(lanes)
        assert set(stats["transport"]) == set(TransportStats().as_dict())
        assert set(stats["injected"]) == {"ingress_dropped", "ingress_duplicated", "egress_dropped",
                                          "egress_duplicated"}
    finally:
        agg.stop()
        server.join(10)
    assert not server.is_alive()


@pytest.mark.timeout(60)
def test_native_service_counts_garbage_and_keeps_serving():
    lanes = 8
    agg = SoftwareAggregator(listen=("127.0.0.1", 0), control=None, lanes=lanes, slots=64, engine="native")
    server = threading.Thread(target=agg.serve)
    server.start()
    try:
        rng = np.random.default_rng(3)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for size in (0, 1, 15, 16, wire.packet_size(lanes) - 1, wire.packet_size(lanes) + 1, 1500, 60000):
                s.sendto(rng.integers(0, 256, size, dtype=np.uint8).tobytes(), agg.address)
            wrong = wire.encode(type=wire.DATA, job=1, worker=0, psn=0, pool=4, payload=[1] * lanes, lanes=lanes)
            wrong["hdr"]["version"] = 1
            s.sendto(wrong.tobytes(), agg.address)
            s.sendto(wrong.tobytes()[:-1], agg.address)
        deadline = time.monotonic() + 5
        while agg.stats()["totals"]["malformed"] < 10 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert agg.stats()["totals"]["malformed"] == 10
        assert len(run_rounds(agg, 3, lanes)) == 3  # still serving
    finally:
        agg.stop()
        server.join(10)


@pytest.mark.timeout(120)
def test_native_impairment_is_recovered_by_retransmissions():
    """Seeded drop/duplicate/reorder in C, both ways: a host that retransmits gets every sum right."""
    lanes, workers, pool, rounds_ = 8, 3, 4, 200
    rng = np.random.default_rng(9)
    agg = SoftwareAggregator(listen=("127.0.0.1", 0), control=None, lanes=lanes, slots=64, engine="native",
                             ingress=Impairment(0.2, 0.2, True, rng), egress=Impairment(0.2, 0.2, True, rng))
    server = threading.Thread(target=agg.serve)
    server.start()
    socks = [udp_socket() for _ in range(workers)]
    try:
        spec = agg.add_job(job_from_json({"job": 1, "pool": pool, "workers": [
            "{}:{}".format(*s.getsockname()) for s in socks]}))
        for psn in range(rounds_):  # stop-and-wait per round, every worker until it has its RESULT
            pending = set(range(workers))
            while pending:
                for w in pending:
                    socks[w].sendto(wire.encode(type=wire.DATA, job=1, worker=w, psn=psn, pool=pool,
                                                payload=[psn * (w + 1)] * lanes, generation=spec.generation,
                                                lanes=lanes).tobytes(), agg.address)
                deadline = time.monotonic() + 0.02  # then the pending ones send again (one wait for all of them)
                while pending and (left := deadline - time.monotonic()) > 0:
                    for s in select.select([socks[w] for w in pending], [], [], left)[0]:
                        p = wire.decode(s.recv(65536), lanes)[0]
                        if p["hdr"]["psn"] == psn:
                            assert (p["payload"] == psn * 6).all()
                            pending.discard(socks.index(s))
        stats = agg.stats()
    finally:
        agg.stop()
        server.join(10)
        for s in socks:
            s.close()
    injected = stats["injected"]
    assert all(injected[k] > 0 for k in injected), injected
    assert stats["totals"]["completed"] == rounds_
    assert stats["totals"]["aggregated"] == workers * rounds_  # a duplicate is never added twice


@pytest.mark.timeout(30)
def test_an_idle_native_service_sleeps():
    """No busy polling: the data path blocks in poll(), the control loop wakes 10 times a second."""
    agg = SoftwareAggregator(listen=("127.0.0.1", 0), control="tcp://127.0.0.1:*", engine="native")
    server = threading.Thread(target=agg.serve)
    server.start()
    try:
        time.sleep(0.2)
        before = time.process_time()
        time.sleep(1.0)
        assert time.process_time() - before < 0.2
    finally:
        agg.stop()
        server.join(10)


def test_a_closed_unserved_aggregator_frees_its_data_path():
    agg = SoftwareAggregator(listen=("127.0.0.1", 0), control=None, engine="native")
    assert agg.engine_name == "native" and agg.native is not None
    agg.close()
    agg.close()  # twice: harmless
    assert agg.native.handle is None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", ["numpy", "native"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_cli_engine_option_and_signals(engine, sig):
    proc, ready = start_aggregator(["--engine", engine])
    try:
        assert ready["engine"] == engine
        assert ControlClient(ready["control"]).request("ping")["engine"] == engine
    finally:
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=10)
    assert proc.returncode == 0
    stopped = json.loads(out.splitlines()[-1])
    assert stopped["event"] == "stopped" and stopped["engine"] == engine


def test_cli_native_engine_unavailable_is_a_clear_error(tmp_path):
    env = {**os.environ, "PASSING_NATIVE_LIB": str(tmp_path / "missing.so"), "PYTHONUNBUFFERED": "1"}
    r = subprocess.run([sys.executable, "-m", "passing.cli", "aggregator", "serve", "--engine", "native",
                        "--listen", "127.0.0.1:0", "--control", "none"], capture_output=True, text=True, timeout=30,
                       env=env)
    assert r.returncode == 2 and "cannot be loaded" in r.stderr
    r = subprocess.run([sys.executable, "-c", "from passing.aggregator.native_engine import make_engine; "
                        "import warnings; warnings.simplefilter('error'); make_engine(4, 4)"],
                       capture_output=True, text=True,
                       timeout=30, env=env)
    assert r.returncode != 0 and "numpy engines" in r.stderr  # auto falls back, with a warning


def test_native_service_serves_two_jobs_of_the_same_hosts():
    """Two jobs on the same two worker sockets: each socket gets every RESULT of both, none mixed up."""
    lanes, pool = 4, 8
    socks = [udp_socket() for _ in range(2)]
    addresses = ["{}:{}".format(*s.getsockname()) for s in socks]
    agg = SoftwareAggregator(listen=("127.0.0.1", 0), control=None, lanes=lanes, slots=16, engine="native",
                             jobs=[job_from_json({"job": 1, "base": 0, "pool": pool, "workers": addresses}),
                                   job_from_json({"job": 2, "base": pool, "pool": pool,
                                                  "workers": addresses[::-1]})])
    server = threading.Thread(target=agg.serve)
    server.start()
    try:
        for psn in range(pool):  # a whole window in flight per job
            for job in (1, 2):
                for w in range(2):
                    sock = socks[w if job == 1 else 1 - w]
                    sock.sendto(wire.encode(type=wire.DATA, job=job, worker=w, psn=psn, pool=pool,
                                            payload=[job * psn + w] * lanes, lanes=lanes).tobytes(), agg.address)
        for i, sock in enumerate(socks):
            got = sorted((int(h["job"]), int(h["psn"]), int(h["worker"]), int(v))
                         for h, v in ((p["hdr"], p["payload"][0])
                                      for p in (wire.decode(sock.recv(100), lanes)[0] for _ in range(2 * pool))))
            want = sorted((job, psn, i if job == 1 else 1 - i, 2 * job * psn + 1)
                          for job in (1, 2) for psn in range(pool))
            assert got == want
    finally:
        agg.stop()
        server.join(10)
        for s in socks:
            s.close()
