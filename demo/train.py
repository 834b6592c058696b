"""DDP training of a small MLP on scikit-learn's bundled digits (no downloads).

Run as one rank of a torchrun-like launch (demo/run.py starts 2 servers × 2 ranks):
trains on backend "passing", then the same run on gloo, then once more with PASSING
in flat mode (every rank its own worker), and prints one JSON line with the accuracy,
the loss and the bytes this rank sent to the aggregator in each.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.distributed.optim import PostLocalSGDOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import passing.torch


@dataclass
class Digits:
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


def digits() -> Digits:
    """8×8 digit images, standardised; a fixed 80/20 split."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32)
    y = torch.tensor(d.target, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    cut = int(0.8 * len(x))
    mean, std = x[:cut].mean(0), x[:cut].std(0) + 1e-3
    x = (x - mean) / std
    return Digits(x[:cut], y[:cut], x[cut:], y[cut:])


def mlp(hidden: int = 256) -> nn.Module:
    torch.manual_seed(0)  # DDP broadcasts rank 0's weights anyway; this makes runs comparable
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def flat_parameters(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def train(data: Digits, group: dist.ProcessGroup | None, epochs: int, batch: int = 64, lr: float = 0.05,
          check_group: dist.ProcessGroup | None = None, check_every: int = 0, local_sgd: int = 0,
          subgroup: dist.ProcessGroup | None = None, hook=None, label: str = "", hidden: int = 256,
          after_step: Callable[[int], None] | None = None) -> dict:
    """Train with DDP over ``group``; every rank takes its share of each global batch.

    ``check_every``: every that many steps, all-gather the parameters over ``check_group``
    and record how far any rank's are from rank 0's. ``local_sgd``: PostLocalSGD with that
    averaging period (after one epoch of plain DDP), intra-server averaging over ``subgroup``.
    ``after_step(step)``: called after each optimizer step (the failover tests act on a step, not a clock).
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    model = mlp(hidden)
    ddp = DDP(model, process_group=group)
    optimizer: torch.optim.Optimizer = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
    steps_per_epoch = len(data.x_train) // batch
    if local_sgd:
        state = PostLocalSGDState(process_group=group, subgroup=subgroup, start_localSGD_iter=steps_per_epoch)
        ddp.register_comm_hook(state, post_localSGD_hook)
        optimizer = PostLocalSGDOptimizer(optimizer, PeriodicModelAverager(local_sgd, warmup_steps=steps_per_epoch,
                                                                           process_group=group))
    elif hook is not None:
        ddp.register_comm_hook(*hook)
    loss_fn = nn.CrossEntropyLoss()
    divergence, checks, step, history = 0.0, 0, 0, []
    for epoch in range(epochs):
        start = time.monotonic()
        order = torch.randperm(len(data.x_train), generator=torch.Generator().manual_seed(epoch))
        for b in range(steps_per_epoch):
            mine = order[b * batch:(b + 1) * batch][rank::world]
            optimizer.zero_grad()
            loss_fn(ddp(data.x_train[mine]), data.y_train[mine]).backward()
            optimizer.step()
            step += 1
            if after_step is not None:
                after_step(step)
            if check_every and step % check_every == 0:
                divergence = max(divergence, spread(model, check_group))
                checks += 1
        loss, accuracy = evaluate(model, data)
        history.append(loss)
        if rank == 0:
            print(f"{label}epoch {epoch + 1}/{epochs}: train loss {loss:.4f}, test accuracy {accuracy:.3f}, "
                  f"{time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)
    loss, accuracy = evaluate(model, data)
    return {"loss": loss, "accuracy": accuracy, "history": history, "steps": step, "checks": checks,
            "divergence": divergence, "parameters": sum(p.numel() for p in model.parameters())}


def spread(model: nn.Module, group: dist.ProcessGroup | None) -> float:
    """Largest |difference| between any rank's parameters and rank 0's."""
    mine = flat_parameters(model)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    return max(float((p - everyone[0]).abs().max()) for p in everyone)


@torch.no_grad()
def evaluate(model: nn.Module, data: Digits) -> tuple[float, float]:
    loss = float(nn.functional.cross_entropy(model(data.x_train), data.y_train))
    accuracy = float((model(data.x_test).argmax(1) == data.y_test).float().mean())
    return loss, accuracy


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--hidden", type=int, default=256, help="width of the MLP's two hidden layers")
    args = p.parse_args()
    dist.init_process_group("passing")
    data = digits()
    gloo = dist.new_group(backend="gloo")
    flat = dist.new_group(backend="passing", pg_options=passing.torch.Options(scheme="switchml"))
    runs = {}
    for name, group in (("passing", None), ("gloo", gloo), ("flat", flat)):
        before = passing.torch.transport_stats(group) if name != "gloo" else {}
        runs[name] = train(data, group, args.epochs, check_group=gloo, check_every=50, label=f"[{name}] ",
                           hidden=args.hidden)
        after = passing.torch.transport_stats(group) if name != "gloo" else {}
        for key, value in before.items():  # the counters; what names a path (a string) is not counted
            if isinstance(value, int | float):
                runs[name][key] = after[key] - value
    pg = dist.distributed_c10d._get_default_group()
    report = {"rank": dist.get_rank(), "server": pg.layout.server, "mode": pg.mode, "reason": pg.reason, **runs}
    dist.destroy_process_group()
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
