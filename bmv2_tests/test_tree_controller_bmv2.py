"""The controller places a group across racks as a tree with the BMv2 switch as one rack's leaf
(docs/control.md, Fabric): rack1 is h1 and h2 on the switch, rack2 is h3 and h4 under a software
aggregator (the PS leaf on host `ps`), and the root is a software aggregator on host `ps2`, all
reached through the one switch (a mixed tree: a BMv2 leaf under a PS root, beside a PS leaf)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from .network import REPO, start_ps
from .test_e2e_bmv2 import CONTROLLER, ControllerProcess, finish_within_bound, run_workers, wait_running

pytestmark = pytest.mark.slow  # three BMv2 switches or a controller's tree: make test-all's (~1 min each file)

HOSTS = 4
PS = {"ps": "10.0.0.100", "ps2": "10.0.0.101", "ps3": "10.0.0.102"}  # ps3: a spare, named by no fabric node
EXTRA = (("ps", PS["ps"], False), ("ps2", PS["ps2"], False), ("ps3", PS["ps3"], False),
         ("ctl", CONTROLLER.split("//")[1].split(":")[0], True))
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


@contextmanager
def tree_services(network, pipeline, tmp: Path) -> Iterator[ControllerProcess]:
    """The three PSs (ps, ps2 and the spare ps3) and the controller with FABRIC, on ``network``'s hosts."""
    procs = []
    try:
        for host, ip in PS.items():
            procs.append(start_ps(network.net.get(host), ip))
        c = ControllerProcess(network, pipeline, tmp)
        topo = json.loads(c.topology.read_text())
        topo["ps"] = [{"data": f"{ip}:9877", "control": f"tcp://{ip}:9878"} for ip in PS.values()]
        topo["fabric"] = FABRIC
        c.topology.write_text(json.dumps(topo))
        ready = c.start()
        assert ready["switch"] == "connected", ready
        try:
            yield c
        finally:
            c.stop()
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)


@pytest.fixture(scope="module")
def controller(network, pipeline, tmp_path_factory):
    with tree_services(network, pipeline, tmp_path_factory.mktemp("controller")) as c:
        yield c


@pytest.mark.timeout(600)
def test_a_tree_with_the_switch_as_a_leaf_and_a_controller_restart(network, controller, tmp_path):
    """Two allreduces of one group; between them the controller restarts and reconciles the switch, writing
    the tree's entries again from the group's record. Every result within float32's bound of the sum."""
    size = 20_000
    gate = tmp_path / "restarted"
    procs = run_workers(network, tmp_path, "tree", ["h1", "h2", "h3", "h4"], size,
                        extra=["--iterations", "2", "--gate", str(gate)], wait=False)
    # the root's rounds (`stats` reads the root's PS) complete only with the switch leaf's partials: its
    # worker 0 is the switch's aggregation address, which nothing but the switch's program sends from
    job = wait_running(controller, "tree", procs, timeout=60)
    assert job["mode"] == "tree", job
    nodes = {n["name"]: n for n in job["tree"]}
    assert nodes["rack1"]["control"] == "switch" and nodes["spine"]["control"] == f"tcp://{PS['ps2']}:9878"
    controller.stop()
    ready = controller.start()
    assert ready["switch"] == "connected" and ready["jobs"] >= 1
    gate.touch()
    for report in finish_within_bound(procs, tmp_path, "tree", size):
        assert report["mode"] == "tree", report
    controller.ctl("leave", "tree")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("drop", [0.0, 0.05], ids=["clean", "lossy"])
def test_reduce_scatter_and_all_gather_through_the_switch_leaf(network, controller, tmp_path, drop):
    """Sharded collectives across the racks (bmv2_tests/sharded_worker.py): the reduce_scatter's OWNER_ONLY
    rounds (the owner map at the switch leaf and at the PS root: the sums to each block's server, ACKs to
    the others) and the all_gather's GATHERs and NACKs relayed through both levels; exact, with and without
    packets dropped at the servers."""
    from . import sharded_worker

    workers = 4
    job = f"tree-sharded-{int(drop * 100)}"
    procs = []
    for w in range(workers):
        host = network.net.get(f"h{w + 1}")
        procs.append(host.popen(
            [sys.executable, "-m", "bmv2_tests.sharded_worker", "--controller", CONTROLLER, "--job-name", job,
             "--worker", str(w), "--workers", str(workers), "--bind", f"{host.IP()}:{20000 + w}",
             "--drop", str(drop), "--rto", "0.2" if drop else "5", "--out", str(tmp_path / f"{w}.npz")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(REPO)))
    reports = []
    for w, p in enumerate(procs):
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, f"worker {w}: {stderr[-3000:]}"
        reports.append(json.loads(stdout.splitlines()[-1]))
    assert {r["mode"] for r in reports} == {"tree"}, reports
    ins = [sharded_worker.inputs(0, w, workers) for w in range(workers)]
    total = np.sum([x for x, _ in ins], axis=0, dtype=np.int64)
    gathered = np.concatenate([piece for _, piece in ins])
    block = sharded_worker.BLOCK
    for w in range(workers):  # the servers' numbers are their group indices: rack1 h1 h2, rack2 h3 h4
        got = np.load(tmp_path / f"{w}.npz")
        assert np.array_equal(got["block"], total[w * block:(w + 1) * block]), w
        assert np.array_equal(got["gathered"], gathered), w


@pytest.mark.timeout(600)
def test_a_spare_ps_takes_the_place_of_a_switch_leaf_out_of_slots(network, controller, tmp_path):
    """A group that asks for more slots than the switch has (1 024): the spare PS (ps3) takes rack1's leaf
    role, and the group runs as a tree with the sum within float32's bound (docs/control.md, Fabric)."""
    size = 5_000
    gate = tmp_path / "placed"
    procs = run_workers(network, tmp_path, "tree-full", ["h1", "h2", "h3", "h4"], size,
                        extra=["--pool", "2000", "--iterations", "2", "--gate", str(gate)], wait=False)
    try:
        deadline = time.monotonic() + 60
        while not (jobs := [j for j in controller.ctl("jobs")["jobs"] if j["job"] == "tree-full"]):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "the group was not placed"
            time.sleep(0.2)
    finally:
        gate.touch()
    nodes = {n["name"]: n for n in jobs[0]["tree"]}
    assert jobs[0]["mode"] == "tree" and nodes["rack1"]["control"] == f"tcp://{PS['ps3']}:9878", jobs[0]
    for report in finish_within_bound(procs, tmp_path, "tree-full", size):
        assert report["mode"] == "tree", report
    controller.ctl("leave", "tree-full")
