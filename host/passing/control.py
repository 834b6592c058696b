"""The host side of the controller protocol (docs/control.md): join a job group, leave it.

The controller answers a join once every worker of the group has joined, with where to
send (a switch or a software aggregator) and the group's parameters; ``Group.from_answer``
turns that answer into a streaming group, so switch and PS runs use one code path.

Every request is authenticated with the worker's CURVE key (``keys``; default: the key
directory's ``worker.key_secret``, docs/security.md). A join carries the job's secret, which
every worker of the job shares; its answer carries this worker's ``token``, which the
worker's later requests about its group (leave, alive, stuck, report) must carry.
"""

from __future__ import annotations

import os
import secrets
import threading
from typing import Any

from passing_protocol import rpc
from passing_protocol.keys import ClientKeys, KeysError

from .errors import PassingError

SECRET_ENV = "PASSING_JOB_SECRET"  # where the CLI finds the job's secret (never on a command line)
HEARTBEAT_SECONDS = 1.0  # a worker with failover says it is alive this often
REPORT_TIMEOUT = 10.0  # a 'stuck' report not answered in this long: keep waiting, ask again (a move
# may take the controller a check and an admission: seconds)


class ControllerError(PassingError):
    """The controller refused, or did not answer in time."""


def new_job_secret() -> str:
    """A job's secret: 128 random bits in hex. Every worker of the job must be given the same one."""
    return secrets.token_hex(16)


def job_secret_from_env() -> str:
    secret = os.environ.get(SECRET_ENV, "")
    if not secret:
        raise ControllerError(f"no job secret: set {SECRET_ENV} to the same value (e.g. `openssl rand -hex 16`) "
                              "for every worker of the job")
    return secret


def worker_keys(keys: ClientKeys | None) -> ClientKeys:
    try:
        return keys or ClientKeys.load(role="worker")
    except KeysError as e:
        raise ControllerError(str(e)) from None


def request(controller: str, cmd: str, timeout: float = 10.0, keys: ClientKeys | None = None,
            **fields: Any) -> dict[str, Any]:
    try:
        reply = rpc.call(controller, {"version": rpc.CONTROLLER_VERSION, "cmd": cmd, **fields}, timeout,
                         worker_keys(keys))
    except (TimeoutError, ConnectionError) as e:
        raise ControllerError(f"controller {e}") from None
    if not reply.get("ok"):
        raise ControllerError(f"controller refused {cmd}: {reply.get('error')}")
    return reply


def join(controller: str, job: str, worker: int, workers: int, host: str, udp_port: int, group: int = 0,
         pool: int | None = None, aggregator: str = "any", timeout: float = 120.0, secret: str | None = None,
         keys: ClientKeys | None = None, streams: int = 1) -> dict[str, Any]:
    """Wait until the whole group has joined; returns the controller's answer, with this
    worker's ``token``. ``secret``: the job's secret (``new_job_secret``), the same for every
    worker of the job (default: $PASSING_JOB_SECRET).

    ``aggregator="ps"`` asks for a software aggregator even when the switch could serve
    (the PS and PSRing baselines). ``streams`` > 1: the group's reduce passes striped over that many streams,
    stream s sent from ``udp_port`` + s (passing.stripes.bind_streams), each a job of its own at the aggregator
    (the answer's ``stream_jobs``; ``Group.from_answer`` takes them)."""
    fields: dict[str, Any] = {"job": job, "group": group, "worker": worker, "workers": workers, "host": host,
                              "udp_port": udp_port, "aggregator": aggregator,
                              "secret": secret if secret is not None else job_secret_from_env()}
    if pool is not None:
        fields["pool"] = pool
    if streams != 1:
        fields["streams"] = streams
    return request(controller, "join", timeout=timeout, keys=keys, **fields)


def leave(controller: str, job: str, group: int, worker: int, token: str, timeout: float = 10.0,
          stats: dict[str, float] | None = None, keys: ClientKeys | None = None) -> dict[str, Any]:
    """This worker is done; the group goes when all its workers are. ``stats``: the worker's
    final report (see ``report``). (Ending a whole group at once is an operator's `passing-ctl leave`.)"""
    fields: dict[str, Any] = {"job": job, "group": group, "worker": worker, "token": token}
    if stats is not None:
        fields["stats"] = stats
    return request(controller, "leave", timeout=timeout, keys=keys, **fields)


def report(controller: str, job: str, group: int, worker: int, token: str, stats: dict[str, float],
           timeout: float = 5.0, keys: ClientKeys | None = None) -> dict[str, Any]:
    """Tell the controller this worker's counters so far (cumulative: packets and bytes sent and
    received, retransmissions, ``calls`` and ``call_seconds`` of its allreduces); it exports them
    as metrics (docs/control.md)."""
    return request(controller, "report", timeout=timeout, keys=keys, job=job, group=group, worker=worker,
                   token=token, stats=stats)


class Failover:
    """One worker's line to the controller for moving its group mid-job (docs/control.md).

    A thread says every ``heartbeat`` seconds that this worker is alive, so the controller
    can tell a dead peer from a slow one; ``report`` is the stream's question once its
    aggregator has been silent for ``after`` seconds. Neither needs the controller to be
    up: a missed heartbeat or report only means the data path waits on."""

    def __init__(self, controller: str, job: str, group: int, worker: int, token: str, aggregator: str = "any",
                 after: float = 5.0, heartbeat: float = HEARTBEAT_SECONDS, keys: ClientKeys | None = None) -> None:
        if not after > 0:
            raise ValueError(f"failover_after must be > 0 seconds, got {after}")
        self.controller, self.job, self.group, self.worker = controller, job, group, worker
        self.token, self.keys = token, worker_keys(keys)
        self.aggregator, self.after, self.heartbeat = aggregator, after, heartbeat
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"passing-heartbeat-{job}-{group}-{worker}",
                                        daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.is_set():
            try:
                request(self.controller, "alive", timeout=self.heartbeat, keys=self.keys, job=self.job,
                        group=self.group, worker=self.worker, token=self.token, every=self.heartbeat)
            except PassingError:
                pass  # the controller is down or busy: it counts a worker dead only after 3 missed beats
            self._stop.wait(self.heartbeat)

    def report(self, job_id: int, generation: int, call: int) -> dict[str, Any]:
        """This worker's aggregator went silent in ``call`` of allocation (``job_id``, ``generation``). The
        answer's ``state``: "wait" (peers have not reported yet), "move" (a join answer for the new
        allocation, and ``redo``: the call every worker starts again from) or "failed"."""
        return request(self.controller, "stuck", timeout=REPORT_TIMEOUT, keys=self.keys, job=self.job,
                       group=self.group, worker=self.worker, token=self.token, job_id=job_id, generation=generation,
                       call=call, aggregator=self.aggregator)

    def close(self) -> None:
        self._stop.set()
