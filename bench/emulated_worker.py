"""One rank of the emulated-cluster benchmark (bench/emulated.py starts s × n of these).

    python bench/emulated_worker.py --workload resnet50=51114 --iterations 5

Runs under torchrun's environment (cluster.local.rank_env) with PASSING_SCHEME and
PASSING_CONTROLLER set by the harness. Per workload: one warm-up all_reduce, then
``iterations`` timed all_reduces, each after a barrier on a separate gloo group so that
every rank starts together. Then two probes the cost model takes as inputs: a
one-packet all_reduce (the per-call cost) and, in the in-host schemes, the in-host
reduce-scatter + all-gather alone. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import passing.torch  # registers backend "passing"
from passing import wire


def timed_all_reduces(tensor: torch.Tensor, iterations: int, barrier: dist.ProcessGroup,
                      all_reduce: Callable[[torch.Tensor], Any] = dist.all_reduce) -> tuple[list[float], list[float]]:
    """Seconds of each ``all_reduce``, and the wall-clock time each started (all ranks share one
    machine's clock, so the harness can see how far apart the ranks left the barrier)."""
    seconds, starts = [], []
    for _ in range(iterations):
        work = tensor.clone()  # fresh values each time: repeated sums would grow by the world size
        dist.barrier(group=barrier)
        starts.append(time.time())
        start = time.perf_counter()
        all_reduce(work)
        seconds.append(time.perf_counter() - start)
    return seconds, starts


class NoNetwork:
    """A network stage that leaves the chunk as it is: what is left is the in-host stage."""

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


def in_host_probe(pg: Any, elements: int, repeats: int, barrier: dist.ProcessGroup) -> float | None:
    """Median seconds of the in-host stage alone, as the all_reduce runs it (passing.torch.in_host:
    shared memory, or the ring where the ranks cannot share it); None where the scheme has none."""
    in_host = getattr(pg, "in_host", {}).get("cpu")
    if in_host is None:
        return None
    tensor = torch.randn(elements)
    seconds = []
    for _ in range(repeats):
        dist.barrier(group=barrier)
        start = time.perf_counter()
        in_host.allreduce(tensor, NoNetwork())
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", action="append", required=True, help="name=elements (float32), repeatable")
    p.add_argument("--iterations", type=int, default=5)
    p.add_argument("--probes", type=int, default=5, help="repeats of each probe")
    args = p.parse_args()

    dist.init_process_group("passing")
    barrier = dist.new_group(backend="gloo")
    pg = dist.distributed_c10d._get_default_group()
    rank = dist.get_rank()
    stats = (lambda: passing.torch.transport_stats()) if getattr(pg, "stream", None) else (lambda: {})
    out: dict[str, Any] = {"rank": rank, "world": dist.get_world_size(), "server": pg.layout.server,
                           "local_rank": pg.layout.local_rank, "scheme": pg.options.scheme, "mode": pg.mode,
                           "reason": pg.reason, "pool": pg.stream.aggregators[0].pool if pg.stream else None,
                           "lanes": pg.stream.lanes if pg.stream else None,  # what the controller's answer gave
                           "workloads": {}}
    for spec in args.workload:
        name, elements = spec.split("=")
        tensor = torch.randn(int(elements), generator=torch.Generator().manual_seed(rank))
        work = tensor.clone()
        dist.barrier(group=barrier)
        start = time.perf_counter()
        dist.all_reduce(work)  # warm-up: joins are done, but this trains the retransmission timer's RTT
        warmup = time.perf_counter() - start
        before, cpu = stats(), time.process_time()
        seconds, starts = timed_all_reduces(tensor, args.iterations, barrier)
        cpu = time.process_time() - cpu
        after = stats()
        out["workloads"][name] = {
            "elements": int(elements), "seconds": seconds, "starts": starts, "median_s": statistics.median(seconds),
            "warmup_s": warmup, "cpu_s": cpu,
            # over the timed all_reduces (the counters; io and io_reason as they are)
            "transport": {k: after[k] - before[k] if isinstance(after[k], int) else after[k] for k in after},
            "in_host_s": in_host_probe(pg, int(elements), args.probes, barrier),
        }
    small = torch.ones(wire.DEFAULT_LANES)
    out["fixed_s"] = statistics.median(timed_all_reduces(small, args.probes, barrier)[0])
    dist.barrier(group=barrier)
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
