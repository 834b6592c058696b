"""A group of several streams through the controller (docs/control.md, join's ``streams``; passing.stripes): the
controller admits a job per stream at the group's one aggregator, its answer names them, the results are the bits
of one stream, the streams' jobs go at the leave, bad stream counts are refused, and a move takes every stream.

Real parts: software aggregator processes, the controller service, worker threads with real sockets that join
through passing.control.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from passing import Group, native
from passing.aggregator.control_channel import ControlClient
from passing.control import HEARTBEAT_SECONDS, ControllerError, Failover, join, leave, new_job_secret
from passing.stripes import bind_streams, sized
from passing_controller.store import Record, Store
from tests.cluster import run_threads
from tests.test_controller_ps_fallback import Running
from tests.test_failover import AFTER, CHECK, assert_exact, inputs, ps_processes, ps_topology

pytestmark = pytest.mark.skipif(not native.available(), reason="the native library is not built")

WORKERS = 2


@pytest.fixture
def one_ps():
    yield from ps_processes(1)


@pytest.fixture
def two_ps():
    yield from ps_processes(2)


def striped_run(endpoint: str, job: str, streams: int, failover: bool = False, data=None, on_call=None) -> list:
    """Every worker joins ``job`` with ``streams`` streams (sockets at consecutive ports), runs its calls (default:
    a float32 allreduce, an int32 allreduce and an int32 reduce_scatter of its own data) and leaves; each one's
    (answer, outputs, moves)."""
    secret = new_job_secret()

    def work(w: int) -> tuple:
        socks = bind_streams("127.0.0.1", streams)
        try:
            answer = join(endpoint, job, w, WORKERS, host="127.0.0.1", udp_port=socks[0].address[1], timeout=30,
                          secret=secret, streams=streams)
        except BaseException:
            for sock in socks:
                sock.close()
            raise
        socks = sized(socks, int(answer["lanes"]))  # the PS's packets
        line = Failover(endpoint, job, 0, w, answer["token"], after=AFTER, heartbeat=HEARTBEAT_SECONDS) \
            if failover else None
        with Group.from_answer(answer, bind=socks[0], streams=streams, stream_sockets=socks[1:], engine="native",
                               io="udp", timeout=60, failover=line) as g:
            assert g.streams == streams
            if data is None:
                r = np.random.default_rng(w)
                x = r.standard_normal(50_001, dtype=np.float32)
                xi = r.integers(-1000, 1000, 40_000, dtype=np.int32)
                outputs = [g.allreduce(x), g.allreduce(xi), g.reduce_scatter(xi)]
            else:
                outputs = []
                for k, x in enumerate(data[w]):
                    if on_call is not None:
                        on_call(w, k, g)
                    outputs.append(g.allreduce(x))
            moves = g.moves
        leave(endpoint, job, 0, w, answer["token"])
        return answer, outputs, moves

    outcomes = run_threads(work, WORKERS, timeout=120)
    for outcome in outcomes:
        assert not isinstance(outcome, BaseException), outcome
    return outcomes


@pytest.mark.timeout(120)
def test_streams_through_the_controller_give_one_streams_bits(one_ps, tmp_path):
    ((_, ready),) = one_ps
    running = Running(ps_topology(ready), tmp_path / "ctl.sqlite")
    try:
        one = striped_run(running.endpoint, "one", 1)
        assert all(answer["streams"] == 1 and answer["stream_jobs"] == [] for answer, _, _ in one)
        for streams in (2, 3):
            several = striped_run(running.endpoint, f"striped{streams}", streams)
            answer = several[0][0]
            ids = [answer["job_id"]] + [j for j, _ in answer["stream_jobs"]]
            assert answer["streams"] == streams and len(set(ids)) == streams  # a job id per stream
            assert all(a["stream_jobs"] == answer["stream_jobs"] for a, _, _ in several)
            for (_, a, _), (_, b, _) in zip(one, several):
                for x, y in zip(a, b):
                    assert x.dtype == y.dtype and np.array_equal(x, y)
            # every stream's job was the PS's and carried packets; each went at the leave
            final = running.ctl.metrics()["groups"]
            assert any(g["job"] == f"striped{streams}" and not g["running"] for g in final)
        stats = ControlClient(ready["control"]).request("stats")
        assert stats["jobs"] == {}, "every stream's job is removed when the group ends"
        assert running.ctl.status()["jobs"] == []
    finally:
        running.stop()


@pytest.mark.timeout(60)
def test_each_stream_is_a_job_at_the_aggregator_while_the_group_runs(one_ps, tmp_path):
    ((_, ready),) = one_ps
    running = Running(ps_topology(ready), tmp_path / "ctl.sqlite")
    secret = new_job_secret()
    try:
        socks = bind_streams("127.0.0.1", 3)
        with socks[0], socks[1], socks[2]:
            answer = join(running.endpoint, "held", 0, 1, host="127.0.0.1", udp_port=socks[0].address[1],
                          secret=secret, streams=3, pool=16, timeout=10)
            (job,) = running.ctl.status()["jobs"]
            assert [s["job_id"] for s in job["stripes"]] == [j for j, _ in answer["stream_jobs"]]
            bases = [job["base"]] + [s["base"] for s in job["stripes"]]
            assert len(set(bases)) == 3  # three ranges of 16 slots
            ps_jobs = ControlClient(ready["control"]).request("stats")["jobs"]
            assert sorted(ps_jobs) == sorted(str(i) for i in [answer["job_id"]] + [j for j, _ in
                                                                                   answer["stream_jobs"]])
            # a restarted controller has them from its store: the streams' slots and job ids stay taken
            running.stop()
            running = Running(ps_topology(ready), tmp_path / "ctl.sqlite")
            (again,) = running.ctl.status()["jobs"]
            assert again["stripes"] == job["stripes"]
            # a later group's job ids are none of these
            other = join(running.endpoint, "other", 0, 1, host="127.0.0.1", udp_port=socks[0].address[1] + 10,
                         secret=secret, timeout=10)
            assert other["job_id"] not in [answer["job_id"]] + [j for j, _ in answer["stream_jobs"]]
            leave(running.endpoint, "held", 0, 0, answer["token"])
            leave(running.endpoint, "other", 0, 0, other["token"])
        assert ControlClient(ready["control"]).request("stats")["jobs"] == {}
    finally:
        running.stop()


@pytest.mark.timeout(60)
def test_bad_stream_counts_are_refused(one_ps, tmp_path):
    ((_, ready),) = one_ps
    running = Running(ps_topology(ready), tmp_path / "ctl.sqlite")
    secret = new_job_secret()

    def ask(job: str, **fields) -> str:
        base = {"worker": 0, "workers": 1, "host": "127.0.0.1", "udp_port": 20000, "secret": secret, "timeout": 10}
        with pytest.raises(ControllerError) as e:
            join(running.endpoint, job, **{**base, **fields})
        return str(e.value)

    try:
        assert "streams 17 outside 1..16" in ask("a", streams=17)
        assert "streams 0 outside 1..16" in ask("b", streams=0)
        assert "3 streams of 2048 slots need 6144 slots at one aggregator; the largest of the topology has 4096" \
            in ask("c", streams=3, pool=2048)
        assert "2 streams from UDP port 65535" in ask("d", streams=2, udp_port=65535)
        # more slots than the aggregator has left: every stream's range or none (and the group is refused)
        held = join(running.endpoint, "held", 0, 1, host="127.0.0.1", udp_port=20100, secret=secret, pool=16,
                    timeout=10)
        assert "(2 streams of 2048 slots)" in ask("e", streams=2, pool=2048)
        assert ControlClient(ready["control"]).request("stats")["jobs"].keys() == {str(held["job_id"])}
        # the workers of one group must agree: a worker asking for other streams than the first joiner is refused,
        # and the group still forms with the right ones
        answers: dict[int, dict] = {}

        def first_joiner() -> None:
            answers[1] = join(running.endpoint, "f", 1, 2, host="127.0.0.1", udp_port=20010, secret=secret,
                              streams=2, timeout=10)

        waiting = threading.Thread(target=first_joiner)
        waiting.start()
        deadline = time.monotonic() + 10
        while not any(p["job"] == "f" for p in running.ctl.status()["pending"]) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "job 'f' group 0 has 2 streams, not 3" in ask("f", streams=3, workers=2)
        answers[0] = join(running.endpoint, "f", 0, 2, host="127.0.0.1", udp_port=20000, secret=secret, streams=2,
                          timeout=10)
        waiting.join(10)
        assert answers[0]["stream_jobs"] == answers[1]["stream_jobs"] and len(answers[0]["stream_jobs"]) == 1
        for w in (0, 1):
            leave(running.endpoint, "f", 0, w, answers[w]["token"])
    finally:
        running.stop()


def test_the_store_never_hands_out_a_streams_job_id_in_use(tmp_path):
    store = Store(tmp_path / "s.sqlite")
    ids = [store.claim_job_id(3)[0] for _ in range(3)]
    assert ids == [1, 2, 3]
    store.add(Record(1, "j", 0, "ps", 0, 0, 8, [], {"data": "x:1", "stripes": [
        {"job_id": 2, "generation": 0, "base": 8}]}))
    assert [store.claim_job_id(3)[0] for _ in range(2)] == [3, 3]  # 2 is stream 1's
    store.remove(1)
    assert store.claim_job_id(3)[0] == 1 and store.claim_job_id(3)[0] == 2
    store.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("streams,size,delay", [(2, 20_000, None),
                                                pytest.param(3, 200_000, 0.02, marks=pytest.mark.slow)])
def test_a_striped_group_moves_with_every_stream_and_every_result_is_exact(two_ps, tmp_path, streams, size, delay):
    """The PS that serves every stream is SIGKILLed as worker 0 begins its call 4 (``delay`` None), or shortly
    after, while the streams' threads are on the wire: the group moves once, with every stream, and every
    result is exact whenever the kill lands."""
    (p0, r0), (p1, r1) = two_ps
    running = Running(ps_topology(r0, r1), tmp_path / "ctl.sqlite", check_timeout=CHECK)
    try:
        data = inputs(calls=8, workers=WORKERS, size=size)

        def kill_at_call_4(w: int, k: int, g: Group) -> None:
            if w == 0 and k == 4:
                port = g.aggregators[0].port
                pid = (p0 if r0["data"].endswith(f":{port}") else p1).pid
                if delay is None:
                    os.kill(pid, signal.SIGKILL)
                else:
                    threading.Timer(delay, os.kill, (pid, signal.SIGKILL)).start()

        outcomes = striped_run(running.endpoint, f"moved{streams}", streams, failover=True, data=data,
                               on_call=kill_at_call_4)
        assert_exact(data, outcomes)
        assert all(moves == 1 for _, _, moves in outcomes)
    finally:
        running.stop()
