"""Mid-job failover (docs/control.md "Failover"): a group whose aggregator goes silent moves,
every worker consistently, to the next aggregator, and every result stays exact.

Real parts throughout: the controller service, software aggregators (processes, or the real
SoftwareAggregator class in a thread where a test must kill it at an exact packet), worker
threads with real sockets, heartbeats and reports over ZeroMQ.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from passing import Group, wire
from passing.aggregator.server import SoftwareAggregator
from passing.control import HEARTBEAT_SECONDS, Failover, join, request
from passing.errors import AggregatorUnreachable, GroupFailed
from passing.launch import free_udp_ports
from passing_controller.topology import Topology
from tests.cluster import run_threads, start_aggregator
from tests.test_controller_ps_fallback import Running

AFTER = 0.5  # failover_after of these tests: silence this long starts a move
# The workers' heartbeats are the product's (HEARTBEAT_SECONDS, 1 s: a worker is presumed dead after 3 s without
# one). Each beat is a fresh CURVE connection and request whose round trip, here, runs through the threads of
# this process (the workers', numpy's included, and the in-process controller's serving and ZAP threads), all
# sharing its GIL: on a loaded machine it took longer than the 0.2 s these tests once beat at, the beat was
# dropped at its own timeout (the interval), and after 0.6 s a live worker was declared dead and its group
# ended ("worker N (no heartbeat)": test_lanes' move to another lane count, the SIGSTOP runs below). Nothing here
# times how fast a dead worker is found but in a bound (test_a_dead_worker_is_named_to_its_peers...).
# The controller's liveness check of a silent group's PS (--check-timeout, 2 s by default): the tests
# that kill a PS wait it out once per move, and the killed PS never answers, however long the wait.
CHECK = 1.0
LANES = wire.DEFAULT_LANES


def ps_topology(*ps: dict) -> Topology:
    """No switch: the hosts are addresses, the PS list is given in the order given."""
    return Topology.from_dict({"ps": [{"data": p["data"], "control": p["control"]} for p in ps]})


def inputs(calls: int, workers: int, size: int) -> list[list[np.ndarray]]:
    """Integer-valued floats: their auto-scaled sums are exact, so results compare with ==."""
    rng = np.random.default_rng(7)
    return [[rng.integers(-100, 100, size).astype(np.float32) for _ in range(calls)] for _ in range(workers)]


def allreduce_call(in_place: bool):  # noqa: ANN201
    """run_group's call k: an allreduce of worker w's data[w][k], to a new array or in place."""

    def call(g: Group, k: int, x: np.ndarray) -> np.ndarray:
        if not in_place:
            return g.allreduce(x)
        y = x.copy()
        g.allreduce(y, out=y)
        return y

    return call


def run_group(endpoint: str, job: str, data: list[list[np.ndarray]], on_call=None, engine: str = "auto",
              in_place: bool = False, call=None, hosts: list[str] | None = None) -> list:  # noqa: ANN001
    """Every worker joins with failover and runs its calls (``call(group, k, x)``, default: an allreduce);
    returns (results or the error, moves). ``hosts``: each worker's address (default: all on 127.0.0.1)."""
    call = call or allreduce_call(in_place)
    workers = len(data)
    ports = free_udp_ports(workers)

    def work(w: int) -> tuple:
        host = hosts[w] if hosts else "127.0.0.1"
        answer = join(endpoint, job, w, workers, host=host, udp_port=ports[w], timeout=30)
        line = Failover(endpoint, job, 0, w, answer["token"], after=AFTER, heartbeat=HEARTBEAT_SECONDS)
        results: list = []
        with Group.from_answer(answer, bind=(host, ports[w]), timeout=60, engine=engine,
                               failover=line) as g:
            for k, x in enumerate(data[w]):
                if on_call is not None:
                    on_call(w, k, g)
                try:
                    results.append(call(g, k, x))
                except GroupFailed as e:
                    results.append(e)
                    break
            return answer, results, g.moves

    return run_threads(work, workers, timeout=120)


def assert_exact(data: list[list[np.ndarray]], outcomes: list) -> None:
    expected = [np.sum([d[k] for d in data], axis=0) for k in range(len(data[0]))]
    for _, results, _ in outcomes:
        assert len(results) == len(expected)
        for k, r in enumerate(results):
            assert not isinstance(r, Exception), r
            assert np.array_equal(r, expected[k]), k


def ps_processes(count: int):
    """``count`` software aggregator processes, (process, ready line) each; stopped afterwards
    unless a test killed them."""
    procs = [start_aggregator() for _ in range(count)]
    yield procs
    for proc, _ in procs:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(10)


@pytest.fixture
def one_ps():
    yield from ps_processes(1)


@pytest.fixture
def two_ps():
    yield from ps_processes(2)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("engine", ["native", "numpy"])
def test_killed_ps_mid_run_moves_the_group_and_every_result_is_exact(two_ps, tmp_path, engine):
    (p0, r0), (p1, r1) = two_ps
    running = Running(ps_topology(r0, r1), tmp_path / "ctl.sqlite", check_timeout=CHECK)
    try:
        data = inputs(calls=30, workers=3, size=20_000)
        first = {}

        def kill_at_call_5(w: int, k: int, g: Group) -> None:
            if w == 0 and k == 5:  # the PS that serves the group, SIGKILLed between two calls of worker 0
                first["port"] = g.aggregators[0].port
                proc = p0 if r0["data"].endswith(f":{first['port']}") else p1
                os.kill(proc.pid, signal.SIGKILL)

        start = time.monotonic()
        outcomes = run_group(running.endpoint, "killed-ps", data, kill_at_call_5, engine=engine)
        print(f"killed PS ({engine}): 30 calls of 3 workers in {time.monotonic() - start:.1f} s, "
              f"failover_after {AFTER} s")
        assert_exact(data, outcomes)
        assert all(moves == 1 for _, _, moves in outcomes)
        killed, other = (r0, r1) if r0["data"].endswith(f":{first['port']}") else (r1, r0)
        status = running.ctl.status()
        job = next(j for j in status["jobs"] if j["job"] == "killed-ps")
        assert job["aggregator"] == other["data"]
        down = [a for a in status["aggregators"] if a["state"] == "down"]
        assert [a["aggregator"] for a in down] == [killed["control"]]
        assert f"did not answer 'ping' within {CHECK:g} s" in down[0]["reason"]
    finally:
        running.stop()


class DyingAggregator(SoftwareAggregator):
    """The real software aggregator (numpy engine), made to die at an exact packet: when it emits
    the RESULT of psn ``at``, it sends it to the workers in ``deliver_to`` only, and stops
    serving (its data and control sockets close: to the controller it is dead)."""

    def __init__(self, at: int, deliver_to: set[int]) -> None:
        super().__init__(listen=("127.0.0.1", 0), control="tcp://127.0.0.1:*", engine="numpy", offload=False,
                         max_lanes=LANES)  # the psns below count 64-lane packets
        self.at, self.deliver_to = at, deliver_to
        self.dead = threading.Event()

    def send(self, out) -> None:
        if self.dead.is_set():
            return
        hdr = out.packets["hdr"]
        last = np.flatnonzero(hdr["psn"] == self.at)
        if last.size:
            keep = [i for i in range(len(out)) if i not in set(last) or hdr["worker"][i] in self.deliver_to]
            rows = np.array(keep, dtype=np.int64)
            if rows.size:
                self.socket.send_batch(out.packets, out.dest[rows], rows)
            self.dead.set()
            self.stop()
            return
        super().send(out)

    def pump(self, max_batches: int = 64) -> int:
        if self.dead.is_set():  # nothing reaches the engine once dead
            self.socket.recv_packets()
            return 0
        return super().pump(max_batches)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case, deliver_to, redo_call", [
    ("before the last RESULT of call 2", set(), 2),  # nobody completes call 2
    ("during it: worker 0 gets it, worker 1 does not", {0}, 2),  # worker 0 is in call 3 already
    ("just after it: both get it", {0, 1}, 3),  # both completed call 2, both stuck in call 3
])
@pytest.mark.parametrize("in_place", [False, True])
def test_the_group_agrees_on_the_call_to_redo_around_the_last_result(tmp_path, case, deliver_to, redo_call,
                                                                     in_place):
    size = 50 * LANES  # 50 packets: with auto scale, a call is one MAX packet and 50 SUM packets
    last_psn_of_call_2 = 3 * 51 - 1
    dying = DyingAggregator(at=last_psn_of_call_2, deliver_to=deliver_to)
    thread = threading.Thread(target=dying.serve)
    thread.start()
    backup, backup_ready = start_aggregator(["--max-lanes", str(LANES)])
    try:
        host, port = dying.address
        first = {"data": f"{host}:{port}", "control": dying.control_endpoint}
        # job id 1 is the first one handed out: it starts at PS 1 mod 2, the dying one
        running = Running(ps_topology(backup_ready, first), tmp_path / "ctl.sqlite", check_timeout=CHECK)
        try:
            data = inputs(calls=6, workers=2, size=size)
            reports: list[tuple[int, int]] = []
            real_report = Failover.report

            def spy(self, job_id: int, generation: int, call: int) -> dict:
                reports.append((self.worker, call))
                return real_report(self, job_id, generation, call)

            Failover.report = spy
            try:
                outcomes = run_group(running.endpoint, "race", data, in_place=in_place)
            finally:
                Failover.report = real_report
            assert dying.dead.is_set(), case
            assert_exact(data, outcomes)
            assert all(moves == 1 for _, _, moves in outcomes)
            assert min(call for _, call in reports) == redo_call, (case, reports)
            if deliver_to == {0}:
                assert {(0, 3), (1, 2)} <= set(reports)
        finally:
            running.stop()
    finally:
        dying.stop()
        thread.join(10)
        backup.terminate()
        backup.wait(10)


@pytest.mark.timeout(120)
def test_with_no_aggregator_left_the_group_fails_with_the_reason(one_ps, tmp_path):
    [(proc, ready)] = one_ps
    running = Running(ps_topology(ready), tmp_path / "ctl.sqlite", check_timeout=CHECK)
    try:
        data = inputs(calls=10, workers=2, size=5000)

        def kill(w: int, k: int, g: Group) -> None:
            if w == 0 and k == 3:
                os.kill(proc.pid, signal.SIGKILL)

        start = time.monotonic()
        outcomes = run_group(running.endpoint, "alone", data, kill)
        took = time.monotonic() - start
        for _, results, _ in outcomes:
            error = results[-1]
            assert isinstance(error, GroupFailed) and error.dead == []
            assert "no aggregator left" in str(error) and "ping" in str(error)
            assert error.current is not None and len(results) in (4, 5)
            expected = np.sum([d[3] for d in data], axis=0)
            if len(results) == 5:  # completed call 3 before the kill reached it
                assert np.array_equal(results[3], expected) and len(error.redo) in (0, 1)
        assert took < 30  # AFTER + the check, not the 60 s timeout
        print(f"no aggregator left: GroupFailed after {took:.1f} s of a 10-call run")
        assert running.ctl.status()["jobs"] == []  # the allocation on the dead PS is gone
    finally:
        running.stop()


@pytest.mark.timeout(120)
def test_a_dead_worker_is_named_to_its_peers_and_its_slots_are_freed(one_ps, tmp_path):
    [(_, ready)] = one_ps
    running = Running(ps_topology(ready), tmp_path / "ctl.sqlite")
    try:
        data = inputs(calls=8, workers=3, size=5000)

        class Died(Exception):
            pass

        def die(w: int, k: int, g: Group) -> None:
            if w == 2 and k == 4:  # worker 2 stops: no more packets, no more heartbeats
                g.failover.close()
                raise Died()

        start = time.monotonic()
        outcomes = run_group(running.endpoint, "mortal", data, die)
        took = time.monotonic() - start
    finally:
        status = running.ctl.status()
        running.stop()
    assert isinstance(outcomes[2], Died)
    for _, results, _ in outcomes[:2]:
        assert len(results) == 5 and isinstance(results[4], GroupFailed), results[-1]
        assert results[4].dead == [2] and "worker 2 (no heartbeat)" in str(results[4])
        assert "slots freed" in str(results[4])
    assert status["jobs"] == [] and status["pending"] == []
    assert took < 20  # AFTER + 3 missed heartbeats, not the 60 s timeout
    print(f"dead worker: its peers' error after {took:.1f} s (failover_after {AFTER} s, heartbeat "
          f"{HEARTBEAT_SECONDS:g} s)")


@pytest.mark.timeout(60)
def test_a_slow_peer_is_waited_for_not_declared_dead(two_ps, tmp_path):
    """Silence while a live peer is late (a checkpoint, a slow batch) is no failure: the group
    waits for it, and nothing moves."""
    (_, r0), (_, r1) = two_ps
    running = Running(ps_topology(r0, r1), tmp_path / "ctl.sqlite")
    try:
        data = inputs(calls=4, workers=2, size=5000)

        def late(w: int, k: int, g: Group) -> None:
            if w == 1 and k == 2:
                time.sleep(4 * AFTER + 1.0)  # heartbeats go on meanwhile

        outcomes = run_group(running.endpoint, "slow", data, late)
        assert_exact(data, outcomes)
        assert all(moves == 0 for _, _, moves in outcomes)
    finally:
        running.stop()


@pytest.mark.timeout(60)
def test_a_call_that_times_out_while_the_controller_waits_names_the_peers_it_waited_for(one_ps, tmp_path):
    """Worker 1 is alive (its heartbeats go on) but makes no call: worker 0's aggregator is silent, the
    controller answers "wait" (a late peer is no failure), and worker 0's call ends at its timeout. The error
    says for whom the controller waited, which is why no move came."""
    ((_, r0),) = one_ps
    running = Running(ps_topology(r0), tmp_path / "ctl.sqlite")
    try:
        ports = free_udp_ports(2)
        idle_until = threading.Event()

        def work(w: int) -> BaseException | None:
            answer = join(running.endpoint, "late", w, 2, host="127.0.0.1", udp_port=ports[w], timeout=30)
            line = Failover(running.endpoint, "late", 0, w, answer["token"], after=AFTER,
                            heartbeat=HEARTBEAT_SECONDS)
            with Group.from_answer(answer, bind=("127.0.0.1", ports[w]), timeout=4, failover=line) as g:
                if w == 1:
                    idle_until.wait(30)  # alive, beating, and calling nothing
                    return None
                try:
                    g.allreduce(np.ones(1000, np.float32))
                except AggregatorUnreachable as e:
                    return e
                finally:
                    idle_until.set()
            return None

        error, idle = run_threads(work, 2, timeout=60)
        assert idle is None
        assert isinstance(error, AggregatorUnreachable), error
        assert "the controller was waiting for worker(s) [1]" in "\n".join(getattr(error, "__notes__", [])), error
    finally:
        running.stop()


@pytest.mark.timeout(60)
def test_a_call_that_times_out_with_the_controller_down_says_so(one_ps, tmp_path):
    """The controller is gone when worker 0's aggregator falls silent (worker 1 makes no call): the silence
    report gets no answer, and the call's timeout error says that is why nothing moved."""
    ((_, r0),) = one_ps
    running = Running(ps_topology(r0), tmp_path / "ctl.sqlite")
    ports = free_udp_ports(2)
    answers = run_threads(lambda w: join(running.endpoint, "orphan", w, 2, host="127.0.0.1", udp_port=ports[w],
                                         timeout=30), 2)
    running.stop()
    line = Failover(running.endpoint, "orphan", 0, 0, answers[0]["token"], after=AFTER, heartbeat=HEARTBEAT_SECONDS)
    with Group.from_answer(answers[0], bind=("127.0.0.1", ports[0]), timeout=4, failover=line) as g:
        with pytest.raises(AggregatorUnreachable) as caught:
            g.allreduce(np.ones(1000, np.float32))
    assert "the controller did not answer the silence report" in "\n".join(caught.value.__notes__)


@pytest.mark.timeout(60)
def test_stuck_reports_are_checked(two_ps, tmp_path):
    (_, r0), (_, r1) = two_ps
    running = Running(ps_topology(r0, r1), tmp_path / "ctl.sqlite")
    try:
        ports = free_udp_ports(2)
        answers = run_threads(lambda w: join(running.endpoint, "checked", w, 2, host="127.0.0.1",
                                             udp_port=ports[w], timeout=30), 2)
        generation, job_id = answers[0]["generation"], answers[0]["job_id"]
        token = {a["worker"]: a["token"] for a in answers}
        for fields, error in [
            ({"job_id": job_id, "generation": generation + 1, "call": 0}, "no allocation of job id"),
            ({"job_id": job_id + 1, "generation": generation, "call": 0}, "no allocation of job id"),
            ({"generation": generation, "call": 0}, "job_id"),
            ({"job_id": job_id, "generation": generation, "call": -1}, "call -1 outside"),
            ({"job_id": job_id, "generation": generation, "call": 0, "aggregator": "fpga"},
             "aggregator must be one of"),
            ({"job_id": job_id, "generation": generation, "call": 0, "token": token[1]}, "no worker 0 with this token"),
        ]:
            with pytest.raises(Exception, match=error):
                request(running.endpoint, "stuck", **{"job": "checked", "group": 0, "worker": 0, "token": token[0],
                                                      **fields})
        request(running.endpoint, "alive", job="checked", group=0, worker=1, token=token[1], every=5.0)
        reply = request(running.endpoint, "stuck", job="checked", group=0, worker=0, token=token[0],
                        job_id=job_id, generation=generation, call=0)
        assert reply["state"] == "wait" and reply["waiting_for"] == [1]  # worker 1 beats: it is only late
        with pytest.raises(Exception, match="every 0 outside"):
            request(running.endpoint, "alive", job="checked", group=0, worker=1, token=token[1], every=0)
        with pytest.raises(Exception, match="not running"):  # no state for a group that does not run
            request(running.endpoint, "alive", job="made-up", group=0, worker=1, token=token[1], every=1)
    finally:
        running.stop()


KINDS = ("allreduce", "reduce_scatter", "allgather")


def mixed_call(g: Group, k: int, x: np.ndarray) -> np.ndarray:
    """Every kind of call in turn: call k is KINDS[k % 3] of worker w's data[w][k]."""
    kind = KINDS[k % 3]
    if kind == "allreduce":
        return g.allreduce(x)
    if kind == "reduce_scatter":
        return g.reduce_scatter(x)
    return g.allgather(x)


def run_mixed(endpoint: str, job: str, data: list[list[np.ndarray]], on_call=None, engine: str = "auto") -> list:
    return run_group(endpoint, job, data, on_call, engine, call=mixed_call)


def assert_mixed_exact(data: list[list[np.ndarray]], outcomes: list) -> None:
    workers = len(data)
    for w, (_, results, _) in enumerate(outcomes):
        assert len(results) == len(data[0])
        for k, r in enumerate(results):
            assert not isinstance(r, Exception), (w, k, r)
            total = np.sum([d[k] for d in data], axis=0)
            kind = KINDS[k % 3]
            if kind == "allreduce":
                assert np.array_equal(r, total), (w, k)
            elif kind == "reduce_scatter":
                assert np.array_equal(r, total.reshape(workers, -1)[w]), (w, k)
            else:
                assert np.array_equal(r, np.stack([d[k] for d in data])), (w, k)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("engine", ["native", "numpy"])
@pytest.mark.parametrize("signal_name", ["SIGKILL", "SIGSTOP"])
@pytest.mark.parametrize("kill_at", [3, 4, 5])
def test_every_kind_of_call_survives_its_aggregator(two_ps, tmp_path, engine, signal_name, kill_at):
    """The PS that serves the group is SIGKILLed (or SIGSTOPped: it hangs) just before worker 0's call
    ``kill_at``: an allreduce, a reduce_scatter or an all_gather is the one interrupted. The group moves
    to the other PS, every worker redoes what the group agrees on, and every result is exact (issue 36:
    an all_gather or reduce_scatter that lost its aggregator hung or failed)."""
    (p0, r0), (p1, r1) = two_ps
    running = Running(ps_topology(r0, r1), tmp_path / "ctl.sqlite", check_timeout=CHECK)
    stopped = []
    try:
        data = inputs(calls=9, workers=3, size=3 * 4000)

        def strike(w: int, k: int, g: Group) -> None:
            if w == 0 and k == kill_at:
                port = g.aggregators[0].port
                proc = p0 if r0["data"].endswith(f":{port}") else p1
                os.kill(proc.pid, getattr(signal, signal_name))
                stopped.append(proc)

        outcomes = run_mixed(running.endpoint, f"mixed-{signal_name}-{kill_at}", data, strike, engine=engine)
        assert_mixed_exact(data, outcomes)
        assert all(moves == 1 for _, _, moves in outcomes)
    finally:
        for proc in stopped:
            if proc.poll() is None:  # a stopped one: let the fixture end it
                os.kill(proc.pid, signal.SIGCONT)
        running.stop()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("engine", ["native", "numpy"])
def test_every_kind_of_call_with_no_aggregator_left_fails_with_its_replay_record(one_ps, tmp_path, engine):
    """The only PS killed during an all_gather: GroupFailed carries the interrupted call's replay record
    (its kind and input), and the calls to redo, for another transport to finish them (the torch
    backend: gloo)."""
    [(proc, ready)] = one_ps
    running = Running(ps_topology(ready), tmp_path / "ctl.sqlite", check_timeout=CHECK)
    try:
        data = inputs(calls=6, workers=2, size=2 * 3000)

        def kill(w: int, k: int, g: Group) -> None:
            if w == 0 and k == 2:
                os.kill(proc.pid, signal.SIGKILL)

        outcomes = run_mixed(running.endpoint, "mixed-alone", data, kill, engine=engine)
        for w, (_, results, _) in enumerate(outcomes):
            error = results[-1]
            assert isinstance(error, GroupFailed) and error.dead == [], error
            assert error.current is not None
            interrupted = len(results) - 1
            assert error.current.kind == {0: "reduce", 1: "scatter", 2: "gather"}[interrupted % 3]
            expected = data[w][interrupted].reshape(-1)
            got = error.current.input if error.current.kind != "gather" else error.current.input.view(np.float32)
            assert np.array_equal(got, expected)
    finally:
        running.stop()
