"""One rank of tests/test_torch_contract.py: `python -m tests.torch_contract_worker SCENARIO [ARGS]`.

Each scenario holds backend "passing" to what gloo does with the same calls (issue 45's defects);
it prints one JSON line with what the test checks. Started with torchrun's environment
(cluster.local.rank_env), forked from the torch zygote (tests/zygote.py).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import passing.torch  # noqa: F401  (registers backend "passing")


def barrier_reads(_: list[str]) -> dict:
    """Async all_reduce and all_gather, then barrier(), then the outputs read without wait(): gloo's barrier
    waits for the group's prior collectives, so they are complete."""
    rank, world = dist.get_rank(), dist.get_world_size()
    big = torch.full((1 << 22,), float(rank + 1))  # 16 MiB: on the wire for a while
    gathered = torch.empty(world * 100_000)
    reduced = dist.all_reduce(big, async_op=True)
    collected = dist.all_gather_into_tensor(gathered, torch.full((100_000,), float(rank)), async_op=True)
    dist.barrier()
    summed = float(world * (world + 1) / 2)
    out = {"summed": float((big == summed).float().mean()),
           "gathered": float((gathered == torch.arange(world).repeat_interleave(100_000).float()).float().mean())}
    reduced.wait()
    collected.wait()
    return out


def overflow_in_reduce_scatter(_: list[str]) -> dict:
    """A fixed scale that overflows the chunks of local index 0 only: every rank's call must fail, those of
    local index 1 too (their own network stage succeeded)."""
    world = dist.get_world_size()
    pg = dist.distributed_c10d._get_default_group()
    chunk = 1000
    x = torch.full((world, chunk), 1e-3)
    for r in range(world):
        if r in [row[0] for row in pg.layout.grid]:  # the chunks of the ranks of local index 0
            x[r] = 100.0  # x scale 1e8 x servers: past int32
    out = torch.empty(chunk)
    start = time.monotonic()
    try:
        dist.reduce_scatter_tensor(out, x.reshape(-1))
        return {"raised": None}
    except Exception as e:  # noqa: BLE001  (the test reads it)
        return {"raised": f"{type(e).__name__}: {e}", "after": time.monotonic() - start}


def ddp_overflow(_: list[str]) -> dict:
    """DDP's backward whose gradients overflow a fixed scale: the error must reach DDP's reducer (C++), which
    reads the future's value: it raises there, on every rank, and nothing crashes."""
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(torch.nn.Linear(1000, 1, bias=False))
    start = time.monotonic()
    try:
        model(torch.full((1, 1000), 100.0)).sum().backward()  # gradients of 100 x scale 1e8: past int32
        return {"raised": None}
    except Exception as e:  # noqa: BLE001  (the test reads it)
        return {"raised": f"{type(e).__name__}: {e}", "after": time.monotonic() - start}


def reinit_after_a_failure(args: list[str]) -> dict:
    """A collective that fails on every rank (the overflow above), then destroy_process_group and
    init_process_group again, ``args[0]`` times (the fuzzer's rank does so after a program with an error):
    each new group must form and sum right, at once, as gloo's does."""
    timeout = float(os.environ.get("PG_TIMEOUT", "60"))
    rounds = []
    for _ in range(int(args[0])):
        dist.init_process_group("passing", timeout=timedelta(seconds=timeout))
        failed = overflow_in_reduce_scatter([])
        dist.destroy_process_group()
        start = time.monotonic()
        dist.init_process_group("passing", timeout=timedelta(seconds=timeout))
        x = torch.ones(1000)
        dist.all_reduce(x)
        rounds.append({"raised": failed["raised"] is not None, "init_and_sum": time.monotonic() - start,
                       "sum": x.tolist() == [float(dist.get_world_size())] * 1000})
        dist.destroy_process_group()
    return {"rounds": rounds}


def skip_a_call(args: list[str]) -> dict:
    """Rank ``args[0]`` skips an all_reduce (and exits ``args[1]`` s later); the others must raise within the
    process group's timeout, as on gloo."""
    x = torch.ones(10_000)
    dist.all_reduce(x)  # everyone is in
    if dist.get_rank() == int(args[0]):
        time.sleep(float(args[1]))
        os._exit(0)
    return _next_call_raises(x)


def _next_call_raises(x: torch.Tensor) -> dict:
    """An all_reduce that a peer will not join: whether and when it raised. The process then ends without
    destroy_process_group (whose gloo cannot shut down with a peer gone)."""
    start = time.monotonic()
    try:
        dist.all_reduce(x)
        result: dict = {"raised": None}
    except Exception as e:  # noqa: BLE001  (the test reads it)
        result = {"raised": f"{type(e).__name__}: {e}"[:500], "after": time.monotonic() - start}
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    os._exit(0)


def rank0_dies(_: list[str]) -> dict:
    """Rank 0 (the embedded controller's and aggregator's) dies mid-job: the others raise within the process
    group's timeout."""
    x = torch.ones(10_000)
    dist.all_reduce(x)
    if dist.get_rank() == 0:
        os._exit(3)
    return _next_call_raises(x)


def cycles(args: list[str]) -> dict:
    """init/destroy cycles, a few collectives of each kind each: the Python threads alive after each destroy."""
    left = []
    for _ in range(int(args[0])):
        if not dist.is_initialized():
            dist.init_process_group("passing", timeout=timedelta(seconds=60))
        world = dist.get_world_size()
        dist.all_reduce(torch.ones(1000))
        dist.all_reduce(torch.ones(1000), async_op=True).wait()
        dist.all_gather_into_tensor(torch.empty(world * 10), torch.ones(10))
        dist.reduce_scatter_tensor(torch.empty(10), torch.ones(world * 10))
        dist.all_reduce(torch.ones(10), async_op=True).get_future().then(lambda f: f.value()).wait()
        dist.destroy_process_group()
        left.append(sorted(t.name for t in threading.enumerate() if t is not threading.main_thread()))
    return {"threads_left": left}


def strided(_: list[str]) -> dict:
    """all_reduce of views with a step (SUM and AVG, float32 and int64): the view summed, nothing else touched."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for dtype in (torch.float32, torch.int64):
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            if op == dist.ReduceOp.AVG and dtype == torch.int64:
                continue
            for async_op in (False, True):
                base = torch.arange(40, dtype=dtype) + 100 * (rank + 1)
                view = base[1::3]
                work = dist.all_reduce(view, op=op, async_op=async_op)
                if async_op:
                    work.wait()
                expected = torch.arange(40, dtype=torch.float64)[1::3] * world + 100 * world * (world + 1) / 2
                if op == dist.ReduceOp.AVG:
                    expected /= world
                untouched = torch.ones(40, dtype=torch.bool)
                untouched[1::3] = False
                outside = base[untouched] == (torch.arange(40, dtype=dtype) + 100 * (rank + 1))[untouched]
                out[f"{dtype}-{op}-{async_op}"] = {"view": bool((view.double() == expected).all()),
                                                   "outside": bool(outside.all())}
    return out


def keep_all_gather_on_gloo(_: list[str]) -> dict:
    """PASSING_KEEP_ON_GLOO=all_gather: no gather lane (no second group, socket, segment or threads)."""
    pg = dist.distributed_c10d._get_default_group()
    world = dist.get_world_size()
    out = torch.empty(world * 10)
    dist.all_gather_into_tensor(out, torch.full((10,), float(dist.get_rank())))
    return {"gather_lane": pg.gather_lane is not None, "lanes": len(pg.lanes()),
            "gathered": bool((out == torch.arange(world).repeat_interleave(10).float()).all()),
            "threads": sorted(t.name for t in threading.enumerate() if t.name.startswith("passing"))}


def coalesced_future(_: list[str]) -> dict:
    """get_future() on a coalesced work (FSDP's form): an all_gather's is a future with the outputs, as gloo's;
    a reduce_scatter's too where PASSING runs it (gloo's has none)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    outputs = [torch.empty(world * 5), torch.empty(world * 3)]
    inputs = [torch.full((5,), float(rank)), torch.full((3,), float(rank) + 10)]
    with dist._coalescing_manager(async_ops=True) as cm:
        for o, i in zip(outputs, inputs):
            dist.all_gather_into_tensor(o, i)
    future = cm.works[0].get_future()
    value = future.wait()
    scattered = [torch.empty(4), torch.empty(2)]
    with dist._coalescing_manager(async_ops=True) as cm:
        for o, n in zip(scattered, (4, 2)):
            dist.reduce_scatter_tensor(o, torch.ones(world * n))
    try:  # gloo's reduce_scatter works have no future ("not implemented"); PASSING's have
        summed: list | str = [t.tolist() for t in cm.works[0].get_future().wait()]
    except RuntimeError as e:
        summed = str(e)
    cm.wait()
    return {"gathered": bool(torch.equal(outputs[0], torch.arange(world).repeat_interleave(5).float())),
            "value": [list(t.shape) for t in value], "summed": summed,
            "scattered": [t.tolist() for t in scattered]}


def _socket_kinds(targets: list[str]) -> list[str]:
    """'socket:[inode]' -> its protocol and local address, from /proc/net (for a report that names what leaked)."""
    inodes = {t[len("socket:["):-1] for t in targets}
    found = []
    for table in ("tcp", "tcp6", "udp", "udp6", "unix"):
        try:
            with open(f"/proc/net/{table}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            inode = cols[6] if table == "unix" else cols[9]
            if inode in inodes:
                found.append(f"{table} {cols[7] if table == 'unix' and len(cols) > 7 else cols[1]}")
                inodes.discard(inode)
    return found + [f"other {i}" for i in sorted(inodes)]


def works_kept(_: list[str]) -> dict:
    """The user keeps its works, futures and a callback's future past destroy_process_group (the fuzzer's rank
    keeps its last program's): what the process holds after the destroy beyond what it held before init, and
    once the works are released too, for the test to hold to gloo's."""
    from tests.differential.rank import settled_leftover, snapshot

    baseline = snapshot()
    dist.init_process_group(os.environ.get("CONTRACT_BACKEND", "passing"), timeout=timedelta(seconds=60))
    world = dist.get_world_size()
    kept = [dist.all_reduce(torch.ones(1000), async_op=True),
            dist.all_gather_into_tensor(torch.empty(world * 10), torch.ones(10), async_op=True),
            dist.reduce_scatter_tensor(torch.empty(10), torch.ones(world * 10), async_op=True)]
    kept.append(kept[0].get_future().then(lambda f: f.value()))
    kept.append(dist.all_reduce(torch.ones(10), async_op=True).get_future())
    for k in kept:
        k.wait()
    rank = dist.get_rank()
    dist.destroy_process_group()
    left = settled_leftover(baseline, 10.0)
    left["sockets"] = _socket_kinds([f.split()[1] for f in left["fds"] if f.startswith("socket")])
    del kept
    ended = os.environ.get("CONTRACT_DIR")
    if ended and rank == 0:
        # rank 0 counts once the others are gone: their ends close connections to it (gloo's pairs, the
        # store's), at times that differ between backends (passing's ranks wait for rank 0's store)
        _wait_for_peers(Path(ended), world - 1, 120.0)
    released = settled_leftover(baseline, 10.0)
    released["sockets"] = _socket_kinds([f.split()[1] for f in released["fds"] if f.startswith("socket")])
    if ended and rank != 0:
        (Path(ended) / f"pid-{rank}").write_text(str(os.getpid()))
    return {"left": left, "released": released}


def _wait_for_peers(where: Path, peers: int, most: float) -> None:
    """Until ``peers`` processes have written their pid under ``where`` and ended (gone, or a zombie)."""
    deadline = time.monotonic() + most
    while time.monotonic() < deadline:
        pids = [int(p.read_text()) for p in where.glob("pid-*")]
        if len(pids) == peers and not any(_running(pid) for pid in pids):
            return
        time.sleep(0.05)
    raise TimeoutError(f"the other ranks did not end within {most:.0f} s")


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except OSError:
        return False


def subgroup_ends_alone(_: list[str]) -> dict:
    """A subgroup's destroy is each rank's own, as on gloo: every rank but 0 destroys the subgroup while rank 0
    waits for them to say so (the fuzzer's seed 3100369: rank 0 was busy, and the others' destroy waited for
    its end, embedded mode)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    t = torch.ones(10)
    dist.all_reduce(t, group=group)
    store = dist.distributed_c10d._get_default_store()
    alone = None
    if rank == 0:
        try:
            store.wait([f"contract/ended/{r}" for r in range(1, world)], timedelta(seconds=60))
            alone = True
        except (RuntimeError, dist.DistError):
            alone = False
        dist.destroy_process_group(group)
    else:
        dist.destroy_process_group(group)
        store.set(f"contract/ended/{rank}", "1")
    dist.barrier()
    return {"alone": alone, "summed": t.tolist() == [float(world)] * 10}


SCENARIOS = {"barrier_reads": barrier_reads, "overflow_in_reduce_scatter": overflow_in_reduce_scatter,
             "skip_a_call": skip_a_call, "rank0_dies": rank0_dies, "cycles": cycles, "strided": strided,
             "keep_all_gather_on_gloo": keep_all_gather_on_gloo, "coalesced_future": coalesced_future,
             "works_kept": works_kept, "reinit_after_a_failure": reinit_after_a_failure,
             "subgroup_ends_alone": subgroup_ends_alone, "ddp_overflow": ddp_overflow}


def main() -> None:
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # cluster.local.collect asks before it kills
    scenario, args = sys.argv[1], sys.argv[2:]
    timeout = float(os.environ.get("PG_TIMEOUT", "60"))
    if scenario not in ("cycles", "works_kept", "reinit_after_a_failure"):
        dist.init_process_group("passing", timeout=timedelta(seconds=timeout))
    result = SCENARIOS[scenario](args)
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
