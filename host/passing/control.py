"""The host side of the controller protocol (docs/control.md): join a job group, leave it.

The controller answers a join once every worker of the group has joined, with where to
send (a switch or a software aggregator) and the group's parameters; ``Group.from_answer``
turns that answer into a streaming group, so switch and PS runs use one code path.
"""

from __future__ import annotations

import threading
from typing import Any

from . import rpc
from .stream import PassingError

PROTOCOL_VERSION = 2  # 2: the join answer carries the allocation's generation
HEARTBEAT_SECONDS = 1.0  # a worker with failover says it is alive this often
REPORT_TIMEOUT = 10.0  # a 'stuck' report not answered in this long: keep waiting, ask again (a move
# may take the controller a check and an admission: seconds)


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


class Failover:
    """One worker's line to the controller for moving its group mid-job (docs/control.md).

    A thread says every ``heartbeat`` seconds that this worker is alive, so the controller
    can tell a dead peer from a slow one; ``report`` is the stream's question once its
    aggregator has been silent for ``after`` seconds. Neither needs the controller to be
    up: a missed heartbeat or report only means the data path waits on."""

    def __init__(self, controller: str, job: str, group: int, worker: int, aggregator: str = "any",
                 after: float = 5.0, heartbeat: float = HEARTBEAT_SECONDS) -> None:
        if not after > 0:
            raise ValueError(f"failover_after must be > 0 seconds, got {after}")
        self.controller, self.job, self.group, self.worker = controller, job, group, worker
        self.aggregator, self.after, self.heartbeat = aggregator, after, heartbeat
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"passing-heartbeat-{job}-{group}-{worker}",
                                        daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.is_set():
            try:
                request(self.controller, "alive", timeout=self.heartbeat, job=self.job, group=self.group,
                        worker=self.worker, every=self.heartbeat)
            except PassingError:
                pass  # the controller is down or busy: it counts a worker dead only after 3 missed beats
            self._stop.wait(self.heartbeat)

    def report(self, generation: int, call: int) -> dict[str, Any]:
        """This worker's aggregator went silent in ``call`` of allocation ``generation``. The answer's
        ``state``: "wait" (peers have not reported yet), "move" (a join answer for the new
        allocation, and ``redo``: the call every worker starts again from) or "failed"."""
        return request(self.controller, "stuck", timeout=REPORT_TIMEOUT, job=self.job, group=self.group,
                       worker=self.worker, generation=generation, call=call, aggregator=self.aggregator)

    def close(self) -> None:
        self._stop.set()
