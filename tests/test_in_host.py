"""The in-host stage through shared memory (passing.torch.in_host): the segment and barrier
that the ranks of a server set up through the c10d store, the sums piece by piece, and what
happens when they cannot share memory or a rank goes away. The ranks are threads here, each
with its own segment mapping and sockets, sharing an in-process store; tests/test_torch_embedded.py runs the
same stage in real processes under torch."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from passing import native
from passing.errors import PassingError
from passing.torch.in_host import SharedMemoryInHost, shared_memory
from tests.cluster import run_threads

ENGINES = ["numpy", pytest.param("native", marks=pytest.mark.skipif(not native.available(),
                                                                    reason="the native library is not built"))]

PIECE_BYTES = 4 * 60  # pieces of 60 float32, cut in n chunks


class Servers:
    """The network stage of rank j as ``servers`` servers that all hold the same chunk: it sums by
    multiplying, and records the chunk sizes it was handed."""

    def __init__(self, servers: int) -> None:
        self.servers = servers
        self.sizes: list[int] = []

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        self.sizes.append(tensor.numel())
        tensor *= self.servers
        return tensor


def on_threads(n: int, body: Callable[[int, dist.Store], Any], timeout: float = 60) -> list[Any]:
    """``body(rank, store)`` on n threads that share one in-process store (a c10d HashStore, whose
    blocking get lets the others set); their results (or the exceptions they raised), in rank order."""
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=timeout))
    return run_threads(lambda r: body(r, store), n, timeout)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_every_rank_gets_the_sum_piece_by_piece(n, engine, tmp_path):
    """Sizes under a chunk, at a piece's edges and over several pieces: every rank ends with the
    exact sum over the ranks and the servers, in its own tensor, and the same bits as the others.
    Every rank streams a whole chunk each piece (a short one padded), so no network group skips a call."""
    sizes = [1, n - 1, n + 1, 59, 60, 61, 3 * 60 + 7]
    servers = 3

    def body(rank: int, store: dist.Store) -> list[tuple[torch.Tensor, torch.Tensor, list[int]]]:
        found = shared_memory(store, "t/", rank, n, n * PIECE_BYTES, 10, str(tmp_path))
        assert not isinstance(found, str), found
        stage, out = SharedMemoryInHost(*found, n, rank, engine), []
        for size in sizes:
            network = Servers(servers)
            mine = torch.arange(size, dtype=torch.float32) * (rank + 1) + 0.25
            result = stage.allreduce(mine, network)
            assert result.data_ptr() == mine.data_ptr()  # summed in the caller's tensor
            out.append((mine, network.sizes))
        return out

    results = on_threads(n, body)
    for rank, result in enumerate(results):
        assert not isinstance(result, BaseException), f"rank {rank}: {result!r}"
    for i, size in enumerate(sizes):
        expected = sum(torch.arange(size, dtype=torch.float32) * (r + 1) + 0.25 for r in range(n)) * servers
        pieces = [min(60, size - start) for start in range(0, size, 60)]
        for rank, result in enumerate(results):
            mine, streamed = result[i]
            assert torch.equal(mine, results[0][i][0]), f"rank {rank}, size {size}: not rank 0's bits"
            torch.testing.assert_close(mine, expected, rtol=1e-6, atol=1e-4)
            assert streamed == [-(-p // n) for p in pieces], (rank, size, streamed)
    assert os.listdir(tmp_path) == []  # the segment and the socket were removed once all had them


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("n", [2, 3])
def test_the_sharded_collectives_in_host_parts_interleaved_with_all_reduces(n, engine, tmp_path):
    """reduce_scatter (row j of the server's sum to local rank j), all_gather (every rank's block,
    bytes, to every rank) and all_reduce in turn on the same segment, each over several pieces:
    every one exact, whichever came before."""
    width = PIECE_BYTES // 4 // n  # float32 elements of a region: the pieces of reduce_scatter's rows
    sizes = [1, width, width + 3, 3 * width + 1]

    def rows_of(rank: int, size: int) -> torch.Tensor:
        return torch.arange(n * size, dtype=torch.float32).view(n, size) * (rank + 1) - 0.5

    def block_of(rank: int, size: int) -> torch.Tensor:
        return ((torch.arange(4 * size) * 7 + rank * 31) % 256).to(torch.uint8)

    def body(rank: int, store: dist.Store) -> list[Any]:
        found = shared_memory(store, "t/", rank, n, n * PIECE_BYTES, 10, str(tmp_path))
        assert not isinstance(found, str), found
        stage, out = SharedMemoryInHost(*found, n, rank, engine), []
        for size in sizes:  # all_reduce -> all_gather -> reduce_scatter -> all_reduce ...: every hand-over
            summed = stage.allreduce(torch.ones(2 * size + 1) * (rank + 1), Servers(1))
            gathered = torch.zeros(n, 4 * size, dtype=torch.uint8)
            stage.all_gather(block_of(rank, size), gathered)
            mine = torch.full((size,), 9.0)
            stage.reduce_scatter(rows_of(rank, size), mine)
            out.append((mine, gathered, summed))
        return out

    results = on_threads(n, body)
    for rank, result in enumerate(results):
        assert not isinstance(result, BaseException), f"rank {rank}: {result!r}"
        for (mine, gathered, summed), size in zip(result, sizes):
            expected = sum(rows_of(r, size) for r in range(n))[rank]
            assert torch.equal(mine, expected), (rank, size)
            assert torch.equal(gathered, torch.stack([block_of(r, size) for r in range(n)])), (rank, size)
            assert torch.equal(summed, torch.full((2 * size + 1,), float(n * (n + 1) // 2))), (rank, size)


def test_ranks_that_cannot_share_memory_all_say_why(tmp_path):
    """Local rank 0 cannot make the segment (its directory does not exist): every rank gets the
    same reason, and none is left waiting for the others."""
    missing = str(tmp_path / "not-there")
    results = on_threads(3, lambda rank, store: shared_memory(store, "t/", rank, 3, 3 * PIECE_BYTES, 10, missing))
    assert all(isinstance(r, str) for r in results), results
    assert len(set(results)) == 1 and "local rank 0" in results[0] and "not-there" in results[0], results


def test_a_rank_that_goes_away_is_an_error_at_the_barrier_not_a_hang(tmp_path):
    """A rank whose sockets close (a process that exits) stops the others at their next barrier
    with an error that names it, at once rather than at the timeout."""

    def body(rank: int, store: dist.Store) -> Any:
        found = shared_memory(store, "t/", rank, 3, 3 * PIECE_BYTES, 30, str(tmp_path))
        assert not isinstance(found, str), found
        segment, barrier = found
        if rank == 2:
            barrier.close()
            return None
        start = time.monotonic()
        with pytest.raises(PassingError) as raised:
            SharedMemoryInHost(segment, barrier, 3, rank).allreduce(torch.ones(10), Servers(1))
        return str(raised.value), time.monotonic() - start

    results = on_threads(3, body)
    for rank in (0, 1):
        assert not isinstance(results[rank], BaseException), f"rank {rank}: {results[rank]!r}"
    message, seconds = results[0]
    assert "local rank 2 left" in message and seconds < 10, results[0]
    message, seconds = results[1]  # rank 1 hears it from rank 0, which failed
    assert "local rank 0" in message and "failed" in message and seconds < 10, results[1]


@pytest.mark.skipif(not native.available(), reason="the native library is not built")
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_the_native_bulk_moves_are_torchs_bit_for_bit(offset):
    """pn_copy_f32 and pn_sum_f32 (host/csrc/memory.c) against torch's copy_ and add chain, the
    specification: below and above the size where the stores turn non-temporal, at every
    alignment of the destination, with 1 to 4 sources, NaN, infinities, signed zeros and
    subnormals among the values."""
    g = torch.Generator().manual_seed(offset)
    for n in (0, 1, 7, 65535, 65536, 65537, 300_001):
        sources = [torch.randn(n + offset, generator=g) * 1e3 for _ in range(4)]
        specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-42, -1e-42, 3.4e38])
        for t in sources:
            t[offset::max(1, n // 7)][:len(specials)] = specials[:len(t[offset::max(1, n // 7)])]
        views = [t[offset:] for t in sources]
        for k in range(1, 5):
            expected = views[0].clone()
            for t in views[1:k]:
                expected += t
            out = torch.full((n + offset,), 5.0)[offset:]
            native.sum_f32(out.data_ptr(), [t.data_ptr() for t in views[:k]], n)
            assert torch.equal(out.view(torch.int32), expected.view(torch.int32)), (n, k, offset)
        out = torch.full((n + offset,), 5.0)[offset:]
        native.copy_f32(out.data_ptr(), views[0].data_ptr(), n)
        assert torch.equal(out.view(torch.int32), views[0].view(torch.int32)), (n, offset)


class FailsOnce:
    """A network stage that raises on its ``at``-th call (counting from 1), on this rank only."""

    def __init__(self, at: int) -> None:
        self.at, self.calls = at, 0

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at:
            raise PassingError("no RESULT for psn 7 (a network stage's error on this rank)")
        return tensor


@pytest.mark.parametrize("failing", [0, 1])
def test_an_error_on_one_local_rank_fails_the_call_on_every_rank_never_a_wrong_sum(failing, tmp_path):
    """Local rank ``failing``'s network stage raises in the second call; it retries, as a training loop
    may. Every rank's second call raises (the failing one its own error, the others the stage's), and
    every later call raises on every rank: no barrier out of phase, no sum of the wrong chunks (before
    issue 35 the others returned wrong sums without an error)."""

    def body(rank: int, store: dist.Store) -> list[Any]:
        found = shared_memory(store, "t/", rank, 3, 3 * PIECE_BYTES, 30, str(tmp_path))
        assert not isinstance(found, str), found
        stage = SharedMemoryInHost(*found, 3, rank)
        network = FailsOnce(2) if rank == failing else Servers(1)
        outcomes: list[Any] = []
        for call in range(4):
            x = torch.full((30,), float(rank + 1 + 10 * call))
            try:
                outcomes.append(stage.allreduce(x, network).clone())
            except PassingError as e:
                outcomes.append(str(e))
        return outcomes

    results = on_threads(3, body)
    for rank, outcomes in enumerate(results):
        assert not isinstance(outcomes, BaseException), f"rank {rank}: {outcomes!r}"
        assert torch.equal(outcomes[0], torch.full((30,), 6.0)), (rank, outcomes[0])  # the first call: exact
        if rank == failing:
            assert "psn 7" in outcomes[1], outcomes[1]
        else:
            assert isinstance(outcomes[1], str) and "failed" in outcomes[1], (rank, outcomes[1])
        for later in outcomes[2:]:
            assert isinstance(later, str) and "failed earlier" in later, (rank, later)


SEGMENT_RANK = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
from passing.torch.in_host import shared_memory
rank, size, port, directory = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, timeout=timedelta(seconds=60))
print("store", flush=True)
found = shared_memory(store, "t/", rank, size, size * 4096, 60, directory)
print("ready" if not isinstance(found, str) else found, flush=True)
time.sleep(60)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("victim,how", [(0, "SIGTERM"), (0, "SIGKILL"), (1, "SIGKILL")])
def test_nothing_of_the_segment_is_ever_in_a_file_system(victim, how, tmp_path):
    """Local rank 0 waiting for a rank that never comes, or a set-up done, then a rank killed: the
    segment's directory holds nothing at any moment, so nothing can outlive the processes (before
    issue 35 a rank 0 stopped while it waited left its n x 8 MiB segment behind)."""
    import signal
    import subprocess
    import sys

    from cluster.local import free_tcp_port

    port = free_tcp_port()
    size = 3 if victim == 0 else 2  # victim 0: rank 2 never starts, so rank 0 waits; else all set up
    procs = [subprocess.Popen([sys.executable, "-c", SEGMENT_RANK, str(r), str(size), str(port), str(tmp_path)],
                              stdout=subprocess.PIPE, text=True) for r in range(2)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "store"
        if victim != 0:
            for p in procs:
                assert p.stdout.readline().strip() == "ready"
        else:
            time.sleep(0.5)  # rank 0 has made the segment and waits for rank 2
        assert os.listdir(tmp_path) == []
        procs[victim].send_signal(getattr(signal, how))
        procs[victim].wait(10)
        assert os.listdir(tmp_path) == []
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
    assert os.listdir(tmp_path) == []


@pytest.mark.timeout(120)
def test_an_error_on_one_local_rank_fails_the_ring_on_every_rank_too():
    """Where the ranks share no memory (the gloo ring over loopback): local rank 1's network stage raises
    in the second call; it aborts the ring's gloo group, so the others' current call raises at once
    rather than at gloo's timeout (or, worse, pairs its steps with rank 1's next call), and every later
    call raises on every rank."""
    from passing.torch.in_host import RingInHost

    def body(rank: int, store: dist.Store) -> list[Any]:
        group = dist.ProcessGroupGloo(dist.PrefixStore("ring/", store), rank, 3, timedelta(seconds=60))
        stage = RingInHost(group)
        network = FailsOnce(2) if rank == 1 else Servers(1)
        outcomes: list[Any] = []
        for call in range(3):
            start = time.monotonic()
            try:
                outcomes.append(stage.allreduce(torch.full((30,), float(rank + 1 + 10 * call)), network).clone())
            except PassingError as e:
                outcomes.append((str(e), time.monotonic() - start))
        return outcomes

    results = on_threads(3, body, timeout=90)
    for rank, outcomes in enumerate(results):
        assert not isinstance(outcomes, BaseException), f"rank {rank}: {outcomes!r}"
        assert torch.equal(outcomes[0], torch.full((30,), 6.0)), (rank, outcomes[0])
        message, seconds = outcomes[1]
        assert ("psn 7" if rank == 1 else "failed") in message and seconds < 30, (rank, outcomes[1])
        assert "failed earlier" in outcomes[2][0], (rank, outcomes[2])


class ShardedNetwork:
    """The sharded collectives' network stage of one server: a block is the server's own (one server), or
    an error on this rank."""

    def __init__(self, fails: bool) -> None:
        self.fails = fails

    def _check(self) -> None:
        if self.fails:
            raise PassingError("no RESULT for psn 7 (a network stage's error on this rank)")

    def reduce_scatter(self, array):
        self._check()
        return array.copy()

    def allgather(self, piece, out) -> None:
        self._check()
        out[...] = piece


@pytest.mark.parametrize("kind", ["reduce_scatter", "all_gather"])
@pytest.mark.parametrize("failing", [0, 1])
def test_a_network_error_on_one_local_rank_fails_every_ranks_sharded_call(kind, failing, tmp_path):
    """As for all_reduce above, for reduce_scatter (whose network stage comes after the in-host one: a last
    barrier makes the others hear of it) and all_gather (network first): the other local rank's call raises
    too, never returns (before issue 45 it returned, or waited out its timeout at the barrier)."""
    from passing.torch.sharded import ShardedCollectives

    def body(rank: int, store: dist.Store) -> str:
        found = shared_memory(store, "t/", rank, 2, 2 * PIECE_BYTES, 30, str(tmp_path))
        assert not isinstance(found, str), found
        stage = SharedMemoryInHost(*found, 2, rank)
        import numpy as np
        collectives = ShardedCollectives("ps", 2, ShardedNetwork(rank == failing), stage, None, None, None,
                                         np.array([[0, 1]]), (), set())
        try:
            if kind == "reduce_scatter":
                collectives._reduce_scatter(torch.empty(8), torch.ones(16), False)
            else:
                collectives._all_gather(torch.empty(16), torch.ones(8))
        except PassingError as e:
            return str(e)
        return "returned"

    outcomes = on_threads(2, body, timeout=30)
    assert "psn 7" in outcomes[failing], outcomes
    assert "a collective failed on local rank" in outcomes[1 - failing], outcomes
