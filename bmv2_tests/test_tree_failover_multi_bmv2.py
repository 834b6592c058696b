"""A leaf switch of a tree of three BMv2 switches dies mid-job (docs/control.md, "Several switches"):
`simple_switch_grpc` of s2 SIGKILLed while the group streams through the tree that the controller placed on
s1, s2 and s3; the controller finds s2 down and places the tree again with the spare PS (on the controller's
host ctl, on the spine's port 4) in rack 2's place, under the same root switch, and every result stays right.

A dead switch takes its servers' links with it, so the servers, the controller and the spare also meet on a
management network (test_failover_bmv2.ManagementNetwork: a bridge in the root namespace, host routes to the
controller's address over it); the spare's partials go up to the spine's address through s3 port 4."""

from __future__ import annotations

import numpy as np
import pytest

from .network import start_ps
from .test_e2e_bmv2 import ControllerProcess, expected, finish, run_workers, wait_running
from .test_failover_bmv2 import ManagementNetwork
from .test_tree_controller_multi_bmv2 import CONTROLLER_IP

pytestmark = pytest.mark.slow  # three BMv2 switches, a switch killed: make test-all's

SPARE = f"{CONTROLLER_IP}:9877"
SPARE_CONTROL = f"tcp://{CONTROLLER_IP}:9878"
HOSTS = ["h1", "h2", "h3", "h4"]


@pytest.fixture(scope="module")
def tree():
    from .tree_network import TreeNetwork

    net = TreeNetwork(per_rack=2, controller_ip=CONTROLLER_IP)
    mgmt = ManagementNetwork(net, HOSTS)
    yield net
    mgmt.close([net.net.get(h).IP() for h in HOSTS])
    net.stop()


@pytest.mark.timeout(600)
def test_a_leaf_switch_killed_mid_job_is_replaced_by_the_spare_ps(tree, pipeline, tmp_path):
    spare = start_ps(tree.net.get("ctl"), CONTROLLER_IP)
    controller = ControllerProcess(tree, pipeline, tmp_path, ps=[{"data": SPARE, "control": SPARE_CONTROL}])
    try:
        assert set(controller.start()["switches"].values()) == {"connected"}
        size = 20_000
        over = tmp_path / "over"  # the workers go on (--until) until the switch is dead, however fast it is
        procs = run_workers(tree, tmp_path, "doomed", HOSTS, size, wait=False,
                            extra=["--iterations", "4", "--failover-after", "1", "--until", str(over)])
        # s2 is killed once the tree runs on the switches and its root has completed rounds
        job = wait_running(controller, "doomed", procs, completed=500)
        assert {n["name"]: n["control"] for n in job["tree"]}["rack2"] == "switch:s2", job
        tree.net.get("s2").process.kill()
        over.touch()
        total, bound = expected(4, size)
        for report, r in finish(procs, tmp_path, "doomed"):
            assert report["moves"] == 1 and report["mode"] == "tree", report
            assert np.max(np.abs(r - total)) <= bound
        status = controller.ctl("status")
        job = next(j for j in status["jobs"] if j["job"] == "doomed")
        assert {n["name"]: n["control"] for n in job["tree"]} == {
            "rack1": "switch:s1", "rack2": SPARE_CONTROL, "spine": "switch:s3"}, job["tree"]
        s2 = next(a for a in status["aggregators"] if a["aggregator"] == "switch:s2")
        assert s2["state"] == "down" and status["switches"]["s2"].startswith("unavailable"), status
    finally:
        controller.stop()
        spare.terminate()
        spare.wait(10)
