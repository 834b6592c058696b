"""Job turnover: late packets of an earlier allocation of the same job id never reach a later one.

Two allocations of one job id run back to back from the same worker addresses (the
pattern of an elastic restart) against a real aggregator process; copies of the first
allocation's DATA are fired into the second one's run from the very sockets the
workers use. And a host never takes a RESULT of another generation for its own.
"""

from __future__ import annotations

import socket
import threading
import time

import numpy as np

from passing import wire
from passing.aggregator.control_channel import ControlClient
from passing.launch import free_udp_ports
from passing.stream import Group
from passing.transport import BatchSocket, parse_endpoint
from tests.cluster import run_threads, start_aggregator

WORKERS, POOL, LANES = 2, 16, 64
SIZE = 64 * 400  # 400 packets per worker and call
CALLS = 12  # per allocation: long enough for the replay to land between and inside calls
REPLAYED_FIRST = 100  # copies fired before the calls start (the replay goes on meanwhile)


def _inputs(generation: int, worker: int) -> np.ndarray:
    return np.random.default_rng([generation, worker]).integers(-1000, 1000, SIZE, dtype=np.int32)


def _late_copies(generation: int, job: int, rng: np.random.Generator) -> list[tuple[int, bytes]]:
    """What workers of allocation ``generation`` sent: every psn of its calls, some marked resent."""
    copies = []
    for w in range(WORKERS):
        rows = _inputs(generation, w).reshape(-1, LANES)
        psn = np.arange(CALLS * len(rows))  # every call of the same array
        flags = np.where(rng.random(psn.size) < 0.5, wire.FLAG_RETRANSMIT, 0)
        packets = wire.encode(type=wire.DATA, job=job, worker=w, psn=psn, pool=POOL, generation=generation,
                              flags=flags, payload=np.vstack([rows] * CALLS), lanes=LANES)
        copies += [(w, p.tobytes()) for p in packets]
    return copies


def _run_allocation(ready: dict, addresses: list[str], generation: int, replay: bool,
                    rng: np.random.Generator) -> int:
    """Two allreduce calls of allocation ``generation`` of job 2, checked exactly; with ``replay``
    the previous allocation's packets are fired in meanwhile. Returns how many were fired."""
    aggregator = parse_endpoint(ready["data"], wire.UDP_PORT)
    groups = [Group(2, w, WORKERS, [ready["data"]], pool=POOL, lanes=LANES, generation=generation,
                    bind=addresses[w], timeout=20) for w in range(WORKERS)]
    stop, under_way = threading.Event(), threading.Event()
    fired = 0

    def fire() -> None:
        """The previous allocation's packets, from the very sockets of the workers, at random moments."""
        nonlocal fired
        copies = _late_copies(generation - 1, 2, rng)
        while not stop.is_set():
            for i in rng.choice(len(copies), 20):
                w, raw = copies[i]
                groups[w].socket.sock.sendto(raw, aggregator)
                fired += 1
            if fired >= REPLAYED_FIRST:
                under_way.set()
            time.sleep(float(rng.uniform(0, 0.002)))

    replayer = threading.Thread(target=fire)
    if replay:
        replayer.start()
        # the calls start once REPLAYED_FIRST copies are out, and the replay goes on all through them: at
        # least that many, however fast the calls are on this machine (once all 12 calls were over after 40)
        assert under_way.wait(30), "the replay did not get under way"
    try:
        results = run_threads(lambda w: [groups[w].allreduce(_inputs(generation, w)) for _ in range(CALLS)], WORKERS)
    finally:
        stop.set()
        if replay:
            replayer.join()
        for g in groups:
            g.close()
    expected = np.sum([_inputs(generation, w).astype(np.int64) for w in range(WORKERS)], axis=0)
    for w, r in enumerate(results):
        assert not isinstance(r, Exception), f"worker {w}: {r}"
        for call in r:
            assert np.array_equal(call, expected), f"generation {generation} worker {w}: a wrong sum"
    return fired


def test_late_copies_of_the_previous_allocation_never_touch_the_next_one():
    agg, ready = start_aggregator(["--lanes", str(LANES), "--slots", "64"])
    control = ControlClient(ready["control"])
    addresses = [f"127.0.0.1:{p}" for p in free_udp_ports(WORKERS)]
    rng = np.random.default_rng(5)
    try:
        for generation in (0, 1):
            admitted = control.request("add_job", job={"job": 2, "pool": POOL, "workers": addresses})["job"]
            assert admitted["generation"] == generation  # standalone: the aggregator counts them per job id
            before = control.request("stats", job=2)["jobs"]["2"]
            fired = _run_allocation(ready, addresses, generation, generation == 1, rng)
            deadline = time.monotonic() + 10
            while True:  # until the last copies are counted (a loaded machine takes its time), not a fixed wait
                after = control.request("stats", job=2)["jobs"]["2"]
                if after["rejected"] - before["rejected"] >= fired or time.monotonic() > deadline:
                    break
                time.sleep(0.02)
            if generation == 1:
                assert fired >= REPLAYED_FIRST
                # every copy was rejected at admission; nothing else of this allocation was
                assert after["rejected"] - before["rejected"] == fired
                assert after["stale"] == before["stale"]
            control.request("remove_job", job=2)
    finally:
        agg.terminate()
        agg.wait(10)


def test_a_result_of_another_generation_does_not_complete_a_call():
    """A stand-in aggregator answers every DATA first with another allocation's RESULT (another
    generation, or another job id) holding a wrong sum, and only then with the right one."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(0.2)
    stop = threading.Event()
    x = np.arange(64 * 50, dtype=np.int32)

    def aggregator() -> None:
        while not stop.is_set():
            try:
                raw, src = sock.recvfrom(65536)
            except TimeoutError:
                continue
            pkt = wire.decode(raw, LANES).copy()
            h = pkt["hdr"]
            h["type"] = wire.RESULT
            for job, generation in ((h["job"][0], h["generation"][0] ^ 1), (h["job"][0] + 1, h["generation"][0])):
                foreign = pkt.copy()
                foreign["hdr"]["job"], foreign["hdr"]["generation"] = job, generation
                foreign["payload"] = 12345
                sock.sendto(foreign.tobytes(), src)
            time.sleep(0.001)  # the foreign ones are first in the host's queue
            sock.sendto(pkt.tobytes(), src)  # one worker: the sum is its own contribution

    server = threading.Thread(target=aggregator)
    server.start()
    try:
        with Group(7, 0, 1, ["{}:{}".format(*sock.getsockname())], pool=8, generation=3,
                   bind=BatchSocket(("127.0.0.1", 0)), timeout=10) as g:
            out = g.allreduce(x)
            foreign = g.stats.foreign_results
    finally:
        stop.set()
        server.join()
        sock.close()
    assert np.array_equal(out, x)
    assert foreign >= 2 * 50  # two foreign RESULTs per packet (MAX round aside: int32 needs none)
