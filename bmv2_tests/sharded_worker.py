"""One worker of a reduce_scatter + all_gather run on BMv2 (bmv2_tests/test_e2e_bmv2.py), in a Mininet host.

Joins through the controller, then: a reduce_scatter of int32 (OWNER_ONLY rounds: the sums to each
block's worker, ACKs to the others) and an all_gather of arbitrary bytes of every worker's size
(GATHER relayed by the switch, NACKs where a piece lacks packets). Saves what it got to --out (.npz)
and prints one JSON line with its stream counters. Inputs come from `inputs(seed, worker)`, which
the test calls too.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from passing import Group, control
from passing.errors import PassingError
from passing.transport import parse_endpoint

BLOCK = 1000  # int32 elements of each worker's block of the reduce_scatter: 16 packets of 64 lanes


def gather_size(worker: int) -> int:
    """Bytes of worker w's all_gather piece: unequal, not whole packets."""
    return 3000 + 517 * worker


def inputs(seed: int, worker: int, workers: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed * 100 + worker)
    return (rng.integers(-(10**6), 10**6, workers * BLOCK).astype(np.int32),
            rng.integers(0, 256, gather_size(worker)).astype(np.uint8))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--controller", required=True)
    p.add_argument("--job-name", required=True)
    p.add_argument("--worker", type=int, required=True)
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--bind", required=True)
    p.add_argument("--engine", default="auto")
    p.add_argument("--drop", type=float, default=0.0)
    p.add_argument("--rto", type=float, default=5.0, help="probe/NACK silence; 5 s: a late peer is no loss")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    reduce_in, piece = inputs(args.seed, args.worker, args.workers)
    sizes = [gather_size(w) for w in range(args.workers)]
    host, port = parse_endpoint(args.bind, 0)
    try:
        answer = control.join(args.controller, args.job_name, args.worker, args.workers, host, port,
                              pool=16, timeout=60)
        token = str(answer["token"])
        with Group.from_answer(answer, bind=args.bind, timeout=60, engine=args.engine, drop=args.drop,
                               drop_seed=args.seed * 1000 + args.worker, rto=args.rto, max_rto=max(args.rto, 1.0)) as g:
            block = g.reduce_scatter(reduce_in)
            gathered = np.empty(sum(sizes), np.uint8)
            g.allgather_bytes(piece, sizes, gathered)
            stats = g.stats.as_dict()
            engine = g.engine
        control.leave(args.controller, args.job_name, 0, args.worker, token)
    except (PassingError, OSError, ValueError) as e:
        print(f"sharded worker {args.worker}: error: {e}", file=sys.stderr)
        return 1
    np.savez(args.out, block=block, gathered=gathered)
    print(json.dumps({"worker": args.worker, "mode": answer["mode"], "job_id": answer["job_id"], "engine": engine,
                      **stats}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
