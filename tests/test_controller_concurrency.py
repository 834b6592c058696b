"""The controller stays responsive while it waits on an aggregator (docs/control.md, threads):
a move's check of a hanging PS and a `stats` that reads it delay nobody else's requests.

Real parts: two `passing-aggregator` processes (one of them stopped with SIGSTOP, so it hangs
exactly as a wedged host does), the controller service, workers with heartbeats and failover.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from passing import Group
from passing.control import Failover, join
from passing.launch import free_udp_ports
from passing_controller.service import CHECK_TIMEOUT
from passing_controller.topology import Topology
from tests.cluster import run_threads, start_aggregator
from tests.keys import ask, controller


@pytest.fixture
def two_ps():
    started = [start_aggregator() for _ in range(2)]
    yield started
    for proc, _ in started:
        proc.send_signal(signal.SIGCONT)
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def ctl(two_ps, tmp_path):
    """The controller service over the two PSs, serving from a thread of this process."""
    ps = [ready for _, ready in two_ps]
    service = controller(Topology.from_dict({"ps": [{"data": p["data"], "control": p["control"]} for p in ps]}),
                         tmp_path / "ctl.sqlite", join_timeout=10)
    serving = threading.Thread(target=service.serve)
    serving.start()
    yield service
    service.stop()
    serving.join(10)


def timed_join(endpoint: str, job: str) -> float:
    began = time.monotonic()
    answer = join(endpoint, job, 0, 1, host="127.0.0.1", udp_port=free_udp_ports(1)[0], pool=4, timeout=10)
    assert answer["mode"] == "ps"
    return time.monotonic() - began


@pytest.mark.timeout(120)
def test_joins_are_answered_while_a_move_checks_a_hanging_ps(two_ps, ctl):
    (proc_a, a), _ = two_ps
    assert timed_join(ctl.endpoint, "filler") < 5  # job id 1: PS b (ids spread over the PSs)
    ports = free_udp_ports(2)
    stopped = threading.Event()
    data = [np.arange(2000, dtype=np.float32) * (w + 1) for w in range(2)]

    def victim(w: int) -> list:
        answer = join(ctl.endpoint, "victim", w, 2, host="127.0.0.1", udp_port=ports[w], timeout=10)
        assert answer["aggregators"][0]["port"] == int(a["data"].split(":")[1])  # job id 2: PS a
        line = Failover(ctl.endpoint, "victim", 0, w, answer["token"], after=0.3, heartbeat=0.2)
        out = []
        with Group.from_answer(answer, bind=("127.0.0.1", ports[w]), timeout=30, failover=line) as g:
            out.append(g.allreduce(data[w]))
            if w == 0:
                os.kill(proc_a.pid, signal.SIGSTOP)  # PS a hangs: alive to the kernel, deaf to everyone
                stopped.set()
            stopped.wait(10)
            out.append(g.allreduce(data[w]))  # silence, reports, the check of a (CHECK_TIMEOUT), a move to b
            line.close()
            return [*out, g.moves]

    results: list = []
    streaming = threading.Thread(target=lambda: results.extend(run_threads(victim, 2, timeout=60)))
    streaming.start()
    deadline = time.monotonic() + 30
    while not ctl.moving and time.monotonic() < deadline:  # every worker reported: the check is on
        time.sleep(0.01)
    assert ctl.moving, f"the move never started: {results}"
    latencies, checked_at = [], time.monotonic()
    while ctl.moving and time.monotonic() - checked_at < CHECK_TIMEOUT:
        latencies.append(timed_join(ctl.endpoint, f"during-{len(latencies)}"))
        latencies.append(_timed(lambda: ask(ctl.endpoint, "status")))
    streaming.join(60)
    assert len(latencies) >= 4, latencies  # the check lasted long enough to try
    # before, the first one waited out the 2 s check (nothing was served meanwhile)
    assert latencies[0] < CHECK_TIMEOUT / 2 and max(latencies) < CHECK_TIMEOUT * 0.75, latencies
    expected = data[0] + data[1]
    for r in results:
        assert not isinstance(r, Exception), r
        assert np.array_equal(r[0], expected) and np.array_equal(r[1], expected) and r[2] == 1


@pytest.mark.timeout(60)
def test_stats_of_a_hanging_ps_does_not_hold_other_requests(two_ps, ctl):
    (proc_a, _), _ = two_ps
    timed_join(ctl.endpoint, "on-b")
    timed_join(ctl.endpoint, "on-a")
    os.kill(proc_a.pid, signal.SIGSTOP)
    stats: list = []
    reading = threading.Thread(target=lambda: stats.append(_timed(lambda: ask(ctl.endpoint, "stats"))))
    reading.start()
    time.sleep(0.2)  # the stats request is waiting on PS a now
    assert _timed(lambda: ask(ctl.endpoint, "status")) < CHECK_TIMEOUT / 2
    assert timed_join(ctl.endpoint, "meanwhile") < CHECK_TIMEOUT / 2
    reading.join(30)
    assert stats and stats[0] >= CHECK_TIMEOUT - 0.1  # it did wait on a, and answered


def _timed(fn) -> float:
    began = time.monotonic()
    fn()
    return time.monotonic() - began
