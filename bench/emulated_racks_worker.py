"""One rank of bench/emulated_racks.py: scheme ``hring`` here, every other one bench/emulated_worker.py's.

    PASSING_SCHEME=hring PASSING_RACK_SIZE=2 python bench/emulated_racks_worker.py --workload resnet50=255570

The hierarchical ring on gloo alone, over torch.distributed's own collectives (ranks numbered rack by rack,
PASSING_RACK_SIZE servers a rack, one rank a server): a reduce_scatter among the servers of a rack (an
all_to_all and a sum: gloo's reduce_scatter_tensor moves an all_reduce's bytes), then
an all_reduce of each server's shard among the servers of the same index in every rack (one ring across
the racks per index, all at once), then an all_gather in the rack. Prints one JSON line as
emulated_worker.py does (no transport counters: no PASSING packets).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import emulated_worker  # noqa: E402  (bench/: the other schemes, and the timed loop)


class Hierarchy:
    """The rack's group and the group of this index across racks, and the all_reduce through them."""

    def __init__(self, rack_size: int) -> None:
        world, rank = dist.get_world_size(), dist.get_rank()
        if rack_size < 1 or world % rack_size:
            raise ValueError(f"PASSING_RACK_SIZE {rack_size} does not divide the world of {world}")
        racks = world // rack_size
        self.size = rack_size
        for k in range(racks):  # every rank makes every group, in one order (torch.distributed's rule)
            g = dist.new_group(list(range(k * rack_size, (k + 1) * rack_size)), backend="gloo")
            if rank // rack_size == k:
                self.rack = g
        for i in range(rack_size):
            g = dist.new_group([k * rack_size + i for k in range(racks)], backend="gloo")
            if rank % rack_size == i:
                self.across = g

    def all_reduce(self, tensor: torch.Tensor) -> None:
        n = tensor.numel()
        padded = -(-n // self.size) * self.size
        flat = torch.nn.functional.pad(tensor, (0, padded - n))
        parts = torch.empty(padded)
        # the reduce_scatter as an all_to_all and a local sum: each server sends (m-1)/m K, where gloo's own
        # reduce_scatter_tensor sends K, an all_reduce's bytes (measured: docs/benchmarks.md)
        dist.all_to_all_single(parts, flat, group=self.rack)
        shard = parts.view(self.size, -1).sum(0)
        dist.all_reduce(shard, group=self.across)
        with warnings.catch_warnings():  # all_gather_into_tensor: deprecated for a new name, same collective
            warnings.simplefilter("ignore", FutureWarning)
            dist.all_gather_into_tensor(flat, shard, group=self.rack)
        tensor.copy_(flat[:n])


def hierarchical(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    barrier = dist.new_group(backend="gloo")
    h = Hierarchy(int(os.environ["PASSING_RACK_SIZE"]))
    rank = dist.get_rank()
    out: dict[str, Any] = {"rank": rank, "world": dist.get_world_size(), "scheme": "hring", "mode": "gloo",
                           "reason": "hierarchical ring: reduce_scatter in the rack (all_to_all), all_reduce "
                                     "across racks, all_gather in the rack", "lanes": None, "workloads": {}}
    for spec in args.workload:
        name, elements = spec.split("=")
        tensor = torch.randn(int(elements), generator=torch.Generator().manual_seed(rank))
        # the sum every rank must get, from every rank's seed (no collective: the links carry the timed calls)
        expected = torch.stack([torch.randn(int(elements), generator=torch.Generator().manual_seed(r))
                                for r in range(dist.get_world_size())]).sum(0)
        work = tensor.clone()
        start = time.perf_counter()
        h.all_reduce(work)
        warmup = time.perf_counter() - start
        if not torch.allclose(work, expected, rtol=1e-5, atol=1e-4):
            raise SystemExit(f"hring: the hierarchical sum differs from the exact one by "
                             f"{(work - expected).abs().max().item():g}")
        cpu = time.process_time()
        seconds, starts = emulated_worker.timed_all_reduces(tensor, args.iterations, barrier, h.all_reduce)
        out["workloads"][name] = {"elements": int(elements), "seconds": seconds, "starts": starts,
                                  "median_s": statistics.median(seconds), "warmup_s": warmup,
                                  "cpu_s": time.process_time() - cpu, "transport": {}, "in_host_s": None}
    probes = emulated_worker.timed_all_reduces(torch.ones(64), args.probes, barrier, h.all_reduce)[0]
    out["fixed_s"] = statistics.median(probes)
    dist.barrier(group=barrier)
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()


def main() -> None:
    if os.environ.get("PASSING_SCHEME") != "hring":
        emulated_worker.main()
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", action="append", required=True, help="name=elements (float32), repeatable")
    p.add_argument("--iterations", type=int, default=5)
    p.add_argument("--probes", type=int, default=5, help="repeats of the one-packet probe")
    hierarchical(p.parse_args())


if __name__ == "__main__":
    main()
