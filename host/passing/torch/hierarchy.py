"""The in-host stage: which ranks share a server, and the two-stage allreduce.

Rank j of every server sums chunk j of the server's reduce-scatter with rank j of every other
server, through group (job, j) of an aggregator or through a collective among those peers; the
ranks then all-gather the summed chunks (design §1, §5).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as C10dBackend

from .options import OptionError

IN_HOST_TAG = 1  # gloo's send/recv tag of the in-host stage (one collective at a time per group)


class NetworkStage(Protocol):
    """The network stage: sums a 1-D float32 tensor over the servers (the same rank index on each)."""

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum; ``tensor`` itself, summed in place, where it can be."""
        ...


class ArrayStage(Protocol):
    """What an aggregator's stream offers: a Group, or the backend's Group-then-gloo FailoverStage."""

    def allreduce(self, array: np.ndarray, op: str = "sum", out: np.ndarray | None = None) -> np.ndarray: ...


def sum_through(stream: ArrayStage, tensor: torch.Tensor) -> torch.Tensor:
    """The network stage through an aggregator's stream: on the CPU, in the tensor's own memory."""
    if tensor.device.type == "cpu":
        array = tensor.numpy()
        stream.allreduce(array, "sum", out=array)
        return tensor
    return torch.from_numpy(stream.allreduce(tensor.cpu().numpy(), "sum")).to(tensor.device)


class PeerStage:
    """The network stage as a collective among the peers (gloo; NCCL for CUDA): no aggregator."""

    def __init__(self, peers: dict[str, C10dBackend]) -> None:
        self.peers = peers  # device type -> this rank index's group across the servers

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        self.peers[tensor.device.type].allreduce([tensor], dist.AllreduceOptions()).wait()
        return tensor


@dataclass(frozen=True)
class Layout:
    """Where the ranks of one process group sit: s servers of n ranks each."""

    servers: int
    ranks_per_server: int
    server: int  # this rank's server index, in order of each server's lowest rank
    local_rank: int  # this rank's index among its server's ranks

    @classmethod
    def exchange(cls, store: dist.Store, rank: int, size: int, server_key: str) -> Layout:
        """Every rank publishes its server's name in the group's store and reads all of them."""
        store.set(f"passing/server/{rank}", server_key)
        keys = [store.get(f"passing/server/{r}").decode() for r in range(size)]
        servers = list(dict.fromkeys(keys))
        members = {s: [r for r, k in enumerate(keys) if k == s] for s in servers}
        counts = {s: len(m) for s, m in members.items()}
        if len(set(counts.values())) != 1:
            raise OptionError(f"PASSING needs the same number of ranks on every server; got {counts} "
                              "(set PASSING_SERVER per rank if the servers' names are wrong)")
        return cls(len(servers), counts[server_key], servers.index(server_key), members[server_key].index(rank))


def _exchange(group: C10dBackend, outgoing: torch.Tensor, to: int, incoming: torch.Tensor, source: int) -> None:
    sent = group.send([outgoing], to, IN_HOST_TAG)
    group.recv([incoming], source, IN_HOST_TAG).wait()
    sent.wait()


def ring_reduce_scatter(group: C10dBackend, rows: torch.Tensor) -> torch.Tensor:
    """Leaves the sum over the group of row r of ``rows`` (n rows, one per rank) in row r of this
    rank r, and returns that row. gloo has no reduce-scatter of its own (its _reduce_scatter_base
    all-reduces the whole tensor and keeps one chunk: twice the bytes), so a ring of n-1 steps:
    at each, a rank passes a partial sum of one row to the next rank and adds its own to the one
    it gets. Each row is summed by its owner alone, so the sums are the same bits everywhere."""
    n, r = rows.shape[0], group.rank()
    right, left = (r + 1) % n, (r - 1) % n
    spare = [torch.empty_like(rows[0]) for _ in range(min(n - 1, 2))]  # a step sends one while it fills the other
    outgoing = rows[left]
    for step in range(n - 1):
        incoming = spare[step % 2]
        _exchange(group, outgoing, right, incoming, left)
        row = (r - step - 2) % n
        if row == r:  # the last step: this rank's own row completes the sum
            rows[r] += incoming
        else:
            incoming += rows[row]
            outgoing = incoming
    return rows[r]


def ring_allgather(group: C10dBackend, rows: torch.Tensor) -> None:
    """Every rank's row r to every rank, in place: n-1 steps of passing the row last received on."""
    n, r = rows.shape[0], group.rank()
    for step in range(n - 1):
        _exchange(group, rows[(r - step) % n], (r + 1) % n, rows[(r - step - 1) % n], (r - 1) % n)


def two_stage_allreduce(flat: torch.Tensor, local: C10dBackend | None, layout: Layout,
                        network: NetworkStage) -> torch.Tensor:
    """Sum a 1-D float32 tensor over every rank of every server; returns the sums.

    With ``local`` (n > 1 ranks per server): reduce-scatter in the server, sum this rank's
    chunk over the servers, all-gather. Without: sum the whole tensor over the servers
    (flat). Either way ``flat`` is overwritten where it can be (then the result is ``flat``
    itself, or a view of it): the caller passes a tensor it means to replace by the sums.
    """
    if local is None:
        return network.sum(flat)
    n, size = layout.ranks_per_server, flat.numel()
    chunk = -(-size // n)
    if n * chunk == size and flat.is_contiguous():  # n chunks exactly: no padded copy, gathered in place
        padded = flat
    else:
        padded = torch.zeros(n * chunk, dtype=flat.dtype, device=flat.device)
        padded[:size] = flat
    if padded.device.type == "cpu":
        rows = padded.view(n, chunk)
        mine = ring_reduce_scatter(local, rows)
        summed = network.sum(mine)
        if summed.data_ptr() != mine.data_ptr():
            mine.copy_(summed)
        ring_allgather(local, rows)
    else:  # NCCL's own reduce-scatter and all-gather
        mine = torch.empty(chunk, dtype=flat.dtype, device=flat.device)
        local._reduce_scatter_base(mine, padded, dist.ReduceScatterOptions()).wait()
        local._allgather_base(padded, network.sum(mine)).wait()
    return padded[:size]
