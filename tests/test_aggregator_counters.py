"""The UDP software aggregator keeps docs/protocol.md's counters and emission order to the letter,
numpy and native: a relayed GATHER or NACK is part of its job's ``received``; per-job counters add
up to the totals whatever the stream; and a worker gets its packets of one batch in the order their
rounds completed (an ACK never overtakes an earlier RESULT). Real sockets, a real aggregator."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from passing import native, wire
from passing.aggregator.engine import COUNTERS, JobSpec
from passing.aggregator.server import SoftwareAggregator
from passing.transport import pack_address
from tests.test_datapath import bound_sockets

ENGINES = ["numpy", pytest.param("native", marks=pytest.mark.skipif(not native.available(),
                                                                     reason="the native library is not built"))]
LANES = 4


def origin(s: socket.socket) -> int:
    return pack_address(*s.getsockname())


def aggregator(engine: str, jobs: list[JobSpec]) -> SoftwareAggregator:
    return SoftwareAggregator(listen=("127.0.0.1", 0), control=None, slots=64, lanes=LANES, jobs=jobs,
                              engine=engine)


def serve(agg: SoftwareAggregator) -> threading.Thread:
    thread = threading.Thread(target=agg.serve, daemon=True)
    thread.start()
    return thread


def wait_taken(agg: SoftwareAggregator, datagrams: int, timeout: float = 10.0) -> dict:
    """The aggregator's stats once its transport has counted ``datagrams`` (each then counted by the engine)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = agg.stats()
        if stats["transport"]["packets_received"] >= datagrams:
            return stats
        if time.monotonic() > deadline:
            raise TimeoutError(f"the aggregator took {stats['transport']['packets_received']} of {datagrams}")
        time.sleep(0.005)


def header(s: socket.socket) -> tuple[int, int]:
    """(type, psn) of the next datagram a worker receives."""
    hdr = np.frombuffer(s.recv(2048)[: wire.HEADER_SIZE], dtype=wire.HEADER_DTYPE)[0]
    return int(hdr["type"]), int(hdr["psn"])


def packet(kind: int, job: int, worker: int, psn: int, generation: int = 0, owner: int = 0, flags: int = 0,
           pool: int = 8, values: list[int] | None = None) -> bytes:
    return wire.encode(type=kind, job=job, worker=worker, psn=psn, pool=pool, payload=values or [worker + 1] * LANES,
                       generation=generation, owner=owner, flags=flags, lanes=LANES).tobytes()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", ENGINES)
def test_a_relayed_gather_is_received_by_its_job(engine):
    """One GATHER of worker 2 of 3: relayed +1, results_sent +2 and received +1, in the job's counters
    as in the totals (before issue 40 the job's received stayed 0)."""
    socks = bound_sockets(3)
    agg = aggregator(engine, [JobSpec(5, 0, 8, [origin(s) for s in socks], generation=0, lanes=LANES)])
    thread = serve(agg)
    try:
        socks[2].sendto(packet(wire.GATHER, 5, 2, 0, owner=2), agg.address)
        stats = wait_taken(agg, 1)
        job, totals = stats["jobs"]["5"], stats["totals"]
        assert {k: job[k] for k in ("received", "relayed", "results_sent")} == {
            "received": 1, "relayed": 1, "results_sent": 2}
        assert totals["received"] == job["received"] == 1
        for s in socks[:2]:  # the two others got it
            assert header(s) == (wire.GATHER, 0)
    finally:
        agg.stop()
        thread.join(10)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", ENGINES)
def test_one_batch_emits_each_workers_packets_in_completion_order(engine):
    """Two OWNER_ONLY rounds complete in one receive batch, psn 0 owned by worker 1, psn 1 by worker 0:
    worker 1 gets psn 0's RESULT, then psn 1's ACK (the numpy server sent ACKs first: one send per
    packet size, smallest first)."""
    socks = bound_sockets(2)
    agg = aggregator(engine, [JobSpec(1, 0, 8, [origin(s) for s in socks], generation=0, lanes=LANES)])
    own = wire.FLAG_OWNER_ONLY
    # All queued before the aggregator reads: its first recvmmsg takes the four as one batch.
    for w, psn, owner in ((0, 0, 1), (0, 1, 0), (1, 0, 1), (1, 1, 0)):
        socks[w].sendto(packet(wire.DATA, 1, w, psn, owner=owner, flags=own), agg.address)
    time.sleep(0.05)  # on loopback a sent datagram is queued at once; this only spares a reading of it
    thread = serve(agg)
    try:
        stats = wait_taken(agg, 4)
        assert stats["server"]["batches"] == 1, "the four datagrams were not one batch: the test proves nothing"
        for w, expected in ((0, [(wire.ACK, 0), (wire.RESULT, 1)]), (1, [(wire.RESULT, 0), (wire.ACK, 1)])):
            assert [header(socks[w]) for _ in expected] == expected, f"worker {w}"
    finally:
        agg.stop()
        thread.join(10)


def hostile_and_host_like_stream(rng: np.random.Generator, jobs: dict[int, list[socket.socket]],
                                 stranger: socket.socket, count: int) -> tuple[list[tuple[socket.socket, bytes]], dict]:
    """A random mix of every outcome the protocol names: DATA rounds (new, contribution, duplicate
    before and after completion, stale, OWNER_ONLY), GATHERs and NACKs (admitted and not), another
    generation, a stranger's origin, a slot out of range, unknown jobs, malformed datagrams.
    Returns the datagrams and how many name no admitted job (unknown) or are not PASSING (malformed)."""
    out: list[tuple[socket.socket, bytes]] = []
    tally = {"unknown": 0, "malformed": 0}
    for _ in range(count):
        job = int(rng.choice(list(jobs)))
        socks = jobs[job]
        w = int(rng.integers(len(socks)))
        psn = int(rng.integers(0, 24))
        what = rng.random()
        src = socks[w]
        if what < 0.45:
            owner_only = rng.random() < 0.3
            flags = (wire.FLAG_OWNER_ONLY if owner_only else 0) | (wire.FLAG_RETRANSMIT if rng.random() < 0.2 else 0)
            data = packet(wire.DATA, job, w, psn, owner=psn % len(socks) if owner_only else 0, flags=flags,
                          values=rng.integers(-1000, 1000, LANES).tolist())
        elif what < 0.6:
            data = packet(wire.GATHER, job, w, psn, owner=w if rng.random() < 0.8 else (w + 1) % len(socks))
        elif what < 0.7:
            data = packet(wire.NACK, job, w, psn, owner=int(rng.integers(len(socks))), values=[0] * LANES)
        elif what < 0.75:
            data = packet(wire.DATA, job, w, psn, generation=1)  # another allocation's
        elif what < 0.8:
            data, src = packet(wire.DATA, job, w, psn), stranger  # not the worker's origin
        elif what < 0.85:
            data = wire.encode(type=wire.DATA, job=job, worker=w, psn=psn, slot=9, set=0, payload=[1] * LANES,
                               lanes=LANES).tobytes()  # slot past the pool
        elif what < 0.92:
            data = packet(wire.DATA, 77, w, psn)  # no such job
            tally["unknown"] += 1
        else:
            data = packet(wire.DATA, job, w, psn)
            data = [data[:-1], b"\x07" + data[1:], packet(wire.RESULT, job, w, psn)][int(rng.integers(3))]
            tally["malformed"] += 1
        out.append((src, data))
    return out, tally


@pytest.mark.timeout(90)
@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("engine", ENGINES)
def test_per_job_counters_add_up_to_the_totals(engine, seed):
    """For every counter, the totals are the sum of the jobs' plus what names no admitted job
    (``rejected`` and ``received`` of unknown jobs, ``malformed``): the next counter cannot drift."""
    rng = np.random.default_rng(seed)
    jobs = {3: bound_sockets(3), 4: bound_sockets(2)}
    stranger = bound_sockets(1)[0]
    specs = [JobSpec(j, 8 * i, 8, [origin(s) for s in socks], generation=0, lanes=LANES)
             for i, (j, socks) in enumerate(jobs.items())]
    agg = aggregator(engine, specs)
    stream, tally = hostile_and_host_like_stream(rng, jobs, stranger, 600)
    thread = serve(agg)
    try:
        for i in range(0, len(stream), 25):  # paced: no datagram may be lost to a full socket buffer
            for src, data in stream[i : i + 25]:
                src.sendto(data, agg.address)
            wait_taken(agg, i + len(stream[i : i + 25]))
        stats = wait_taken(agg, len(stream))
    finally:
        agg.stop()
        thread.join(10)
        for s in [stranger, *(s for socks in jobs.values() for s in socks)]:
            s.close()
    totals, per_job = stats["totals"], stats["jobs"].values()
    summed = {name: sum(j[name] for j in per_job) for name in COUNTERS if name != "malformed"}
    assert totals["malformed"] == tally["malformed"]
    assert totals["received"] + totals["malformed"] == len(stream)
    assert totals["received"] == summed["received"] + tally["unknown"]
    assert totals["rejected"] == summed["rejected"] + tally["unknown"]
    for name in set(summed) - {"received", "rejected"}:
        assert totals[name] == summed[name], name
    for job in per_job:  # each admitted packet under exactly one outcome
        assert job["received"] == sum(job[k] for k in ("rejected", "aggregated", "duplicate", "duplicate_answered",
                                                       "stale", "relayed"))
    for name in ("rejected", "aggregated", "completed", "duplicate", "duplicate_answered", "stale", "relayed"):
        assert summed[name] > 0, f"the stream reached no {name}: it proves less than it claims"
