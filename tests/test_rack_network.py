"""cluster/netns.RackNetwork, the racks of bench/emulated_racks.py: servers under leaf bridges, leaves on
uplinks to a spine, every link limited both ways, the uplinks at their own rate; one L2 network in which a
server of one rack reaches a server of another, the leaves' and the spine's addresses (where the tree's
aggregators listen) and a host on the spine; the fabric topology cluster/racks.py writes for it."""

from __future__ import annotations

import re
import subprocess

import pytest

from cluster import netns
from cluster.racks import fabric_topology, rack_hosts


def tbf_rates(ns: str) -> dict[str, str]:
    shown = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "show"], capture_output=True, text=True,
                           check=True).stdout
    return dict(re.findall(r"qdisc tbf \S+ dev (\S+) .*?rate (\S+)", shown))


@pytest.mark.timeout(60)
def test_racks_under_leaves_and_a_spine_reach_each_other_and_the_uplinks_have_their_own_rate():
    why = netns.available()
    if why:
        pytest.skip(f"network namespaces: {why}")
    with netns.RackNetwork(2, 2, 100.0, 50.0, ["ps"]) as net:
        assert sorted(net.hosts) == ["ps", "r0s0", "r0s1", "r1s0", "r1s1"] and sorted(net.leaves) == ["leaf0", "leaf1"]
        assert net.hosts["r1s1"].ip == "10.56.2.2" and net.leaves["leaf1"].ip == "10.56.2.254"
        src = net.hosts["r0s0"].namespace
        for ip in (net.hosts["r1s1"].ip, net.leaves["leaf1"].ip, net.switch.ip, net.hosts["ps"].ip):
            done = subprocess.run(["ip", "netns", "exec", src, "ping", "-c1", "-W5", ip], capture_output=True)
            assert done.returncode == 0, ip
        assert tbf_rates(net.hosts["r0s0"].namespace) == {"eth0": "100Mbit"}
        leaf = tbf_rates(net.leaves["leaf0"].namespace)  # its uplink, and its servers' ports
        assert leaf.pop("uplink") == "50Mbit" and sorted(leaf.values()) == ["100Mbit", "100Mbit"]
        assert sorted(tbf_rates(net.switch.namespace).values()) == ["100Mbit", "50Mbit", "50Mbit"]  # ps, uplinks
        net.set_uplink_rate(25.0)
        assert tbf_rates(net.leaves["leaf1"].namespace)["uplink"] == "25Mbit"
        assert tbf_rates(net.hosts["r1s0"].namespace) == {"eth0": "100Mbit"}
        assert rack_hosts(net, 1) == ["10.56.2.1", "10.56.2.2"]  # the fabric's racks (cluster/racks.py)
        leaves = [{"data": f"{net.leaves[f'leaf{k}'].ip}:9877", "control": f"c{k}"} for k in range(2)]
        root, spare = {"data": "10.56.0.254:9877", "control": "r"}, {"data": "10.56.250.1:9877", "control": "s"}
        topology = fabric_topology(net, leaves, root, [spare])
        assert topology["ps"] == [*leaves, root, spare]
        assert topology["fabric"] == [
            {"name": "rack0", "ps": "10.56.1.254:9877", "uplink": "spine", "hosts": ["10.56.1.1", "10.56.1.2"]},
            {"name": "rack1", "ps": "10.56.2.254:9877", "uplink": "spine", "hosts": ["10.56.2.1", "10.56.2.2"]},
            {"name": "spine", "ps": "10.56.0.254:9877"}]
        namespaces = list(net._namespaces)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns in listed for ns in namespaces)  # all removed
