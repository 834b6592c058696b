"""An all_gather's stream takes every datagram of a receive batch, also those behind its completion
RESULT: a faster peer's GATHERs of the next call come right after that RESULT (the aggregator sends
in order), and the C loop dropped them, so the next all_gather waited a probe for its NACK (a second
at `rto` on loss-free links: FSDP's 8 x 1 emulated step took 1.3 s instead of 0.29 s, and resent).

Deterministic: the worker is a real Group in a process of its own; the test is its aggregator on a
real UDP socket, and stops the worker (SIGSTOP) while it queues the RESULT and the next GATHER, so
that one receive batch holds both."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest

from passing import native, wire

ENGINES = ["numpy", pytest.param("native", marks=pytest.mark.skipif(not native.available(),
                                                                     reason="the native library is not built"))]
LANES = 4
WORKER = """
import json, sys
import numpy as np
from passing import Group
port, engine = int(sys.argv[1]), sys.argv[2]
with Group(job=3, worker=0, workers=2, aggregators=[f"127.0.0.1:{port}"], pool=4, lanes=4, bind=("127.0.0.1", 0),
           engine=engine, rto=5.0, max_rto=5.0, timeout=20) as g:
    print(json.dumps({"port": g.address[1]}), flush=True)
    first = g.allgather(np.array([1, 2, 3, 4], np.int32))
    second = g.allgather(np.array([5, 6, 7, 8], np.int32))
    print(json.dumps({"first": first.tolist(), "second": second.tolist(),
                      "retransmissions": g.stats.retransmissions}), flush=True)
"""


def packet(kind: int, psn: int, owner: int, payload: list[int], slot: int = 0, set_: int = 0) -> bytes:
    return wire.encode(type=kind, job=3, worker=0, psn=psn, slot=slot, set=set_, owner=owner, payload=payload,
                       lanes=LANES).tobytes()


def expect(sock: socket.socket, kind: int) -> np.ndarray:
    """The worker's next datagram, of ``kind``."""
    while True:
        data, _ = sock.recvfrom(4096)
        hdr = np.frombuffer(data[: wire.HEADER_SIZE], dtype=wire.HEADER_DTYPE)[0]
        if int(hdr["type"]) == kind:
            return hdr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("engine", ENGINES)
def test_the_next_calls_gathers_behind_a_completion_result_are_kept(engine):
    agg = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    agg.bind(("127.0.0.1", 0))
    agg.settimeout(10)
    proc = subprocess.Popen([sys.executable, "-c", WORKER, str(agg.getsockname()[1]), engine],
                            stdout=subprocess.PIPE, text=True)
    try:
        worker = ("127.0.0.1", json.loads(proc.stdout.readline())["port"])
        # call 1: positions 0 (one packet a piece); worker 1's piece, relayed; then the completion round
        assert int(expect(agg, wire.GATHER)["psn"]) == 0
        agg.sendto(packet(wire.GATHER, 0, owner=1, payload=[9, 9, 9, 9]), worker)
        done = expect(agg, wire.DATA)  # the worker's completion DATA, psn 0 of its reduce stream
        os.kill(proc.pid, signal.SIGSTOP)  # nothing is read until both are queued
        try:
            agg.sendto(packet(wire.RESULT, int(done["psn"]), owner=0, payload=[2, 0, 0, 0]), worker)
            agg.sendto(packet(wire.GATHER, 1, owner=1, payload=[7, 7, 7, 7]), worker)  # call 2's, right behind
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        assert int(expect(agg, wire.GATHER)["psn"]) == 1  # call 2: the worker's own piece
        done = expect(agg, wire.DATA)  # it holds worker 1's already: no NACK, straight to the completion
        agg.sendto(packet(wire.RESULT, int(done["psn"]), owner=0, payload=[2, 0, 0, 0], slot=1), worker)
        report = json.loads(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait(10)
        agg.close()
    def as_sent(values: list[int]) -> list[int]:  # a GATHER's lanes are raw bytes: big-endian on the wire here
        return np.array(values, ">i4").view(np.int32).tolist()

    assert report["first"] == [[1, 2, 3, 4], as_sent([9, 9, 9, 9])]
    assert report["second"] == [[5, 6, 7, 8], as_sent([7, 7, 7, 7])]
    assert report["retransmissions"] == 0
