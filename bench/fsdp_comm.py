"""An FSDP step's communication on backend "passing" against gloo, in the same rank processes.

    python bench/fsdp_comm.py [--servers 4] [--ranks 2] [--params 1048576] [--iterations 7]

FSDP2 (fully_shard, resharding after forward) moves, per step and per parameter of the model, an
all_gather in forward, an all_gather in backward and a reduce_scatter of the gradients; this times
exactly that (2 x all_gather_into_tensor + reduce_scatter_tensor of ``params`` float32) on s
servers x n ranks on loopback, PASSING through a software aggregator behind a PS-only controller
(cluster.local), alternating with gloo's in the same processes; prints the medians and their
ratio and writes bench/results/fsdp_comm.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "fsdp_comm.json"


def worker(params: int, iterations: int) -> None:
    import torch
    import torch.distributed as dist

    import passing.torch  # noqa: F401  (registers backend "passing")

    dist.init_process_group("passing")
    world = dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    shard = params // world
    piece = torch.randn(shard)
    gathered = torch.empty(shard * world)
    grads = torch.randn(shard * world)
    reduced = torch.empty(shard)
    times: dict[str, list[float]] = {f"{b}{part}": [] for b in ("passing", "gloo") for part in ("", "_ag", "_rs")}
    for i in range(iterations + 1):  # the first of each: warm-up
        for name, group in (("passing", None), ("gloo", gloo)):
            dist.barrier(group=gloo)
            start = time.perf_counter()
            dist.all_gather_into_tensor(gathered, piece, group=group)  # forward
            dist.all_gather_into_tensor(gathered, piece, group=group)  # backward
            gathered_at = time.perf_counter()
            dist.reduce_scatter_tensor(reduced, grads, group=group)
            if i:
                end = time.perf_counter()
                times[name].append(end - start)
                times[f"{name}_ag"].append((gathered_at - start) / 2)
                times[f"{name}_rs"].append(end - gathered_at)
    pg = dist.distributed_c10d._get_default_group()
    report = {"mode": pg.mode, "medians": {k: statistics.median(v) for k, v in times.items()}, "times": times}
    dist.destroy_process_group()
    print(json.dumps(report), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--params", type=int, default=1 << 20)
    parser.add_argument("--iterations", type=int, default=7)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.params, args.iterations)
        return
    sys.path.insert(0, str(REPO))
    from cluster.local import LocalServices, collect, ensure_keys, launch_ranks

    ensure_keys()  # the controller, aggregator and workers authenticate (docs/security.md)

    with LocalServices() as services:
        argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "--params", str(args.params),
                "--iterations", str(args.iterations)]
        outcomes = collect(launch_ranks(argv, args.servers, args.ranks,
                                        {"PASSING_CONTROLLER": services.controller, "PASSING_TIMEOUT": "60",
                                         "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}), 1800)
    for rank, (rc, report, stderr) in enumerate(outcomes):
        if rc != 0 or report is None:
            raise SystemExit(f"rank {rank} failed ({rc}):\n{stderr[-3000:]}")
    medians = {k: statistics.median(r["medians"][k] for _, r, _ in outcomes) for k in outcomes[0][1]["medians"]}
    passing, gloo = medians["passing"], medians["gloo"]
    result = {"servers": args.servers, "ranks": args.ranks, "params": args.params, "iterations": args.iterations,
              "mode": outcomes[0][1]["mode"], "medians_s": medians, "gloo_over_passing": gloo / passing}
    print(f"{args.servers}x{args.ranks}, {args.params} float32 parameters ({outcomes[0][1]['mode']}): "
          f"PASSING {passing * 1e3:.1f} ms (all_gather {medians['passing_ag'] * 1e3:.1f}, reduce_scatter "
          f"{medians['passing_rs'] * 1e3:.1f}), gloo {gloo * 1e3:.1f} ms (all_gather {medians['gloo_ag'] * 1e3:.1f}, "
          f"reduce_scatter {medians['gloo_rs'] * 1e3:.1f}) per step's communication (gloo / PASSING = "
          f"{gloo / passing:.2f})")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
