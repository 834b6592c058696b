"""A join the controller cannot honour is refused at once, to the worker that sent it, before it
waits for its group; and a group that fails, for whatever reason, answers every member. Real
ZeroMQ requests to a controller thread, a software aggregator thread as its PS."""

from __future__ import annotations

import threading
import time

import pytest

from passing.aggregator.server import SoftwareAggregator
from passing.control import ControllerError, join
from passing.launch import free_udp_ports
from passing_controller.topology import Topology
from tests.cluster import run_threads
from tests.keys import controller as make_controller

JOIN_TIMEOUT = 10.0  # a refusal must come at once, never after this


@pytest.fixture(scope="module")
def ps():
    agg = SoftwareAggregator(listen=("127.0.0.1", 0), control="tcp://127.0.0.1:*", engine="numpy")
    server = threading.Thread(target=agg.serve)
    server.start()
    yield {"data": "{}:{}".format(*agg.address), "control": agg.control_endpoint}
    agg.stop()
    server.join(10)


@pytest.fixture
def controller(ps, tmp_path):
    topo = Topology.from_dict({"hosts": [{"name": "local", "ip": "127.0.0.1"}], "ps": [ps]})
    ctl = make_controller(topo, tmp_path / "ctl.sqlite", join_timeout=JOIN_TIMEOUT, default_pool=16)
    thread = threading.Thread(target=ctl.serve)
    thread.start()
    yield ctl
    ctl.stop()
    thread.join(10)


def join_group(ctl, job: str, fields: list[dict]) -> tuple[list, float]:
    """Worker w of len(fields) joins with fields[w], all at once; each one's answer or exception,
    and the seconds the slowest took."""
    ports = free_udp_ports(len(fields))
    start = time.monotonic()
    outcomes = run_threads(lambda w: join(ctl.endpoint, job, w, len(fields), host="127.0.0.1", udp_port=ports[w],
                                          timeout=JOIN_TIMEOUT + 5, **fields[w]), len(fields), timeout=60)
    return outcomes, time.monotonic() - start


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pool", [0, -1, 1.5, "16", True, 4097])
def test_a_pool_no_aggregator_can_hold_is_refused_to_its_worker_at_once(controller, pool):
    """Today's failure: the first joiner of the group waited for its join timeout, the last got
    the error. Each worker is refused as it joins; nothing is left waiting."""
    outcomes, seconds = join_group(controller, "bad-pool", [{"pool": pool}, {"pool": pool}])
    for o in outcomes:
        assert isinstance(o, ControllerError) and "pool" in str(o) and "1..4096" in str(o), o
    assert seconds < 5 and controller.pending == {}


@pytest.mark.timeout(60)
def test_a_worker_asking_another_pool_than_its_group_is_refused(controller):
    """The group keeps the pool of its first joiner: a peer asking another is refused (not given
    a window the aggregator does not have); the group completes when it joins with the same."""
    ports = free_udp_ports(2)
    first: list = []
    waiting = threading.Thread(target=lambda: first.append(
        join(controller.endpoint, "mixed", 0, 2, host="127.0.0.1", udp_port=ports[0], pool=8, timeout=20)))
    waiting.start()
    while ("mixed", 0) not in controller.pending:
        time.sleep(0.01)
    with pytest.raises(ControllerError, match="pool 8, not 32"):
        join(controller.endpoint, "mixed", 1, 2, host="127.0.0.1", udp_port=ports[1], pool=32, timeout=5)
    second = join(controller.endpoint, "mixed", 1, 2, host="127.0.0.1", udp_port=ports[1], pool=8, timeout=20)
    waiting.join(20)
    assert first[0]["pool"] == second["pool"] == 8


@pytest.mark.timeout(60)
def test_udp_port_0_is_refused_at_join(controller):
    with pytest.raises(ControllerError, match="udp_port 0 outside 1..65535"):
        join(controller.endpoint, "port0", 0, 1, host="127.0.0.1", udp_port=0, timeout=5)


@pytest.mark.timeout(60)
def test_a_group_that_fails_for_any_reason_answers_every_member(controller, monkeypatch):
    """Whatever goes wrong once the group is complete (here an error the controller did not
    foresee), every worker gets an answer, not only the last one to join."""
    def broken(*_args, **_kwargs):
        raise ValueError("the allocation broke")

    monkeypatch.setattr(controller.placement, "allocate", broken)
    outcomes, seconds = join_group(controller, "broken", [{}, {}, {}])
    for o in outcomes:
        assert isinstance(o, ControllerError) and "the allocation broke" in str(o), o
    assert seconds < 5 and controller.pending == {}


@pytest.mark.timeout(30)
def test_more_than_32_workers_without_racks_are_refused_at_once(controller):
    """One aggregator takes 32 workers; a topology without a fabric has nowhere to put more (with one, up
    to 1 024 across racks: tests/test_controller_tree.py)."""
    start = time.monotonic()
    with pytest.raises(ControllerError, match=r"workers.*1\.\.32"):
        join(controller.endpoint, "too-big", 0, 33, host="127.0.0.1", udp_port=free_udp_ports(1)[0],
             timeout=JOIN_TIMEOUT + 5)
    assert time.monotonic() - start < JOIN_TIMEOUT / 2
