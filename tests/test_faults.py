"""The fault campaign's data-path rows (docs/reliability.md): a long run under loss, duplication
and reordering both ways, and hostile datagrams fired at the software aggregator while a job runs.
Real aggregator processes, real sockets; the figures they print go to docs/reliability.md."""

from __future__ import annotations

import os
import socket
import threading
import time

import numpy as np
import pytest

from passing import Group, wire
from passing.aggregator.control_channel import ControlClient
from passing.launch import free_udp_ports
from tests.cluster import run_threads, start_aggregator

LANES = wire.DEFAULT_LANES
pytestmark = pytest.mark.slow  # a soak and a campaign: `make test-all` runs them


def admitted_job(ready: dict, workers: int, pool: int) -> tuple[list[str], int]:
    addresses = [f"127.0.0.1:{p}" for p in free_udp_ports(workers)]
    job = ControlClient(ready["control"]).request("add_job", job={"job": 1, "pool": pool, "workers": addresses})
    return addresses, int(job["job"]["generation"])


def integer_inputs(seed: int, workers: int, size: int) -> list[np.ndarray]:
    """Integer-valued floats: auto-scaled sums of them are exact, so results compare with ==."""
    rng = np.random.default_rng(seed)
    return [rng.integers(-1000, 1000, size).astype(np.float32) for _ in range(workers)]


def kernel_drops(port: int) -> int:
    """Datagrams the kernel dropped at the UDP socket bound to 127.0.0.1:port (receive buffer full)."""
    for line in open("/proc/net/udp").read().splitlines()[1:]:
        fields = line.split()
        if fields[1] == f"0100007F:{port:04X}":
            return int(fields[-1])
    raise LookupError(f"no UDP socket on 127.0.0.1:{port}")


@pytest.mark.timeout(300)
def test_soak_1000_calls_under_loss_duplication_and_reordering_both_ways():
    proc, ready = start_aggregator(["--drop-ingress", "0.05", "--drop-egress", "0.05", "--duplicate", "0.05",
                                    "--reorder", "--seed", "3"])
    try:
        workers, calls, size = 2, 1000, 16 * LANES
        addresses, generation = admitted_job(ready, workers, pool=16)

        def work(w: int) -> tuple[int, float, int]:
            wrong = 0
            with Group(1, w, workers, [ready["data"]], pool=16, generation=generation, bind=addresses[w],
                       timeout=30) as g:
                start = time.monotonic()
                for k in range(calls):
                    xs = integer_inputs(k, workers, size)
                    wrong += not np.array_equal(g.allreduce(xs[w]), xs[0] + xs[1])
                return wrong, time.monotonic() - start, g.stats.retransmissions

        outcomes = run_threads(work, workers, timeout=280)
        for o in outcomes:
            assert not isinstance(o, Exception), o
        assert [wrong for wrong, _, _ in outcomes] == [0, 0]
        injected = ControlClient(ready["control"]).request("stats")["injected"]
        assert injected["ingress_dropped"] > 0 and injected["egress_dropped"] > 0
        assert injected["ingress_duplicated"] > 0 and injected["egress_duplicated"] > 0
        seconds = max(s for _, s, _ in outcomes)
        print(f"soak: {calls} calls of {size} float32, 2 workers, 5 % loss + 5 % duplication + reordering "
              f"each way: {seconds:.1f} s ({seconds / calls * 1e3:.1f} ms per call), "
              f"{sum(r for _, _, r in outcomes)} retransmissions, every result exact")
    finally:
        proc.terminate()
        proc.wait(10)


def hostile_datagrams(rng: np.random.Generator, count: int, template: np.ndarray, pool: int) -> list[bytes]:
    """Half random bytes of random lengths, half a worker's DATA packet with one field wrong."""
    out = [rng.bytes(int(rng.integers(0, 700))) for _ in range(count // 2)]
    size = template.nbytes
    for i in range(count - count // 2):
        p = template.copy()
        hdr = p["hdr"]
        kind = i % 7
        if kind == 0:
            hdr["job"] = 1 + int(rng.integers(1, 1000))  # no such job
        elif kind == 1:
            hdr["generation"] = (int(hdr["generation"][0]) + int(rng.integers(1, 1000))) % wire.GENERATIONS
        elif kind == 2:
            hdr["worker"] = 1  # worker 1 posing from worker 0's address
        elif kind == 3:
            hdr["slot"] = pool + int(rng.integers(0, 1000))  # outside the job's slots
        elif kind == 4:
            hdr["version"] = int(rng.choice([0, 1, 2, 255]))  # any but wire.VERSION
        elif kind == 5:
            hdr["type"] = wire.RESULT
        raw = p.tobytes()
        if kind == 6:
            raw = raw[: int(rng.integers(0, size))] if i % 2 else raw + rng.bytes(int(rng.integers(1, 64)))
        out.append(raw)
    return out


@pytest.mark.timeout(300)
def test_hostile_traffic_leaves_the_job_exact_and_every_datagram_counted():
    proc, ready = start_aggregator(["--engine", "native"])
    try:
        workers, pool, calls, size = 2, 64, 60, 20_000
        addresses, generation = admitted_job(ready, workers, pool)
        host, port = ready["data"].rsplit(":", 1)
        target = (host, int(port))
        template = wire.encode(type=wire.DATA, job=1, worker=0, psn=np.array([5]), pool=pool,
                               payload=np.full(LANES, 10**6, np.int64), generation=generation, lanes=LANES)
        hostile = hostile_datagrams(np.random.default_rng(11), 100_000, template, pool)
        groups: dict[int, Group] = {}
        started = threading.Barrier(workers + 1)

        def work(w: int) -> tuple[int, int]:
            wrong = 0
            with Group(1, w, workers, [ready["data"]], pool=pool, generation=generation, bind=addresses[w],
                       timeout=60) as g:
                groups[w] = g
                started.wait()
                k = 0
                while stop_at[0] is None or k < stop_at[0]:  # the job runs all through the attack
                    xs = integer_inputs(k, workers, size)
                    wrong += not np.array_equal(g.allreduce(xs[w]), xs[0] + xs[1])
                    k += 1
                    # worker 0 decides, one call ahead: the peer is at most one call behind or ahead
                    if w == 0 and stop_at[0] is None and k >= calls and fired.is_set():
                        stop_at[0] = k + 1
                return wrong, g.stats.packets_sent, k

        sent = {"stranger": 0, "origin": 0}
        fired = threading.Event()
        stop_at: list[int | None] = [None]

        def fire() -> None:
            """Paced bursts (the kernel must not drop them: then they could not be counted) from a
            stranger and, sharing its socket, from worker 0's admitted address."""
            started.wait()
            stranger = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            origin = socket.socket(fileno=os.dup(groups[0].socket.fd))
            try:
                for i in range(0, len(hostile), 500):
                    for j, d in enumerate(hostile[i : i + 500]):
                        (origin if (i + j) % 2 else stranger).sendto(d, target)
                        sent["origin" if (i + j) % 2 else "stranger"] += 1
                    time.sleep(0.002)
            finally:
                stranger.close()
                origin.close()
                fired.set()

        firing = threading.Thread(target=fire)
        firing.start()
        outcomes = run_threads(work, workers, timeout=280)
        firing.join(120)
        for o in outcomes:
            assert not isinstance(o, Exception), o
        assert [wrong for wrong, _, _ in outcomes] == [0, 0]
        assert outcomes[0][2] == outcomes[1][2] >= calls  # the same calls on both workers
        assert sum(sent.values()) == len(hostile)
        expected = len(hostile) + sum(p for _, p, _ in outcomes)
        deadline = time.monotonic() + 30
        while True:  # until the last datagrams are served (a loaded machine takes its time), then check
            stats = ControlClient(ready["control"]).request("stats")
            if stats["transport"]["packets_received"] >= expected or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the aggregator died"
        totals, received = stats["totals"], stats["transport"]["packets_received"]
        assert kernel_drops(int(port)) == 0  # else some datagrams were never the aggregator's to count
        assert received == expected  # every datagram reached it
        assert totals["received"] + totals["malformed"] == received
        outcomes_sum = sum(totals[k] for k in ("rejected", "aggregated", "duplicate", "duplicate_answered", "stale",
                                               "relayed"))
        assert outcomes_sum == totals["received"]  # each PASSING packet counted once, under one outcome
        assert totals["malformed"] + totals["rejected"] == len(hostile)
        print(f"hostile: {len(hostile)} datagrams ({sent['stranger']} from a stranger, {sent['origin']} from an "
              f"admitted origin): {totals['malformed']} malformed, {totals['rejected']} rejected; "
              f"the job's {outcomes[0][2]} calls meanwhile all exact")
    finally:
        proc.terminate()
        proc.wait(10)
