"""The controller places a group across racks as a tree with the BMv2 switch as one rack's leaf
(docs/control.md, Fabric): rack1 is h1 and h2 on the switch, rack2 is h3 and h4 under a software
aggregator (the PS leaf on host `ps`), and the root is a software aggregator on host `ps2`, all
reached through the one switch (a mixed tree: a BMv2 leaf under a PS root, beside a PS leaf)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest

from .test_e2e_bmv2 import CONTROLLER, ControllerProcess, expected, finish, run_workers

HOSTS = 4
PS = {"ps": "10.0.0.100", "ps2": "10.0.0.101"}
EXTRA = (("ps", PS["ps"], False), ("ps2", PS["ps2"], False), ("ctl", CONTROLLER.split("//")[1].split(":")[0], True))
FABRIC = [
    {"name": "rack1", "switch": True, "hosts": ["h1", "h2"], "uplink": "spine"},
    {"name": "rack2", "ps": f"{PS['ps']}:9877", "hosts": ["h3", "h4"], "uplink": "spine"},
    {"name": "spine", "ps": f"{PS['ps2']}:9877"},
]


@pytest.fixture(scope="module")
def network():
    from .network import Bmv2Network

    net = Bmv2Network(HOSTS, extra=EXTRA)
    yield net
    net.stop()


@pytest.fixture(scope="module")
def aggregators(network):
    procs = []
    try:
        for host, ip in PS.items():
            proc = network.net.get(host).popen(
                [sys.executable, "-m", "passing.cli", "aggregator", "serve", "--listen", f"{ip}:9877", "--control",
                 f"tcp://{ip}:9878"], stdout=subprocess.PIPE, text=True)
            procs.append(proc)
            assert json.loads(proc.stdout.readline())["event"] == "ready"
        yield procs
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)


@pytest.fixture(scope="module")
def controller(network, pipeline, aggregators, tmp_path_factory):
    c = ControllerProcess(network, pipeline, tmp_path_factory.mktemp("controller"))
    topo = json.loads(c.topology.read_text())
    topo["ps"] = [{"data": f"{ip}:9877", "control": f"tcp://{ip}:9878"} for ip in PS.values()]
    topo["fabric"] = FABRIC
    c.topology.write_text(json.dumps(topo))
    ready = c.start()
    assert ready["switch"] == "connected", ready
    yield c
    c.stop()


@pytest.mark.timeout(600)
def test_a_tree_with_the_switch_as_a_leaf_and_a_controller_restart(network, controller, tmp_path):
    """Two allreduces of one group; between them the controller restarts and reconciles the switch, writing
    the tree's entries again from the group's record. Every result within float32's bound of the sum."""
    size = 20_000
    gate = tmp_path / "restarted"
    procs = run_workers(network, tmp_path, "tree", ["h1", "h2", "h3", "h4"], size,
                        extra=["--iterations", "2", "--gate", str(gate)], wait=False)
    deadline = time.monotonic() + 60
    while True:
        jobs = [j for j in controller.ctl("jobs")["jobs"] if j["job"] == "tree"]
        # the root's rounds (`stats` reads the root's PS) complete only with the switch leaf's partials: its
        # worker 0 is the switch's aggregation address, which nothing but the switch's program sends from
        if jobs and controller.ctl("stats", "--job-id", str(jobs[0]["job_id"])).get(str(jobs[0]["job_id"]),
                                                                                     {}).get("completed", 0):
            break
        assert time.monotonic() < deadline, "the tree did not run"
        time.sleep(0.2)
    assert jobs[0]["mode"] == "tree", jobs[0]
    nodes = {n["name"]: n for n in jobs[0]["tree"]}
    assert nodes["rack1"]["control"] == "switch" and nodes["spine"]["control"] == f"tcp://{PS['ps2']}:9878"
    controller.stop()
    ready = controller.start()
    assert ready["switch"] == "connected" and ready["jobs"] >= 1
    gate.touch()
    total, bound = expected(4, size)
    for report, r in finish(procs, tmp_path, "tree"):
        assert report["mode"] == "tree", report
        assert np.max(np.abs(r - total)) <= bound
    controller.ctl("leave", "tree")
