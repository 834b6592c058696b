"""One rank of a torch test run: `python -m tests.torch_worker SCENARIO [ARGS]`.

Started by tests/test_torch_*.py with torchrun's environment (cluster.local.rank_env);
prints one JSON line with what the test checks.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import passing.torch  # registers backend "passing"
from passing.torch import transport_stats


def bound(x_max: float, servers: int, world: int, scale_workers: int) -> float:
    """|PASSING − gloo| allowed: quantization of a sum of ``world`` inputs at most x_max,
    plus float32 rounding of the two different summation orders."""
    from passing import quantize

    total = world * x_max
    if total == 0:
        return 0.0
    q = quantize.error_bound(quantize.auto_scale(total, scale_workers), scale_workers)
    return q + 4 * world * float(np.finfo(np.float32).eps) * total


def allreduce(sizes: list[int]) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = dist.new_group(backend="gloo")
    pg = dist.distributed_c10d._get_default_group()
    servers = pg.layout.servers
    checks = []
    for size in sizes:
        for async_op in (False, True):
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
                g = torch.Generator().manual_seed(size * 131 + rank)
                x = (torch.rand(size, generator=g) - 0.5) * (rank + 1)
                mine = x.clone()
                sent = transport_stats().get("packets_sent", 0)
                work = dist.all_reduce(mine, op=op, async_op=async_op)
                if async_op:
                    work.wait()
                streamed = transport_stats().get("packets_sent", 0) > sent  # it went through PASSING
                expected = x.clone()
                dist.all_reduce(expected, group=reference)  # gloo has no AVG: sum, then divide
                if op == dist.ReduceOp.AVG:
                    expected /= world
                x_max = torch.tensor([x.abs().max().item()])
                dist.all_reduce(x_max, op=dist.ReduceOp.MAX, group=reference)
                # the servers the stream scales for: its group's, or a tree's whole job (its leaf's are fewer)
                b = bound(float(x_max), servers, world, pg.stream.state.servers if pg.stream else world)
                if op == dist.ReduceOp.AVG:
                    b /= world
                err = float((mine - expected).abs().max())
                # every rank must hold the very same bits
                digest = torch.tensor([float(mine.double().sum())], dtype=torch.float64)
                lo, hi = digest.clone(), digest.clone()
                dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=reference)
                dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=reference)
                checks.append({"size": size, "async": async_op, "op": str(op), "error": err, "bound": b,
                               "identical": bool(lo == hi), "streamed": streamed,
                               "identical_to_gloo": bool(torch.equal(mine, expected))})
    return {"checks": checks, "mode": pg.mode, "reason": pg.reason, "servers": servers,
            "ranks_per_server": pg.layout.ranks_per_server, "stream": pg.stream is not None,
            "embedded": pg.embedded is not None, "streams": pg.stream.streams if pg.stream else None,
            "in_host": type(pg.in_host["cpu"]).__name__ if pg.in_host else None}


def bytes_per_allreduce(size: int) -> dict:
    x = torch.ones(size)
    dist.all_reduce(x)  # warm-up: the first call's MAX round is in every call, so count a later one
    before = transport_stats()["bytes_sent"]
    dist.all_reduce(x)
    return {"bytes_sent": transport_stats()["bytes_sent"] - before, "server": int(dist.get_rank()) // int(
        dist.distributed_c10d._get_default_group().layout.ranks_per_server)}


def fallback() -> dict:
    """Other dtypes, ops and collectives go to gloo, and give gloo's answers."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict = {"rank": rank}
    i = torch.full((5,), rank + 1, dtype=torch.int64)
    dist.all_reduce(i)
    out["int64_sum"] = i.tolist()
    d = torch.full((3,), float(rank), dtype=torch.float64)
    dist.all_reduce(d, op=dist.ReduceOp.MAX)
    out["float64_max"] = d.tolist()
    f = torch.full((4,), float(rank))
    dist.all_reduce(f, op=dist.ReduceOp.MAX)
    out["float32_max"] = f.tolist()
    b = torch.full((2,), float(rank))
    dist.broadcast(b, src=world - 1)
    out["broadcast"] = b.tolist()
    gathered = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor([float(rank)]))
    out["all_gather"] = [float(t) for t in gathered]
    single = torch.zeros(world)
    dist.all_gather_single(single, torch.tensor([float(rank)]))
    out["all_gather_single"] = single.tolist()
    mine = torch.zeros(1)
    dist.reduce_scatter_single(mine, torch.arange(world, dtype=torch.float32) + rank)
    out["reduce_scatter_single"] = mine.tolist()
    parts = [torch.zeros(1)]
    dist.reduce_scatter(parts[0], [torch.tensor([float(rank + w)]) for w in range(world)])
    out["reduce_scatter"] = parts[0].tolist()
    r = torch.tensor([float(rank)])
    dist.reduce(r, dst=0)
    out["reduce_at_0"] = r.tolist() if rank == 0 else None
    g = [torch.zeros(1) for _ in range(world)] if rank == 0 else None
    dist.gather(torch.tensor([float(rank) * 2]), g, dst=0)
    out["gather_at_0"] = [float(t) for t in g] if g is not None else None
    sc = torch.zeros(1)
    dist.scatter(sc, [torch.tensor([float(w) * 3]) for w in range(world)] if rank == 0 else None, src=0)
    out["scatter"] = sc.tolist()
    a2a = torch.zeros(world)
    dist.all_to_all_single(a2a, torch.arange(world, dtype=torch.float32) + 10 * rank)
    out["all_to_all_single"] = a2a.tolist()
    peer = rank ^ 1  # 0 <-> 1, 2 <-> 3
    got = torch.zeros(1)
    if rank % 2 == 0:
        dist.send(torch.tensor([float(rank)]), peer)
        dist.recv(got, peer)
    else:
        dist.recv(got, peer)
        dist.send(torch.tensor([float(rank)]), peer)
    out["from_peer"] = got.tolist()
    pair = [torch.zeros(world), torch.zeros(world)]
    with dist._coalescing_manager():  # FSDP's way: one coalesced call of two all_gather_single
        for k, t in enumerate(pair):
            dist.all_gather_single(t, torch.tensor([float(rank + k)]))
    out["coalesced_all_gather"] = [t.tolist() for t in pair]
    halves = [torch.zeros(1), torch.zeros(1)]
    with dist._coalescing_manager():
        for k, t in enumerate(halves):
            dist.reduce_scatter_single(t, torch.arange(world, dtype=torch.float32) * (k + 1))
    out["coalesced_reduce_scatter"] = [t.tolist() for t in halves]
    # Back-to-back gloo calls: a collective left to torch's trampoline ran with the GIL held and
    # deadlocked with gloo's worker thread dropping the previous call's tensors (backend.py)
    for k in range(1500):
        m = torch.full((4,), float(rank))
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
        c = torch.full((2,), float(rank))
        dist.broadcast(c, src=k % world)
    out["back_to_back"] = [m.tolist(), c.tolist()]
    dist.barrier()
    return out


def dead_peer(victim: int) -> dict:
    """Rank ``victim`` exits before the second all_reduce; the others must get an error from wait()."""
    x = torch.ones(10_000)
    dist.all_reduce(x)
    if dist.get_rank() == victim:
        sys.stdout.write(json.dumps({"victim": True}) + "\n")
        sys.stdout.flush()
        os._exit(0)
    start = time.monotonic()
    work = dist.all_reduce(torch.ones(10_000), async_op=True)
    try:
        work.wait()
    except Exception as e:  # what the test wants to see
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def ddp(epochs: int) -> dict:
    """The same DDP training on "passing" and on gloo; parameters compared every 10 steps."""
    from demo.train import digits, train

    data, gloo = digits(), dist.new_group(backend="gloo")
    return {"passing": train(data, None, epochs, check_group=gloo, check_every=10),
            "gloo": train(data, gloo, epochs, check_group=gloo, check_every=10)}


def ddp_fault(epochs: int, when: str = "training", hidden: int = 256) -> dict:
    """DDP training while the test kills an aggregator under it (tests/test_torch_failover.py): the
    parameters are compared across ranks every 10 steps. The same training on gloo, which the test
    compares it with, is scenario ddp_gloo. ``when``: "training" (rank 0 says so past its fifth step, and
    goes on) or "startup" (rank 0 says so before DistributedDataParallel(...), whose parameter check is an
    all_gather through the aggregator, and waits until the test has struck: PASSING_TEST_MARKER.done).
    ``hidden``: the MLP's width (narrower through BMv2, which adds ~1 k packets/s)."""
    from demo.train import digits, train

    data, gloo = digits(), dist.new_group(backend="gloo")
    pg = dist.distributed_c10d._get_default_group()
    start = time.time()
    marker = Path(os.environ["PASSING_TEST_MARKER"])

    # PASSING_TEST_HOLD: the ranks wait at the last step until the test has made that file (or 120 s), so a test
    # that strikes twice sees its second move while the training still runs, however fast the machine is. They
    # wait in calls through the group (a flag all-reduced until rank 0 has seen the file): a strike meanwhile is
    # met by every rank and the group moves, where a rank waiting outside any call would keep its group's move
    # waiting for its silence report until the others' calls time out
    hold, last = os.environ.get("PASSING_TEST_HOLD"), len(data.x_train) // 64 * epochs

    def mid_training(step: int) -> None:  # the test kills the aggregator once rank 0 is past step 5
        if step == 5 and dist.get_rank() == 0 and when == "training":
            marker.touch()
        if hold and step == last:
            deadline, flag = time.monotonic() + 120, torch.ones(1)
            while flag.item():
                time.sleep(0.05)
                flag.fill_(float(dist.get_rank() == 0 and not Path(hold).exists() and time.monotonic() < deadline))
                dist.all_reduce(flag)

    if when == "startup" and dist.get_rank() == 0:
        marker.touch()
        deadline = time.monotonic() + 30
        while not marker.with_suffix(".done").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    passing_run = train(data, None, epochs, check_group=gloo, check_every=10, after_step=mid_training, hidden=hidden)
    passing_run.update(started=start, ended=time.time(), seconds=time.time() - start)
    return {"passing": passing_run, "moves": sum(lane.stream.moves for lane in pg.lanes()),
            "on_gloo": any(lane.gloo is not None for lane in pg.lanes()), "mode": pg.mode}


def ddp_gloo(epochs: int, hidden: int = 256) -> dict:
    """ddp_fault's training on a gloo default group: the fault-free reference of the failover tests."""
    from demo.train import digits, train

    start = time.monotonic()
    gloo_run = train(digits(), None, epochs, check_group=None, check_every=10, hidden=hidden)
    gloo_run["seconds"] = time.monotonic() - start
    return {"gloo": gloo_run}


def post_local_sgd(epochs: int) -> dict:
    """torch's PostLocalSGD (hook + optimizer) over "passing", averaging within each server."""
    from demo.train import digits, train

    pg = dist.distributed_c10d._get_default_group()
    n = pg.layout.ranks_per_server
    world = dist.get_world_size()
    subgroup, _ = dist.new_subgroups_by_enumeration([list(range(s, s + n)) for s in range(0, world, n)])
    sent = transport_stats()["packets_sent"]
    out = train(digits(), None, epochs, local_sgd=4, subgroup=subgroup)
    out["streamed"] = transport_stats()["packets_sent"] > sent
    return out


def hook(epochs: int) -> dict:
    """gloo stays the default group; DDP's gradients go through passing.torch.allreduce_hook."""
    from demo.train import digits, train

    data, group = digits(), dist.new_group(backend="passing")
    hooked = train(data, None, epochs, check_group=None, check_every=10, hook=(group, passing.torch.allreduce_hook))
    hooked["bytes_sent"] = transport_stats(group)["bytes_sent"]
    return {"hook": hooked, "gloo": train(data, None, epochs, check_group=None, check_every=10)}


def nonfinite() -> dict:
    """NaN, +inf and -inf in some ranks' tensors, in float32, float16 and bfloat16: the same classes
    as gloo's IEEE sums element by element, and the finite elements within the scale bound."""
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = dist.new_group(backend="gloo")
    checks = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for pattern in ("nan", "inf", "mixed", "all"):
            g = torch.Generator().manual_seed(rank)
            x = (torch.rand(5000, generator=g) - 0.5) * 4
            if pattern == "nan" and rank == 0:
                x[::97] = float("nan")
            if pattern in ("inf", "mixed"):
                x[rank::50] = float("inf") if rank % 2 == 0 else float("-inf")  # +inf and -inf meet at some
            if pattern == "mixed" and rank == world - 1:
                x[7::31] = float("nan")
            if pattern == "all":
                x[:] = float("inf") if rank == 0 else 1.0  # every element non-finite: the shard's scale is 0
            x = x.to(dtype)
            mine = x.clone()
            sent = transport_stats().get("packets_sent", 0)
            dist.all_reduce(mine)
            streamed = transport_stats().get("packets_sent", 0) > sent
            expected = x.float()
            dist.all_reduce(expected, group=reference)  # float32 IEEE sums, cast back like PASSING's
            expected = expected.to(dtype).float()
            got = mine.float()
            same_class = bool(torch.equal(got.isnan(), expected.isnan()) and torch.equal(got.isposinf(),
                              expected.isposinf()) and torch.equal(got.isneginf(), expected.isneginf()))
            finite = expected.isfinite()
            error = float((got[finite] - expected[finite]).abs().max()) if finite.any() else 0.0
            scale = float(expected[finite].abs().max()) if finite.any() else 0.0
            checks.append({"dtype": str(dtype), "pattern": pattern, "streamed": streamed, "same_class": same_class,
                           "error": error, "tolerance": 1e-3 + scale * (1e-2 if dtype != torch.float32 else 1e-5)})
    return {"checks": checks}


def gradscaler(steps: int) -> dict:
    """Mixed precision (CPU autocast to bfloat16) with torch.amp.GradScaler, whose first steps
    overflow to inf on purpose; the same run on "passing" and on gloo."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from demo.train import digits

    data = digits()
    out = {}
    for name, group in (("passing", None), ("gloo", dist.new_group(backend="gloo"))):
        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)),
                    process_group=group)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127, backoff_factor=2.0**-20)
        skipped = 0
        rank, world = dist.get_rank(), dist.get_world_size()
        for step in range(steps):
            idx = torch.arange(step * 32, step * 32 + 32) % len(data.x_train)
            xb, yb = data.x_train[idx][rank::world], data.y_train[idx][rank::world]
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = torch.nn.functional.cross_entropy(model(xb), yb)
            scaler.scale(loss * 64).backward()  # x 64: at the initial scale the gradients overflow to inf
            before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            skipped += scaler.get_scale() < before
        out[name] = {"skipped": skipped, "scale": scaler.get_scale(), "loss": float(loss),
                     "params": [p.detach().double().sum().item() for p in model.parameters()]}
    return out


def reported_calls(pg, wait: float = 10.0) -> float | None:
    """On rank 0, whose embedded controller holds the metrics: the fewest calls any worker of any
    all_reduce group (not a gather lane's) has reported (PASSING_REPORT_INTERVAL); None on the other
    ranks (a worker's key may not ask for metrics)."""
    from passing.torch.network import GATHER_GROUP

    if pg.embedded is None:
        return None
    deadline = time.monotonic() + wait
    while True:
        groups = [g for g in pg.embedded.controller.metrics()["groups"] if g["running"] and g["group"] < GATHER_GROUP]
        calls = min((h.get("calls", 0.0) for g in groups for h in g["hosts"].values()), default=0.0)
        if (groups and all(len(g["hosts"]) == g["workers"] for g in groups) and calls) \
                or time.monotonic() > deadline:
            return calls
        time.sleep(0.05)


def embedded_run() -> dict:
    """One all_reduce, then destroy_process_group: reports where the controller was and, on rank 0,
    whether the embedded controller and aggregator stopped with the group."""
    import socket
    import threading

    pg = dist.distributed_c10d._get_default_group()
    x = torch.full((5000,), float(dist.get_rank() + 1))
    dist.all_reduce(x)
    world = dist.get_world_size()
    out = {"sum_ok": bool((x == world * (world + 1) / 2).all()), "mode": pg.mode, "reason": pg.reason,
           "embedded_mode": pg.embedded_mode, "controller": pg.options.controller, "host": pg.options.host,
           "rank": dist.get_rank(), "reported_calls": reported_calls(pg)}
    dist.destroy_process_group()
    host, port = pg.options.controller.rsplit("/", 1)[-1].rsplit(":", 1)
    deadline = time.monotonic() + 2.0  # ZeroMQ closes a listening socket in its I/O thread, a moment later
    while True:
        with socket.socket() as s:  # free again once the embedded controller has stopped
            out["port_free"] = s.connect_ex((host, int(port))) != 0
        if out["port_free"] or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    out["threads_left"] = [t.name for t in threading.enumerate() if t.name.startswith("passing-embedded")]
    return out


def one_server() -> dict:
    """All ranks on one server: gloo's own bits, with no stream, no controller, no aggregator."""
    import threading

    pg = dist.distributed_c10d._get_default_group()
    reference = dist.new_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(rank))
    identical = []
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        for async_op in (False, True):
            mine, expected = x.clone(), x.clone()
            work = dist.all_reduce(mine, op=op, async_op=async_op)
            if async_op:
                work.wait()
            dist.all_reduce(expected, group=reference)  # gloo has no AVG: its sum, divided
            if op == dist.ReduceOp.AVG:
                expected /= world
            identical.append(bool(torch.equal(mine, expected)))
    return {"rank": rank, "mode": pg.mode, "reason": pg.reason, "identical_to_gloo": identical,
            "stream": pg.stream is not None, "embedded": pg.embedded is not None, "stats": transport_stats(),
            "threads": [t.name for t in threading.enumerate() if t.name.startswith("passing")]}


def chained_hook(group, bucket):  # noqa: ANN001, ANN201  (DDP's hook signature)
    """A comm hook whose `then` callback issues a second collective and waits on it: the mean, then
    summed again and divided (the same mean), as a hook that chains collectives does."""
    world = dist.get_world_size(group)

    def again(fut):  # noqa: ANN001, ANN202
        mean = fut.value()[0]
        dist.all_reduce(mean, group=group, async_op=True).wait()
        return mean.div_(world)

    return dist.all_reduce(bucket.buffer().div_(world), group=group, async_op=True).get_future().then(again)


def comm_hooks(epochs: int) -> dict:
    """Every DDP comm hook torch ships (post-localSGD is scenario post_local_sgd; bf16_compress_hook, which
    DDP refuses without CUDA and NCCL whatever the backend, runs where there is a GPU), and one that
    chains two collectives in `then`: the same training on "passing" (the default group) and on gloo."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as power

    from demo.train import digits, train

    def hooks(group: dist.ProcessGroup | None) -> dict:
        def power_sgd(error_feedback: bool) -> power.PowerSGDState:
            return power.PowerSGDState(group, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                       min_compression_rate=0.5, use_error_feedback=error_feedback, random_seed=0)

        return {
            "allreduce": (group, default_hooks.allreduce_hook),
            "fp16_compress": (group, default_hooks.fp16_compress_hook),
            "powerSGD": (power_sgd(True), power.powerSGD_hook),
            "powerSGD_no_error_feedback": (power_sgd(False), power.powerSGD_hook),
            "batched_powerSGD": (power_sgd(True), power.batched_powerSGD_hook),
            "batched_powerSGD_no_error_feedback": (power_sgd(False), power.batched_powerSGD_hook),
            "chained": (group, chained_hook),
        }

    def outcome(group: dist.ProcessGroup | None, hook: tuple, **kwargs) -> dict:
        """The training, or the error it ends in (a hook that fails on gloo must fail alike on passing)."""
        try:
            return train(data, group, epochs, hook=hook, hidden=64, **kwargs)
        except Exception as e:  # noqa: BLE001
            return {"error": f"{type(e).__name__}: {str(e)[:200]}"}

    data, gloo = digits(), dist.new_group(backend="gloo")
    out = {}
    for name in hooks(None):
        reference = outcome(gloo, hooks(gloo)[name])
        sent = transport_stats().get("packets_sent", 0)
        start = time.monotonic()
        mine = outcome(None, hooks(None)[name], check_group=gloo, check_every=10)
        mine.update(seconds=time.monotonic() - start, streamed=transport_stats().get("packets_sent", 0) > sent)
        out[name] = {"passing": mine, "gloo": reference}
    pg = dist.distributed_c10d._get_default_group()
    return {"hooks": out, "mode": pg.mode}


def strided() -> dict:
    """all_reduce of a 1-D tensor with a step and of a transposed 2-D one, as gloo takes them."""
    rank, world, gloo = dist.get_rank(), dist.get_world_size(), dist.new_group(backend="gloo")
    checks = {}
    for name, make in (("step", lambda t: t[::3]), ("transposed", lambda t: t.view(50, 40).t())):
        base = torch.arange(2000, dtype=torch.float32) / 7
        mine, ref = make(base * (rank + 1)), make(base * (rank + 1))
        expected = make(base * (world * (world + 1) / 2))
        dist.all_reduce(mine)
        dist.all_reduce(ref, group=gloo)
        checks[name] = {"contiguous": mine.is_contiguous(), "error": float((mine - expected).abs().max()),
                        "gloo_error": float((ref - expected).abs().max()), "scale": float(expected.abs().max())}
    return {"checks": checks}


def first_sharded(rounds: int) -> dict:
    """reduce_scatter_tensor(async_op=True), then an int64 all_reduce (gloo's) before waiting on it,
    with the ranks out of step: the first sharded call of each fresh group must not collide with the
    caller's own gloo collective (issue 35: it hung about one run in two)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ok = True
    for r in range(rounds):
        group = dist.new_group(backend="passing")  # a fresh group: its first sharded call
        time.sleep(0.05 * ((rank + r) % world))
        out = torch.empty(8)
        work = dist.reduce_scatter_tensor(out, torch.ones(8 * world) * (rank + 1), group=group, async_op=True)
        count = torch.tensor([rank], dtype=torch.int64)
        dist.all_reduce(count, group=group)
        work.wait()
        expected = world * (world + 1) / 2
        ok = ok and int(count) == world * (world - 1) // 2 and bool(torch.allclose(out, torch.full((8,), expected)))
    return {"ok": ok, "rounds": rounds}


def cuda_streams(steps: int) -> dict:
    """CUDA tensors through PASSING as NCCL's Work treats them: the input is written on a side stream
    behind a long kernel and the collective issued without a synchronisation (it must wait for that
    stream), the result read on another stream after wait() (which must wait for the collective's),
    and a `then` callback's value; then DDP steps on CUDA against the same steps on every rank's data
    at once, on the CPU, without communication."""
    from demo.train import mlp

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    checks = []
    for size in (1, 4099, 1 << 20):
        writer, reader = torch.cuda.Stream(), torch.cuda.Stream()
        x = torch.zeros(size, device=device)
        with torch.cuda.stream(writer):
            torch.cuda._sleep(50_000_000)  # the write lands well after the all_reduce is issued
            x.fill_(rank + 1.0)
            work = dist.all_reduce(x, async_op=True)
        with torch.cuda.stream(reader):
            work.wait()
            seen = float(x.sum().item()) / size
        chained = work.get_future().then(lambda f, n=size: f.value()[0].sum().item() / n).wait()
        checks.append({"size": size, "seen": seen, "chained": chained, "expected": world * (world + 1) / 2})
    torch.manual_seed(0)
    model = mlp(64).to(device)
    reference = mlp(64)  # the same start: every rank's batches summed on the CPU, no communication
    reference.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0])
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    batches = []  # every rank's batch, the same each step (so the loss must fall)
    for r in range(world):
        g = torch.Generator().manual_seed(r)
        batches.append((torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)))
    losses = []
    for _ in range(steps):
        data, target = batches[rank]
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(data.to(device)), target.to(device))
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
        reference_optimizer.zero_grad()  # DDP's average of the ranks' mean losses = the mean over all
        torch.nn.functional.cross_entropy(reference(torch.cat([b[0] for b in batches])),
                                          torch.cat([b[1] for b in batches])).backward()
        reference_optimizer.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
    expected = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
    off_reference = float((flat - expected).abs().max())
    everyone = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(everyone, flat, group=dist.new_group(backend="gloo"))
    spread = max(float((p - everyone[0]).abs().max()) for p in everyone)
    pg = dist.distributed_c10d._get_default_group()
    return {"checks": checks, "losses": losses, "spread": spread, "off_reference": off_reference, "mode": pg.mode,
            "streamed": transport_stats().get("packets_sent", 0) > 0}


SCENARIOS = {"allreduce": lambda a: allreduce([int(s) for s in a]), "bytes": lambda a: bytes_per_allreduce(int(a[0])),
             "fallback": lambda a: fallback(), "dead_peer": lambda a: dead_peer(int(a[0])),
             "ddp": lambda a: ddp(int(a[0])), "ddp_fault": lambda a: ddp_fault(int(a[0]), *a[1:2], *map(int, a[2:])),
             "ddp_gloo": lambda a: ddp_gloo(*map(int, a)),
             "post_local_sgd": lambda a: post_local_sgd(int(a[0])),
             "hook": lambda a: hook(int(a[0])), "nonfinite": lambda a: nonfinite(),
             "gradscaler": lambda a: gradscaler(int(a[0])), "embedded": lambda a: embedded_run(),
             "one_server": lambda a: one_server(), "comm_hooks": lambda a: comm_hooks(int(a[0])),
             "strided": lambda a: strided(), "first_sharded": lambda a: first_sharded(int(a[0])),
             "cuda_streams": lambda a: cuda_streams(int(a[0]))}


def init_explicitly() -> None:
    """init_process_group with arguments instead of torchrun's variables (which are removed first)."""
    env = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
                                          "LOCAL_RANK", "LOCAL_WORLD_SIZE", "PASSING_CONTROLLER")}
    options = passing.torch.Options(controller=env["PASSING_CONTROLLER"], server=f"server-{env['GROUP_RANK']}")
    dist.init_process_group("passing", init_method=f"tcp://{env['MASTER_ADDR']}:{env['MASTER_PORT']}",
                            rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]), pg_options=options)


def main() -> None:
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # cluster.local.collect asks before it kills
    faulthandler.enable(all_threads=True)  # a crash says where (a forked rank never read PYTHONFAULTHANDLER)
    scenario, args = sys.argv[1], sys.argv[2:]
    if "--explicit" in args:
        args.remove("--explicit")
        init_explicitly()
    else:
        dist.init_process_group("gloo" if scenario in ("hook", "ddp_gloo") else "passing")
    try:
        result = SCENARIOS[scenario](args)
    finally:
        if scenario not in ("dead_peer", "embedded"):  # these end the group themselves
            dist.destroy_process_group()
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    if scenario == "dead_peer":
        os._exit(0)  # the default group's gloo cannot shut down cleanly with a peer gone


if __name__ == "__main__":
    main()
