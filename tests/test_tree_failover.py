"""Failover at either level of a tree across racks (docs/control.md, "Failover"; docs/reliability.md): the real
`passing-controller` with a fabric of two racks (tests/test_controller_tree.Services: a PS leaf per rack, a PS
root, and here a spare PS that no node names), worker threads on 127.x addresses with real sockets, heartbeats
and reports. A leaf or the root is SIGKILLed or SIGSTOPped while the group's allreduces run: every worker
reports silence, the controller checks every node of the tree at once, places the group again (the spare
takes the lost node's place; with none, one PS takes the whole group) under a new job id, and every worker
redoes the interrupted call there. Every result is exact, `status` shows the new tree, and nothing of the
old allocation is left at any node."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from passing import Group
from passing.aggregator.control_channel import ControlClient
from passing.control import HEARTBEAT_SECONDS, Failover, join, leave
from passing.errors import GroupFailed
from passing.launch import free_udp_ports
from tests.cluster import run_threads
from tests.keys import ask
from tests.test_controller_tree import Services, assert_freed, host_ip

AFTER = 0.5  # failover_after: silence this long starts a move
CALLS, STRIKE_AT = 12, 4  # the calls of each worker; worker 0 strikes as it starts this one
# The bound on one call that a move interrupts: AFTER of silence, the check of every node at once (the
# controller's --check-timeout, 2 s), the new placement (a ping and an add_job per node) and the meeting
# round; the rest is slack for a loaded 2-core machine (tests run two at a time).
BOUND = AFTER + 2.0 + 6.0


def inputs(workers: int, size: int = 20_000) -> list[list[np.ndarray]]:
    """Integer-valued floats: their auto-scaled sums are exact, so results compare with ==."""
    rng = np.random.default_rng(11)
    return [[rng.integers(-100, 100, size).astype(np.float32) for _ in range(CALLS)] for _ in range(workers)]


class Run:
    """A group of ``len(data)`` workers, worker w on rack w % 2, each making CALLS allreduces with failover;
    ``strike()`` runs (on a timer, so the calls are in flight) as worker 0 starts call STRIKE_AT. Worker 0 reads
    the controller's status and every PS's jobs once its calls are done, before anyone leaves."""

    def __init__(self, services: Services, job: str, data: list[list[np.ndarray]], strike: Callable[[], None],
                 call: Callable[[Group, np.ndarray], np.ndarray] = Group.allreduce) -> None:
        self.services, self.job, self.data, self.strike, self.call = services, job, data, strike, call
        self.first: dict = {}  # worker 0's join answer
        self.after: dict = {}  # the status, and the jobs each PS holds, once worker 0 is done
        self.done = threading.Barrier(len(data), timeout=120)

    def work(self, w: int) -> tuple:
        ip, workers = host_ip(w % 2, w // 2), len(self.data)
        endpoint = self.services.endpoint
        answer = join(endpoint, self.job, w, workers, host=ip, udp_port=self.ports[w], pool=8, timeout=30)
        if w == 0:
            self.first = answer
        line = Failover(endpoint, self.job, 0, w, answer["token"], after=AFTER, heartbeat=HEARTBEAT_SECONDS)
        try:
            return self._calls(w, ip, answer, line)
        except BaseException:
            self.done.abort()  # the others do not wait for this one at the barrier
            raise
        finally:
            leave(endpoint, self.job, 0, w, answer["token"], timeout=20)

    def _calls(self, w: int, ip: str, answer: dict, line: Failover) -> tuple:
        endpoint = self.services.endpoint
        results: list = []
        durations: list[float] = []
        with Group.from_answer(answer, bind=(ip, self.ports[w]), timeout=60, failover=line) as g:
            for k, x in enumerate(self.data[w]):
                if w == 0 and k == STRIKE_AT:
                    threading.Timer(0.002, self.strike).start()
                start = time.monotonic()
                try:
                    results.append(self.call(g, x))
                except GroupFailed as e:
                    results.append(e)
                    break
                durations.append(time.monotonic() - start)
            at = (g.state.worker, g.state.workers, g.state.servers)
            moves = g.moves
        self.done.wait()  # every worker's calls are done: the group is still placed
        if w == 0:
            self.after["status"] = ask(endpoint, "status")
            self.after["held"] = {r["control"]: set(ControlClient(r["control"]).request("stats")["jobs"])
                                  for r, proc in zip(self.services.ready, self.processes(), strict=True)
                                  if proc.poll() is None and not self.stopped(proc)}
        self.done.wait()
        return answer, results, moves, durations, at

    def processes(self) -> list:
        return [*self.services.procs[:3], *self.services.spare_procs]  # in ``ready``'s order

    def stopped(self, proc: object) -> bool:
        return proc in getattr(self, "stopped_procs", ())

    def run(self) -> list:
        self.ports = free_udp_ports(len(self.data))
        start = time.monotonic()
        outcomes = run_threads(self.work, len(self.data), timeout=150)
        self.seconds = time.monotonic() - start
        return outcomes


def check_exact(data: list[list[np.ndarray]], outcomes: list, expect: Callable | None = None) -> float:
    """Every worker's every result exact (``expect(w, k)``, default: the sum of call k); every worker moved
    once. Returns the longest call."""
    sums = [np.sum([d[k] for d in data], axis=0) for k in range(CALLS)]
    expect = expect or (lambda w, k: sums[k])
    for w, outcome in enumerate(outcomes):
        assert isinstance(outcome, tuple), f"worker {w}: {outcome!r}"
        _, results, moves, _, _ = outcome
        assert len(results) == CALLS, results[-1]
        for k, got in enumerate(results):
            assert isinstance(got, np.ndarray), f"worker {w} call {k}: {got!r}"
            assert np.array_equal(got, expect(w, k)), (w, k)
        assert moves == 1, (w, moves)
    return max(max(o[3]) for o in outcomes)


def the_job(run: Run) -> dict:
    (job,) = [j for j in run.after["status"]["jobs"] if j["job"] == run.job]
    return job


def strike_with(services: Services, index: int, sig: signal.Signals, run_box: list) -> Callable[[], None]:
    """Send ``sig`` to the PS of ``ready[index]``; a stopped one is noted (it answers nothing)."""
    def strike() -> None:
        proc = run_box[0].processes()[index]
        if sig == signal.SIGSTOP:
            run_box[0].stopped_procs = [proc]
        os.kill(proc.pid, sig)
    return strike


def run_struck(tmp_path: Path, spares: int, index: int, sig: signal.Signals, job: str, workers: int = 4,
               call: Callable[[Group, np.ndarray], np.ndarray] = Group.allreduce) -> tuple[Services, Run, list]:
    services = Services(tmp_path, spares=spares)
    box: list = []
    run = Run(services, job, inputs(workers), strike_with(services, index, sig, box), call)
    box.append(run)
    try:
        outcomes = run.run()
    except BaseException:
        services.stop()
        raise
    return services, run, outcomes


def finish(services: Services, index: int) -> None:
    """The struck PS ends (a stopped one is killed), then everything else."""
    proc = ([*services.procs[:3], *services.spare_procs])[index]
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    services.stop()


@pytest.mark.timeout(180)
# (make test runs the leaf's case; the root's, as the cases below, is CI's: each waits out a silence and a check)
@pytest.mark.parametrize("node, index", [("rack0", 0), pytest.param("spine", 2, marks=pytest.mark.slow)])
def test_a_node_killed_mid_allreduce_is_replaced_by_the_spare_and_every_result_is_exact(tmp_path, node, index):
    services, run, outcomes = run_struck(tmp_path, 1, index, signal.SIGKILL, f"kill-{node}")
    try:
        longest = check_exact(run.data, outcomes)
        print(f"{node} SIGKILLed: {CALLS} calls of 4 workers in {run.seconds:.1f} s, the interrupted call "
              f"{longest:.1f} s (failover_after {AFTER} s)")
        assert longest <= BOUND
        ready, spare = services.ready, services.ready[3]
        job = the_job(run)
        assert job["mode"] == "tree" and job["job_id"] != run.first["job_id"]
        data = {n["name"]: n["data"] for n in job["tree"]}
        assert data == {"rack0": ready[0]["data"], "rack1": ready[1]["data"], "spine": ready[2]["data"],
                        node: spare["data"]}, job["tree"]
        assert [n["workers"] for n in job["tree"][:2]] == [[0, 2], [1, 3]]
        for w, (answer, _, _, _, at) in enumerate(outcomes):  # the same leaf index as before the move
            assert at == (w // 2, 2, 4) and (answer["worker"], answer["workers"], answer["servers"]) == at
        # the old allocation is gone from every live node, the new one held at each of the tree's nodes
        new = str(job["job_id"])
        in_tree = {n["control"] for n in job["tree"]}
        for control, held in run.after["held"].items():
            assert held == ({new} if control in in_tree else set()), (control, held)
        states = {a["aggregator"]: a for a in run.after["status"]["aggregators"]}
        assert states[ready[index]["control"]]["state"] == "down"
        assert "ping" in states[ready[index]["control"]]["reason"]
        assert_freed([r for k, r in enumerate(ready) if k != index])
        assert ask(services.endpoint, "status")["jobs"] == []
        used = {a["aggregator"]: a["slots"] - a["free_slots"] for a in ask(services.endpoint, "metrics")["aggregators"]}
        assert set(used.values()) == {0}, used  # the dead node's slots too
    finally:
        finish(services, index)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_silent_leaf_with_no_spare_moves_the_group_to_one_ps(tmp_path):
    """A SIGSTOPped leaf (it answers nothing, not even the check) and no spare: the tree cannot be placed
    again, and the group of 4 (at most 32) runs on the next PS as a flat group, each worker with its index
    in the group and every result exact."""
    services, run, outcomes = run_struck(tmp_path, 0, 0, signal.SIGSTOP, "stop-leaf")
    try:
        longest = check_exact(run.data, outcomes)
        print(f"rack0 SIGSTOPped, no spare: {CALLS} calls of 4 workers in {run.seconds:.1f} s, the interrupted "
              f"call {longest:.1f} s")
        assert longest <= BOUND
        job = the_job(run)
        assert job["mode"] == "ps" and "tree" not in job and job["aggregator"] != services.ready[0]["data"]
        assert job["job_id"] != run.first["job_id"]
        for w, (_, _, _, _, at) in enumerate(outcomes):
            assert at == (w, 4, 4), (w, at)
        data_of = {r["control"]: r["data"] for r in services.ready}
        for control, held in run.after["held"].items():  # the stopped leaf is not asked
            assert held == ({str(job["job_id"])} if data_of[control] == job["aggregator"] else set()), (control, held)
    finally:
        finish(services, 0)


@pytest.mark.slow  # 40 worker threads with heartbeats
@pytest.mark.timeout(180)
def test_a_tree_of_more_than_32_with_no_spare_ends_with_the_reason(tmp_path):
    """40 servers (20 per rack), the root SIGKILLed and no spare: the tree cannot be placed again and no one
    aggregator takes 40, so every worker gets GroupFailed naming the root and why, within the bound, and
    every slot of the old allocation is free."""
    workers = 40
    services = Services(tmp_path)
    ports = free_udp_ports(workers)
    data = [np.arange(64, dtype=np.int32) * (w + 1) for w in range(workers)]
    struck = threading.Event()

    def work(w: int) -> object:
        ip = host_ip(w % 2, w // 2)
        answer = join(services.endpoint, "wide", w, workers, host=ip, udp_port=ports[w], pool=4, timeout=60)
        line = Failover(services.endpoint, "wide", 0, w, answer["token"], after=AFTER, heartbeat=HEARTBEAT_SECONDS)
        with Group.from_answer(answer, bind=(ip, ports[w]), timeout=60, failover=line) as g:
            first = g.allreduce(data[w])
            if w == 0:
                os.kill(services.procs[2].pid, signal.SIGKILL)
                struck.set()
            assert struck.wait(30)
            start = time.monotonic()
            try:
                g.allreduce(data[w])
            except GroupFailed as e:
                return first, e, time.monotonic() - start
            return first, None, time.monotonic() - start

    try:
        outcomes = run_threads(work, workers, timeout=150)
        flat = np.sum(data, axis=0)
        for w, outcome in enumerate(outcomes):
            assert isinstance(outcome, tuple), f"worker {w}: {outcome!r}"
            first, error, seconds = outcome
            assert np.array_equal(first, flat)
            assert isinstance(error, GroupFailed), (w, error)
            assert "no aggregator left" in str(error) and f"PS {services.ready[2]['control']}" in str(error), error
            assert "a group on one aggregator takes at most 32" in str(error) and "no spare PS" in str(error), error
            assert seconds <= BOUND, seconds
        print(f"40 servers, root killed, no spare: GroupFailed in {max(o[2] for o in outcomes):.1f} s at most")
        status = ask(services.endpoint, "status")
        assert status["jobs"] == []
        used = {a["aggregator"]: a["slots"] - a["free_slots"] for a in ask(services.endpoint, "metrics")["aggregators"]}
        assert set(used.values()) == {0}, used
        assert_freed(services.ready[:2])
    finally:
        services.stop()


@pytest.mark.slow  # waits out the dead leaf's ping (--ps-timeout 2 s)
@pytest.mark.timeout(120)
def test_a_join_finds_a_leaf_down_and_places_the_tree_with_the_spare(tmp_path):
    """A rack's leaf that does not answer at the join: the spare takes its place, the group runs as a tree
    (not flat, as with no spare: test_controller_tree), and every worker gets the exact sum."""
    services = Services(tmp_path, spares=1)
    try:
        services.procs[0].terminate()
        services.procs[0].wait(10)
        ports = free_udp_ports(4)
        data = [np.full(100, w + 1, dtype=np.int32) for w in range(4)]

        def work(w: int) -> tuple[dict, np.ndarray]:
            ip = host_ip(w % 2, w // 2)
            answer = join(services.endpoint, "spare", w, 4, host=ip, udp_port=ports[w], pool=4, timeout=30)
            try:
                with Group.from_answer(answer, bind=(ip, ports[w]), timeout=10) as g:
                    return answer, g.allreduce(data[w])
            finally:
                leave(services.endpoint, "spare", 0, w, answer["token"])

        spare = services.ready[3]["data"]
        for w, result in enumerate(run_threads(work, 4)):
            assert isinstance(result, tuple), result
            answer, got = result
            assert answer["mode"] == "tree" and answer["leaf"] == f"rack{w % 2}", answer
            leaf = f"{answer['aggregators'][0]['host']}:{answer['aggregators'][0]['port']}"
            assert leaf == (spare if w % 2 == 0 else services.ready[1]["data"]), (w, leaf)
            assert np.array_equal(got, np.full(100, 10, dtype=np.int32))
        assert_freed(services.ready[1:])
    finally:
        services.stop()


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["reduce_scatter", "allgather"])
def test_sharded_calls_through_a_leaf_killed_with_no_spare_keep_the_callers_order(tmp_path, kind):
    """The racks interleave the group (workers 0, 2 under rack0; 1, 3 under rack1), so the tree numbers its
    servers 0, 2, 1, 3 and the flat PS it moves to (rack0's leaf SIGKILLed, no spare) 0, 1, 2, 3: every
    reduce_scatter block and every all_gather piece stays in the caller's order (the join's worker) through
    the move, and exact."""
    call = Group.reduce_scatter if kind == "reduce_scatter" else Group.allgather
    services, run, outcomes = run_struck(tmp_path, 0, 0, signal.SIGKILL, f"sharded-{kind}", call=call)
    try:
        def expect(w: int, k: int) -> np.ndarray:
            if kind == "allgather":
                return np.stack([d[k] for d in run.data])
            return np.split(np.sum([d[k] for d in run.data], axis=0), 4)[w]

        longest = check_exact(run.data, outcomes, expect)
        print(f"{kind}, rack0 SIGKILLed, no spare: the interrupted call {longest:.1f} s")
        assert longest <= BOUND
        assert the_job(run)["mode"] == "ps"
        assert [o[0]["number"] for o in outcomes] == [0, 2, 1, 3]  # the tree's numbers before the move
    finally:
        finish(services, 0)
