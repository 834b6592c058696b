"""Controller pieces that need no switch: topology files, value encoding, an unreachable switch."""

from __future__ import annotations

import socket
import time

import pytest

from passing_controller.p4runtime import SwitchUnreachable, encode
from passing_controller.session import Switch
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


def _allocate(store, job_id, generation, name):
    from passing_controller.store import Record

    store.add(Record(job_id, name, 0, "ps", generation, 0, 1, [], {"data": "x"}))


def test_job_ids_are_handed_out_least_recently_used_with_the_next_generation(tmp_path):
    from passing_controller.store import Store, StoreError

    store = Store(tmp_path / "s.sqlite")
    max_id = 3
    claimed = [store.claim_job_id(max_id) for _ in range(3)]
    assert claimed == [(1, 0), (2, 0), (3, 0)]  # never-used ids first
    for job_id, generation in claimed:
        _allocate(store, job_id, generation, f"j{job_id}")
    with pytest.raises(StoreError, match="all 3 job ids"):
        store.claim_job_id(max_id)
    store.remove(2)
    store.remove(1)
    assert store.claim_job_id(max_id) == (1, 1)  # both free: id 1 was used longer ago
    _allocate(store, 1, 1, "again")
    assert store.claim_job_id(max_id) == (2, 1)
    store.close()
    # The order and the generations survive a restart.
    store = Store(tmp_path / "s.sqlite")
    store.remove(1)
    store.remove(3)
    assert store.claim_job_id(max_id) == (3, 1)  # last used before 1 and 2 were reused
    assert store.claim_job_id(max_id) == (1, 2)
    assert store.claim_job_id(max_id) == (2, 2)  # 2's claim above never became an allocation: free, and newest


def test_a_job_id_never_recurs_with_the_same_generation_before_65536_uses():
    from passing_controller.store import Store

    store = Store(":memory:")  # the claims' logic, not the disk: 12 000 synchronous commits took 2 minutes
    seen = set()
    for _ in range(2_000):  # one free id: it is reused at every claim
        pair = store.claim_job_id(1)
        assert pair not in seen
        seen.add(pair)
    assert {g for _, g in seen} == set(range(2_000))


def test_a_store_of_the_previous_schema_is_refused_with_a_clear_error(tmp_path):
    import sqlite3

    from passing_controller.store import Store, StoreError

    path = tmp_path / "old.sqlite"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE allocation (job_id INTEGER PRIMARY KEY, epoch INTEGER)")
    db.commit()
    db.close()
    with pytest.raises(StoreError, match="another controller version"):
        Store(path)


def test_p4runtime_tls_in_the_topology_and_a_clear_error_for_a_missing_file():
    from pathlib import Path

    from passing_controller.p4runtime import SwitchError, Tls
    from passing_controller.switch import connect
    from passing_controller.topology import Topology, TopologyError

    switch = {"p4runtime": "127.0.0.1:1", "aggregation_mac": "02:00:00:00:00:fe", "aggregation_ip": "10.0.0.254"}
    topo = Topology.from_dict({"switch": {**switch, "tls": {"ca": "ca.pem", "cert": "c.pem", "key": "c.key"}},
                               "hosts": []})
    assert topo.tls == {"ca": "ca.pem", "cert": "c.pem", "key": "c.key"}
    for bad in ({"cert": "c.pem"}, {"ca": "ca.pem", "cert": "c.pem"}, {"ca": "x", "extra": 1}, "ca.pem"):
        with pytest.raises(TopologyError, match="tls"):
            Topology.from_dict({"switch": {**switch, "tls": bad}, "hosts": []})
    with pytest.raises(SwitchError, match="cannot read /nonexistent/ca.pem"):
        connect("127.0.0.1:1", tls=Tls(Path("/nonexistent/ca.pem")))
