"""The host side of the controller protocol (docs/control.md): join a job group, leave it.

The controller answers a join once every worker of the group has joined, with where to
send (a switch or a software aggregator) and the group's parameters; ``Group.from_answer``
turns that answer into a streaming group, so switch and PS runs use one code path.
"""

from __future__ import annotations

from typing import Any

from . import rpc
from .stream import PassingError

PROTOCOL_VERSION = 2  # 2: the join answer carries the allocation's generation


class ControllerError(PassingError):
    """The controller refused, or did not answer in time."""


def request(controller: str, cmd: str, timeout: float = 10.0, **fields: Any) -> dict[str, Any]:
    try:
        reply = rpc.call(controller, {"version": PROTOCOL_VERSION, "cmd": cmd, **fields}, timeout)
    except TimeoutError as e:
        raise ControllerError(f"controller {e}") from None
    if not reply.get("ok"):
        raise ControllerError(f"controller refused {cmd}: {reply.get('error')}")
    return reply


def join(controller: str, job: str, worker: int, workers: int, host: str, udp_port: int, group: int = 0,
         pool: int | None = None, aggregator: str = "any", timeout: float = 120.0) -> dict[str, Any]:
    """Wait until the whole group has joined; returns the controller's answer.

    ``aggregator="ps"`` asks for a software aggregator even when the switch could serve
    (the PS and PSRing baselines)."""
    fields: dict[str, Any] = {"job": job, "group": group, "worker": worker, "workers": workers, "host": host,
                              "udp_port": udp_port, "aggregator": aggregator}
    if pool is not None:
        fields["pool"] = pool
    return request(controller, "join", timeout=timeout, **fields)


def leave(controller: str, job: str, group: int = 0, worker: int | None = None,
          timeout: float = 10.0, stats: dict[str, float] | None = None) -> dict[str, Any]:
    """With ``worker``: this worker is done; the group goes when all its workers are.
    Without: end the group now. ``stats``: the worker's final report (see ``report``)."""
    fields: dict[str, Any] = {"job": job, "group": group}
    if worker is not None:
        fields["worker"] = worker
    if stats is not None:
        fields["stats"] = stats
    return request(controller, "leave", timeout=timeout, **fields)


def report(controller: str, job: str, group: int, worker: int, stats: dict[str, float],
           timeout: float = 5.0) -> dict[str, Any]:
    """Tell the controller this worker's counters so far (cumulative: packets and bytes sent and
    received, retransmissions, ``calls`` and ``call_seconds`` of its allreduces); it exports them
    as metrics (docs/control.md)."""
    return request(controller, "report", timeout=timeout, job=job, group=group, worker=worker, stats=stats)
