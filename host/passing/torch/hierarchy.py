"""Which ranks share a server, and the network stage of the two-stage allreduce.

Rank j of every server sums chunk j of the server's in-host reduction (passing.torch.in_host)
with rank j of every other server, through group (job, j) of an aggregator or through a
collective among those peers (docs/torch.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as C10dBackend

from .options import OptionError


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
    grid: tuple[tuple[int, ...], ...]  # grid[server][local rank] = the rank there, the same on every rank

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
        return cls(len(servers), counts[server_key], servers.index(server_key), members[server_key].index(rank),
                   tuple(tuple(members[s]) for s in servers))
