"""torch.distributed backend "passing": ``import passing.torch`` registers it.

    import passing.torch
    dist.init_process_group("passing")                      # under torchrun
    dist.init_process_group("passing", rank=r, world_size=w, init_method="tcp://h:p",
                            pg_options=passing.torch.Options(controller="tcp://ctl:9090"))

See docs/torch.md for the options, the schemes and the limits.
"""

from __future__ import annotations

import torch.distributed as dist

from .backend import ProcessGroupPassing, create
from .hooks import allreduce_hook
from .options import SCHEMES, OptionError, Options, Scheme

BACKEND = "passing"

if BACKEND.upper() not in dist.Backend._plugins:
    dist.Backend.register_backend(BACKEND, create, extended_api=True, devices=["cpu", "cuda"])


def transport_stats(group: dist.ProcessGroup | None = None) -> dict[str, int | str]:
    """This rank's PASSING transport counters (packets, bytes, retransmissions) in ``group``, and its I/O path
    (``io``: 'xdp' or 'udp'; ``io_reason``: one line, the AF_XDP mode or why not)."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if not isinstance(pg, ProcessGroupPassing):
        raise TypeError(f"not a PASSING process group: {type(pg).__name__}")
    return pg.transport_stats()


__all__ = ["BACKEND", "SCHEMES", "OptionError", "Options", "ProcessGroupPassing", "Scheme", "allreduce_hook",
           "transport_stats"]
