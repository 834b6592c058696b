"""reduce_scatter (OWNER_ONLY rounds) and all_gather (GATHER, NACK, completion round) end to end:
worker threads and a software aggregator in this process, real UDP on loopback (docs/protocol.md,
Kinds). Loss, duplication and reordering are injected at the aggregator, both ways."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from passing import Group, wire
from passing.aggregator.control_channel import job_from_json
from passing.aggregator.server import Impairment, SoftwareAggregator
from passing.launch import free_udp_ports
from tests.cluster import run_threads


@pytest.fixture(params=["native", "numpy"])
def engine(request) -> str:
    """The aggregator's engine; the hosts' is ``host_engine``."""
    return request.param


def run_group(workers: int, work, engine: str, pool: int = 8, lanes: int = 64, impaired: bool = False,
              host_engine: str = "numpy", **group_args) -> tuple[list, dict]:
    """``work(group, worker)`` in one thread per worker, all in one group on one aggregator; returns the
    results (or exceptions) and the aggregator's counters. Without impairments the hosts wait 5 s before
    they resend or NACK anything (a late thread is no loss), with them 50 ms."""
    ports = free_udp_ports(workers)
    addresses = [f"127.0.0.1:{p}" for p in ports]
    impair = dict(ingress=Impairment(drop=0.05, duplicate=0.05, reorder=True, rng=np.random.default_rng(1)),
                  egress=Impairment(drop=0.05, duplicate=0.05, reorder=True, rng=np.random.default_rng(2))) \
        if impaired else {}
    agg = SoftwareAggregator(listen=("127.0.0.1", 0), control=None, engine=engine, lanes=lanes,
                             jobs=[job_from_json({"job": 1, "pool": pool, "workers": addresses, "lanes": lanes})],
                             **impair)
    server = threading.Thread(target=agg.serve, daemon=True)
    server.start()

    # Every socket is bound before anyone sends: a GATHER relayed to a port nobody listens on yet is lost
    # (as a worker that has not joined misses it), and only a NACK after the silence brings it back.
    rto = dict(rto=0.05, max_rto=0.2) if impaired else dict(rto=5.0, max_rto=5.0)
    groups: list[Group] = []
    try:
        for w in range(workers):
            groups.append(Group(1, w, workers, [agg.address], pool=pool, bind=addresses[w], timeout=20,
                                lanes=lanes, engine=host_engine, **rto, **group_args))
        results = run_threads(lambda w: work(groups[w], w), workers)
    finally:
        for g in groups:
            g.close()
        agg.stop()
        server.join(10)
    return results, agg.engine.counters()


def raise_any(results: list) -> None:
    for r in results:
        if isinstance(r, BaseException):
            raise r


@pytest.mark.timeout(120)
@pytest.mark.parametrize("host", ["native", "numpy"])
@pytest.mark.parametrize("workers,chunk", [(2, 1), (3, 100), (4, 1000), (3, 64 * 5)])
def test_reduce_scatter_int32_is_exact_and_returns_each_worker_its_block(engine, host, workers, chunk):
    rng = np.random.default_rng(workers * chunk)
    inputs = [rng.integers(-1000, 1000, workers * chunk).astype(np.int32) for _ in range(workers)]
    results, counters = run_group(workers, lambda g, w: g.reduce_scatter(inputs[w]), engine, host_engine=host)
    raise_any(results)
    total = np.sum(inputs, axis=0)
    for w, r in enumerate(results):
        assert r.dtype == np.int32 and np.array_equal(r, total[w * chunk : (w + 1) * chunk])
    # the physics: every round answered once per worker, its sums to one worker and ACKs to the others
    packets = workers * -(-chunk // 64)
    assert counters["completed"] == packets
    assert counters["results_sent"] == workers * packets + counters["duplicate_answered"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("impaired", [False, True])
def test_native_and_numpy_reduce_scatter_give_the_same_bits(impaired):
    """The C stream's OWNER_ONLY rounds against the numpy stream's, float (auto and fixed scale) and int32."""
    from tests.test_native_stream import tricky_floats

    workers, chunk = 3, 3001
    floats = [tricky_floats(w, workers * chunk) for w in range(workers)]
    ints = [np.random.default_rng(w).integers(-10**6, 10**6, workers * chunk).astype(np.int32)
            for w in range(workers)]

    def work(g: Group, w: int) -> list[np.ndarray]:
        return [g.reduce_scatter(floats[w]), g.reduce_scatter(floats[w], op="avg"), g.reduce_scatter(ints[w])]

    got = {}
    for host in ("native", "numpy"):
        results, _ = run_group(workers, work, "native", impaired=impaired, host_engine=host)
        raise_any(results)
        got[host] = results
    for a, b in zip(got["native"], got["numpy"]):
        for x, y in zip(a, b):
            assert x.dtype == y.dtype and x.tobytes() == y.tobytes()
    total = np.sum(ints, axis=0)
    for w, r in enumerate(got["native"]):
        assert np.array_equal(r[2], total[w * chunk : (w + 1) * chunk])


@pytest.mark.timeout(120)
def test_reduce_scatter_float_sum_and_average(engine):
    workers, chunk = 3, 5000
    rng = np.random.default_rng(3)
    inputs = [rng.standard_normal(workers * chunk).astype(np.float32) for _ in range(workers)]
    results, _ = run_group(workers, lambda g, w: (g.reduce_scatter(inputs[w]),
                                                  g.reduce_scatter(inputs[w], op="avg")), engine)
    raise_any(results)
    total = np.sum(inputs, axis=0, dtype=np.float64)
    for w, (summed, averaged) in enumerate(results):
        want = total[w * chunk : (w + 1) * chunk]
        assert np.max(np.abs(summed - want)) < 1e-4
        assert np.max(np.abs(averaged - want / workers)) < 1e-4


@pytest.mark.timeout(120)
def test_reduce_scatter_keeps_nonfinite_values(engine):
    workers, chunk = 2, 200
    inputs = [np.ones(workers * chunk, np.float32) for _ in range(workers)]
    inputs[0][3] = np.nan  # worker 0's block
    inputs[1][chunk + 7] = np.inf  # worker 1's block
    inputs[0][chunk + 8], inputs[1][chunk + 8] = np.inf, -np.inf
    results, _ = run_group(workers, lambda g, w: g.reduce_scatter(inputs[w]), engine)
    raise_any(results)
    assert np.isnan(results[0][3]) and np.isfinite(np.delete(results[0], 3)).all()
    assert results[1][7] == np.inf and np.isnan(results[1][8]) and (np.delete(results[1], [7, 8]) == 2).all()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("host", ["native", "numpy"])
@pytest.mark.parametrize("dtype", ["float32", "float64", "int8", "uint16", "bool", "complex64"])
def test_allgather_is_bit_exact_for_every_dtype(engine, host, dtype):
    workers = 3
    rng = np.random.default_rng(7)
    raw = [rng.integers(0, 256, 8 * 777, dtype=np.uint8) for _ in range(workers)]  # any bits: NaNs, denormals
    inputs = [r.view(np.dtype(dtype)) if dtype != "bool" else (r & 1).astype(bool) for r in raw]
    results, counters = run_group(workers, lambda g, w: g.allgather(inputs[w]), engine, host_engine=host)
    raise_any(results)
    for r in results:
        assert r.dtype == inputs[0].dtype and r.shape == (workers, *inputs[0].shape)
        for w in range(workers):
            assert r[w].tobytes() == inputs[w].tobytes()
    packets = -(-inputs[0].nbytes // 256)
    assert counters["relayed"] == workers * packets  # each piece sent once: no loss, no NACK
    assert counters["completed"] == 1  # and one completion round


@pytest.mark.timeout(120)
@pytest.mark.parametrize("host", ["native", "numpy"])
def test_allgather_of_uneven_pieces_and_empty_ones(engine, host):
    sizes = [0, 1000, 3, 257]
    pieces = [np.arange(n, dtype=np.uint8) + 11 * w for w, n in enumerate(sizes)]

    def work(g: Group, w: int) -> np.ndarray:
        out = np.empty(sum(sizes), np.uint8)
        return g.allgather_bytes(pieces[w], sizes, out)

    results, _ = run_group(len(sizes), work, engine, host_engine=host)
    raise_any(results)
    want = np.concatenate(pieces)
    for r in results:
        assert np.array_equal(r, want)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("host", ["native", "numpy"])
def test_back_to_back_collectives_under_loss_duplication_and_reordering(engine, host):
    """Many calls in a row (a faster peer's next all_gather arrives early), mixed with reduce_scatter
    and allreduce, through an aggregator that drops, duplicates and reorders 5% each way."""
    workers, calls = 3, 8
    rng = np.random.default_rng(11)
    pieces = [[rng.standard_normal(700).astype(np.float32) for _ in range(workers)] for _ in range(calls)]
    ints = [[rng.integers(-50, 50, workers * 300).astype(np.int32) for _ in range(workers)] for _ in range(calls)]

    def work(g: Group, w: int) -> list:
        out = []
        for c in range(calls):
            out.append(g.allgather(pieces[c][w]))
            out.append(g.allgather(pieces[c][w][: 100 + c]))
            out.append(g.reduce_scatter(ints[c][w]))
            if c % 3 == 0:
                out.append(g.allreduce(ints[c][w]))
        return out

    results, counters = run_group(workers, work, engine, impaired=True, host_engine=host)
    raise_any(results)
    for w, got in enumerate(results):
        it = iter(got)
        for c in range(calls):
            assert next(it).tobytes() == np.stack(pieces[c]).tobytes()
            assert next(it).tobytes() == np.stack([p[: 100 + c] for p in pieces[c]]).tobytes()
            assert np.array_equal(next(it), np.sum(ints[c], axis=0)[w * 300 : (w + 1) * 300])
            if c % 3 == 0:
                assert np.array_equal(next(it), np.sum(ints[c], axis=0))
    assert counters["relayed"] > 2 * calls * workers * 3  # GATHERs and, for the losses, NACKs and resends


def test_reduce_scatter_refuses_what_it_cannot_split():
    with Group(1, 0, 2, ["127.0.0.1:9"], engine="numpy") as g:
        with pytest.raises(ValueError, match="multiple"):
            g.reduce_scatter(np.ones(3, np.float32))
        with pytest.raises(TypeError):
            g.reduce_scatter(np.ones(4, np.float64))
        with pytest.raises(ValueError, match="sizes"):
            g.allgather_bytes(np.ones(3, np.uint8), [3], np.empty(3, np.uint8))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("host", ["native", "numpy"])
def test_a_faster_peers_gathers_are_kept_for_the_next_call_whatever_the_host_engine(host):
    """reduce_scatter then all_gather, again and again, without loss: a peer that finishes its
    reduce_scatter first sends its GATHERs while the others are still in theirs (C or numpy stream),
    and they must keep them for their all_gather: no NACK and no second sending, ever (the hosts
    would wait 5 s before they asked)."""
    workers, calls, chunk = 3, 12, 2000
    rng = np.random.default_rng(5)
    grads = [rng.integers(-9, 9, workers * chunk).astype(np.int32) for _ in range(workers)]
    params = [rng.standard_normal(chunk).astype(np.float32) for _ in range(workers)]

    def work(g: Group, w: int) -> list:
        out = []
        for _ in range(calls):
            out.append(g.reduce_scatter(grads[w]))
            out.append(g.allgather(params[w]))
        return out

    results, counters = run_group(workers, work, "native", host_engine=host)
    raise_any(results)
    for w, got in enumerate(results):
        for c in range(calls):
            assert np.array_equal(got[2 * c], np.sum(grads, axis=0)[w * chunk : (w + 1) * chunk])
            assert got[2 * c + 1].tobytes() == np.stack(params).tobytes()
    assert counters["relayed"] == calls * workers * -(-chunk * 4 // 256)  # every GATHER once, no NACK


@pytest.mark.timeout(120)
@pytest.mark.parametrize("host", ["native", "numpy"])
def test_a_result_in_place_of_an_ack_is_taken_as_the_ack(host):
    """The Tofino 1 program sends every worker the whole RESULT of an OWNER_ONLY round (its egress cannot cut
    the lanes: docs/protocol.md, Kinds). Between the workers and the aggregator, one UDP relay per worker here
    turns each ACK into a RESULT of the same header with other lanes (the sums are not its receiver's output);
    reduce_scatter must give every worker its block exactly as before."""
    import socket

    workers, chunk, lanes = 3, 1000, 64
    rng = np.random.default_rng(7)
    inputs = [rng.integers(-1000, 1000, workers * chunk).astype(np.int32) for _ in range(workers)]
    hosts = [f"127.0.0.1:{p}" for p in free_udp_ports(workers)]
    relays = []
    for _ in range(workers):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind(("127.0.0.1", 0))
        s.settimeout(0.05)
        relays.append(s)
    relay_addresses = [f"127.0.0.1:{s.getsockname()[1]}" for s in relays]
    agg = SoftwareAggregator(listen=("127.0.0.1", 0), control=None, engine="numpy", lanes=lanes,
                             jobs=[job_from_json({"job": 1, "pool": 8, "workers": relay_addresses, "lanes": lanes})])
    server = threading.Thread(target=agg.serve, daemon=True)
    server.start()
    stop = threading.Event()
    turned = [0]

    def relay(w: int) -> None:
        host = ("127.0.0.1", int(hosts[w].rsplit(":", 1)[1]))
        while not stop.is_set():
            try:
                data, source = relays[w].recvfrom(65536)
            except TimeoutError:
                continue
            if source == host:
                relays[w].sendto(data, agg.address)
            elif len(data) == wire.HEADER_SIZE and data[1] == wire.ACK:
                turned[0] += 1
                result = bytearray(data + bytes(range(256)) * (4 * lanes // 256))
                result[1] = wire.RESULT
                relays[w].sendto(bytes(result), host)
            else:
                relays[w].sendto(data, host)

    threads = [threading.Thread(target=relay, args=(w,), daemon=True) for w in range(workers)]
    for t in threads:
        t.start()
    groups: list[Group] = []
    try:
        for w in range(workers):
            groups.append(Group(1, w, workers, [relay_addresses[w]], pool=8, bind=hosts[w], timeout=20, lanes=lanes,
                                engine=host, rto=5.0, max_rto=5.0))
        results = run_threads(lambda w: groups[w].reduce_scatter(inputs[w]), workers)
    finally:
        stop.set()
        for g in groups:
            g.close()
        agg.stop()
        for t in threads:
            t.join(5)
        for s in relays:
            s.close()
    raise_any(results)
    total = np.sum(inputs, axis=0)
    for w, r in enumerate(results):
        assert np.array_equal(r, total[w * chunk : (w + 1) * chunk])
    assert turned[0] >= (workers - 1) * workers * -(-chunk // lanes)  # every ACK came as a RESULT
