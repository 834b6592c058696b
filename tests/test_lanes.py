"""Packets sized to the aggregator (docs/control.md, Lanes): a software aggregator states the largest
packet it takes, the controller gives a group on a PS the most lanes that the PS and the path MTU
allow, one aggregator serves jobs of different lane counts at once, and a group that moves to a PS
of another lane count carries on."""

from __future__ import annotations

import os
import signal
import threading

import numpy as np
import pytest

from passing import Group, wire
from passing.aggregator.control_channel import ControlClient, job_from_json
from passing.aggregator.server import SoftwareAggregator
from passing.control import join
from passing.launch import free_udp_ports
from passing.transport import BatchSocket, pack_address
from passing_controller.topology import PS_WINDOW_BYTES, Topology, TopologyError, lanes_for, ps_pool
from tests.cluster import run_threads
from tests.test_controller_ps_fallback import Running
from tests.test_failover import assert_exact, inputs, run_group, two_ps  # noqa: F401  (the fixture)


def test_lanes_fill_the_mtu_without_fragmentation():
    for mtu in (68, 576, 1280, 1400, 1500, 9000, 65536):
        lanes = lanes_for(mtu, 1 << 20)
        datagram = wire.packet_size(lanes) + 28  # + UDP and IPv4 headers
        assert datagram <= min(mtu, 65535) and wire.packet_size(lanes + 1) + 28 > min(mtu, 65535), mtu
    assert lanes_for(1500, 1024) == 364 and lanes_for(9000, 4096) == 2239
    assert lanes_for(9000, 1024) == 1024 and lanes_for(65536, 1024) == 1024  # the PS's limit
    assert lanes_for(65536, 1 << 20) == 16372  # the largest UDP datagram, 65 507 bytes


def test_the_topology_gives_each_ps_a_path_mtu():
    topo = Topology.from_dict({"ps": [{"data": "10.0.0.100:9877", "control": "tcp://10.0.0.100:9878"},
                                      {"data": "127.0.0.1:9877", "control": "tcp://127.0.0.1:9878"},
                                      {"data": "10.0.0.101:9877", "control": "tcp://10.0.0.101:9878", "mtu": 9000}]})
    assert [p.mtu for p in topo.ps] == [1500, 65536, 9000]  # a real network, loopback, as configured
    assert [p.lanes({"lanes": 64, "max_lanes": 1024}) for p in topo.ps] == [364, 1024, 1024]
    assert topo.ps[0].lanes({"lanes": 64}) == 64  # a PS that states no max_lanes: its lanes
    with pytest.raises(TopologyError, match="mtu 40"):
        Topology.from_dict({"ps": [{"data": "10.0.0.1:9877", "control": "tcp://10.0.0.1:9878", "mtu": 40}]})


@pytest.mark.parametrize("engine", ["native", "numpy"])
def test_a_software_aggregator_states_the_largest_packet_it_takes(engine):
    agg = SoftwareAggregator(listen=("127.0.0.1", 0), control="tcp://127.0.0.1:*", max_lanes=512, engine=engine)
    server = threading.Thread(target=agg.serve)
    server.start()
    try:
        client = ControlClient(agg.control_endpoint)
        ping = client.request("ping")
        assert (ping["lanes"], ping["max_lanes"], ping["max_datagram"]) == (64, 512, wire.packet_size(512))
        with pytest.raises(Exception, match="513 lanes, this aggregator takes 1..512"):
            client.request("add_job", job={"job": 1, "pool": 4, "workers": ["127.0.0.1:1"], "lanes": 513})
        added = client.request("add_job", job={"job": 2, "pool": 4, "workers": ["127.0.0.1:1"]})["job"]
        assert added["lanes"] == 64  # a job that states none: the aggregator's lanes
    finally:
        agg.stop()
        server.join(10)


def test_coalesced_datagrams_of_another_size_each_land_in_a_row_of_their_own():
    """A socket whose rows hold the largest packet receives GRO buffers of smaller packets: every
    datagram in its own row, bytes and length intact (the software aggregator's receive path)."""
    wide = BatchSocket(("127.0.0.1", 0), lanes=1024)
    senders = {lanes: BatchSocket(("127.0.0.1", 0), lanes=lanes) for lanes in (64, 364, 1024)}
    dest = pack_address(*wide.address)
    sent = {}
    try:
        for lanes, sock in senders.items():
            packets = wire.encode(type=wire.DATA, job=lanes, worker=0, psn=np.arange(150), pool=150,
                                  payload=np.arange(150 * lanes).reshape(150, lanes) % 1000 - 500, lanes=lanes)
            sock.send_batch(packets, dest)
            sent[lanes] = [p.tobytes() for p in packets]
        got: dict[int, list[bytes]] = {lanes: [] for lanes in senders}
        while sum(map(len, got.values())) < 450 and wide.wait_readable(2.0):
            view, lengths, sources = wide.recv_packets()
            for row, length in zip(view, lengths):
                lanes = (int(length) - wire.HEADER_SIZE) // 4
                got[lanes].append(row.tobytes()[:length])
        for lanes in senders:
            assert got[lanes] == sent[lanes], lanes  # in order, every byte
    finally:
        wide.close()
        for sock in senders.values():
            sock.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("engine", ["native", "numpy"])
def test_one_aggregator_serves_jobs_of_different_lane_counts_at_once(engine):
    lane_counts = (64, 364, 1024)
    agg = SoftwareAggregator(listen=("127.0.0.1", 0), control=None, engine=engine)
    addresses = {lanes: [f"127.0.0.1:{p}" for p in free_udp_ports(2)] for lanes in lane_counts}
    for job, lanes in enumerate(lane_counts, 1):
        agg.add_job(job_from_json({"job": job, "base": 64 * job, "pool": 32, "workers": addresses[lanes],
                                   "lanes": lanes}))
    server = threading.Thread(target=agg.serve)
    server.start()
    data = {lanes: [np.arange(50_000, dtype=np.int32) * (w + 1) + lanes for w in range(2)] for lanes in lane_counts}

    def work(i: int) -> np.ndarray:
        job, w = divmod(i, 2)
        lanes = lane_counts[job]
        with Group(job + 1, w, 2, [agg.address], pool=32, lanes=lanes, bind=addresses[lanes][w], engine=engine,
                   timeout=20) as g:
            return g.allreduce(data[lanes][w])

    try:
        results = run_threads(work, 6)
        totals = {j.job: agg.engine.counters(j.job) for j in agg.engine.jobs()}
    finally:
        agg.stop()
        server.join(10)
    for i, r in enumerate(results):
        lanes = lane_counts[i // 2]
        assert not isinstance(r, Exception), r
        assert np.array_equal(r, data[lanes][0] + data[lanes][1]), lanes
    for job, lanes in enumerate(lane_counts, 1):
        assert totals[job]["completed"] == -(-50_000 // lanes) and totals[job]["rejected"] == 0, (lanes, totals)


def join_on_a_ps(tmp_path, ps: dict, groups: list[tuple[str, int | None]], workers: int, default_pool: int = 16,
                 size: int = 10_000) -> dict[str, list[tuple[dict, np.ndarray, np.ndarray]]]:
    """A software aggregator on loopback and a PS-only controller over it (topology entry ``ps`` with
    the aggregator's endpoints added); for each (job, pool) in ``groups``, ``workers`` workers join
    and allreduce once. Returns per job each worker's (answer, result, the exact sum)."""
    agg = SoftwareAggregator(listen=("127.0.0.1", 0), control="tcp://127.0.0.1:*")
    server = threading.Thread(target=agg.serve)
    server.start()
    topology = {"ps": [{"data": "{}:{}".format(*agg.address), "control": agg.control_endpoint, **ps}]}
    running = Running(Topology.from_dict(topology), tmp_path / "ctl.sqlite", default_pool=default_pool)
    x = [np.arange(size, dtype=np.float32) * (w + 1) for w in range(workers)]

    def work(w: int, job: str, pool: int | None, ports: list[int]) -> tuple[dict, np.ndarray, np.ndarray]:
        answer = join(running.endpoint, job, w, workers, host="127.0.0.1", udp_port=ports[w], pool=pool, timeout=30)
        with Group.from_answer(answer, bind=("127.0.0.1", ports[w]), timeout=20) as g:
            return answer, g.allreduce(x[w]), np.sum(x, axis=0)

    try:
        outcomes = {}
        for job, pool in groups:
            ports = free_udp_ports(workers)
            outcomes[job] = run_threads(lambda w, j=job, p=pool, q=ports: work(w, j, p, q), workers)
    finally:
        running.stop()
        agg.stop()
        server.join(10)
    for outcome in [o for per_job in outcomes.values() for o in per_job]:
        assert not isinstance(outcome, Exception), outcome
    return outcomes


@pytest.mark.timeout(120)
def test_the_controller_sizes_a_ps_group_to_the_path_mtu(tmp_path):
    for answer, result, exact in join_on_a_ps(tmp_path, {"mtu": 1500}, [("mtu", None)], workers=2)["mtu"]:
        assert answer["mode"] == "ps" and answer["lanes"] == 364  # 1500 - 28 - 16 = 364 x 4 bytes
        assert np.array_equal(result, exact)


def test_a_ps_group_keeps_its_window_within_the_ps_budget():
    """Without a pool asked for, a PS group's workers keep at most PS_WINDOW_BYTES in flight:
    wide packets get fewer slots, more workers fewer again; switch-sized packets keep the default."""
    assert ps_pool(64, 2, 256) == 256 and ps_pool(64, 8, 256) == 256  # 272-byte packets
    assert [ps_pool(1024, n, 256) for n in (1, 2, 4, 8, 16, 32)] == [256, 255, 127, 63, 31, 16]
    for lanes in (1, 64, 364, 1024, 2239, 16372):
        for workers in (1, 2, 3, 8, 32):
            pool = ps_pool(lanes, workers, 256)
            assert 16 <= pool <= 256
            assert pool == 16 or workers * pool * wire.packet_size(lanes) <= PS_WINDOW_BYTES


@pytest.mark.timeout(120)
def test_the_controller_gives_a_ps_group_its_window_unless_the_job_asks(tmp_path):
    # loopback: 1024 lanes
    outcomes = join_on_a_ps(tmp_path, {}, [("chosen", None), ("asked", 200)], workers=4, default_pool=256,
                            size=50_000)
    for job, pool in (("chosen", 127), ("asked", 200)):  # 2 MiB / (4 x 4 112 bytes) = 127
        for answer, result, exact in outcomes[job]:
            assert answer["mode"] == "ps" and answer["lanes"] == 1024 and answer["pool"] == pool, answer
            assert np.array_equal(result, exact)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("engine", ["native", "numpy"])
def test_a_group_moves_to_a_ps_of_another_lane_count(two_ps, tmp_path, engine):  # noqa: F811
    """Two PSs, one behind a 1500-byte path (364 lanes), one on loopback (1024 lanes): the one that
    serves the group is killed mid-run, and the group carries on with the other one's lane count."""
    (p0, r0), (p1, r1) = two_ps
    topo = Topology.from_dict({"ps": [{**r0, "mtu": 1500}, {**r1}]})
    running = Running(topo, tmp_path / "ctl.sqlite")
    data = inputs(calls=12, workers=2, size=30_000)
    lanes_seen: dict[int, list[int]] = {0: [], 1: []}

    def kill_at_call_4(w: int, k: int, g: Group) -> None:
        lanes_seen[w].append(g.lanes)
        if w == 0 and k == 4:
            port = g.aggregators[0].port
            os.kill((p0 if r0["data"].endswith(f":{port}") else p1).pid, signal.SIGKILL)

    try:
        outcomes = run_group(running.endpoint, "moved-lanes", data, kill_at_call_4, engine=engine)
    finally:
        running.stop()
    assert_exact(data, outcomes)
    first = outcomes[0][0]["lanes"]
    assert first in (364, 1024)
    for answer, _, moves in outcomes:
        assert answer["lanes"] == first and moves == 1
    for w in (0, 1):  # the lane count of each call's start: the first PS's, then the other's
        assert lanes_seen[w][0] == first and lanes_seen[w][-1] == {364: 1024, 1024: 364}[first], lanes_seen[w]
