"""The aggregator's UDP data path on both engines: every datagram counted once, whatever GRO
coalesces (large lanes, short last segments), GSO refusals that cost one message and not the
whole service, and admission of origins a RESULT can be sent to. Real sockets, real GSO/GRO:
the kernel coalesces what a sender hands it as one GSO message (docs/reliability.md)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from passing import Group, native, wire
from passing.aggregator.engine import JobSpec
from passing.aggregator.server import SoftwareAggregator
from passing.launch import free_udp_ports
from passing.transport import SOL_UDP, UDP_GRO, UDP_SEGMENT, BatchSocket, SendError, pack_address
from passing_protocol import rpc

ENGINES = ["numpy", pytest.param("native", marks=pytest.mark.skipif(not native.available(),
                                                                     reason="the native library is not built"))]
OUTCOMES = ("malformed", "rejected", "aggregated", "duplicate", "duplicate_answered", "stale")


def send_gso(sock: socket.socket, data: bytes, segment: int, dest: tuple[str, int]) -> None:
    """One GSO message: the kernel cuts it into datagrams of ``segment`` bytes (the last may be
    shorter), and a receiver with UDP_GRO gets them back as one coalesced buffer."""
    sock.sendmsg([data], [(SOL_UDP, UDP_SEGMENT, struct.pack("=H", segment))], 0, dest)


def bound_sockets(count: int) -> list[socket.socket]:
    socks = []
    for port in free_udp_ports(count):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind(("127.0.0.1", port))
        s.settimeout(5)
        socks.append(s)
    return socks


def serve_until(agg: SoftwareAggregator, received: int, timeout: float = 10.0) -> dict:
    """Serve in a thread until the aggregator's transport has counted ``received`` datagrams (or
    the timeout passed); returns its stats."""
    server = threading.Thread(target=agg.serve)
    server.start()
    try:
        deadline = time.monotonic() + timeout
        while True:
            stats = agg.stats()
            if stats["transport"]["packets_received"] >= received or time.monotonic() > deadline:
                return stats
            time.sleep(0.02)
    finally:
        agg.stop()
        server.join(10)


def assert_counted_once(stats: dict, datagrams: int) -> None:
    totals = stats["totals"]
    assert stats["transport"]["packets_received"] == datagrams, "datagrams the aggregator never counted"
    assert totals["received"] + totals["malformed"] == datagrams  # received: the PASSING packets among them
    assert sum(totals[k] for k in OUTCOMES) == datagrams  # each one counted once, under one outcome


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", ENGINES)
def test_a_gro_batch_of_many_small_segments_loses_no_datagram_at_large_lanes(engine):
    """1024 lanes (4 KiB packets): a receive buffer holds 17 packets, but the kernel coalesces up
    to 64 (128 on newer kernels) small datagrams of one GSO message into it. A stranger's
    messages of 64 tiny segments queued between two workers' DATA fill a whole receive batch's
    worth of datagrams: every one of them, and every DATA after them, is counted, and the
    round completes."""
    lanes, pool, workers = 1024, 16, 2
    socks = bound_sockets(workers)
    stranger = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    spec = JobSpec(1, 0, pool, [pack_address(*s.getsockname()) for s in socks], generation=3)
    agg = SoftwareAggregator(listen=("127.0.0.1", 0), control=None, lanes=lanes, engine=engine, jobs=[spec])
    try:
        payload = np.arange(pool * lanes, dtype=np.int64).reshape(pool, lanes) % 1000
        data = [wire.encode(type=wire.DATA, job=1, worker=w, psn=np.arange(pool), pool=pool, payload=payload + w,
                            generation=3, lanes=lanes) for w in range(workers)]
        messages, segments = 300, 64
        sent = 0
        for w in range(workers):  # worker w's first half, the stranger's flood, then the second halves
            for row in data[w][: pool // 2]:
                sent += socks[w].sendto(row.tobytes(), agg.address) > 0
        for i in range(messages):
            send_gso(stranger, bytes([i % 251]) * (8 * segments), 8, agg.address)
            sent += segments
        for w in range(workers):
            for row in data[w][pool // 2:]:
                sent += socks[w].sendto(row.tobytes(), agg.address) > 0
        stats = serve_until(agg, sent)
        print(f"{engine}: {sent} datagrams ({messages} GSO messages of {segments} tiny segments between "
              f"{workers * pool} DATA of 4 KiB), {stats['transport']['packets_received']} counted, "
              f"{stats['totals']['completed']} of {pool} rounds completed")
        assert_counted_once(stats, sent)
        assert stats["totals"]["malformed"] == messages * segments
        assert stats["totals"]["aggregated"] == workers * pool and stats["totals"]["completed"] == pool
        for s in socks:  # and the round's RESULTs reached every worker
            got = {}
            for _ in range(pool):
                r = wire.decode(s.recv(65536), lanes)[0]
                got[int(r["hdr"]["psn"])] = r["payload"].astype(np.int64)
            assert sorted(got) == list(range(pool))
            assert all(np.array_equal(got[p], 2 * payload[p] + 1) for p in got)
    finally:
        agg.close()
        stranger.close()
        for s in socks:
            s.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", ENGINES)
def test_a_short_last_segment_of_a_coalesced_buffer_is_read_from_its_own_offset(engine):
    """GRO coalesces datagrams of one size and a last, shorter one. Here: three datagrams of the
    packet size + 8 bytes (malformed), each the DATA of another job, then one well-formed DATA
    of the admitted job. The last one starts at 3 x (size + 8), not on a packet row: read from
    anywhere else, it would be one of the others (rejected), not the job's packet. Then the same
    with two datagrams of twice the packet size: the last one is on a row, but not the row its
    index says."""
    lanes, pool = wire.DEFAULT_LANES, 4
    (sock,) = bound_sockets(1)
    spec = JobSpec(1, 0, pool, [pack_address(*sock.getsockname())], generation=0)
    agg = SoftwareAggregator(listen=("127.0.0.1", 0), control=None, lanes=lanes, engine=engine, jobs=[spec])
    try:
        payload = np.arange(2 * lanes, dtype=np.int64).reshape(2, lanes) * 7 - 100
        good = wire.encode(type=wire.DATA, job=1, worker=0, psn=[0, 1], pool=pool, payload=payload, lanes=lanes)
        other = wire.encode(type=wire.DATA, job=2, worker=0, psn=0, pool=pool, payload=payload[0], lanes=lanes)
        size = wire.packet_size(lanes)
        send_gso(sock, (other.tobytes() + bytes(8)) * 3 + good[0].tobytes(), size + 8, agg.address)
        send_gso(sock, other.tobytes() * 4 + good[1].tobytes(), 2 * size, agg.address)
        stats = serve_until(agg, 7)
        assert_counted_once(stats, 7)
        # (a datagram's length gives its lanes: the longer ones are packets of 66 and 138 lanes of a
        # job that is not admitted, so rejected, once each)
        assert {k: stats["totals"][k] for k in ("malformed", "rejected", "aggregated")} == {
            "malformed": 0, "rejected": 5, "aggregated": 2}
        for psn in (0, 1):
            result = wire.decode(sock.recv(65536), lanes)[0]
            assert result["hdr"]["type"] == wire.RESULT and result["hdr"]["psn"] == psn
            assert np.array_equal(result["payload"], payload[psn])
    finally:
        agg.close()
        sock.close()


def gro_socket() -> socket.socket:
    """A receiving socket with UDP_GRO: what leaves a sender as one GSO message arrives as one
    coalesced buffer, what leaves as plain datagrams arrives one by one."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    s.setsockopt(SOL_UDP, UDP_GRO, 1)
    s.settimeout(5)
    return s


def receive_coalesced(sock: socket.socket) -> tuple[int, int]:
    """One receive: (bytes, GRO segment size or 0 when the buffer is one datagram)."""
    data, ancillary, _, _ = sock.recvmsg(1 << 17, socket.CMSG_SPACE(4))
    segment = [struct.unpack("=i", d[:4])[0] for level, kind, d in ancillary if level == SOL_UDP and kind == UDP_GRO]
    return len(data), (segment[0] if segment else 0)


@pytest.mark.timeout(30)
def test_a_gso_message_the_kernel_refuses_costs_that_message_not_gso():
    """numpy BatchSocket: the kernel refuses a GSO message to UDP port 0 (EINVAL). That message's
    packets are retried as plain datagrams (refused too: SendError, none sent) and GSO stays on:
    the next batch to a reachable receiver still leaves as one GSO message."""
    receiver = gro_socket()
    with BatchSocket(("127.0.0.1", 0)) as sender:
        packets = wire.encode(type=wire.RESULT, job=1, worker=0, psn=np.arange(8), pool=8,
                              payload=np.zeros(wire.DEFAULT_LANES))
        nowhere, there = pack_address("127.0.0.1", 0), pack_address(*receiver.getsockname())
        with pytest.raises(SendError) as refused:
            sender.send_batch(packets, np.r_[[nowhere] * 4, [there] * 4])
        assert refused.value.errno == errno.EINVAL and refused.value.sent == 0
        assert sender.gso and sender.stats.gso_fallbacks == 1
        sender.send_batch(packets, there)
        assert receive_coalesced(receiver) == (8 * sender.size, sender.size)  # one GSO message
    receiver.close()


def raw_udp(source_port: int, dest: tuple[str, int], payload: bytes) -> bytes:
    """A UDP datagram (header + payload) from 127.0.0.1:source_port, checksum 0 (none: IPv4)."""
    return struct.pack("!HHHH", source_port, dest[1], 8 + len(payload), 0) + payload


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", ENGINES)
def test_a_result_to_port_0_leaves_gso_on_for_everyone_else(engine):
    """A job admitted (programmatically: the control channel refuses it) with a worker at UDP port
    0, whose DATA a raw socket forges. Its RESULTs cannot be sent: the kernel refuses them (EINVAL)
    as a GSO message and as plain datagrams alike. That costs one send error and one GSO
    fallback; the other worker's RESULTs of the same batch still leave as one GSO message."""
    if os.geteuid() != 0:
        pytest.skip("a raw socket (forging source port 0) needs root")
    pool = 16
    worker = gro_socket()
    raw = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_UDP)
    spec = JobSpec(1, 0, pool, [pack_address("127.0.0.1", 0), pack_address(*worker.getsockname())], generation=0)
    agg = SoftwareAggregator(listen=("127.0.0.1", 0), control=None, engine=engine, jobs=[spec])
    try:
        for w in range(2):  # both workers' DATA, queued before the aggregator reads: one batch, one engine call
            data = wire.encode(type=wire.DATA, job=1, worker=w, psn=np.arange(pool), pool=pool,
                               payload=np.full(wire.DEFAULT_LANES, w + 1))
            for row in data:
                if w == 0:
                    raw.sendto(raw_udp(0, agg.address, row.tobytes()), agg.address)
                else:
                    worker.sendto(row.tobytes(), agg.address)
        stats = serve_until(agg, 2 * pool)
        assert_counted_once(stats, 2 * pool)
        assert stats["totals"]["completed"] == pool
        size = wire.packet_size()
        assert receive_coalesced(worker) == (pool * size, size)  # the worker's RESULTs: one GSO message
        assert stats["server"]["send_errors"] == 1 and stats["server"]["last_errno"] == errno.EINVAL
        assert stats["transport"]["gso_fallbacks"] == 1
        assert stats["transport"]["packets_sent"] == pool
    finally:
        agg.close()
        raw.close()
        worker.close()


def small_mtu_scenario(engine: str) -> dict:
    """Run inside a network namespace of its own (unshare -n): a route to 127.0.0.2 with an MTU of
    1500, below the 4 KiB packets of 1024 lanes. The kernel refuses GSO messages on that route
    (EMSGSIZE: a segment would not fit) but fragments plain datagrams. Job 1's worker sits at
    127.0.0.2 (its RESULTs take that route), job 2's at 127.0.0.1; each allreduces alone. Then a
    second aggregator at 127.0.0.2: a worker's DATA take that route. Returns what happened."""
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    subprocess.run(["ip", "route", "add", "local", "127.0.0.2/32", "dev", "lo", "table", "local", "mtu", "lock",
                    "1500"], check=True)
    lanes, pool = 1024, 8
    x = np.arange(16 * lanes, dtype=np.float32) - 5000  # 16 packets a call: 2 windows of pool

    def serve(listen: str, binds: list[tuple[str, int]]) -> tuple[list, dict, list]:
        jobs = [JobSpec(j + 1, j * pool, pool, [pack_address(*b)], generation=0) for j, b in enumerate(binds)]
        agg = SoftwareAggregator(listen=(listen, 0), control=None, lanes=lanes, engine=engine, jobs=jobs)
        server = threading.Thread(target=agg.serve)
        server.start()
        outcomes: list = [None] * len(binds)
        fallbacks: list = [None] * len(binds)

        def work(j: int) -> None:
            try:
                with Group(j + 1, 0, 1, [agg.address], pool=pool, lanes=lanes, bind=binds[j], timeout=5,
                           engine=engine) as g:
                    exact = all(np.array_equal(g.allreduce(x), x) for _ in range(3))
                    outcomes[j], fallbacks[j] = "exact" if exact else "wrong", g.stats.gso_fallbacks
            except Exception as e:  # reported to the test
                outcomes[j] = f"{type(e).__name__}: {e}"

        workers = [threading.Thread(target=work, args=(j,)) for j in range(len(binds))]
        for t in workers:
            t.start()
        for t in workers:
            t.join(60)
        stats = agg.stats()
        agg.stop()
        server.join(10)
        return outcomes, stats, fallbacks

    outcomes, stats, _ = serve("127.0.0.1", [("127.0.0.2", 20000), ("127.0.0.1", 20000)])
    data_outcomes, data_stats, host_fallbacks = serve("127.0.0.2", [("127.0.0.1", 20001)])
    return {"outcomes": outcomes, "gso_fallbacks": stats["transport"]["gso_fallbacks"],
            "send_errors": stats["server"]["send_errors"], "data_outcomes": data_outcomes,
            "host_gso_fallbacks": host_fallbacks[0], "data_aggregator_gso_fallbacks":
            data_stats["transport"]["gso_fallbacks"]}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("engine", ENGINES)
def test_a_route_whose_mtu_is_below_the_packet_size_gets_plain_datagrams(engine):
    """The kernel refuses GSO on one route only (its MTU is below the packet size). RESULTs on it
    go as plain, fragmented datagrams, and GSO stays on for the other job; a worker's DATA on it
    too, counted in the worker's own stats. Every result is exact."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a network namespace with its own routes needs root and unshare(1)")
    script = f"import json, sys; from tests.test_datapath import small_mtu_scenario; " \
             f"print(json.dumps(small_mtu_scenario({engine!r})))"
    done = subprocess.run(["unshare", "-n", sys.executable, "-c", script], cwd=Path(__file__).parent.parent,
                          capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    print(f"{engine}: MTU 1500 on one route, 4 KiB packets: {report}")
    assert report["outcomes"] == ["exact", "exact"] and report["data_outcomes"] == ["exact"]
    assert report["send_errors"] == 0 and report["gso_fallbacks"] >= 3  # a window's RESULTs at least, per call
    assert report["host_gso_fallbacks"] >= 3  # the worker's first window, per call
    assert report["data_aggregator_gso_fallbacks"] == 0  # its RESULTs' route takes them whole


@pytest.mark.parametrize("worker, why", [
    ("127.0.0.1:0", "UDP port 0 outside 1..65535"),
    ("0.0.0.0:20000", "0.0.0.0 is not a host's address"),
    ("224.0.0.1:20000", "224.0.0.1 is not a host's address"),
    ("255.255.255.255:20000", "255.255.255.255 is not a host's address"),
])
def test_admission_refuses_an_origin_no_result_can_be_sent_to(worker, why):
    """add_job over the control channel (the controller's way in) and the config file's jobs both
    go through job_from_json: a worker at port 0 or at no host's address is refused, clearly,
    and nothing is admitted."""
    agg = SoftwareAggregator(listen=("127.0.0.1", 0), control=None, engine="numpy")
    try:
        reply = agg.handle({"version": rpc.AGGREGATOR_VERSION, "cmd": "add_job",
                            "job": {"job": 1, "pool": 4, "workers": ["127.0.0.1:20001", worker]}})
        assert reply["ok"] is False and why in reply["error"], reply
        assert agg.handle({"version": rpc.AGGREGATOR_VERSION, "cmd": "jobs"})["jobs"] == []
    finally:
        agg.close()
