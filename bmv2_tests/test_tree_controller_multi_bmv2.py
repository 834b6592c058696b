"""The controller places a group across racks as a tree of three BMv2 switches (docs/control.md, "Several
switches"; docs/bmv2.md, "A tree of three switches"): bmv2_tests/tree_network.py's leaves s1 (h1, h2) and s2
(h3, h4) and its spine s3, all three named in the topology's "switches", each with its own P4Runtime session;
the real passing-controller process, on the host ctl of the spine, writes every switch's entries itself: the
leaves' and the root's roles, over each switch's session, and reads each node's counters from its switch."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest

from .network import REPO
from .test_e2e_bmv2 import CONTROLLER, ControllerProcess, finish_within_bound, run_workers, wait_running

pytestmark = pytest.mark.slow  # three BMv2 switches and a controller: make test-all's

CONTROLLER_IP = CONTROLLER.split("//")[1].split(":")[0]
SWITCHES = {"rack1": "switch:s1", "rack2": "switch:s2", "spine": "switch:s3"}


@pytest.fixture(scope="module")
def tree():
    from .tree_network import TreeNetwork

    net = TreeNetwork(per_rack=2, controller_ip=CONTROLLER_IP)
    yield net
    net.stop()


@pytest.fixture(scope="module")
def controller(tree, pipeline, tmp_path_factory):
    """passing-controller on the topology of the three switches (TreeNetwork.topology), in the root namespace
    (the host ctl): it reaches each BMv2's gRPC port on localhost, the servers through s3."""
    c = ControllerProcess(tree, pipeline, tmp_path_factory.mktemp("controller"), ps=[])
    ready = c.start()
    assert ready["switches"] == {"s1": "connected", "s2": "connected", "s3": "connected"}, ready
    yield c
    c.stop()


@pytest.mark.timeout(600)
def test_a_tree_of_three_switches_placed_by_the_controller_and_its_restart(tree, controller, tmp_path):
    """Four servers under two leaf switches, the root on the spine switch: two allreduces, between them the
    controller restarts and reconciles all three switches, writing the tree's entries again from the group's
    record. Every node's counters come from its own switch; every result within float32's bound of the sum;
    the group's end removes its entries from every switch."""
    size = 20_000
    gate = tmp_path / "restarted"
    procs = run_workers(tree, tmp_path, "tree3", ["h1", "h2", "h3", "h4"], size,
                        extra=["--iterations", "2", "--gate", str(gate)], wait=False)
    try:
        job = wait_running(controller, "tree3", procs)
        assert job["mode"] == "tree", job
        assert {n["name"]: n["control"] for n in job["tree"]} == SWITCHES, job["tree"]
        status = controller.ctl("status")
        (running,) = [j for j in status["jobs"] if j["job"] == "tree3"]
        counted = {n["name"]: n["counters"] for n in running["tree"]}  # read now, from each switch
        assert counted["spine"]["completed"] > 0 and counted["rack1"]["sent_up"] > 0 \
            and counted["rack2"]["sent_up"] > 0, counted
        assert counted["rack1"]["aggregated"] > 0 and counted["rack2"]["aggregated"] > 0, counted
        aggregators = {a["aggregator"]: a for a in status["aggregators"]}
        assert all(aggregators[c]["state"] == "up" and aggregators[c]["chip"] == "bmv2" for c in SWITCHES.values()), \
            aggregators
        controller.stop()
        ready = controller.start()
        assert ready["jobs"] >= 1 and set(ready["switches"].values()) == {"connected"}, ready
    finally:
        gate.touch()
    for report in finish_within_bound(procs, tmp_path, "tree3", size):
        assert report["mode"] == "tree", report
    end_and_check_entries_removed(tree, controller, "tree3")


def end_and_check_entries_removed(tree, controller: ControllerProcess, name: str) -> None:
    """End group ``name`` (an operator's leave), then, with the controller stopped (its sessions closed: ours may
    read what the group's end left), check that no switch keeps an entry of it: no admission, rewrite or
    multicast group, no tree role, uplink or owner map; the controller is started again."""
    controller.ctl("leave", name)
    deadline = time.monotonic() + 30
    while controller.ctl("jobs")["jobs"]:
        assert time.monotonic() < deadline, f"group {name} did not end"
        time.sleep(0.2)
    controller.stop()
    try:
        assert_entries_removed(tree)
    finally:
        assert set(controller.start()["switches"].values()) == {"connected"}


def assert_entries_removed(tree) -> None:
    """No switch keeps a group's entries (flat or a tree node's) once its groups ended."""
    from passing_controller import admission, result_rewrite, tree_switch
    from passing_controller.session import Switch

    for name, info in tree.switches.items():
        s = Switch(f"127.0.0.1:{info.grpc_port}")
        try:
            s.fetch_pipeline()
            for table in (admission.TABLE, result_rewrite.TABLE, *tree_switch.TABLES):
                assert s.read_table(table) == [], (name, table)
            assert [g for g in s.read_multicast_groups()
                    if g.packet_replication_engine_entry.multicast_group_entry.multicast_group_id != 1] == [], name
        finally:
            s.close()


@pytest.mark.timeout(600)
def test_a_group_of_one_racks_servers_runs_flat_on_its_named_switch(tree, controller, tmp_path):
    """h1 and h2 (rack 1, both on s1): the group aggregates flat on s1 (docs/control.md, "Several switches"),
    as on a topology's one switch; its counters come from s1, every result within float32's bound of the sum,
    and its end removes its entries from s1."""
    size = 20_000
    gate = tmp_path / "seen"
    procs = run_workers(tree, tmp_path, "rack1-flat", ["h1", "h2"], size,
                        extra=["--iterations", "2", "--gate", str(gate)], wait=False)
    try:
        job = wait_running(controller, "rack1-flat", procs)
        assert (job["mode"], job["control"]) == ("switch", "switch:s1"), job
        assert job["aggregator"] == f"{tree.switches['s1'].ip}:9877", job
        counted = controller.ctl("stats", "--job-id", str(job["job_id"]))[str(job["job_id"])]
        assert counted["aggregated"] > 0 and counted["completed"] > 0 and counted["rejected"] == 0, counted
    finally:
        gate.touch()
    for report in finish_within_bound(procs, tmp_path, "rack1-flat", size):
        assert report["mode"] == "switch", report
    end_and_check_entries_removed(tree, controller, "rack1-flat")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("drop", [0.0, 0.05], ids=["clean", "lossy"])
def test_reduce_scatter_and_all_gather_through_three_switches(tree, controller, tmp_path, drop):
    """Sharded collectives (bmv2_tests/sharded_worker.py) through the switches' tree: the reduce_scatter's
    OWNER_ONLY rounds (the owner maps at both leaves and at the root switch) and the all_gather's GATHERs
    and NACKs relayed through both levels; exact, with and without packets dropped at the servers."""
    from . import sharded_worker

    workers = 4
    job = f"tree3-sharded-{int(drop * 100)}"
    procs = []
    for w in range(workers):
        host = tree.net.get(f"h{w + 1}")
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
