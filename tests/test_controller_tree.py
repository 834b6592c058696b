"""A group across racks placed by the controller (docs/control.md, "Trees across racks"): the real
`passing-controller` process with a fabric of two racks, three `passing-aggregator` processes (a PS leaf per
rack, a PS root), and workers that join it on loopback, each host its own 127.x address so that the fabric
places them: `passing-allreduce --controller` processes, and (more than 32 workers) threads joining through
passing.control and allreducing through Group.from_answer. Every result equals the flat sum over all
workers, and the group's end frees every node of the tree."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from cluster.local import free_tcp_port
from passing import Group
from passing.aggregator.control_channel import ControlClient
from passing.cli import worker_inputs
from passing.control import ControllerError, join, leave
from passing.launch import free_udp_ports
from passing.stripes import bind_streams, sized
from passing_controller.top import render
from passing_controller.topology import Topology
from tests.cluster import run_threads, start_aggregator, start_controller
from tests.keys import ask
from tests.zygote import CLI_PRELOAD, shared

ELEMENTS, SCALE = 2000, 1e6


def host_ip(rack: int, i: int) -> str:
    return f"127.0.{rack + 1}.{i + 1}"


class Services:
    """Three software aggregators (leaf0, leaf1, root: ``ready`` lines, ``procs``) and the controller
    (``endpoint``, procs[3]) on a fabric of two racks of 20 hosts; a PS that does not answer in 2 s is down.
    ``spares``: more PSs in the topology that no node of the fabric names (``spare_procs``, their ready lines
    ``ready[3:]``), which may take a node's place (docs/control.md, Failover)."""

    def __init__(self, workdir: Path, spares: int = 0) -> None:
        self.workdir, self.procs, self.ready, self.spare_procs = workdir, [], [], []
        for _ in range(spares):
            proc, line = start_aggregator()
            self.spare_procs.append(proc)
            self.ready.append(line)
        for _ in range(3):
            proc, line = start_aggregator()
            self.procs.append(proc)
            self.ready.append(line)
        self.ready = self.ready[spares:] + self.ready[:spares]  # leaf0, leaf1, root, then the spares
        self.topology = {"ps": [{"data": r["data"], "control": r["control"]} for r in self.ready], "fabric": [
            *({"name": f"rack{k}", "ps": self.ready[k]["data"], "hosts": [host_ip(k, i) for i in range(20)],
               "uplink": "spine"} for k in range(2)),
            {"name": "spine", "ps": self.ready[2]["data"]}]}
        self.endpoint = f"tcp://127.0.0.1:{free_tcp_port()}"
        self.procs.append(self._controller())

    def _controller(self) -> subprocess.Popen:
        return start_controller(self.topology, self.workdir, self.endpoint, ["--ps-timeout", "2"])[0]

    def restart_controller(self) -> None:
        """The controller stopped, and started again on its store."""
        self.procs[3].terminate()
        self.procs[3].wait(10)
        self.procs[3] = self._controller()

    def stop(self) -> None:
        for proc in self.procs + self.spare_procs:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


def allreduce_once(endpoint: str, job: str, data: list[np.ndarray]) -> list:
    """Worker w (of len(data), host_ip(w % 2, w // 2): the racks alternate) joins ``job``, allreduces data[w]
    once and leaves; per worker (the join's answer, the result), or what it raised."""
    ports = free_udp_ports(len(data))

    def work(w: int) -> tuple[dict, np.ndarray]:
        ip = host_ip(w % 2, w // 2)
        answer = join(endpoint, job, w, len(data), host=ip, udp_port=ports[w], pool=4, timeout=30)
        try:
            with Group.from_answer(answer, bind=(ip, ports[w]), timeout=10) as g:
                return answer, g.allreduce(data[w])
        finally:
            leave(endpoint, job, 0, w, answer["token"])

    return run_threads(work, len(data))


@pytest.fixture
def fabric(tmp_path):
    """(controller endpoint, [leaf0, leaf1, root] ready lines, the processes: the three PSs, the controller)."""
    services = Services(tmp_path)
    try:
        yield services.endpoint, services.ready, services
    finally:
        services.stop()


def assert_freed(ready: list[dict]) -> None:
    """Every node of the tree let go of the group once it ended."""
    deadline = time.monotonic() + 10
    while any(ControlClient(r["control"]).request("stats")["jobs"] for r in ready):
        assert time.monotonic() < deadline, "a node of the tree still holds the group's job"
        time.sleep(0.1)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", ["int32", "float32"])
def test_a_group_across_two_racks_is_placed_as_a_tree_and_sums_as_flat(fabric, tmp_path, dtype):
    endpoint, ready, _ = fabric
    workers = 4
    racks = [0, 1, 0, 1]  # the group's workers sit interleaved across the racks
    hosts = [host_ip(r, w) for w, r in enumerate(racks)]
    ports = free_udp_ports(workers)
    gate = tmp_path / "gate"
    procs = {}
    for w in range(workers):
        out = tmp_path / f"out-{w}.npy"
        procs[out] = shared(CLI_PRELOAD).popen(
            [sys.executable, "-m", "passing.cli", "allreduce", "--controller", endpoint, "--job-name", "across",
             "--worker", str(w), "--workers", str(workers), "--bind", f"{hosts[w]}:{ports[w]}", "--pool", "8",
             "--size", str(ELEMENTS), "--dtype", dtype, "--scale", str(SCALE), "--seed", "5", "--iterations", "2",
             "--gate", str(gate), "--timeout", "30", "--failover-after", "0", "--leave", "--out", str(out),
             "--no-check"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (jobs := ask(endpoint, "status")["jobs"]):  # the placed tree, while the workers wait
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs.values())
            time.sleep(0.1)
        (job,) = jobs
        assert job["mode"] == "tree" and job["workers"] == workers and job["aggregator"] == ready[2]["data"]
        tree = job["tree"]
        assert [(n["name"], n["role"], n["data"]) for n in tree] == [
            ("rack0", "leaf", ready[0]["data"]), ("rack1", "leaf", ready[1]["data"]),
            ("spine", "root", ready[2]["data"])]
        assert [n["workers"] for n in tree[:2]] == [[0, 2], [1, 3]] and [n["first"] for n in tree[:2]] == [0, 2]
        for r in ready:  # each node holds the job, with its role
            held = ControlClient(r["control"]).request("stats")["jobs"]
            assert list(held) == [str(job["job_id"])]
    finally:
        gate.touch()
    for proc in procs.values():
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
    inputs = [worker_inputs(5, w, ELEMENTS, dtype) for w in range(workers)]
    flat = np.sum(inputs, axis=0, dtype=np.float64)
    for out in procs:
        got = np.load(out)
        if dtype == "int32":
            assert np.array_equal(got, flat.astype(np.int32)), out.name
        else:  # the scaled sum: each of the 4 values rounds by at most half a step (docs/protocol.md)
            assert np.max(np.abs(got - flat)) <= workers * 0.5 / SCALE + 1e-5 * np.max(np.abs(flat)), out.name
    assert ask(endpoint, "status")["jobs"] == []
    assert_freed(ready)


@pytest.mark.timeout(180)
def test_more_than_32_workers_across_two_racks(fabric):
    """40 workers (20 per rack): more than one aggregator's bitmap takes; their answers name their leaf,
    their index there, the job's 40 servers and their number in it."""
    endpoint, ready, _ = fabric
    workers = 40
    ports = free_udp_ports(workers)
    data = [np.arange(64, dtype=np.int32) * (w + 1) - w for w in range(workers)]
    lock = threading.Lock()
    answers: dict[int, dict] = {}

    def work(w: int) -> np.ndarray:
        ip = host_ip(w % 2, w // 2)
        answer = join(endpoint, "wide", w, workers, host=ip, udp_port=ports[w], pool=4, timeout=60)
        with lock:
            answers[w] = answer
        try:
            with Group.from_answer(answer, bind=(ip, ports[w]), timeout=30) as g:
                return g.allreduce(data[w])
        finally:
            leave(endpoint, "wide", 0, w, answer["token"])

    results = run_threads(work, workers, timeout=120)
    flat = np.sum(data, axis=0)
    for w, got in enumerate(results):
        assert isinstance(got, np.ndarray) and np.array_equal(got, flat), (w, got)
    leaf_data = {f"rack{k}": ready[k]["data"] for k in range(2)}
    for w, a in answers.items():
        assert a["mode"] == "tree" and a["servers"] == workers and a["workers"] == 20 and a["owner_only"]
        assert a["leaf"] == f"rack{w % 2}" and a["worker"] == w // 2 and a["number"] == (w % 2) * 20 + w // 2
        assert a["numbers"] == [(v % 2) * 20 + v // 2 for v in range(workers)]  # every worker's, in group order
        assert f"{a['aggregators'][0]['host']}:{a['aggregators'][0]['port']}" == leaf_data[a["leaf"]]
    assert_freed(ready)
    assert ask(endpoint, "status")["jobs"] == []


@pytest.mark.timeout(60)
def test_a_group_under_one_rack_stays_flat_and_too_many_without_racks_are_refused(fabric):
    endpoint, ready, _ = fabric
    ports = free_udp_ports(2)

    def work(w: int) -> dict:
        return join(endpoint, "onerack", w, 2, host=host_ip(1, w), udp_port=ports[w], pool=4, timeout=30)

    answers = run_threads(work, 2)
    assert all(isinstance(a, dict) and a["mode"] == "ps" and "servers" not in a for a in answers), answers
    assert [a["worker"] for a in answers] == [0, 1]
    for w, a in enumerate(answers):
        leave(endpoint, "onerack", 0, w, a["token"])
    # 33 workers of one rack's hosts: no tree can take them, and one aggregator takes 32
    many = free_udp_ports(33)

    def crowd(w: int) -> object:
        return join(endpoint, "crowd", w, 33, host=host_ip(0, w % 20), udp_port=many[w], pool=4, timeout=30)

    refused = run_threads(crowd, 33)
    assert all(isinstance(e, ControllerError) and "at most 32" in str(e) for e in refused), refused[:2]
    assert_freed(ready)


@pytest.mark.timeout(60)
def test_a_tree_that_cannot_be_placed_falls_back_to_one_aggregator_and_says_why(fabric):
    """A leaf that does not answer: a group of two racks runs flat on another PS, the reason naming the
    leaf; every worker gets the flat sum."""
    endpoint, ready, services = fabric
    services.procs[0].terminate()
    services.procs[0].wait(10)
    data = [np.full(100, w + 1, dtype=np.int32) for w in range(4)]
    results = allreduce_once(endpoint, "fallback", data)
    for w, result in enumerate(results):
        assert isinstance(result, tuple), result
        answer, got = result
        assert answer["mode"] == "ps" and answer["worker"] == w and "servers" not in answer
        assert f"no tree across racks: leaf 'rack0' (PS {ready[0]['control']})" in answer["reason"], answer["reason"]
        assert f"{answer['aggregators'][0]['host']}:{answer['aggregators'][0]['port']}" != ready[0]["data"]
        assert np.array_equal(got, np.full(100, 10, dtype=np.int32))


@pytest.mark.timeout(60)
def test_a_group_of_several_streams_across_racks_runs_on_one_aggregator_and_says_why(fabric):
    """A tree carries one stream a group: a group of two streams across the racks is placed flat, every stream
    on one PS, the reason saying so; the sums are exact (docs/control.md, join's streams)."""
    endpoint, ready, _ = fabric
    data = [np.full(5000, w + 1, dtype=np.int32) for w in range(4)]

    def work(w: int) -> tuple[dict, np.ndarray]:
        ip = host_ip(w % 2, w // 2)
        socks = bind_streams(ip, 2)
        answer = join(endpoint, "striped", w, 4, host=ip, udp_port=socks[0].address[1], pool=4, timeout=30,
                      streams=2)
        socks = sized(socks, int(answer["lanes"]))
        try:
            with Group.from_answer(answer, bind=socks[0], stream_sockets=socks[1:], engine="native", io="udp",
                                   timeout=10) as g:
                return answer, g.allreduce(data[w])
        finally:
            leave(endpoint, "striped", 0, w, answer["token"])

    for result in run_threads(work, 4):
        assert isinstance(result, tuple), result
        answer, got = result
        assert answer["mode"] == "ps" and answer["streams"] == 2 and len(answer["stream_jobs"]) == 1, answer
        assert "no tree across racks: a group of 2 streams is placed on one aggregator" in answer["reason"]
        assert np.array_equal(got, np.full(5000, 10, dtype=np.int32))
    assert_freed(ready)


@pytest.mark.timeout(60)
def test_a_tree_survives_a_controller_restart_and_its_end_frees_every_node(fabric):
    """The stored tree: its slots at every node are held again after a restart, its workers' leaves end
    it there, and every node lets go of it."""
    endpoint, ready, services = fabric
    ports = free_udp_ports(4)
    restarted = threading.Event()

    def work(w: int) -> list[np.ndarray]:
        ip = host_ip(w % 2, w // 2)
        answer = join(endpoint, "restart", w, 4, host=ip, udp_port=ports[w], pool=8, timeout=30)
        with Group.from_answer(answer, bind=(ip, ports[w]), timeout=10) as g:
            out = [g.allreduce(np.full(50, w, dtype=np.int32))]
            assert restarted.wait(30)
            out.append(g.allreduce(np.full(50, 2 * w, dtype=np.int32)))
        leave(endpoint, "restart", 0, w, answer["token"], timeout=20)
        return out

    def job_id() -> int:
        return ask(endpoint, "status")["jobs"][0]["job_id"]

    def used() -> dict[str, int]:
        return {a["aggregator"]: a["slots"] - a["free_slots"] for a in ask(endpoint, "metrics")["aggregators"]}

    def restart() -> None:
        deadline = time.monotonic() + 30
        while not ask(endpoint, "status")["jobs"]:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert used() == {r["control"]: 8 for r in ready}
        lines = render(ask(endpoint, "metrics"), None, endpoint)  # passing-ctl top's frame
        assert "1 across racks" in lines[2] and "1 tree" in lines[2], lines[2]
        assert any(line.split()[:4] == ["restart", "0", str(job_id()), "tree"] for line in lines), lines
        services.restart_controller()
        (job,) = ask(endpoint, "status")["jobs"]
        assert job["mode"] == "tree" and [n["name"] for n in job["tree"]] == ["rack0", "rack1", "spine"]
        assert used() == {r["control"]: 8 for r in ready}  # held again at every node
        restarted.set()

    watcher = threading.Thread(target=restart)
    watcher.start()
    results = run_threads(work, 4)
    watcher.join(40)
    for result in results:
        assert isinstance(result, list), result
        assert np.array_equal(result[0], np.full(50, 6)) and np.array_equal(result[1], np.full(50, 12))
    assert_freed(ready)
    assert ask(endpoint, "status")["jobs"] == [] and used() == {r["control"]: 0 for r in ready}


@pytest.mark.timeout(60)
def test_an_aggregator_without_the_roles_takes_no_tree(tmp_path, monkeypatch):
    """An older `passing-aggregator` (its ping states no roles: here a real one whose ping the controller
    reads without them) is not given a leaf job: the group runs flat, the reason naming that leaf."""
    from tests.keys import controller

    services = Services(tmp_path)
    services.procs.pop().terminate()  # this test runs the controller in-process, to read one PS as older
    ctl = controller(Topology.from_dict(services.topology), tmp_path / "inproc.sqlite", join_timeout=10)
    request = ctl.ps.request

    def older(control: str, cmd: str, timeout: float | None = None, **fields: object) -> dict:
        reply = request(control, cmd, timeout, **fields)
        return {k: v for k, v in reply.items() if k != "roles"} if control == services.ready[1]["control"] else reply

    monkeypatch.setattr(ctl.ps, "request", older)
    thread = threading.Thread(target=ctl.serve)
    thread.start()
    try:
        ports = free_udp_ports(2)

        def work(w: int) -> dict:
            return join(ctl.endpoint, "older", w, 2, host=host_ip(w, 0), udp_port=ports[w], pool=4, timeout=30)

        answers = run_threads(work, 2)
        for a in answers:
            assert isinstance(a, dict) and a["mode"] == "ps", a
            assert "no tree across racks: leaf 'rack1'" in a["reason"] and "takes no leaf role" in a["reason"], a
        held = {r["control"]: ControlClient(r["control"]).request("stats")["jobs"] for r in services.ready}
        assert sum(len(j) for j in held.values()) == 1  # the flat job alone: the tree's node let go of theirs
    finally:
        ctl.stop()
        thread.join(10)
        services.stop()


@pytest.mark.timeout(90)
def test_stats_metrics_and_top_show_every_node_of_a_tree(fabric):
    """`stats`, `status`, `metrics` (and Prometheus) and `passing-ctl top` show each node's counters: each leaf took
    its rack's contributions and sent one partial up per round, the root took the leaves' partials and
    answered each leaf once per round; a node whose aggregator is gone shows its error, the others their
    counters."""
    from passing_controller.metrics import controller_metrics

    endpoint, ready, services = fabric
    ports = free_udp_ports(4)
    checked, done, lanes = threading.Event(), threading.Semaphore(0), []
    data = [np.arange(5000, dtype=np.int32) + w for w in range(4)]

    def work(w: int) -> np.ndarray:
        ip = host_ip(w % 2, w // 2)
        answer = join(endpoint, "counted", w, 4, host=ip, udp_port=ports[w], pool=8, timeout=30)
        try:
            with Group.from_answer(answer, bind=(ip, ports[w]), timeout=10) as g:
                out = [g.allreduce(data[w]) for _ in range(2)]
            lanes.append(answer["lanes"])
            done.release()
            assert checked.wait(40)
            return out[-1]
        finally:
            leave(endpoint, "counted", 0, w, answer["token"], timeout=20)

    failed: list[BaseException] = []
    seen: dict[str, int] = {}

    def check() -> None:
        try:
            for _ in range(4):  # every worker's two allreduces are done
                assert done.acquire(timeout=40)
            stats = ask(endpoint, "stats")
            (job,) = [k for k in stats if k.isdigit()]
            nodes = stats[job]["nodes"]
            c = [n["counters"] for n in nodes]
            assert [(n["name"], n["role"], n["aggregator"]) for n in nodes] == [
                ("rack0", "leaf", ready[0]["control"]), ("rack1", "leaf", ready[1]["control"]),
                ("spine", "root", ready[2]["control"])]
            leaf0, leaf1, root = c
            rounds = seen["rounds"] = root["completed"]
            assert rounds == 2 * -(-5000 // lanes[0]) > 2  # 2 allreduces of 5000 values, several packets each
            for leaf in (leaf0, leaf1):  # two servers per rack: two contributions a round, one partial up
                assert leaf["completed"] == rounds and leaf["aggregated"] == 2 * rounds
                assert leaf["sent_up"] >= rounds and leaf["answered"] == rounds and leaf["rejected"] == 0
            assert root["aggregated"] == 2 * rounds and root["sent_up"] == 0 and root["answered"] == 0
            assert {k: v for k, v in stats[job].items() if k != "nodes"} == root  # the job's own: the root's
            (placed,) = ask(endpoint, "status")["jobs"]  # status: the tree's nodes, each with its counters
            assert [(n["name"], n["counters"]["completed"], n["counters"]["sent_up"]) for n in placed["tree"]] == [
                ("rack0", rounds, leaf0["sent_up"]), ("rack1", rounds, leaf1["sent_up"]), ("spine", rounds, 0)]
            metrics = ask(endpoint, "metrics")
            (g,) = metrics["groups"]
            assert [n["counters"]["completed"] for n in g["nodes"]] == [rounds] * 3
            families = {f.name: f for f in controller_metrics(metrics)}
            sent_up = {s.labels["node"]: s.value for s in families["passing_group_node_sent_up_packets"].samples
                       if s.name.endswith("_total")}
            assert sent_up == {"rack0": leaf0["sent_up"], "rack1": leaf1["sent_up"], "spine": 0}
            lines = render(metrics, metrics, endpoint)  # passing-ctl top's frame
            rows = [line.split() for line in lines if line.startswith("  ")]
            assert [r[:2] for r in rows] == [["leaf", "rack0"], ["leaf", "rack1"], ["root", "spine"]], lines
            assert all(r[r.index("late") + 1] == "0" for r in rows), rows
            services.procs[0].terminate()  # leaf rack0's aggregator is gone: its node says so, the rest read
            services.procs[0].wait(10)
            nodes = ask(endpoint, "stats")[job]["nodes"]
            assert "error" in nodes[0] and "counters" not in nodes[0], nodes[0]
            assert nodes[1]["counters"]["completed"] == rounds and nodes[2]["counters"]["completed"] == rounds
            (placed,) = ask(endpoint, "status")["jobs"]
            assert "error" in placed["tree"][0] and placed["tree"][2]["counters"]["completed"] == rounds
            lines = render(ask(endpoint, "metrics"), None, endpoint)
            assert any(line.startswith("  leaf rack0") and "not answering" in line for line in lines), lines
        except BaseException as e:  # handed to the test
            failed.append(e)
        finally:
            checked.set()

    watcher = threading.Thread(target=check)
    watcher.start()
    results = run_threads(work, 4, timeout=80)
    watcher.join(60)
    if failed:
        raise failed[0]
    flat = np.sum(data, axis=0)
    for got in results:
        assert isinstance(got, np.ndarray) and np.array_equal(got, flat), got
    (ended,) = ask(endpoint, "metrics")["groups"]  # its final counters, node by node, the dead leaf's error
    assert not ended["running"] and "error" in ended["nodes"][0], ended["nodes"]
    assert [n["counters"]["completed"] for n in ended["nodes"][1:]] == [seen["rounds"]] * 2
    assert ended["counters"] == ended["nodes"][2]["counters"]  # the group's own: its root's


@pytest.mark.timeout(120)
def test_a_spare_ps_takes_an_unreachable_switch_leafs_place(tmp_path):
    """rack0's leaf is the topology's switch, which does not answer (no P4Runtime server at its address); a
    spare PS takes its place at the join: the group runs as a tree with rack0's servers on the spare, and
    every worker gets the flat sum (docs/control.md, Fabric)."""
    from tests.test_controller_ps_fallback import closed_port

    services = Services(tmp_path, spares=1)
    try:
        services.topology["switch"] = {"p4runtime": f"127.0.0.1:{closed_port()}",
                                       "aggregation_mac": "02:00:00:00:00:fe", "aggregation_ip": "10.0.0.254"}
        services.topology["hosts"] = [{"name": f"h{k}-{i}", "mac": f"02:00:00:00:{k + 1:02x}:{i + 1:02x}",
                                       "ip": host_ip(k, i), "port": 20 * k + i + 1}
                                      for k in range(2) for i in range(20)]
        rack0 = services.topology["fabric"][0]
        rack0.pop("ps")
        rack0["switch"] = True
        services.restart_controller()
        endpoint = services.endpoint
        spares = {services.ready[0]["data"], services.ready[3]["data"]}  # the PSs no node of the fabric names now
        data = [np.full(100, w + 1, dtype=np.int32) for w in range(4)]
        for w, result in enumerate(allreduce_once(endpoint, "spare-for-switch", data)):
            assert isinstance(result, tuple), result
            answer, got = result
            assert answer["mode"] == "tree", answer["reason"]
            leaf = f"{answer['aggregators'][0]['host']}:{answer['aggregators'][0]['port']}"
            assert leaf in spares if w % 2 == 0 else leaf == services.ready[1]["data"], (w, leaf)
            assert np.array_equal(got, np.full(100, 10, dtype=np.int32))
        assert ask(endpoint, "status")["jobs"] == []
        assert_freed(services.ready)
    finally:
        services.stop()
