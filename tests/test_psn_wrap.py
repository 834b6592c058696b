"""One psn -> slot rule for both stream engines (docs/protocol.md, The stream): the slot and set of
a packet come from its unwrapped stream position p (psn = p mod 2^32), so a pool that is not a
power of two keeps p and p + pool on one slot across the psn's wrap."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from passing import Group, wire
from passing.aggregator.control_channel import worker_origin
from passing.aggregator.engine import AggregationEngine, JobSpec
from passing.launch import free_udp_ports
from passing.transport import BatchSocket
from tests.cluster import run_threads

WRAP = 1 << 32


class RecordingAggregator:
    """The numpy engine behind a socket, in a thread, noting (worker, psn, slot, set) of every DATA."""

    def __init__(self, addresses: list[str], pool: int, lanes: int = wire.DEFAULT_LANES) -> None:
        self.socket = BatchSocket(("127.0.0.1", 0), lanes=lanes)
        self.engine = AggregationEngine(slots=pool, lanes=lanes)
        sources = [worker_origin(a) for a in addresses]
        self.engine.add_job(JobSpec(job=1, base=0, pool=pool, sources=sources, generation=0))
        self.seen: list[tuple[int, int, int, int]] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.socket.wait_readable(0.05):
                continue
            view, lengths, sources = self.socket.recv_packets()
            hdr = view["hdr"]
            self.seen += zip(hdr["worker"].tolist(), hdr["psn"].tolist(), hdr["slot"].tolist(), hdr["set"].tolist())
            out = self.engine.process(view, sources, lengths)
            if len(out):
                self.socket.send_batch(out.packets, out.dest)

    def close(self) -> None:
        self._stop.set()
        self.thread.join(10)
        self.socket.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("engine", ["native", "numpy"])
@pytest.mark.parametrize("pool", [3, 4])
def test_slots_follow_the_unwrapped_position_across_the_wrap(engine, pool):
    workers, start = 2, WRAP - 40
    addresses = [f"127.0.0.1:{p}" for p in free_udp_ports(workers)]
    aggregator = RecordingAggregator(addresses, pool)
    inputs = [np.arange(64 * 50, dtype=np.int32) * (w + 1) for w in range(workers)]

    def work(w: int) -> list[np.ndarray]:
        with Group(1, w, workers, [("127.0.0.1", aggregator.socket.address[1])], pool=pool, bind=addresses[w],
                   engine=engine, timeout=20) as g:
            g.state.next_psn[:] = start  # as if 2^32 - 40 packets had gone before
            results = [g.allreduce(inputs[w]) for _ in range(2)]  # 50 packets each: across the wrap, then past it
            assert int(g.state.next_psn[0]) == start + 100  # unwrapped: the next position, not its psn
            return results

    try:
        outcomes = run_threads(work, workers)
    finally:
        aggregator.close()
    for outcome in outcomes:
        assert not isinstance(outcome, Exception), outcome
        for result in outcome:
            assert np.array_equal(result, inputs[0] * 3)
    for w in range(workers):
        first = {}
        for worker, psn, slot, set_ in aggregator.seen:
            if worker == w:
                first.setdefault(psn, (slot, set_))  # a retransmission repeats its packet's slot
        assert len(first) == 100
        for psn, (slot, set_) in first.items():
            position = psn if psn >= start else psn + WRAP
            assert (slot, set_) == (position % pool, (position // pool) % 2), (psn, slot, set_)
