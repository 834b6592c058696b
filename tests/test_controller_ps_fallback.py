"""The controller service with no switch to serve: joins are answered with the PS fallback.

Real processes and sockets: a software aggregator process, the controller service, worker
threads that join through passing.control and allreduce through Group.from_answer.
"""

from __future__ import annotations

import json
import socket
import threading

import numpy as np
import pytest

from passing import Group
from passing.aggregator.control_channel import ControlClient
from passing.control import ControllerError, join, leave
from passing.launch import free_udp_ports
from passing_controller.cli import controller_main
from passing_controller.topology import Topology, TopologyError
from tests.cluster import run_threads, start_aggregator
from tests.keys import ask, controller, operator_keys


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ps():
    proc, ready = start_aggregator()
    yield ready
    proc.terminate()
    proc.wait(10)


def topology(ps_ready: dict) -> Topology:
    return Topology.from_dict({
        "switch": {"p4runtime": f"127.0.0.1:{closed_port()}", "aggregation_mac": "02:00:00:00:00:fe",
                   "aggregation_ip": "10.0.0.254"},
        "hosts": [{"name": "local", "mac": "02:00:00:00:00:01", "ip": "127.0.0.1", "port": 1}],
        "ps": [{"data": ps_ready["data"], "control": ps_ready["control"]}],
    })


class Running:
    def __init__(self, topo: Topology, store, join_timeout: float = 10.0, default_pool: int = 16,
                 **options: float) -> None:
        """``options``: the Controller's other keyword arguments (ps_timeout, check_timeout)."""
        self.ctl = controller(topo, store, join_timeout=join_timeout, default_pool=default_pool, switch_timeout=0.5,
                              **options)
        self.endpoint = self.ctl.endpoint
        self.thread = threading.Thread(target=self.ctl.serve)
        self.thread.start()

    def stop(self) -> None:
        self.ctl.stop()
        self.thread.join(10)


def run_workers(endpoint: str, job: str, workers: int, data: list[np.ndarray], aggregator: str = "any") -> list:
    ports = free_udp_ports(workers)

    def work(w: int) -> tuple:
        answer = join(endpoint, job, w, workers, host="127.0.0.1", udp_port=ports[w], aggregator=aggregator,
                      timeout=30)
        with Group.from_answer(answer, bind=("127.0.0.1", ports[w]), timeout=10) as g:
            return answer, g.allreduce(data[w])

    return run_threads(work, workers)


@pytest.mark.timeout(120)
def test_unreachable_switch_falls_back_to_the_ps_and_says_so(ps, tmp_path):
    running = Running(topology(ps), tmp_path / "ctl.sqlite")
    try:
        data = [np.arange(1000, dtype=np.float32) * (w + 1) for w in range(3)]
        results = run_workers(running.endpoint, "resnet", 3, data)
        for answer, result in results:
            assert answer["mode"] == "ps" and "switch unreachable" in answer["reason"]
            assert np.array_equal(result, np.arange(1000, dtype=np.float32) * 6)
        status = ask(running.endpoint, "status")
        assert status["switch"].startswith("unavailable") and status["jobs"][0]["mode"] == "ps"
        assert "1" in ControlClient(ps["control"]).request("stats")["jobs"]  # admitted on the PS
        token = {answer["worker"]: answer["token"] for answer, _ in results}
        assert leave(running.endpoint, "resnet", 0, 0, token[0])["remaining"] == [1, 2]
        assert leave(running.endpoint, "resnet", 0, 2, token[2])["remaining"] == [1]
        assert len(ask(running.endpoint, "status")["jobs"]) == 1  # a worker is still in
        with pytest.raises(ControllerError, match="no worker 1 with this token"):  # a token is its worker's
            leave(running.endpoint, "resnet", 0, 1, token[0])
        assert leave(running.endpoint, "resnet", 0, 1, token[1])["remaining"] == []
        assert ask(running.endpoint, "status")["jobs"] == []
        assert ControlClient(ps["control"]).request("jobs")["jobs"] == []  # and removed there
    finally:
        running.stop()


@pytest.mark.timeout(120)
def test_allocations_survive_a_controller_restart(ps, tmp_path):
    store = tmp_path / "ctl.sqlite"
    running = Running(topology(ps), store)
    try:
        results = run_workers(running.endpoint, "vgg", 2, [np.ones(10, np.float32)] * 2)
        assert all(not isinstance(r, Exception) for r in results), results
    finally:
        running.stop()
    running = Running(topology(ps), store)
    try:
        jobs = ask(running.endpoint, "status")["jobs"]
        assert [(j["job"], j["mode"]) for j in jobs] == [("vgg", "ps")]
        with pytest.raises(ControllerError, match="is running"):
            join(running.endpoint, "vgg", 0, 2, host="127.0.0.1", udp_port=30000, timeout=5)
    finally:
        running.stop()


@pytest.mark.timeout(60)
def test_join_errors_are_clear(ps, tmp_path):
    running = Running(topology(ps), tmp_path / "ctl.sqlite", join_timeout=1.0)
    try:
        with pytest.raises(ControllerError, match="no host"):
            join(running.endpoint, "j", 0, 2, host="10.9.9.9", udp_port=30000, timeout=5)
        with pytest.raises(ControllerError, match="worker 3 outside 0..1"):
            join(running.endpoint, "j", 3, 2, host="127.0.0.1", udp_port=30000, timeout=5)
        with pytest.raises(ControllerError, match=r"workers \[1\] did not join"):
            join(running.endpoint, "j", 0, 2, host="127.0.0.1", udp_port=30000, timeout=5)
        with pytest.raises(ControllerError, match="protocol version"):
            _bad_version(running.endpoint)
        with pytest.raises(ControllerError, match="not running"):
            leave(running.endpoint, "nothing", 0, 0, "00" * 16)
        with pytest.raises(ControllerError, match="not running"):
            ask(running.endpoint, "leave", job="nothing")
    finally:
        running.stop()


def _bad_version(endpoint: str) -> None:
    import json

    import zmq

    sock = zmq.Context.instance().socket(zmq.REQ)
    operator_keys().apply(sock)
    sock.connect(endpoint)
    sock.send(json.dumps({"version": 7, "cmd": "status"}).encode())
    assert sock.poll(5000)
    reply = json.loads(sock.recv())
    sock.close()
    raise ControllerError(reply["error"])


@pytest.mark.timeout(120)
def test_a_topology_without_switch_serves_any_address_from_the_ps(ps, tmp_path):
    topo = Topology.from_dict({"ps": [{"data": ps["data"], "control": ps["control"]}]})
    running = Running(topo, tmp_path / "ctl.sqlite")
    try:
        data = [np.full(300, w + 1, dtype=np.float32) for w in range(2)]
        for aggregator, reason in (("any", "no switch in the topology"), ("ps", "as the job asked")):
            results = run_workers(running.endpoint, f"job-{aggregator}", 2, data, aggregator)
            for answer, result in results:
                assert answer["mode"] == "ps" and reason in answer["reason"]
                assert np.array_equal(result, np.full(300, 3, dtype=np.float32))
        status = ask(running.endpoint, "status")
        assert status["switch"] == "unavailable: no switch in the topology (PS only)" and status["slots"] == 0
        with pytest.raises(ControllerError, match="bad IPv4"):
            join(running.endpoint, "j", 0, 1, host="not-an-address", udp_port=30000, timeout=5)
        with pytest.raises(ControllerError, match="aggregator must be one of"):
            join(running.endpoint, "j", 0, 1, host="127.0.0.1", udp_port=30000, aggregator="fpga", timeout=5)
    finally:
        running.stop()


def test_a_topology_needs_somewhere_to_aggregate():
    with pytest.raises(TopologyError, match="neither a switch nor a PS"):
        Topology.from_dict({"hosts": []})


# ---- the next aggregator when one fails to admit a group (the one policy of placement.candidates) ----

# A down or hanging PS is found out by waiting out the controller's PS request timeout: these
# tests set 2 s (the default is 5 s), the time the controller's own liveness check gives a PS,
# which the live PSs of these tests answer in milliseconds.
PS_TIMEOUT = 2.0


class HangingPs:
    """A control endpoint that takes requests and never answers them."""

    def __init__(self) -> None:
        import zmq

        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.control = f"tcp://127.0.0.1:{port}"
        self.data = f"127.0.0.1:{closed_port()}"

    def close(self) -> None:
        self.sock.close()


def _topology_with(ps_list: list[dict], switch: bool) -> Topology:
    raw: dict = {"ps": [{"data": p["data"], "control": p["control"]} for p in ps_list]}
    if switch:
        raw["switch"] = {"p4runtime": f"127.0.0.1:{closed_port()}", "aggregation_mac": "02:00:00:00:00:fe",
                         "aggregation_ip": "10.0.0.254"}
        raw["hosts"] = [{"name": "local", "mac": "02:00:00:00:00:01", "ip": "127.0.0.1", "port": 1}]
    return Topology.from_dict(raw)


@pytest.fixture
def full_ps():
    """A PS with 4 slots: it refuses a group that asks for 16."""
    proc, ready = start_aggregator(["--slots", "4"])
    yield ready
    proc.terminate()
    proc.wait(10)


def _first_failing(kind: str, full_ps_ready: dict) -> tuple[dict, object | None]:
    if kind == "down":
        return {"data": f"127.0.0.1:{closed_port()}", "control": f"tcp://127.0.0.1:{closed_port()}"}, None
    if kind == "hanging":
        h = HangingPs()
        return {"data": h.data, "control": h.control}, h
    return full_ps_ready, None  # "refusing": no free slots for the group


@pytest.mark.timeout(120)
@pytest.mark.parametrize("switch", [False, True], ids=["ps-only", "switch-unreachable"])
@pytest.mark.parametrize("kind", ["down", "hanging", "refusing"])
def test_a_failing_ps_is_skipped_for_the_next_one(ps, full_ps, tmp_path, kind, switch):
    bad, hanging = _first_failing(kind, full_ps)
    # Job ids start at 1 and the first PS tried is ps[job_id % 2]: put the failing one there.
    running = Running(_topology_with([ps, bad], switch), tmp_path / "ctl.sqlite", ps_timeout=PS_TIMEOUT)
    try:
        data = [np.full(500, w + 1, dtype=np.float32) for w in range(2)]
        for job in ("first", "second"):  # the second join finds the failed PS marked down: no wait
            results = run_workers(running.endpoint, job, 2, data)
            for r in results:
                assert not isinstance(r, Exception), r
                answer, result = r
                assert answer["mode"] == "ps" and answer["aggregators"][0]["port"] == int(ps["data"].split(":")[1])
                assert np.array_equal(result, np.full(500, 3, dtype=np.float32))
            if job == "first":
                assert bad["control"] in answer["reason"]  # the answer says what was tried
                if switch:
                    assert answer["reason"].startswith("switch unreachable")
        status = ask(running.endpoint, "status")
        states = {a["aggregator"]: a for a in status["aggregators"]}
        assert states[bad["control"]]["state"] == "down" and states[bad["control"]]["reason"]
        assert states[ps["control"]]["state"] == "up"
        if switch:
            assert states["switch"]["state"] == "down"
    finally:
        running.stop()
        if hanging:
            hanging.close()


@pytest.mark.timeout(120)
def test_with_no_aggregator_left_the_error_names_every_one_tried(full_ps, tmp_path):
    down = {"data": f"127.0.0.1:{closed_port()}", "control": f"tcp://127.0.0.1:{closed_port()}"}
    hanging = HangingPs()
    running = Running(_topology_with([down, {"data": hanging.data, "control": hanging.control}, full_ps], True),
                      tmp_path / "ctl.sqlite", join_timeout=30, ps_timeout=PS_TIMEOUT)
    try:
        results = run_workers(running.endpoint, "doomed", 1, [np.ones(10, np.float32)])
        assert isinstance(results[0], ControllerError)
        message = str(results[0])
        assert "no aggregator can take the group" in message and "switch unreachable" in message
        for control in (down["control"], hanging.control, full_ps["control"]):
            assert control in message
        assert f"within {PS_TIMEOUT:g} s" in message  # the controller's --ps-timeout, not the 5 s default
        assert ask(running.endpoint, "status")["jobs"] == []  # nothing half-allocated
    finally:
        running.stop()
        hanging.close()


@pytest.mark.parametrize("option", ["ps_timeout", "check_timeout"])
def test_the_ps_timeouts_must_be_positive(tmp_path, capsys, option):
    topology = {"ps": [{"data": "127.0.0.1:1", "control": "tcp://127.0.0.1:1"}]}
    with pytest.raises(ValueError, match="timeout must be positive; got 0"):
        controller(Topology.from_dict(topology), tmp_path / "ctl.sqlite", **{option: 0.0})
    # the command line's --ps-timeout / --check-timeout reach the same check
    (tmp_path / "topo.json").write_text(json.dumps(topology))
    flag = "--" + option.replace("_", "-")
    assert controller_main(["--topology", str(tmp_path / "topo.json"), "--store", str(tmp_path / "cli.sqlite"),
                            "--listen", "tcp://127.0.0.1:*", flag, "0"]) == 2
    assert "timeout must be positive; got 0" in capsys.readouterr().err
