"""The controller's fabric of racks (controller/passing_controller/fabric.py): the topology's leaves and roots
with their errors, and the plan that places a group across racks as a tree's job objects, which a software
aggregator admits as they are."""

from __future__ import annotations

import pytest

from passing.aggregator.control_channel import job_from_json
from passing.aggregator.engine import AggregationEngine
from passing_controller.fabric import UP, Fabric, FabricError, plan
from passing_controller.topology import Topology, TopologyError

PS = ["10.0.1.100:9877", "10.0.2.100:9877", "10.0.3.100:9877", "10.0.9.100:9877"]
RACK_PS = [f"10.0.{k}.200:9877" for k in range(10, 15)]
HOSTS = [f"h{i}" for i in range(8)]


def fabric(nodes: list[dict], hosts: list[str] = HOSTS, switch: bool = False) -> Fabric:
    return Fabric.from_list(nodes, hosts, PS, switch)


def two_racks() -> Fabric:
    return fabric([{"name": "rack1", "ps": PS[0], "hosts": HOSTS[:3], "uplink": "spine"},
                   {"name": "rack2", "ps": PS[1], "hosts": HOSTS[3:5], "uplink": "spine"},
                   {"name": "spine", "ps": PS[3]}])


@pytest.mark.parametrize(("nodes", "error"), [
    ([{"name": "a", "ps": PS[0], "hosts": ["h0"], "uplink": "s"}, {"name": "b", "ps": PS[1], "hosts": ["h0"],
      "uplink": "s"}, {"name": "s", "ps": PS[3]}], "host 'h0' is under two leaves, 'a' and 'b'"),
    ([{"name": "a", "ps": PS[0], "hosts": ["h0"]}, {"name": "b", "ps": PS[1], "hosts": ["h1"], "uplink": "s"},
      {"name": "s", "ps": PS[3]}], "leaf 'a' has no uplink"),
    ([{"name": "a", "ps": PS[0], "hosts": ["h0"], "uplink": "b"},
      {"name": "b", "ps": PS[1], "hosts": ["h1"], "uplink": "a"}], "cycle: a -> b -> a"),
    ([{"name": "a", "ps": PS[0], "hosts": ["h0"], "uplink": "a"}], "cycle: a -> a"),
    ([{"name": "a", "ps": PS[0], "hosts": ["h0"], "uplink": "b"}, {"name": "b", "ps": PS[1], "hosts": ["h1"],
      "uplink": "s"}, {"name": "s", "ps": PS[3]}], "uplink 'b' is a leaf"),
    ([{"name": "a", "ps": PS[0], "hosts": ["h0"], "uplink": "nowhere"}], "no node of the fabric"),
    ([{"name": "s", "ps": PS[3]}], "0 leaves"),
    ([{"name": "a", "ps": "10.9.9.9:1", "hosts": ["h0"]}], "no PS with data address"),
    ([{"name": "a", "switch": True, "hosts": ["h0"]}], "no switch"),
    ([{"name": "a", "ps": PS[0], "hosts": ["h0"], "rack": 1}], "unknown keys"),
    ([{"name": "a", "ps": PS[0], "hosts": ["hx"]}], "which the topology lacks"),
    ([{"name": "a", "ps": PS[0]}, {"name": "a", "ps": PS[1]}], "two nodes named 'a'"),
    ([], "non-empty list"),
])
def test_fabric_errors_are_clear(nodes, error):
    with pytest.raises(FabricError, match=error.replace("(", r"\(").replace(">", ">")):
        fabric(nodes)


def test_a_group_under_one_leaf_stays_flat_there():
    p = plan(two_racks(), ["h3", "h4"])
    assert p.root is None and [r.node.name for r in p.racks] == ["rack2"]
    objects = p.job_objects(5, 2, 16, 64, ["10.0.2.1:1", "10.0.2.2:1"], {})
    assert objects == {"rack2": {"job": 5, "generation": 2, "pool": 16, "lanes": 64, "base": 0,
                                 "workers": ["10.0.2.1:1", "10.0.2.2:1"]}}


def test_a_group_across_racks_is_a_tree_whose_job_objects_the_aggregators_admit():
    # the group's workers in join order, interleaved across the racks
    hosts = ["h3", "h0", "h4", "h1"]
    p = plan(two_racks(), hosts)
    assert p.root is not None and p.root.name == "spine" and p.servers == 4
    assert [(r.node.name, r.hosts, r.first) for r in p.racks] == [("rack1", (1, 3), 0), ("rack2", (0, 2), 2)]
    assert p.number(2) == (1, 1, 3)  # worker 2 (h4): rack2, its second server, global number 3
    addresses = [f"10.0.0.{i}:2000" for i in range(4)]
    data = {"rack1": PS[0], "rack2": PS[1], "spine": PS[3]}
    objects = p.job_objects(5, 2, 16, 64, addresses, data, root_job=40, bases={"spine": 100})
    assert objects["spine"]["workers"] == [PS[0], PS[1]] and objects["spine"]["owners"] == [0, 0, 1, 1]
    assert objects["spine"]["base"] == 100
    assert objects["rack2"]["owners"] == [UP, UP, 0, 1]
    assert objects["rack2"]["workers"] == [addresses[0], addresses[2]]
    assert objects["rack2"]["up"] == {"job": 40, "generation": 2, "worker": 1, "root": PS[3]}
    for name, obj in objects.items():  # each one is a job a software aggregator takes as it is
        spec = AggregationEngine(256, 64).add_job(job_from_json(obj))
        assert spec.role == {"spine": "root"}.get(name, "leaf")


def test_plans_refuse_what_a_tree_cannot_carry():
    f = fabric([{"name": "rack1", "ps": PS[0], "hosts": ["h0"], "uplink": "s1"},
                {"name": "rack2", "ps": PS[1], "hosts": ["h1"], "uplink": "s2"},
                {"name": "s1", "ps": PS[2]}, {"name": "s2", "ps": PS[3]}])
    with pytest.raises(FabricError, match="share no root"):
        plan(f, ["h0", "h1"])
    with pytest.raises(FabricError, match="under no leaf"):
        plan(f, ["h0", "h7"])
    many = [f"x{i}" for i in range(33)]
    big = Fabric.from_list([{"name": "r", "ps": PS[0], "hosts": many[:32], "uplink": "s"},
                            {"name": "q", "ps": PS[1], "hosts": many[32:], "uplink": "s"}, {"name": "s", "ps": PS[3]}],
                           [], PS, False)
    with pytest.raises(FabricError, match="33 workers of one group"):
        plan(big, [*many, many[0]])
    assert plan(big, many).servers == 33


def test_owners_cross_a_tree_of_at_most_128_servers():
    hosts = [f"x{i}" for i in range(5 * 32)]
    nodes = [{"name": f"r{k}", "ps": RACK_PS[k], "hosts": hosts[32 * k: 32 * k + 32], "uplink": "s"} for k in range(5)]
    f = Fabric.from_list([*nodes, {"name": "s", "ps": PS[3]}], [], PS + RACK_PS, False)
    assert plan(f, hosts[:128]).owner_only and not plan(f, hosts).owner_only
    objects = plan(f, hosts).job_objects(1, 0, 8, 64, [f"10.1.{i // 200}.{i % 200 + 1}:9" for i in range(160)],
                                         {**{f"r{k}": RACK_PS[k] for k in range(5)}, "s": PS[3]})
    assert objects["s"]["owners"] is None and objects["r0"]["owners"] is None  # SUM and MAX only
    for obj in objects.values():
        AggregationEngine(64, 64).add_job(job_from_json(obj))


def test_two_racks_of_a_group_on_one_aggregator_or_a_root_sharing_a_leafs_job_id_are_refused():
    shared = fabric([{"name": "a", "ps": PS[0], "hosts": ["h0"], "uplink": "s"},
                     {"name": "b", "ps": PS[0], "hosts": ["h1"], "uplink": "s"}, {"name": "s", "ps": PS[3]}])
    with pytest.raises(FabricError, match="an aggregator of their own"):
        plan(shared, ["h0", "h1"])
    same = fabric([{"name": "a", "ps": PS[0], "hosts": ["h0"], "uplink": "s"},
                   {"name": "b", "ps": PS[1], "hosts": ["h1"], "uplink": "s"}, {"name": "s", "ps": PS[0]}])
    p = plan(same, ["h0", "h1"])
    data = {"a": PS[0], "b": PS[1], "s": PS[0]}
    with pytest.raises(FabricError, match="a job id of its own"):
        p.job_objects(3, 0, 4, 8, ["10.0.0.1:1", "10.0.0.2:1"], data)
    assert p.job_objects(3, 0, 4, 8, ["10.0.0.1:1", "10.0.0.2:1"], data, root_job=4)["s"]["job"] == 4


def test_the_topology_file_reads_its_fabric():
    ps = [{"data": d, "control": f"tcp://{d.split(':')[0]}:9878"} for d in PS]
    topo = Topology.from_dict({"ps": ps, "fabric": [
        {"name": "rack1", "ps": PS[0], "hosts": ["10.0.1.1", "10.0.1.2"], "uplink": "spine"},
        {"name": "rack2", "ps": PS[1], "hosts": ["10.0.2.1"], "uplink": "spine"}, {"name": "spine", "ps": PS[3]}]})
    assert topo.fabric is not None and plan(topo.fabric, ["10.0.2.1", "10.0.1.1"]).root.name == "spine"
    assert Topology.from_dict({"ps": ps}).fabric is None
    with pytest.raises(TopologyError, match="leaf 'rack1' has no uplink"):
        Topology.from_dict({"ps": ps, "fabric": [{"name": "rack1", "ps": PS[0], "hosts": ["10.0.1.1"]},
                                                 {"name": "spine", "ps": PS[3]}]})


def test_status_shows_the_fabric(tmp_path):
    """A controller with a fabric in its topology (PS only: no aggregator is asked anything) says it in
    `status`; one without says none."""
    import threading

    from tests.keys import ask, controller

    ps = [{"data": d, "control": f"tcp://127.0.0.1:{9 + i}"} for i, d in enumerate(PS)]
    nodes = [{"name": "rack1", "ps": PS[0], "hosts": ["10.0.1.1"], "uplink": "spine"},
             {"name": "spine", "ps": PS[3]}]
    for raw, want in (({"ps": ps, "fabric": nodes}, [
            {"name": "rack1", "role": "leaf", "aggregator": PS[0], "hosts": ["10.0.1.1"], "uplink": "spine"},
            {"name": "spine", "role": "root", "aggregator": PS[3], "hosts": [], "uplink": None}]),
            ({"ps": ps}, [])):
        ctl = controller(Topology.from_dict(raw), tmp_path / f"ctl-{len(want)}.sqlite")
        thread = threading.Thread(target=ctl.serve)
        thread.start()
        try:
            assert ask(ctl.endpoint, "status")["fabric"] == want
        finally:
            ctl.stop()
            thread.join(10)


def test_a_tree_nodes_spares_come_in_order(tmp_path):
    """The PSs that may take a tree node's place (tree_placement.TreePlacement.spares): those no fabric node
    names first, then the other nodes'; never one the tree uses or that is down; one that failed lately last."""
    import time

    from passing_controller.state import State
    from passing_controller.tree_placement import TreePlacement

    ps = [{"data": d, "control": f"tcp://127.0.0.1:{9 + i}"} for i, d in enumerate(PS)]
    topo = Topology.from_dict({"ps": ps, "fabric": [
        {"name": "rack1", "ps": PS[0], "hosts": ["10.0.1.1"], "uplink": "spine"},
        {"name": "rack2", "ps": PS[1], "hosts": ["10.0.2.1"], "uplink": "spine"},
        {"name": "spine", "ps": PS[3]}]})  # PS[2]: a spare, named by no node
    state = State(tmp_path / "store.sqlite", 0, [p.control for p in topo.ps])
    trees = TreePlacement(topo, state, None, 8)  # type: ignore[arg-type]  (spares asks no PS)
    control = {p.data: p.control for p in topo.ps}
    # rack1's PS is down and the tree uses rack2's and the spine's: the spare alone
    assert [p.data for p in trees.spares({control[PS[0]], control[PS[1]], control[PS[3]]})] == [PS[2]]
    # a tree of rack1 and the spine: the spare first, then rack2's
    assert [p.data for p in trees.spares({control[PS[0]], control[PS[3]]})] == [PS[2], PS[1]]
    state.store.mark_down(control[PS[2]], "no answer", time.time(), 30.0)  # the spare failed lately: last
    assert [p.data for p in trees.spares({control[PS[0]], control[PS[3]]})] == [PS[1], PS[2]]
    state.close()
