"""The in-host stage of the two-stage allreduce: the n ranks of one server sum their tensors
chunk by chunk, each chunk is summed over the servers by one rank (the network stage), and
every rank gets all the sums back (design §5, "Hierarchy").

On the CPU the ranks of a server share one memory segment: a rank copies in the chunks the
other ranks own, each owner adds them to its own, and every rank copies the sums out, where
a ring over loopback TCP passed each byte through the kernel at every step. The segment (and
a Unix socket for the barriers) is made by local rank 0 in a directory of its own in
/dev/shm, mapped by the others, and removed once all have it (nothing outlives the
processes). Where the ranks cannot share one (another /dev/shm, no room), the stage is a ring
of gloo send/recv. For CUDA tensors it is NCCL's reduce-scatter and all-gather. The sharded
collectives' in-host parts (passing.torch.sharded) use the same stages.
"""

from __future__ import annotations

import logging
import mmap
import os
import shutil
import socket
import tempfile
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as C10dBackend

from .. import native
from ..stream import PassingError
from .hierarchy import NetworkStage

log = logging.getLogger("passing.torch")

IN_HOST_TAG = 1  # gloo's send/recv tag of the ring (one collective at a time per group)
PIECE_BYTES = 8 << 20  # a larger tensor goes through in pieces of this; the segment is n times it
SHM_DIR = "/dev/shm"


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

    def allreduce(self, flat: torch.Tensor, network: NetworkStage) -> torch.Tensor:
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
        width = self.regions.shape[2]
        for start in range(0, rows.shape[1], width):
            end = min(start + width, rows.shape[1])
            self._sum_own_chunk([row[start:end] for row in rows], out[start:end])
            self.barrier.wait()

    def all_gather(self, block: torch.Tensor, out: torch.Tensor) -> None:
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
    """The CPU in-host stage as rings of gloo send/recv, where the ranks share no memory."""

    def __init__(self, group: C10dBackend) -> None:
        self.group = group

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
        n = self.group.size()
        padded, rows = _rows(flat, n)
        mine = self.reduce_scatter_rows(rows)
        _set(network.sum(mine), mine)
        self.allgather_rows(rows)
        return padded[:flat.numel()]

    def reduce_scatter(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(self.reduce_scatter_rows(rows))

    def all_gather(self, block: torch.Tensor, out: torch.Tensor) -> None:
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


class ServerBarrier:
    """A barrier of the ranks of one server over Unix sockets: each rank tells local rank 0 it is
    there, and rank 0 answers all once everyone is. One wake-up each way, in the calling thread
    (a gloo barrier goes through gloo's threads and TCP: ten times the latency on a loaded
    machine), and a rank that exits shows at once as its socket's end."""

    def __init__(self, rank: int, peers: list[socket.socket]) -> None:
        self.rank, self.peers = rank, peers  # rank 0: one socket per other rank, in rank order; else: rank 0's

    def wait(self) -> None:
        if not self.peers:
            raise PassingError("the in-host stage failed earlier: its barrier is closed")
        try:
            if self.rank == 0:
                for k, peer in enumerate(self.peers, 1):
                    _receive_mark(peer, f"local rank {k}")
                for peer in self.peers:
                    peer.sendall(b".")
            else:
                self.peers[0].sendall(b".")
                _receive_mark(self.peers[0], "local rank 0")
        except BaseException:
            self.close()  # the others hear of it at their barrier at once, not at the timeout
            raise

    def close(self) -> None:
        for peer in self.peers:
            peer.close()
        self.peers = []


def _receive_mark(peer: socket.socket, who: str) -> None:
    try:
        mark = peer.recv(1)
    except TimeoutError:
        raise PassingError(f"the in-host stage: {who} did not reach the barrier within "
                           f"{peer.gettimeout():g} s") from None
    except OSError as e:
        raise PassingError(f"the in-host stage: {who} is gone ({e.strerror})") from None
    if not mark:
        raise PassingError(f"the in-host stage: {who} left it (exited, or failed and gave up)")


def shared_memory(store: dist.Store, prefix: str, rank: int, size: int, nbytes: int, timeout: float,
                  directory: str = SHM_DIR) -> tuple[mmap.mmap, ServerBarrier] | str:
    """A memory segment of ``nbytes`` and a barrier for the ``size`` ranks of a server, or why
    there are none (the same answer on every one of them). Local rank 0 makes both in a
    directory of its own in ``directory`` (this user only) and publishes its path in ``store``; every
    rank says whether it could map the segment and reach the barrier's socket; then rank 0
    accepts the others and removes the directory, so nothing outlives the processes."""
    segment: mmap.mmap | None = None
    sockets: list[socket.socket] = []
    made = ""  # rank 0: the directory it made
    error = ""
    try:
        if rank == 0:
            try:
                made = tempfile.mkdtemp(prefix="passing-", dir=directory)  # mode 0700
            except OSError as e:
                store.set(prefix + "path", "")
                raise OSError(f"cannot make a directory in {directory}: {e.strerror}") from e
            try:
                fd = os.open(os.path.join(made, "segment"), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    os.posix_fallocate(fd, 0, nbytes)  # no space shows here, not as a SIGBUS on first touch
                    segment = mmap.mmap(fd, nbytes)
                finally:
                    os.close(fd)
                listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sockets.append(listener)
                listener.bind(os.path.join(made, "barrier"))
                listener.listen(size)
            except OSError as e:
                store.set(prefix + "path", "")
                raise OSError(f"cannot set up {nbytes} bytes in {directory}: {e.strerror}") from e
            store.set(prefix + "path", made)
        else:
            path = store.get(prefix + "path").decode()
            if not path:
                raise OSError("local rank 0 could not make them")
            fd = os.open(os.path.join(path, "segment"), os.O_RDWR)
            try:
                segment = mmap.mmap(fd, nbytes)
            finally:
                os.close(fd)
            peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sockets.append(peer)
            peer.settimeout(timeout)
            peer.connect(os.path.join(path, "barrier"))
            peer.sendall(bytes([rank]))
    except (OSError, ValueError) as e:
        error = f"{type(e).__name__}: {e}"
    store.set(f"{prefix}mapped/{rank}", error or "ok")
    outcomes = [store.get(f"{prefix}mapped/{r}").decode() for r in range(size)]
    failures = [f"local rank {r}: {o}" for r, o in enumerate(outcomes) if o != "ok"]
    try:
        if not failures and rank == 0:  # everyone connected: accept them, in rank order
            sockets = _accept(sockets.pop(), size, timeout)
    finally:
        if made:
            shutil.rmtree(made, ignore_errors=True)
    if failures:
        for s in sockets:
            s.close()
        if segment is not None:
            segment.close()
        return "; ".join(failures)
    assert segment is not None
    return segment, ServerBarrier(rank, sockets)


def _accept(listener: socket.socket, size: int, timeout: float) -> list[socket.socket]:
    """Local rank 0's ends of the barrier: one connection from each other rank, which names itself."""
    accepted: list[socket.socket] = []  # closed, all of them, if the barrier cannot be made
    by_rank: dict[int, socket.socket] = {}
    try:
        listener.settimeout(timeout)
        for _ in range(size - 1):
            peer, _ = listener.accept()
            accepted.append(peer)
            peer.settimeout(timeout)
            said = peer.recv(1)
            if not said or not 1 <= said[0] < size or said[0] in by_rank:
                raise PassingError(f"the in-host stage: a local rank's barrier connection said {said!r}, "
                                   f"not a rank of 1..{size - 1} not yet connected")
            by_rank[said[0]] = peer
    except (OSError, PassingError) as e:
        for peer in accepted:
            peer.close()
        if isinstance(e, PassingError):
            raise
        raise PassingError(f"the in-host stage: the other local ranks did not all connect to its barrier "
                           f"({type(e).__name__}: {e})") from None
    finally:
        listener.close()
    return [by_rank[k] for k in range(1, size)]


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
