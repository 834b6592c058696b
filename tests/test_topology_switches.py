"""A topology of several named switches (docs/control.md, "Several switches"): parsing and its errors, each
switch's view (its hosts, the other switches' hosts and aggregation addresses at its port toward them), the
entries a tree of three switches gets from the fabric's plan, and a controller whose switches are all
unreachable placing the tree on spare PSs, the root's place too."""

from __future__ import annotations

import copy
import threading
from typing import Any

import numpy as np
import pytest

from passing import Group
from passing.control import join, leave
from passing.launch import free_udp_ports
from passing_controller import tree_switch
from passing_controller.fabric import plan
from passing_controller.topology import Topology, TopologyError
from tests.cluster import run_threads, start_aggregator
from tests.keys import ask, controller
from tests.test_controller_ps_fallback import closed_port


def three_switches(ports: tuple[int, int, int] = (9559, 9560, 9561), ip: str = "10.0.0.{}") -> dict[str, Any]:
    """bmv2_tests/tree_network.py's: h1 h2 on s1, h3 h4 on s2 (ports 1, 2; uplink 3), the spine s3 (port 1 to
    s1, 2 to s2, 3 to hs), the fabric rack1 on s1, rack2 on s2, the spine on s3."""
    def sw(n: int, grpc: int, links: dict[str, int]) -> dict[str, Any]:
        return {"p4runtime": f"127.0.0.1:{grpc}", "aggregation_mac": f"02:00:00:00:0{n}:fe",
                "aggregation_ip": f"10.0.9.{n}", "links": links}

    hosts = [{"name": f"h{i}", "mac": f"02:00:00:00:00:0{i}", "ip": ip.format(i), "port": (i - 1) % 2 + 1,
              "switch": "s1" if i < 3 else "s2"} for i in range(1, 5)]
    hosts.append({"name": "hs", "mac": "02:00:00:00:00:64", "ip": ip.format(100), "port": 3, "switch": "s3"})
    return {"switches": {"s1": sw(1, ports[0], {"s3": 3}), "s2": sw(2, ports[1], {"s3": 3}),
                         "s3": sw(3, ports[2], {"s1": 1, "s2": 2})},
            "hosts": hosts,
            "fabric": [{"name": "rack1", "switch": "s1", "hosts": ["h1", "h2"], "uplink": "spine"},
                       {"name": "rack2", "switch": "s2", "hosts": ["h3", "h4"], "uplink": "spine"},
                       {"name": "spine", "switch": "s3"}]}


def test_each_switch_sees_its_hosts_and_the_others_at_its_port_toward_them():
    topo = Topology.from_dict(three_switches())
    assert topo.p4runtime is None and sorted(topo.switches) == ["s1", "s2", "s3"]
    s1, s3 = topo.view("switch:s1"), topo.view("switch:s3")
    assert s1.name == "switch:s1" and s1.p4runtime == "127.0.0.1:9559" and s1.lanes == 64 and s1.chip == "bmv2"
    assert [(h.name, h.port) for h in s1.hosts] == [("h1", 1), ("h2", 2)]
    assert [(h.name, h.port) for h in s1.remote] == [("h3", 3), ("h4", 3), ("hs", 3)]  # all through the spine
    assert [(h.name, h.port, h.ip) for h in s1.neighbours] == [("s2", 3, "10.0.9.2"), ("s3", 3, "10.0.9.3")]
    assert [(h.name, h.port) for h in s3.remote] == [("h1", 1), ("h2", 1), ("h3", 2), ("h4", 2)]
    assert s3.host("10.0.9.1").mac == "02:00:00:00:01:fe"  # a leaf switch, as the root admits it
    assert {n.name: n.aggregator for n in topo.fabric.nodes.values()} == {
        "rack1": "switch:s1", "rack2": "switch:s2", "spine": "switch:s3"}
    with pytest.raises(TopologyError, match="no host 'nobody'"):
        topo.host("nobody")  # a switch's topology names its hosts: no made-up one as for a PS alone


def test_the_one_switch_topology_is_unchanged():
    raw = {"switch": {"p4runtime": "127.0.0.1:9559", "aggregation_mac": "02:00:00:00:00:fe",
                      "aggregation_ip": "10.0.0.254"},
           "hosts": [{"name": "h1", "mac": "02:00:00:00:00:01", "ip": "10.0.0.1", "port": 1}]}
    topo = Topology.from_dict(raw)
    assert topo.switches == {} and topo.view("switch") is topo and topo.remote == topo.neighbours == []
    assert topo.host("h1").switch is None


def test_the_plan_of_three_switches_writes_each_switch_its_role():
    """The job objects of the fabric's plan, as each switch takes them (tree_switch, before any is written):
    a leaf's servers at their ports and its uplink toward the root switch; the root's workers are the leaf
    switches, at its ports to them, with their aggregation addresses."""
    topo = Topology.from_dict(three_switches())
    p = plan(topo.fabric, ["h1", "h3", "h2", "h4"])
    data = {n.name: f"{topo.view(n.aggregator).aggregation_ip}:9877" for n in topo.fabric.nodes.values()}
    objects = p.job_objects(7, 1, 16, 64, [f"{topo.host(h).ip}:{20000 + w}" for w, h in
                                           enumerate(["h1", "h3", "h2", "h4"])], data)
    for name, control in (("rack1", "switch:s1"), ("rack2", "switch:s2"), ("spine", "switch:s3")):
        tree_switch.check(topo.view(control), objects[name])
    root = tree_switch.allocation(topo.view("switch:s3"), objects["spine"])
    assert [(w.host.name, w.host.port, w.host.mac, w.udp_port) for w in root.workers] == [
        ("s1", 1, "02:00:00:00:01:fe", 9877), ("s2", 2, "02:00:00:00:02:fe", 9877)]
    up = tree_switch.uplink(topo.view("switch:s2"), objects["rack2"])
    assert (up.job, up.worker, up.port, up.mac, up.ip) == (7, 1, 3, "02:00:00:00:03:fe", "10.0.9.3")
    leaf = tree_switch.allocation(topo.view("switch:s1"), objects["rack1"])
    assert [(w.host.name, w.host.port, w.udp_port) for w in leaf.workers] == [("h1", 1, 20000), ("h2", 2, 20002)]


def _broken(change) -> dict[str, Any]:
    raw = copy.deepcopy(three_switches())
    change(raw)
    return raw


@pytest.mark.parametrize(("change", "error"), [
    (lambda t: t["hosts"][0].update(switch="s9"), "host 'h1': \"switch\" 's9' is none of"),
    (lambda t: t["hosts"][0].pop("switch"), "host 'h1': \"switch\" None is none of"),
    (lambda t: t["fabric"][2].update(switch="s9"), "fabric node 'spine': no switch named 's9'"),
    (lambda t: t["fabric"][2].update(switch="s1"), "'rack1' and 'spine' are both on switch 's1'"),
    (lambda t: t["fabric"][2].update(switch=True), "the topology has no switch named by true"),
    (lambda t: t["fabric"][0].update(hosts=["h1", "h3"]), "hosts ['h3'] are not on that switch"),
    (lambda t: t["switches"]["s3"].update(chip="tofino2", lanes=32, lanes_override=True),  # a 32-lane rebuild
     "switches take different lane counts"),
    (lambda t: t.update(switch=t["switches"]["s1"]), '"switch" and "switches" together'),
    (lambda t: t["switches"]["s3"]["links"].pop("s2"), "'s2' links to 's3', which names no link back"),
    (lambda t: t["switches"]["s1"]["links"].update(s9=4), '"links" must map other switches'),
    (lambda t: t["switches"]["s1"]["links"].update(s3=1), "a port is named twice"),
    (lambda t: t["switches"]["s2"].update(aggregation_ip="10.0.9.1"), "share an address"),
    (lambda t: t["switches"]["s2"].update(p4runtime="127.0.0.1:9559"), "share a P4Runtime address"),
    (lambda t: t["switches"]["s2"].update(lanes=32), "switch 's2': switch \"lanes\" 32 disagrees"),
    (lambda t: t["switches"]["s2"].update(colour="red"), "switch 's2': unknown keys ['colour']"),
    (lambda t: t["switches"].update(s4=[]), "switch 's4': a named switch must be an object"),
    (lambda t: t["switches"]["s2"].pop("p4runtime"), "missing or bad field 'p4runtime'"),
    (lambda t: t["hosts"][2].update(port=1, switch="s1"), "switch 's1': a port is named twice"),
])
def test_a_bad_topology_of_switches_is_refused_with_the_reason(change, error):
    with pytest.raises(TopologyError) as e:
        Topology.from_dict(_broken(change))
    assert error in str(e.value)


def test_a_host_naming_its_switch_needs_named_switches():
    raw = {"switch": {"p4runtime": "127.0.0.1:9559", "aggregation_mac": "02:00:00:00:00:fe",
                      "aggregation_ip": "10.0.0.254"},
           "hosts": [{"name": "h1", "mac": "02:00:00:00:00:01", "ip": "10.0.0.1", "port": 1, "switch": "s1"}]}
    with pytest.raises(TopologyError, match='only "switches" names switches'):
        Topology.from_dict(raw)


@pytest.mark.slow  # three PS processes and a controller (~8 s here): make test is over its time already
@pytest.mark.timeout(120)
def test_unreachable_switches_leaves_and_root_alike_are_replaced_by_spare_pss(tmp_path):
    """Every switch of the tree is down (no P4Runtime server at its address): at the join, a spare PS takes
    each node's place, the root's too, and every worker gets the flat sum; `status` says which switch is
    unavailable and why."""
    pss = [start_aggregator() for _ in range(3)]
    raw = three_switches((closed_port(), closed_port(), closed_port()), ip="127.0.0.{}")
    raw["ps"] = [{"data": ready["data"], "control": ready["control"]} for _, ready in pss]
    ctl = controller(Topology.from_dict(raw), tmp_path / "ctl.sqlite", switch_timeout=0.3, ps_timeout=2.0)
    thread = threading.Thread(target=ctl.serve)
    thread.start()
    try:
        status = ask(ctl.endpoint, "status")
        assert set(status["switches"]) == {"s1", "s2", "s3"}
        assert all(v.startswith("unavailable: ") for v in status["switches"].values()), status["switches"]
        down = {a["aggregator"] for a in status["aggregators"] if a["state"] == "down"}
        assert down == {"switch:s1", "switch:s2", "switch:s3"}, status["aggregators"]
        ports = free_udp_ports(4)
        data = [np.full(100, w + 1, dtype=np.int32) for w in range(4)]
        seen: list[dict] = []

        def work(w: int) -> np.ndarray:
            ip = f"127.0.0.{w + 1}"
            answer = join(ctl.endpoint, "all-spares", w, 4, host=ip, udp_port=ports[w], pool=4, timeout=30)
            try:
                if w == 0:
                    seen.extend(ask(ctl.endpoint, "status")["jobs"])
                with Group.from_answer(answer, bind=(ip, ports[w]), timeout=10) as g:
                    assert answer["mode"] == "tree", answer["reason"]
                    return g.allreduce(data[w])
            finally:
                leave(ctl.endpoint, "all-spares", 0, w, answer["token"])

        for got in run_threads(work, 4):
            assert isinstance(got, np.ndarray) and np.array_equal(got, np.full(100, 10, dtype=np.int32)), got
        (job,) = seen
        controls = {n["name"]: n["control"] for n in job["tree"]}
        assert sorted(controls.values()) == sorted(ready["control"] for _, ready in pss), controls
        assert ask(ctl.endpoint, "status")["jobs"] == []
    finally:
        ctl.stop()
        thread.join(10)
        for proc, _ in pss:
            proc.terminate()
            proc.wait(10)


def test_a_restart_reserves_each_tree_nodes_slots_on_its_own_switch(tmp_path):
    """A tree record's nodes on the one switch, on a named switch and on a PS: a controller started on the
    store finds those slots taken at each (the one switch's in the allocator that flat groups take theirs
    from: a new group must not be given the slots a running tree's switch leaf aggregates in)."""
    from passing_controller.state import State
    from passing_controller.store import Record, Store

    store = Store(tmp_path / "ctl.sqlite")
    tree = [{"name": "rack1", "role": "leaf", "control": "switch", "data": "10.0.0.254:9877", "base": 0},
            {"name": "rack2", "role": "leaf", "control": "switch:s2", "data": "10.0.9.2:9877", "base": 16},
            {"name": "spine", "role": "root", "control": "tcp://10.0.0.100:9878", "data": "10.0.0.100:9877",
             "base": 32}]
    store.add(Record(1, "j", 0, "tree", 0, 32, 16, [], {"data": "10.0.0.100:9877", "control": tree[2]["control"],
                                                       "tree": tree}))
    store.close()
    state = State(tmp_path / "ctl.sqlite", 1024, [tree[2]["control"]], {"switch:s2": 512})
    try:
        assert state.allocator.free() == 1024 - 16 and "switch" not in state.ps_allocators
        assert state.allocator_for("switch:s2").slots == 512 and state.allocator_for("switch:s2").free() == 512 - 16
        assert state.allocator_for(tree[2]["control"]).free_ranges()[0] == (0, 32)
    finally:
        state.close()
