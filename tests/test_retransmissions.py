"""No spurious retransmissions: a loss-free run whose peers are slow resends (almost) nothing.

A RESULT comes only once every worker has sent its packet, so a peer that starts its allreduce
later makes the others wait as a loss would. Worker processes here take turns being late by tens
of milliseconds before each call (as ranks of a training step do); nothing is lost, so every
retransmission is spurious, and the target is at most 1 per 10 000 packets (docs/benchmarks.md).
Both engines, the host's and the aggregator's alike.

The workers start their first call together, whatever the machine's load: each one, its socket bound,
connects to the test's start line, and all are let go at once. Started as they are forked, their first
calls began up to 0.4 s apart under a load of 10 (and more under heavier load): past ``rto`` (1 s) the
waiting workers probe, a probe answered right after it is sent counts as evidence of loss, and for
LOSS_MEMORY (10 s) a silence then waits two round trips instead of ``rto``, so the next calls' late
peers drew hundreds of probes (a 1.5 s late start: 400 and 800 retransmissions) where the test is
about peers late by LATE.

    python -m tests.test_retransmissions WORKER WORKERS AGGREGATOR BIND ENGINE START   # one worker (the test runs them)
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from passing.aggregator.control_channel import ControlClient
from passing.launch import free_udp_ports
from tests.cluster import start_aggregator
from tests.zygote import CLI_PRELOAD, shared

WORKERS, CALLS, ELEMENTS, LANES, POOL = 4, 24, 300_000, 256, 64
LATE = 0.04  # s: before call k, worker k mod WORKERS starts this late
BOUND = 1e-4  # retransmissions per packet sent


def worker(w: int, workers: int, aggregator: str, bind: str, engine: str, start: int) -> None:
    from passing import Group

    x = np.random.default_rng(w).standard_normal(ELEMENTS).astype(np.float32)
    with Group(1, w, workers, [aggregator], pool=POOL, lanes=LANES, bind=bind, engine=engine, timeout=30) as g:
        with socket.create_connection(("127.0.0.1", start), timeout=120) as line:
            line.recv(1)  # the start line: the test closes it once every worker is at it
        for k in range(CALLS):
            if k % workers == w:
                time.sleep(LATE)  # this worker's peers wait for it
            g.allreduce(x)
        stats = g.stats.as_dict()
    print(json.dumps(stats), flush=True)


def let_go_together(line: socket.socket, count: int) -> None:
    """Wait until ``count`` workers have connected to ``line`` (each ready for its first call), then
    let them all go at once (their connections closed). A worker that died first makes this wait out
    the line's timeout; its exit status tells why."""
    ready = []
    try:
        for _ in range(count):
            ready.append(line.accept()[0])
    except TimeoutError:
        pass
    for connection in ready:
        connection.close()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("engine", ["native", "numpy"])
def test_a_loss_free_run_with_late_peers_resends_nothing(engine):
    agg, ready = start_aggregator(["--engine", engine, "--lanes", str(LANES)])
    line = socket.create_server(("127.0.0.1", 0), backlog=WORKERS)
    line.settimeout(120)
    try:
        addresses = [f"127.0.0.1:{p}" for p in free_udp_ports(WORKERS)]
        ControlClient(ready["control"]).request("add_job", job={"job": 1, "pool": POOL, "workers": addresses})
        popen = shared(CLI_PRELOAD).popen  # forked from a process that imported passing already
        procs = [popen([sys.executable, "-m", "tests.test_retransmissions", str(w), str(WORKERS), ready["data"],
                        addresses[w], engine, str(line.getsockname()[1])], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True)
                 for w in range(WORKERS)]
        let_go_together(line, WORKERS)
        reports = []
        for p in procs:
            out, err = p.communicate(timeout=150)
            assert p.returncode == 0, err[-3000:]
            reports.append(json.loads(out.splitlines()[-1]))
        totals = ControlClient(ready["control"]).request("stats")["totals"]
    finally:
        line.close()
        agg.terminate()
        agg.wait(10)
    sent = sum(r["packets_sent"] for r in reports)
    resent = sum(r["retransmissions"] for r in reports)
    packets = WORKERS * CALLS * (1 + -(-ELEMENTS // LANES))  # a MAX round and the SUM stream per call
    early = sum(r["early_retransmissions"] for r in reports)
    print(f"{engine}: {resent} retransmissions ({early} on evidence) of {sent} packets, peers {LATE * 1e3:.0f} ms "
          "late in turn")
    assert sent == packets + resent
    assert totals["duplicate"] + totals["duplicate_answered"] == resent  # the aggregator saw every resend
    assert resent <= BOUND * sent, f"{resent} spurious retransmissions in {sent} packets"


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], int(sys.argv[6]))
