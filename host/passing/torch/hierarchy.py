"""The in-host stage: which ranks share a server, and the two-stage allreduce.

Rank j of every server streams chunk j of the server's reduce-scatter through group
(job, j); the ranks then all-gather the summed chunks (design §1, §5).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as C10dBackend

from ..stream import Group
from .options import OptionError


class NetworkStage(Protocol):
    """What the network stage needs: a Group, or the backend's Group-then-gloo stage."""

    def allreduce(self, array: np.ndarray, op: str = "sum", out: np.ndarray | None = None) -> np.ndarray: ...


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


def two_stage_allreduce(flat: torch.Tensor, local: C10dBackend | None, layout: Layout,
                        stream: Group | NetworkStage) -> torch.Tensor:
    """Sum a 1-D float32 tensor over every rank of every server; returns the sums.

    With ``local`` (n > 1 ranks per server): reduce-scatter in the server, stream this
    rank's chunk to the aggregator, all-gather. Without: stream the whole tensor (flat).
    The network stage reads and writes the tensor's own memory on the CPU (no copy): the
    flat case returns ``flat`` itself, summed in place.
    """
    if local is None:
        if flat.device.type == "cpu":
            array = flat.numpy()
            stream.allreduce(array, "sum", out=array)
            return flat
        return torch.from_numpy(stream.allreduce(flat.cpu().numpy(), "sum")).to(flat.device)
    n, size = layout.ranks_per_server, flat.numel()
    chunk = -(-size // n)
    padded = torch.zeros(n * chunk, dtype=flat.dtype, device=flat.device)
    padded[:size] = flat
    mine = torch.empty(chunk, dtype=flat.dtype, device=flat.device)
    local._reduce_scatter_base(mine, padded, dist.ReduceScatterOptions()).wait()
    if mine.device.type == "cpu":
        stream.allreduce(mine.numpy(), "sum", out=mine.numpy())
        summed = mine
    else:
        summed = torch.from_numpy(stream.allreduce(mine.cpu().numpy(), "sum")).to(flat.device)
    gathered = torch.empty(n * chunk, dtype=flat.dtype, device=flat.device)
    local._allgather_base(gathered, summed).wait()
    return gathered[:size]
