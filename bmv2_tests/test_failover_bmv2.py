"""The switch dies mid-job (docs/reliability.md): `simple_switch_grpc` SIGKILLed while two workers
stream through it in Mininet; the group moves to the PS and every result stays right.

A switch that dies takes its links down, so the PS, the controller and the hosts also meet on
a management network here (a Linux bridge, as racks have one beside the data-plane switch):
host routes send the controller's and the PS's traffic over it, while the aggregation traffic
(to 10.0.0.254) crosses the switch."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest

from .network import REPO, start_ps
from .test_e2e_bmv2 import CONTROLLER, ControllerProcess, expected

HOSTS = 2
EXTRA = (("ps", "10.0.0.100", False), ("ctl", "10.0.0.253", True))
BRIDGE = "pmgmt0"
PS_IP, CTL_IP = "10.0.0.100", "10.0.0.253"


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True)


class ManagementNetwork:
    """A bridge in the root namespace (where the controller runs) and a veth from it into each
    namespaced host; host routes put the controller and the ``servers`` (the PSs) on it: a server
    reaches every other host over it, any other host the controller and the servers."""

    def __init__(self, network, hosts: list[str], servers: tuple[str, ...] = ("ps",)) -> None:
        self.links: list[str] = []
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)
        sh("ip", "link", "add", BRIDGE, "type", "bridge")
        sh("ip", "link", "set", BRIDGE, "up")
        addresses = {h: network.net.get(h).IP() for h in hosts}
        for i, h in enumerate(hosts):
            node = network.net.get(h)
            outside, inside = f"pmgmt{i + 1}", f"pmgmt{i + 1}i"
            subprocess.run(["ip", "link", "del", outside], capture_output=True)
            sh("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
            self.links.append(outside)
            sh("ip", "link", "set", outside, "master", BRIDGE, "up")
            sh("ip", "link", "set", inside, "netns", str(node.pid))
            node.cmd(f"ip link set {inside} name mgmt0 && ip link set mgmt0 up")
            node.cmd("sysctl -qw net.ipv4.conf.all.rp_filter=0 net.ipv4.conf.mgmt0.rp_filter=0")
            others = [a for o, a in addresses.items() if o != h and (h in servers or o in servers)]
            peers = [CTL_IP] + others
            for ip in peers:
                node.cmd(f"ip route replace {ip}/32 dev mgmt0")
        for ip in addresses.values():  # the controller's side
            sh("ip", "route", "replace", f"{ip}/32", "dev", BRIDGE, "src", CTL_IP)

    def close(self, addresses: list[str]) -> None:
        for ip in addresses:
            subprocess.run(["ip", "route", "del", f"{ip}/32", "dev", BRIDGE], capture_output=True)
        for link in self.links:
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)


@pytest.fixture(scope="module")
def network():
    from .network import Bmv2Network

    net = Bmv2Network(HOSTS, extra=EXTRA)
    hosts = ["h1", "h2", "ps"]
    mgmt = ManagementNetwork(net, hosts)
    yield net
    mgmt.close([net.net.get(h).IP() for h in hosts])
    net.stop()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("streams", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_switch_killed_mid_job_moves_the_group_to_the_ps(network, pipeline, tmp_path, streams):
    """With ``streams`` 2 every stream of the group (a job and entries each on the switch) moves to the PS."""
    if network.switch.process is None or network.switch.process.poll() is not None:  # killed by a run before
        network.switch.start([])
        network._wait_for_grpc()
    ps = start_ps(network.net.get("ps"), PS_IP)
    controller = ControllerProcess(network, pipeline, tmp_path)
    try:
        assert controller.start()["switch"] == "connected"
        size, iterations = 20_000, 4
        over = tmp_path / "over"  # the workers go on (--until) until the switch is dead, however fast it is
        procs = []
        for w, h in enumerate(["h1", "h2"]):
            ip = network.net.get(h).IP()
            procs.append(network.net.get(h).popen(
                [sys.executable, "-m", "passing.cli", "allreduce", "--controller", CONTROLLER, "--job-name", "doomed",
                 "--worker", str(w), "--workers", "2", "--bind", f"{ip}:{20000 + w}", "--size", str(size),
                 "--iterations", str(iterations), "--out", str(tmp_path / f"doomed-{w}.npy"), "--no-check",
                 "--timeout", "60", "--pool", str(64 // streams), "--failover-after", "1", "--until", str(over),
                 "--streams", str(streams), "--engine", "native" if streams > 1 else "auto"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(REPO)))
        deadline, stats = time.monotonic() + 60, {}
        while True:  # kill the switch once the job runs on it and has completed some rounds
            jobs = [j for j in controller.ctl("jobs")["jobs"] if j["job"] == "doomed"]
            if jobs:
                stats = controller.ctl("stats", "--job-id", str(jobs[0]["job_id"]))
                if stats.get(str(jobs[0]["job_id"]), {}).get("completed", 0) >= 1000:  # {}: not read this time
                    break
            if time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                errors = [p.communicate(timeout=30)[1][-3000:] for p in procs]
                raise AssertionError(f"the job did not get going on the switch: {jobs} {stats}; workers: {errors}")
            time.sleep(0.1)
        assert jobs[0]["mode"] == "switch" and len(jobs[0].get("stripes", [])) == streams - 1, jobs[0]
        network.switch.process.kill()
        killed = time.monotonic()
        over.touch()  # the call under way when the switch died ends on the PS, and the job with it
        total, bound = expected(2, size)
        for w, p in enumerate(procs):
            out, err = p.communicate(timeout=240)
            assert p.returncode == 0, f"worker {w}: {err}"
            report = json.loads(out.splitlines()[-1])
            assert report["moves"] == 1 and report["streams"] == streams, json.dumps(report)
            assert np.max(np.abs(np.load(tmp_path / f"doomed-{w}.npy") - total)) <= bound
        recovered = time.monotonic() - killed
        status = controller.ctl("status")
        job = next(j for j in status["jobs"] if j["job"] == "doomed")
        assert job["mode"] == "ps" and job["aggregator"] == f"{PS_IP}:9877"
        assert len(job.get("stripes", [])) == streams - 1, job  # every stream moved
        switch = next(a for a in status["aggregators"] if a["aggregator"] == "switch")
        assert switch["state"] == "down", switch
        print(f"switch killed: the job finished on the PS {recovered:.1f} s after the kill")
    finally:
        controller.stop()
        ps.terminate()
        ps.wait(10)
