"""Controller pieces that need no switch: topology files, value encoding, an unreachable switch."""

from __future__ import annotations

import socket
import time

import pytest

from passing_controller.p4runtime import Switch, SwitchUnreachable, encode
from passing_controller.topology import Topology, TopologyError

GOOD = {
    "switch": {"p4runtime": "127.0.0.1:9559", "aggregation_mac": "02:00:00:00:00:fe",
               "aggregation_ip": "10.0.0.254"},
    "hosts": [{"name": "h1", "mac": "02:00:00:00:00:01", "ip": "10.0.0.1", "port": 1},
              {"name": "h2", "mac": "02:00:00:00:00:02", "ip": "10.0.0.2", "port": 2}],
    "ps": [{"data": "10.0.0.100:9877", "control": "tcp://10.0.0.100:9878"}],
}


def test_topology_loads_and_finds_hosts(tmp_path):
    path = tmp_path / "topo.json"
    import json

    path.write_text(json.dumps(GOOD))
    topo = Topology.load(path)
    assert topo.host("h2").port == 2 and topo.host("10.0.0.1").name == "h1"
    assert topo.slots == 1024 and topo.lanes == 64 and topo.ps[0].data == "10.0.0.100:9877"
    with pytest.raises(TopologyError, match="no host"):
        topo.host("h9")


@pytest.mark.parametrize("change,message", [
    (lambda t: t["hosts"][1].update(mac="02:00:00:00:00:01"), "share a mac"),
    (lambda t: t["hosts"][1].update(port=1), "share a port"),
    (lambda t: t["hosts"][0].update(ip="10.0.0.300"), "bad IPv4"),
    (lambda t: t["hosts"][0].update(mac="zz:00:00:00:00:01"), "bad MAC"),
    (lambda t: t["hosts"][0].update(port=600), "outside"),
    (lambda t: t["switch"].pop("aggregation_ip"), "missing or bad field"),
])
def test_topology_errors_are_clear(change, message):
    import copy

    raw = copy.deepcopy(GOOD)
    change(raw)
    with pytest.raises(TopologyError, match=message):
        Topology.from_dict(raw)


def test_p4runtime_values_are_canonical():
    assert encode(0, 9) == b"\x00"
    assert encode(1, 9) == b"\x01"
    assert encode(0x1FF, 9) == b"\x01\xff"
    assert encode(b"\x00\x00\x05", 48) == b"\x05"
    with pytest.raises(ValueError):
        encode(512, 9)


def test_unreachable_switch_is_an_error_not_a_hang():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again when the block ends: nothing listens
    start = time.monotonic()
    with pytest.raises(SwitchUnreachable, match="no P4Runtime server"):
        Switch(f"127.0.0.1:{port}", timeout=1.0)
    assert time.monotonic() - start < 5
