"""tests/test_torch_tree_failover.py as deployed (docs/reliability.md): DDP and FSDP2 across two racks in
network namespaces (cluster/netns.RackNetwork: 2 racks x 2 servers of one rank each, the racks interleaved
in the servers' order, links of 1000 Mbit/s to their rack's leaf, uplinks of 2000 Mbit/s to the spine). A
software aggregator in each rack's leaf namespace (the PS leaf), the PS root and the spare PSs on hosts of
their own on the spine, the real controller in the spine namespace on a topology whose fabric names them
(cluster/racks.py, as bench/emulated_racks.py starts them). DDP: rack 0's leaf SIGKILLed past rank 0's
fifth step, then the root once the group has moved; the training ends as on gloo, over the same links.
FSDP2: rack 0's leaf, or the root, SIGKILLed mid-step; every step's loss is gloo's."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install -e 'host[test]')")
pytest.importorskip("sklearn", reason="scikit-learn is not installed (pip install -e 'host[test]')")
pytestmark = pytest.mark.slow  # trainings of four ranks in eleven namespaces (make test-all)

from cluster import netns  # noqa: E402
from cluster.local import REPO, collect, launch_ranks  # noqa: E402
from cluster.racks import fabric_topology, start_aggregator_in, start_spine_controller  # noqa: E402
from tests.test_torch_tree_failover import EPOCHS, SERVERS, WORKER, check_ddp_across_racks, running  # noqa: E402
from tests.zygote import torch_ranks_in  # noqa: E402

ORDER = ["r0s0", "r1s0", "r0s1", "r1s1"]  # server s is rack s % 2's: as host_ip(s % 2, s // 2) on loopback
# asks the controller for its status once a line, from inside the spine namespace (the test's own is not on
# the network): one status (or the error) a line, as JSON
PROBE = ("import json, sys\nfrom tests.keys import ask\nfor _ in sys.stdin:\n    try:\n"
         "        print(json.dumps(ask(sys.argv[1], 'status')), flush=True)\n"
         "    except Exception as e:\n        print(json.dumps({'error': repr(e)}), flush=True)\n")


class RackServices:
    """The RackNetwork, its aggregators (``procs``/``ready``: leaf0, leaf1, root, then the spares), the
    controller (``endpoint``; a PS that does not answer in 2 s is down, as Services on loopback) and a
    status probe in the spine."""

    def __init__(self, workdir: Path, spares: int) -> None:
        self.net = netns.RackNetwork(2, 2, 1000.0, 2000.0, ["root", *(f"spare{j}" for j in range(spares))])
        try:
            self.procs: list[subprocess.Popen] = []
            self.ready: list[dict[str, str]] = []
            places = [("leaf0", self.net.leaves["leaf0"].ip), ("leaf1", self.net.leaves["leaf1"].ip),
                      *((h, self.net.hosts[h].ip) for h in ["root", *(f"spare{j}" for j in range(spares))])]
            for where, ip in places:
                proc, ready = start_aggregator_in(self.net.popen, where, ip, f"tcp://{ip}:9878")
                self.procs.append(proc)
                self.ready.append(ready)
            topology = fabric_topology(self.net, self.ready[:2], self.ready[2], self.ready[3:])
            _, self.endpoint = start_spine_controller(self.net, topology, workdir, 9090, ["--ps-timeout", "2"])
            self.probe = self.net.popen("switch", [sys.executable, "-c", PROBE, self.endpoint], cwd=REPO,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        except BaseException:
            self.net.stop()
            raise

    def status(self) -> dict[str, Any]:
        self.probe.stdin.write("\n")
        self.probe.stdin.flush()
        line = self.probe.stdout.readline()
        if not line:
            raise AssertionError(f"the status probe ended ({self.probe.poll()})")
        reply = json.loads(line)
        assert "error" not in reply, f"the controller's status: {reply['error']}"
        return reply

    def on_node(self, control: str) -> bool:
        """Whether some group has a node of its tree on the PS of ``control``."""
        return any(n["control"] == control for j in self.status()["jobs"] for n in j.get("tree", []))

    def wait_on_node(self, control: str, procs: list, seconds: float = 120) -> None:
        """Until some group's tree has a node on ``control`` (every rank running meanwhile)."""
        deadline = time.monotonic() + seconds
        while not self.on_node(control):
            assert running(procs) and time.monotonic() < deadline, f"no tree on {control} in {seconds} s"
            time.sleep(0.05)

    def launch(self, argv: list[str], env: dict[str, str]) -> list[subprocess.Popen]:
        """One rank on each server of ORDER, in its namespace, its address its PASSING_HOST."""
        hosts = [self.net.hosts[s] for s in ORDER]
        return launch_ranks(argv, SERVERS, 1, {"PASSING_CONTROLLER": self.endpoint, "GLOO_SOCKET_IFNAME": "eth0",
                                               **env},
                            popen_for_server=torch_ranks_in([h.namespace for h in hosts]),
                            env_for_server=lambda s: {"PASSING_HOST": hosts[s].ip}, master_host=hosts[0].ip)

    def stop(self) -> None:
        self.net.stop()


@pytest.fixture
def racks(request, tmp_path):
    why = netns.available()
    if why:
        pytest.skip(f"network namespaces unavailable: {why}")
    services = RackServices(tmp_path, request.param)
    try:
        yield services
    finally:
        services.stop()


def kill_all(procs: list) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()


@pytest.mark.timeout(900)
@pytest.mark.parametrize("racks", [2], indirect=True)
def test_ddp_across_racks_in_network_namespaces_survives_a_leaf_and_the_root_killed(racks, tmp_path):
    gloo = collect(racks.launch([*WORKER, "ddp_gloo", str(EPOCHS)], {"PASSING_CONTROLLER": ""}), 400)
    for rank, (rc, report, stderr) in enumerate(gloo):
        assert rc == 0 and report is not None, f"gloo rank {rank} failed ({rc}):\n{stderr[-3000:]}"
    marker, hold = tmp_path / "training", tmp_path / "checked"
    leaf, root, spares = racks.ready[0]["control"], racks.ready[2]["control"], racks.ready[3:]
    procs = racks.launch([*WORKER, "ddp_fault", str(EPOCHS)],
                         {"PASSING_TIMEOUT": "60", "PASSING_FAILOVER_AFTER": "1", "PASSING_TEST_MARKER": str(marker),
                          "PASSING_TEST_HOLD": str(hold), "PYTHONFAULTHANDLER": "1"})
    try:
        while not marker.exists():  # rank 0 is past its fifth training step
            assert running(procs)
            time.sleep(0.05)
        placed = [j for j in racks.status()["jobs"] if j["mode"] == "tree"]
        assert placed and racks.on_node(leaf), racks.status()
        kills = [time.time()]
        racks.procs[0].kill()  # `ip netns exec` execs the aggregator: its SIGKILL
        racks.wait_on_node(spares[0]["control"], procs)  # a group moved: the spare took the leaf
        moved = [time.time()]
        assert racks.on_node(root)
        kills.append(time.time())
        racks.procs[2].kill()
        racks.wait_on_node(spares[1]["control"], procs)  # and the other spare the root
        moved.append(time.time())
        trees = [j for j in racks.status()["jobs"] if j["mode"] == "tree"]
        hold.touch()  # the training may end now (rank 0 held its last step until the test saw both moves)
        outcomes = collect(procs, 400)
    finally:
        hold.touch()
        kill_all(procs)
    check_ddp_across_racks(outcomes, gloo, kills, moved, trees,
                           [spares[0]["data"], racks.ready[1]["data"], spares[1]["data"]], "in namespaces: ")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("racks", [1], indirect=True)
@pytest.mark.parametrize("node, index, phase", [("rack0's leaf", 0, "backward"), ("the root", 2, "forward")])
def test_fsdp2_across_racks_in_network_namespaces_with_a_node_killed_trains_as_on_gloo(racks, tmp_path, node,
                                                                                      index, phase):
    """FSDP2 (`fully_shard`) on the four servers; ``node`` SIGKILLed before step 3's ``phase``: the group in
    flight moves to a tree with the spare in its place, and every step's loss is gloo's (each rank runs the
    same training on gloo too, over the same links)."""
    from tests.test_torch_sharded import WORKER as SHARDED_WORKER
    from tests.test_torch_sharded import check_fsdp_reports, wait_for

    marker = tmp_path / "strike"
    procs = racks.launch([*SHARDED_WORKER, "fsdp_fault", "15", "0.3", phase, "3"],
                         {"PASSING_TIMEOUT": "60", "PASSING_FAILOVER_AFTER": "1", "PASSING_TEST_MARKER": str(marker)})
    try:
        wait_for(marker, procs, 400)
        placed = [j for j in racks.status()["jobs"] if j["mode"] == "tree"]
        assert placed and racks.on_node(racks.ready[index]["control"]), placed
        racks.procs[index].kill()
        marker.with_suffix(".done").touch()
        racks.wait_on_node(racks.ready[3]["control"], procs)  # the spare took the node
        outcomes = collect(procs, 400)
    finally:
        kill_all(procs)
    failed = [f"rank {rank} ({rc}):\n{stderr[-2500:]}" for rank, (rc, report, stderr) in enumerate(outcomes)
              if rc != 0 or report is None]
    assert not failed, "\n".join(failed)
    reports = [report for _, report, _ in outcomes]
    seconds = max(r["passing"]["seconds"] for r in reports)
    print(f"FSDP2 across racks in namespaces, {node} SIGKILLed before step 3's {phase}: {seconds:.1f} s for 15 "
          f"steps; moves {[r['moves'] for r in reports]}")
    check_fsdp_reports(reports, mode="tree")
    assert all(r["moves"] >= 1 and not r["on_gloo"] for r in reports), reports
