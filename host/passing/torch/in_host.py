"""The in-host stage of the two-stage allreduce: the n ranks of one server sum their tensors
chunk by chunk, each chunk is summed over the servers by one rank (the network stage), and
every rank gets all the sums back (docs/torch.md).

On the CPU the ranks of a server share one memory segment: a rank copies in the chunks the
other ranks own, each owner adds them to its own, and every rank copies the sums out, where
a ring over loopback TCP passed each byte through the kernel at every step. The segment is
a file with no name that local rank 0 makes in /dev/shm and hands to the others over a Unix
socket of the abstract namespace, which is also the barriers' (passing.torch.server_memory):
nothing of it is ever in a file system, so nothing outlives the processes however they end. An
error on one rank fails the collective on every rank of the server, and the stage with it (never
a wrong sum). Where the ranks cannot share one (another /dev/shm, no room), the stage is a ring
of gloo send/recv. For CUDA tensors it is NCCL's reduce-scatter and all-gather. The sharded
collectives' in-host parts (passing.torch.sharded) use the same stages.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Protocol

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as C10dBackend

from .. import native
from ..errors import PassingError
from .hierarchy import NetworkStage
from .server_memory import SHM_DIR, ServerBarrier, shared_memory

log = logging.getLogger("passing.torch")

IN_HOST_TAG = 1  # gloo's send/recv tag of the ring (one collective at a time per group)
PIECE_BYTES = 8 << 20  # a larger tensor goes through in pieces of this; the segment is n times it


class InHostStage(Protocol):
    def allreduce(self, flat: torch.Tensor, network: NetworkStage) -> torch.Tensor:
        """The sum of a 1-D float32 tensor over every rank of every server: ``flat`` itself (or a
        view of it), overwritten, where it can be."""
        ...


class CpuInHostStage(InHostStage, Protocol):
    """The CPU stages also serve the sharded collectives' in-host parts (passing.torch.sharded)."""

    def reduce_scatter(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` = the sum over the server's ranks of their row j of ``rows`` (n x B float32,
        contiguous), on local rank j; ``rows`` may be overwritten."""
        ...

    def all_gather(self, block: torch.Tensor, out: torch.Tensor) -> None:
        """Row k of ``out`` (n x B uint8, contiguous) = local rank k's ``block`` (B uint8), on every rank."""
        ...

    def all_or_none(self) -> AbstractContextManager[None]:
        """Around a collective's parts on this rank: an error in them fails the collective on every local rank
        (and the stage with it), never only on this one."""
        ...

    def agree(self) -> None:
        """Return once every local rank has come here: a collective's last step, after its network stage, so that
        one rank's failure there reaches the others (inside ``all_or_none``)."""
        ...


def _set(summed: torch.Tensor, into: torch.Tensor) -> None:
    if summed.data_ptr() != into.data_ptr():
        into.copy_(summed)


class SharedMemoryInHost:
    """The CPU in-host stage through the server's shared segment: n x n regions, region (k, i)
    for local rank k's copy of chunk i, and region (i, i) for the sum of chunk i. Per piece
    (at most n regions' worth), cut in n chunks, chunk i local rank i's: each rank copies the
    other ranks' chunks into its regions; a barrier; rank i adds its own chunk i to region
    (k, i) of every other rank k, into region (i, i), and has the network stage sum that over
    the servers; a barrier; every rank copies region (i, i) out, for every i.

    Why two barriers are enough, whatever the pieces' sizes: region (k, i), k != i, is
    written by k before the first barrier and read by i before the second; region (i, i) is
    written by i between the two and read by everyone after the second, and before the next
    piece's first. Each chunk is added by one rank, so every rank gets the same bits."""

    def __init__(self, segment: mmap.mmap, barrier: ServerBarrier, n: int, j: int, engine: str = "auto") -> None:
        self.segment, self.barrier, self.n, self.j = segment, barrier, n, j
        region = len(segment) // 4 // (n * n)  # float32 elements
        self.regions = torch.frombuffer(segment, dtype=torch.float32)[:n * n * region].view(n, n, region)
        self.piece = n * region  # elements
        self.native = native.use_native(engine)  # the bulk moves in C (streaming stores), else torch's

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.native:
            native.copy_f32(dst.data_ptr(), src.data_ptr(), dst.numel())
        else:
            dst.copy_(src)

    def _sum(self, dst: torch.Tensor, sources: list[torch.Tensor]) -> None:
        """dst = sources[0] + sources[1] + ..., in that order."""
        if self.native:
            native.sum_f32(dst.data_ptr(), [t.data_ptr() for t in sources], dst.numel())
            return
        torch.add(sources[0], sources[1], out=dst)
        for t in sources[2:]:
            dst += t

    def _sum_own_chunk(self, chunks: list[torch.Tensor], out: torch.Tensor) -> int:
        """The first half of a piece: ``chunks`` are this rank's n chunks of it (at most a region
        each); the others go into this rank's regions, a barrier, then ``out`` = this rank's own
        chunk plus the other ranks' copies of it. Returns that chunk's length."""
        n, j, regions = self.n, self.j, self.regions
        for i, chunk in enumerate(chunks):
            if i != j:
                self._copy(regions[j, i, :chunk.numel()], chunk)
        self.barrier.wait()
        length = chunks[j].numel()
        self._sum(out[:length], [chunks[j], *(regions[k, j, :length] for k in range(n) if k != j)])
        return length

    @contextmanager
    def all_or_none(self) -> Iterator[None]:
        """A collective that fails on this rank (its network stage raised, say) fails on every rank of
        the server: the barrier is poisoned (ServerBarrier.poison), so none waits or reads out of phase."""
        try:
            yield
        except BaseException:
            self.barrier.poison()
            raise

    def agree(self) -> None:
        self.barrier.wait()

    def allreduce(self, flat: torch.Tensor, network: NetworkStage) -> torch.Tensor:
        with self.all_or_none():
            return self._allreduce(flat, network)

    def _allreduce(self, flat: torch.Tensor, network: NetworkStage) -> torch.Tensor:
        if flat.dim() != 1 or not flat.is_contiguous() or flat.dtype != torch.float32:
            raise ValueError("the in-host stage takes a contiguous 1-D float32 tensor")
        n, j, regions = self.n, self.j, self.regions
        for start in range(0, flat.numel(), self.piece):
            piece = flat[start:start + self.piece]
            size = piece.numel()
            chunk = -(-size // n)
            bounds = [(min(i * chunk, size), min((i + 1) * chunk, size)) for i in range(n)]  # the last may be short
            own = regions[j, j, :chunk]  # a short chunk is padded with zeros: every rank streams a chunk
            length = self._sum_own_chunk([piece[a:b] for a, b in bounds], own)
            own[length:].zero_()
            _set(network.sum(own), own)
            self.barrier.wait()
            for i, (a, b) in enumerate(bounds):
                self._copy(piece[a:b], regions[i, i, :b - a])
        return flat

    # The sharded collectives keep the same rule: a region (k, i), k != i, is written by k before a
    # piece's first barrier and read before its second; neither writes a region (i, i).

    def reduce_scatter(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        with self.all_or_none():
            width = self.regions.shape[2]
            for start in range(0, rows.shape[1], width):
                end = min(start + width, rows.shape[1])
                self._sum_own_chunk([row[start:end] for row in rows], out[start:end])
                self.barrier.wait()

    def all_gather(self, block: torch.Tensor, out: torch.Tensor) -> None:
        with self.all_or_none():
            n, j = self.n, self.j
            regions = self.regions.view(torch.uint8)  # n x n x 4·region bytes
            width = regions.shape[2]
            out[j].copy_(block)
            for start in range(0, block.numel(), width):
                end = min(start + width, block.numel())
                regions[j, (j + 1) % n, :end - start].copy_(block[start:end])  # a region this rank alone writes
                self.barrier.wait()
                for k in range(n):
                    if k != j:
                        out[k, start:end].copy_(regions[k, (k + 1) % n, :end - start])
                self.barrier.wait()


class RingInHost:
    """The CPU in-host stage as rings of gloo send/recv, where the ranks share no memory. A collective
    that fails on one rank fails on all: it aborts the gloo group, whose other ranks' sends and
    receives then fail at once, and a failed stage takes no more calls (a ring out of phase would
    pair one call's steps with another's)."""

    def __init__(self, group: C10dBackend) -> None:
        self.group = group
        self.failed = False

    @contextmanager
    def all_or_none(self) -> Iterator[None]:
        if self.failed:
            raise PassingError("the in-host stage failed earlier (on this local rank or another): it is unusable")
        try:
            yield
        except BaseException as e:
            self.failed = True
            try:
                self.group.abort()
            except Exception:  # noqa: BLE001  (the error that got here is the one to report)
                log.debug("passing: aborting the in-host ring's gloo group", exc_info=True)
            if isinstance(e, RuntimeError) and not isinstance(e, PassingError):  # gloo's, from an aborted peer
                raise PassingError(f"the in-host stage failed on this local rank or another: {e}") from e
            raise

    def agree(self) -> None:
        self.group.barrier(dist.BarrierOptions()).wait()

    def _exchange(self, outgoing: torch.Tensor, to: int, incoming: torch.Tensor, source: int) -> None:
        sent = self.group.send([outgoing], to, IN_HOST_TAG)
        self.group.recv([incoming], source, IN_HOST_TAG).wait()
        sent.wait()

    def reduce_scatter_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Leaves the sum over the group of row r of ``rows`` (n rows, one per rank) in row r of
        this rank r, and returns that row. gloo has no reduce-scatter of its own (its
        _reduce_scatter_base all-reduces the whole tensor and keeps one chunk: twice the bytes),
        so a ring of n-1 steps: at each, a rank passes a partial sum of one row to the next rank
        and adds its own to the one it gets. Each row is summed by its owner alone, so the sums
        are the same bits everywhere."""
        n, r = rows.shape[0], self.group.rank()
        right, left = (r + 1) % n, (r - 1) % n
        spare = [torch.empty_like(rows[0]) for _ in range(min(n - 1, 2))]  # a step sends one while it fills the other
        outgoing = rows[left]
        for step in range(n - 1):
            incoming = spare[step % 2]
            self._exchange(outgoing, right, incoming, left)
            row = (r - step - 2) % n
            if row == r:  # the last step: this rank's own row completes the sum
                rows[r] += incoming
            else:
                incoming += rows[row]
                outgoing = incoming
        return rows[r]

    def allgather_rows(self, rows: torch.Tensor) -> None:
        """Every rank's row r to every rank, in place: n-1 steps of passing the row last received on."""
        n, r = rows.shape[0], self.group.rank()
        for step in range(n - 1):
            self._exchange(rows[(r - step) % n], (r + 1) % n, rows[(r - step - 1) % n], (r - 1) % n)

    def allreduce(self, flat: torch.Tensor, network: NetworkStage) -> torch.Tensor:
        with self.all_or_none():
            n = self.group.size()
            padded, rows = _rows(flat, n)
            mine = self.reduce_scatter_rows(rows)
            _set(network.sum(mine), mine)
            self.allgather_rows(rows)
            return padded[:flat.numel()]

    def reduce_scatter(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        with self.all_or_none():
            out.copy_(self.reduce_scatter_rows(rows))

    def all_gather(self, block: torch.Tensor, out: torch.Tensor) -> None:
        with self.all_or_none():
            out[self.group.rank()].copy_(block)
            self.allgather_rows(out)


class CollectiveInHost:
    """The in-host stage for CUDA tensors: NCCL's own reduce-scatter and all-gather."""

    def __init__(self, group: C10dBackend) -> None:
        self.group = group

    def allreduce(self, flat: torch.Tensor, network: NetworkStage) -> torch.Tensor:
        padded, rows = _rows(flat, self.group.size())
        mine = torch.empty_like(rows[0])
        self.group._reduce_scatter_base(mine, padded, dist.ReduceScatterOptions()).wait()
        self.group._allgather_base(padded, network.sum(mine)).wait()
        return padded[:flat.numel()]


class ThroughHostMemory:
    """The in-host stage for CUDA tensors where NCCL does not carry them (device_backend gloo): the
    CPU stage on a host copy, the sum copied back to the tensor's device."""

    def __init__(self, cpu: InHostStage) -> None:
        self.cpu = cpu

    def allreduce(self, flat: torch.Tensor, network: NetworkStage) -> torch.Tensor:
        return self.cpu.allreduce(flat.cpu(), network).to(flat.device)


def _rows(flat: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``flat`` as n equal rows: itself where its size divides, else a zero-padded copy."""
    size = flat.numel()
    chunk = -(-size // n)
    if n * chunk == size and flat.is_contiguous():
        padded = flat
    else:
        padded = torch.zeros(n * chunk, dtype=flat.dtype, device=flat.device)
        padded[:size] = flat
    return padded, padded.view(n, chunk)


def cpu_in_host(rank: int, n: int, ring_group: Callable[[], C10dBackend], store: dist.Store, prefix: str,
                timeout: float, piece_bytes: int = PIECE_BYTES, directory: str = SHM_DIR,
                engine: str = "auto") -> CpuInHostStage:
    """The CPU in-host stage of local rank ``rank`` of a server's ``n``: through shared memory in
    ``directory``, in pieces of ``piece_bytes``, its bulk moves in C where ``engine`` says so
    (passing.native.use_native); or, where they cannot share it or ``directory`` is "off", a
    ring over ``ring_group()``, made then (every rank of the server comes to the same answer, so
    they all make it); local rank 0 logs why."""
    if directory == "off":
        if rank == 0:
            log.info("passing: the in-host stage goes over loopback TCP (shared memory off)")
        return RingInHost(ring_group())
    found = shared_memory(store, prefix, rank, n, n * piece_bytes, timeout, directory)
    if isinstance(found, str):
        if rank == 0:
            log.warning("passing: the in-host stage goes over loopback TCP: no shared memory among the %d ranks "
                        "of this server (%s)", n, found)
        return RingInHost(ring_group())
    return SharedMemoryInHost(*found, n, rank, engine)
