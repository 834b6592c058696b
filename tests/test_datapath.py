"""The aggregator's UDP data path on both engines: every datagram counted once, whatever GRO
coalesces (large lanes, short last segments), GSO refusals that cost one message and not the
whole service, and admission of origins a RESULT can be sent to. Real sockets, real GSO/GRO:
the kernel coalesces what a sender hands it as one GSO message (docs/reliability.md)."""

from __future__ import annotations

import socket
import struct
import threading
import time

import numpy as np
import pytest

from passing import native, wire
from passing.aggregation import JobSpec
from passing.aggregator import SoftwareAggregator
from passing.cli import free_udp_ports
from passing.transport import SOL_UDP, UDP_SEGMENT, pack_address

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
    assert totals["received"] == datagrams
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
        assert {k: stats["totals"][k] for k in ("malformed", "rejected", "aggregated")} == {
            "malformed": 5, "rejected": 0, "aggregated": 2}
        for psn in (0, 1):
            result = wire.decode(sock.recv(65536), lanes)[0]
            assert result["hdr"]["type"] == wire.RESULT and result["hdr"]["psn"] == psn
            assert np.array_equal(result["payload"], payload[psn])
    finally:
        agg.close()
        sock.close()
