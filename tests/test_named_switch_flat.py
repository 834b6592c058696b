"""A group whose servers all sit on one named switch aggregates flat on that switch (docs/control.md, "Several
switches"), as a group does on the topology's one "switch": its entries written over that switch's session, its
slots from that switch's allocator, a PS when the switch is unreachable, out of slots or dies mid-job, the same
teardown, a restart that restores it from the store and reconciles the switch, and `status`, `stats` and
`metrics` naming it "switch:NAME".

Real parts as in tests/test_controller_chips.py: the controller service, workers joining over ZeroMQ and
allreducing over UDP, software aggregator processes; only the P4Runtime session of switch s1 is a stand-in
(``ProgramOnAggregator``: the admission and result_rewrite entries the controller writes become the job of a
software aggregator listening on s1's aggregation address). s2 and s3 are unreachable (no P4Runtime server at
their addresses). The topology is tests/test_topology_switches.py's: h1 h2 on s1, h3 h4 on s2, the fabric rack1
on s1, rack2 on s2, the spine s3.
"""

from __future__ import annotations

import os
import random
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from passing import Group, native
from passing.control import ControllerError, join, leave, new_job_secret
from passing.launch import free_udp_ports
from passing.stripes import bind_streams, sized
from passing_controller import admission, result_rewrite, top
from passing_controller import switch as switch_link
from passing_controller.topology import Topology
from tests.cluster import run_threads, start_aggregator
from tests.keys import ask
from tests.test_controller_chips import ProgramOnAggregator
from tests.test_controller_ps_fallback import Running, closed_port
from tests.test_failover import CHECK, assert_exact, inputs, run_group
from tests.test_topology_switches import three_switches

S1_SLOTS = 64
RACK1 = ["127.0.0.1", "127.0.0.2"]  # h1, h2: on s1, at its ports 1 and 2
RACK2 = ["127.0.0.3", "127.0.0.4"]  # h3, h4: on s2


@pytest.fixture
def s1(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[dict[str, Any], ProgramOnAggregator, Any]]:
    """The topology (s1 reachable through the stand-in, s2 and s3 not), s1's stand-in and its data plane's
    process: a software aggregator on s1's aggregation address, PASSING port."""
    address = f"127.{random.randrange(1, 255)}.{random.randrange(1, 255)}.{random.randrange(2, 255)}"
    proc, ready = start_aggregator(["--listen", f"{address}:9877"], host=address)
    raw = three_switches((closed_port(), closed_port(), closed_port()), ip="127.0.0.{}")
    raw["switches"]["s1"].update(aggregation_ip=address, slots=S1_SLOTS)
    program = ProgramOnAggregator(ready["control"], lanes=64, hosts=raw["hosts"])
    s1_address, real = raw["switches"]["s1"]["p4runtime"], switch_link.connect
    monkeypatch.setattr(switch_link, "connect", lambda address, *args, **kwargs:
                        program if address == s1_address else real(address, *args, **kwargs))
    yield raw, program, proc
    if proc.poll() is None:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def ps() -> Iterator[dict[str, str]]:
    proc, ready = start_aggregator()
    yield {"data": ready["data"], "control": ready["control"]}
    proc.terminate()
    proc.wait(10)


def group(endpoint: str, job: str, hosts: list[str], data: list[np.ndarray], **fields: Any) -> list[tuple]:
    """Every worker of a group on ``hosts`` joins (``fields``: the join's options), allreduces its ``data`` and
    leaves: (answer, result) each."""
    ports = free_udp_ports(len(hosts))

    def work(w: int) -> tuple:
        answer = join(endpoint, job, w, len(hosts), host=hosts[w], udp_port=ports[w], timeout=30, **fields)
        try:
            with Group.from_answer(answer, bind=(hosts[w], ports[w]), timeout=10) as g:
                return answer, g.allreduce(data[w])
        finally:
            leave(endpoint, job, 0, w, answer["token"])

    out = run_threads(work, len(hosts))
    for r in out:
        assert not isinstance(r, Exception), r
    return out


def entries(program: ProgramOnAggregator, job: int) -> set[tuple]:
    """The stand-in's admission and result_rewrite entries of ``job``, and its multicast group."""
    return {e for e in program.entries if (e[0] == "table" and e[1] in (admission.TABLE, result_rewrite.TABLE)
                                           and dict(e[2])["job"] == job) or e[:2] == ("multicast", job + 1)}


@pytest.mark.timeout(120)
def test_a_group_of_one_racks_servers_runs_flat_on_its_switch_and_a_restart_keeps_it(s1, tmp_path: Path):
    """h1 and h2 (rack1, both on s1) are placed flat on s1: its entries at their ports, its slots from s1's
    own allocator, `status`/`stats`/`metrics` name "switch:s1". The controller restarts between two allreduces
    of the group: the group is restored from the store, s1 reconciled to the same entries, the second sum
    exact; the group's end removes them and frees s1's slots."""
    raw, program, _ = s1
    topo, store = Topology.from_dict(raw), tmp_path / "ctl.sqlite"
    running = [Running(topo, store)]
    ports = free_udp_ports(2)
    data = [np.arange(3000, dtype=np.float32) * (w + 1) - 50 for w in range(2)]
    seen: dict[str, Any] = {}

    def restart() -> None:
        status = ask(running[0].endpoint, "status")
        (job,) = status["jobs"]
        seen.update(job=job, before=entries(program, job["job_id"]), stats=ask(running[0].endpoint, "stats"),
                    metrics=ask(running[0].endpoint, "metrics"), status=status)
        running[0].stop()
        running[0] = Running(topo, store)
        seen.update(after=ask(running[0].endpoint, "status"), reconciled=entries(program, job["job_id"]))

    barrier = threading.Barrier(2)

    def work(w: int) -> tuple:
        answer = join(running[0].endpoint, "rack1-flat", w, 2, host=RACK1[w], udp_port=ports[w], pool=8, timeout=30)
        with Group.from_answer(answer, bind=(RACK1[w], ports[w]), timeout=10) as g:
            first = g.allreduce(data[w])
            if barrier.wait() == 0:
                restart()
            barrier.wait()
            return answer, first, g.allreduce(2 * data[w])

    try:
        results = run_threads(work, 2)
        for r in results:
            assert not isinstance(r, Exception), r
            answer, first, second = r
            assert answer["mode"] == "switch" and answer["reason"] == "in-network aggregation on switch:s1", answer
            assert answer["aggregators"][0]["host"] == raw["switches"]["s1"]["aggregation_ip"], answer
            assert np.array_equal(first, sum(data)) and np.array_equal(second, 2 * sum(data))
        job = seen["job"]
        assert (job["mode"], job["control"], job["pool"], job["lanes"]) == ("switch", "switch:s1", 8, 64), job
        # its entries: admission of each worker at its host's port on s1, the rewrites, the multicast group
        admitted = sorted((dict(e[2])["worker"], dict(e[2])["ingress_port"], dict(e[4])["base"])
                          for e in seen["before"] if e[1] == admission.TABLE)
        assert admitted == [(0, 1, job["base"]), (1, 2, job["base"])], seen["before"]
        assert ("multicast", job["job_id"] + 1, ((1, 0), (2, 1))) in seen["before"]
        assert seen["reconciled"] == seen["before"]  # the restart wrote the same entries again
        (after,) = seen["after"]["jobs"]
        assert {k: after[k] for k in ("job_id", "base", "control", "generation")} == {
            k: job[k] for k in ("job_id", "base", "control", "generation")}, after
        assert seen["stats"][str(job["job_id"])]["received"] == 0  # s1's counters (the stand-in's read 0)
        (g,) = seen["metrics"]["groups"]
        assert (g["mode"], g["aggregator"]) == ("switch", "switch:s1"), g
        slots = {a["aggregator"]: a for a in seen["metrics"]["aggregators"]}
        assert slots["switch:s1"]["free_slots"] == S1_SLOTS - 8 and slots["switch:s2"]["free_slots"] == 1024
        assert seen["status"]["switches"]["s1"] == "connected"
        assert f"switch:s1 up 8/{S1_SLOTS} slots used" in top.render(seen["metrics"], None, "ctl")[1]  # passing-ctl top
        for answer, *_ in results:
            leave(running[0].endpoint, "rack1-flat", 0, answer["worker"], answer["token"])
        assert entries(program, job["job_id"]) == set() and program.jobs == {}
        slots = {a["aggregator"]: a for a in ask(running[0].endpoint, "metrics")["aggregators"]}
        assert slots["switch:s1"]["free_slots"] == S1_SLOTS
    finally:
        running[0].stop()


@pytest.mark.timeout(120)
def test_a_ps_takes_the_group_when_its_switch_cannot_and_says_why(s1, ps, tmp_path: Path):
    """Each reason a group of one switch's servers, or of several, lands on the PS: its switch unreachable
    (s2), out of slots (s1), the job asking for a PS, servers on two switches (no tree: the spine is down;
    with streams > 1 no tree either, as before); every sum exact."""
    raw, program, _ = s1
    raw["ps"] = [ps]
    running = Running(Topology.from_dict(raw), tmp_path / "ctl.sqlite")
    data = [np.full(500, w + 1, dtype=np.float32) for w in range(2)]
    try:
        cases = [(RACK2, {}, "switch:s2 unreachable: no P4Runtime server at"),
                 (RACK1, {"pool": S1_SLOTS + 1}, f"switch:s1 slots exhausted: no free range of {S1_SLOTS + 1} slots"),
                 (RACK1, {"aggregator": "ps"}, "a software aggregator (PS), as the job asked"),
                 ([RACK1[0], RACK2[0]], {}, "its workers sit on several switches (s1, s2)")]
        for k, (hosts, fields, why) in enumerate(cases):
            for answer, result in group(running.endpoint, f"fallback-{k}", hosts, data, **fields):
                assert answer["mode"] == "ps" and why in answer["reason"], (k, answer["reason"])
                assert answer["aggregators"][0]["port"] == int(ps["data"].rsplit(":", 1)[1])
                assert np.array_equal(result, np.full(500, 3, dtype=np.float32))
        # across racks with streams > 1: no tree (one stream per tree), one aggregator, a PS as before
        ports = free_udp_ports(2)
        answers = run_threads(lambda w: join(running.endpoint, "striped", w, 2, host=[RACK1[0], RACK2[0]][w],
                                             udp_port=ports[w], streams=2, timeout=30), 2)
        for answer in answers:
            assert answer["mode"] == "ps" and answer["streams"] == 2, answer
            assert "a group of 2 streams is placed on one aggregator" in answer["reason"], answer["reason"]
            assert "its workers sit on several switches" in answer["reason"], answer["reason"]
            leave(running.endpoint, "striped", 0, answer["worker"], answer["token"])
        assert program.jobs == {} and not [e for e in program.entries if e[1] == admission.TABLE]
        status = ask(running.endpoint, "status")
        down = {a["aggregator"]: a for a in status["aggregators"] if a["state"] == "down"}
        assert set(down) == {"switch:s2", "switch:s3"} and status["switches"]["s1"] == "connected", down
        # s1 serves its own hosts again once it has slots for them
        (answer, result), _ = group(running.endpoint, "back", RACK1, data)
        assert answer["mode"] == "switch" and np.array_equal(result, np.full(500, 3, dtype=np.float32))
    finally:
        running.stop()


@pytest.mark.timeout(60)
def test_without_a_ps_a_group_on_an_unreachable_switch_is_refused_with_the_reason(s1, tmp_path: Path):
    raw, _, _ = s1
    running = Running(Topology.from_dict(raw), tmp_path / "ctl.sqlite")
    try:
        outcomes = run_threads(lambda w: join(running.endpoint, "nowhere", w, 2, host=RACK2[w], udp_port=20000 + w,
                                              timeout=30), 2)
        for e in outcomes:
            assert isinstance(e, ControllerError), e
            assert "no aggregator can take the group: switch:s2 unreachable" in str(e), e
        assert ask(running.endpoint, "status")["jobs"] == []
    finally:
        running.stop()


@pytest.mark.timeout(120)
def test_a_named_switch_that_dies_mid_job_moves_its_flat_group_to_the_ps(s1, ps, tmp_path: Path):
    """s1 dies between two calls (its data plane killed, its P4Runtime session failing): the workers report
    the silence, the controller finds switch:s1 down (its counters cannot be read), moves the group to the PS
    and every result stays exact."""
    raw, program, plane = s1
    raw["ps"] = [ps]
    running = Running(Topology.from_dict(raw), tmp_path / "ctl.sqlite", check_timeout=CHECK)
    try:
        data = inputs(calls=12, workers=2, size=5000)

        def kill_s1_at_call_4(w: int, k: int, g: Group) -> None:
            if w == 0 and k == 4:
                program.dead = True
                os.kill(plane.pid, signal.SIGKILL)

        outcomes = run_group(running.endpoint, "s1-dies", data, kill_s1_at_call_4, hosts=RACK1)
        assert_exact(data, outcomes)
        for answer, _, moves in outcomes:
            assert answer["mode"] == "switch" and moves == 1, (answer, moves)
        status = ask(running.endpoint, "status")
        (job,) = status["jobs"]
        assert (job["mode"], job["control"]) == ("ps", ps["control"]), job
        s1_state = next(a for a in status["aggregators"] if a["aggregator"] == "switch:s1")
        assert s1_state["state"] == "down" and "switch is gone" in s1_state["reason"], s1_state
        slots = {a["aggregator"]: a for a in ask(running.endpoint, "metrics")["aggregators"]}
        assert slots["switch:s1"]["free_slots"] == S1_SLOTS  # the old allocation's slots are free
    finally:
        running.stop()


def test_a_store_of_groups_on_a_named_switch_the_topology_lost_or_rebuilt_is_refused(tmp_path: Path):
    """A flat group on switch:s1 in the store, and a topology without s1 or with s1 on another chip: the
    controller refuses to start and says which group and why (its workers' packets would go nowhere, or not
    parse there)."""
    from passing_controller.service import check_switch_lanes
    from passing_controller.state import State
    from passing_controller.store import Record, Store
    from passing_controller.topology import TopologyError

    store = Store(tmp_path / "ctl.sqlite")
    store.add(Record(3, "j", 0, "switch", 1, 0, 8, [], {"data": "10.0.9.1:9877", "lanes": 64, "control": "switch:s1"}))
    store.close()
    state = State(tmp_path / "ctl.sqlite", 0, [], {"switch:s1": 1024, "switch:s2": 1024, "switch:s3": 1024})
    try:
        assert state.allocator_for("switch:s1").free() == 1024 - 8  # its slots, on s1's own allocator
        check_switch_lanes(state, Topology.from_dict(three_switches()))  # the topology it was placed under
        rebuilt = three_switches()
        rebuilt.pop("fabric")  # (one tree's switches take one lane count)
        rebuilt["switches"]["s1"].update(chip="tofino2", lanes=32, lanes_override=True)  # rebuilt at 32 lanes
        with pytest.raises(TopologyError, match=r"topology's switch:s1 \(chip 'tofino2', 32 lanes\): j group 0 "
                                                r"\(64 lanes\)"):
            check_switch_lanes(state, Topology.from_dict(rebuilt))
        lost = three_switches()
        lost.pop("fabric")
        lost["switches"].pop("s1")
        lost["switches"]["s3"]["links"].pop("s1")
        lost["hosts"] = [h for h in lost["hosts"] if h["switch"] != "s1"]
        with pytest.raises(TopologyError, match=r"switches the topology does not name: j group 0 \(switch:s1\)"):
            check_switch_lanes(state, Topology.from_dict(lost))
    finally:
        state.close()


@pytest.mark.timeout(120)
@pytest.mark.skipif(not native.available(), reason="the native library is not built")
def test_a_group_of_two_streams_takes_two_ranges_of_its_named_switch(s1, tmp_path: Path):
    """streams = 2 on s1 (as on the one switch): a job id and a range of s1's slots per stream, each stream's
    admission at the workers' ports on s1 from their UDP port + s, and the sum exact through both."""
    raw, program, _ = s1
    running = Running(Topology.from_dict(raw), tmp_path / "ctl.sqlite")
    x = [np.arange(20_000, dtype=np.float32) * (w + 1) - 3 for w in range(2)]
    secret = new_job_secret()

    def work(w: int) -> tuple:
        socks = bind_streams(RACK1[w], 2)
        answer = join(running.endpoint, "striped-s1", w, 2, host=RACK1[w], udp_port=socks[0].address[1], pool=8,
                      secret=secret, streams=2, timeout=30)
        socks = sized(socks, int(answer["lanes"]))
        with Group.from_answer(answer, bind=socks[0], streams=2, stream_sockets=socks[1:], engine="native",
                               io="udp", timeout=30) as g:
            return answer, g.allreduce(x[w]), ask(running.endpoint, "status")

    try:
        results = run_threads(work, 2)
        for r in results:
            assert not isinstance(r, Exception), r
            answer, result, _ = r
            assert answer["mode"] == "switch" and answer["streams"] == 2, answer
            assert np.array_equal(result, x[0] + x[1])
        (job,) = results[0][2]["jobs"]
        assert job["control"] == "switch:s1" and len(job["stripes"]) == 1, job
        ids = [job["job_id"], job["stripes"][0]["job_id"]]
        assert sorted({job["base"], job["stripes"][0]["base"]}) == [0, 8]  # two ranges of s1's 64 slots
        assert sorted(program.jobs) == sorted(ids)  # a job of s1's data plane per stream
        for answer, *_ in results:
            leave(running.endpoint, "striped-s1", 0, answer["worker"], answer["token"])
        assert program.jobs == {} and all(entries(program, i) == set() for i in ids)
    finally:
        running.stop()
