"""Which mode a PASSING process group runs in, and the stages that mode builds (docs/torch.md,
"Which mode runs when"). ``set_up`` decides it in one place, with one return per mode:

- scheme ring: no stage at all, every all_reduce is gloo's (mode "gloo");
- every rank on one server: no network stage, the in-host group's own all_reduce (mode "in-host");
- nothing configured: no aggregator; the in-host stages around an all_reduce of each rank's chunk
  among its peers on the other servers, over gloo (NCCL for CUDA); with one rank per server, the
  whole group's own all_reduce (mode "ring");
- a configured controller (or PASSING_EMBEDDED=ps: rank 0's embedded one): the group joins its
  aggregation groups there, the switch or a PS (mode "switch" or "ps", as the controller answers).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as C10dBackend
from torch.distributed import PrefixStore

from .. import control, stripes, wire
from ..keys import ClientKeys
from ..stream import MAX_SERVERS, Group
from . import embedded
from .embedded import Embedded
from .hierarchy import Layout, NetworkStage, PeerStage
from .in_host import CollectiveInHost, CpuInHostStage, InHostStage, ThroughHostMemory, cpu_in_host
from .network import GATHER_GROUP, FailoverStage, GatherLane, Membership, device_group, gather_pool, gloo_group
from .options import ALL_GATHER, SCHEMES, OptionError, Options, route_source
from .work import InOrder

log = logging.getLogger("passing.torch")

GLOO = "gloo"  # pg.mode of scheme ring: every all_reduce is gloo's
IN_HOST = "in-host"  # pg.mode of a group on one server: no network stage
RING = "ring"  # pg.mode with nothing configured: gloo (NCCL) among the peers, no aggregator
_announced: set[str] = set()  # the modes rank 0 has announced: each once per process


def _announce_once(mode: str, rank: int, message: str) -> bool:
    """Rank 0 logs ``message`` (why its group runs in ``mode``) the first time a group of this process
    does; whether it did."""
    if rank != 0 or mode in _announced:
        return False
    _announced.add(mode)
    log.warning("passing: %s", message)
    return True


@dataclass
class Stages:
    """Everything a process group needs from its set-up (ProcessGroupPassing keeps each as an attribute)."""

    mode: str  # "gloo", "in-host", "ring", or the controller's answer: "switch", "ps"
    reason: str  # why this mode, in words
    options: Options  # as resolved; in embedded mode with rank 0's controller and this rank's host filled in
    in_host: dict[str, InHostStage] = field(default_factory=dict)  # device type -> stage among the server's ranks
    peers: dict[str, C10dBackend] = field(default_factory=dict)  # ring: device type -> its group across servers
    network: NetworkStage | None = None  # how a chunk is summed over the servers
    stream: Group | None = None  # the PASSING group of the reduce lane
    gather_lane: GatherLane | None = None  # the all_gathers' own way through the network, beside stream's
    runner: InOrder | None = None  # the group's collectives (but gather_lane's), in issue order
    membership: Membership | None = None
    embedded: Embedded | None = None  # rank 0's services in embedded mode
    keys: ClientKeys | None = None  # this rank's key toward the controller
    embedded_mode: bool = False  # PASSING_EMBEDDED=ps, no controller: rank 0's embedded one serves the group
    store: dist.Store | None = None  # embedded mode: the group's, for its end (passing.torch.embedded.end)


def set_up(store: dist.Store, rank: int, size: int, timeout: timedelta, name: str, options: Options,
           layout: Layout) -> Stages:
    """Decide the group's mode and build its stages (``name``: the process group's, unique in the job)."""
    scheme = SCHEMES[options.scheme]
    if scheme.aggregator is None:
        return Stages(GLOO, f"scheme {options.scheme}: every all_reduce is gloo's", options)
    if scheme.in_host and layout.servers == 1:
        return _in_host_only(rank, options, layout)
    if options.controller is None and options.embedded == "off":
        return _ring(store, rank, size, timeout, name, options, layout)
    services = _start_embedded(store, rank, options) if options.controller is None and rank == 0 else None
    try:
        return _connect(store, rank, size, timeout, name, options, layout, services)
    except BaseException:
        if services is not None:
            services.close(linger=0)
        raise


def leave(membership: Membership, services: Embedded | None, gather_lane: GatherLane | None = None,
          store: dist.Store | None = None) -> None:
    """Leave the groups; rank 0 then stops its embedded controller once the others have left too. ``store``
    (embedded mode): the group's, where rank 0 says its services have stopped and the others wait for its
    end (passing.torch.embedded.end)."""
    if gather_lane is not None:
        gather_lane.membership.close()
    membership.close()
    if services is not None:
        services.close()
    if store is not None:
        embedded.end(store, services is not None, membership.stream.timeout)


# ---- no controller ------------------------------------------------------------------------------


def _in_host_only(rank: int, options: Options, layout: Layout) -> Stages:
    """Every rank is on one server: the in-host stage alone produces the sum, so all_reduce is
    gloo's (NCCL's) among them, with no controller and no aggregator; rank 0 says so once."""
    reason = (f"one server: its {layout.ranks_per_server} rank(s) are the whole process group, so "
              f"the in-host all_reduce (gloo; NCCL for CUDA) is the sum and there is no network stage "
              f"(scheme {options.scheme}; no controller contacted, no aggregator started)")
    _announce_once(IN_HOST, rank, reason)
    return Stages(IN_HOST, reason, options)


def _ring(store: dist.Store, rank: int, size: int, timeout: timedelta, name: str, options: Options,
          layout: Layout) -> Stages:
    """Nothing configured: no switch to find and no aggregator asked for, and one would only add a
    hop (every worker's bytes in and out of one process), so the network stage is an all_reduce
    among the peers, gloo's (NCCL's): with the in-host stage, rank j of every server sums chunk j
    (a ring of s, not s*n, across the servers, in n flows); without, the whole group's own all_reduce."""
    s, n = layout.servers, layout.ranks_per_server
    in_host: dict[str, InHostStage] = {}
    peers: dict[str, C10dBackend] = {}
    network: NetworkStage | None = None
    runner: InOrder | None = None
    if SCHEMES[options.scheme].in_host and n > 1:
        in_host = _in_host_stages(store, timeout, options, layout)
        peers = _peer_groups(store, timeout, options, layout)
        network = PeerStage(peers)
        runner = InOrder(f"passing-pg{name}")
        how = (f"in-host reduce-scatter among each server's {n} ranks, all_reduce of each rank's chunk among its "
               f"{s} peers on the other servers (gloo; NCCL for CUDA), in-host all-gather")
    else:
        how = f"the all_reduce of gloo (NCCL for CUDA) among all {size} ranks"
    reason = (f"nothing configured (no PASSING_CONTROLLER or pg_options.controller, PASSING_EMBEDDED off): "
              f"no switch or aggregator to use, so {how} (scheme {options.scheme}); set "
              f"PASSING_CONTROLLER for a switch, or PASSING_EMBEDDED=ps for a software aggregator in rank 0")
    _announce_once(RING, rank, reason)
    return Stages(RING, reason, options, in_host=in_host, peers=peers, network=network, runner=runner)


def _peer_groups(store: dist.Store, timeout: timedelta, options: Options, layout: Layout) -> dict[str, C10dBackend]:
    """Rank j's group of the rank j of every server, where gloo's own groups are (or at PASSING_HOST).
    Each rank builds its own group from the process group's store: no new_group ordering to keep."""
    s, j = layout.servers, layout.local_rank
    prefix = f"passing/peers/{j}/"
    groups: dict[str, C10dBackend] = {
        "cpu": gloo_group(PrefixStore(prefix + "gloo/", store), layout.server, s, timeout, options.host)}
    cuda = device_group(options, PrefixStore(prefix + "nccl/", store), layout.server, s, groups["cpu"])
    if cuda is not None:
        groups["cuda"] = cuda
    return groups


def _in_host_stages(store: dist.Store, timeout: timedelta, options: Options, layout: Layout) -> dict[str, InHostStage]:
    """The in-host stages among this server's ranks: shared memory (a gloo group over loopback only where
    there is none) for CPU tensors, NCCL for CUDA ones."""
    n, j = layout.ranks_per_server, layout.local_rank
    prefix = f"passing/local/{layout.server}/"
    cpu = _cpu_in_host(store, timeout, options, layout, prefix)
    stages: dict[str, InHostStage] = {"cpu": cpu}
    cuda = device_group(options, PrefixStore(prefix + "nccl/", store), j, n, None)
    if cuda is not None:
        stages["cuda"] = CollectiveInHost(cuda)
    elif torch.cuda.is_available():
        stages["cuda"] = ThroughHostMemory(cpu)
    return stages


def _cpu_in_host(store: dist.Store, timeout: timedelta, options: Options, layout: Layout,
                 prefix: str) -> CpuInHostStage:
    n, j = layout.ranks_per_server, layout.local_rank
    return cpu_in_host(
        j, n, lambda: gloo_group(PrefixStore(prefix + "gloo/", store), j, n, timeout, "127.0.0.1"), store,
        prefix + "shm/", timeout.total_seconds(), directory=str(options.shared_memory), engine=str(options.engine))


# ---- through a controller ---------------------------------------------------------------------


def _start_embedded(store: dist.Store, rank: int, options: Options) -> Embedded:
    """Rank 0's embedded controller and aggregator; the other ranks wait for its endpoint in the store,
    so a failure to start them is published there too."""
    try:
        address = str(options.host) if options.host else embedded.rank0_address(store)
        return Embedded(address, float(options.join_timeout), options.mtu)
    except BaseException as e:  # the other ranks wait for the key: give them the error
        embedded.publish(store, {"error": f"{type(e).__name__}: {e}"})
        raise


def _use_embedded(store: dist.Store, rank: int, options: Options,
                  services: Embedded | None) -> tuple[Options, ClientKeys]:
    """Rank 0 publishes its embedded controller's endpoint in the group's store; every rank then uses it
    as its controller. The options with that controller and this rank's host toward it, and the key."""
    if services is not None:
        embedded.publish(store, services.announcement())
    endpoint, keys = embedded.endpoint(store)
    host = options.host or route_source(endpoint)
    options = dataclasses.replace(options, controller=endpoint, host=host)
    if not _announce_once("embedded", rank, (
            f"no controller configured (PASSING_CONTROLLER unset, no pg_options.controller) and PASSING_EMBEDDED=ps: "
            f"rank 0 runs an embedded controller and software aggregator at {endpoint}, and the groups aggregate "
            f"there (PS mode); set PASSING_CONTROLLER to use a switch")):
        log.info("passing: embedded controller of rank 0 at %s", endpoint)
    return options, keys


def _connect(store: dist.Store, rank: int, size: int, timeout: timedelta, name: str, options: Options,
             layout: Layout, services: Embedded | None) -> Stages:
    """Join this rank's aggregation group through the controller (rank 0's embedded one if asked for)."""
    embedded_mode = options.controller is None
    if embedded_mode:
        options, keys = _use_embedded(store, rank, options, services)
    else:
        keys = control.worker_keys(None)
    scheme = SCHEMES[options.scheme]
    has_in_host = scheme.in_host and layout.ranks_per_server > 1
    in_host: dict[str, InHostStage] = {}
    if has_in_host:
        in_host = _in_host_stages(store, timeout, options, layout)
        group, worker, workers = layout.local_rank, layout.server, layout.servers
    else:
        group, worker, workers = 0, rank, size
    if workers > MAX_SERVERS:  # more than one aggregator's 32: the controller places them as a tree across racks
        raise OptionError(f"{workers} workers in one aggregation group; PASSING takes at most {MAX_SERVERS} (a tree "
                          f"of 32 racks of {wire.MAX_WORKERS}, {wire.MAX_WORKERS} under one aggregator)"
                          + ("" if has_in_host else " (the in-host schemes need one per server)"))
    job = _Job(*_job_name(store, rank, name, options), options, keys, embedded_mode)
    stream, answer = job.join(group, worker, workers, streams=int(options.streams))
    network = FailoverStage(stream, store, f"passing/fallback/{name}/{group}/", timeout)
    mode, reason = answer["mode"], answer["reason"]
    if embedded_mode:
        reason = f"embedded controller in rank 0 (PASSING_EMBEDDED=ps): {reason}"
    membership = job.membership(group, worker, stream, answer)
    gather_lane = None  # all_gathers kept on gloo need no lane (a second group, socket, segment and threads)
    if ALL_GATHER not in options.keep_on_gloo:
        gather_lane = _open_gather_lane(job, store, timeout, name, layout, group, worker, workers,
                                        gather_pool(int(answer["pool"]), workers), in_host)
    runner = InOrder(f"passing-pg{name}")
    log.info("passing: rank %d: job %s group %d worker %d of %d on %s (%s)", rank, job.name, group, worker, workers,
             mode, reason)
    return Stages(mode, reason, options, in_host=in_host, network=network, stream=stream, gather_lane=gather_lane,
                  runner=runner, membership=membership, embedded=services, keys=keys, embedded_mode=embedded_mode,
                  store=store if embedded_mode else None)


def _open_gather_lane(job: _Job, store: dist.Store, timeout: timedelta, name: str, layout: Layout, group: int,
                      worker: int, workers: int, pool: int, in_host: dict[str, InHostStage]) -> GatherLane:
    """The all_gathers' own group of the job (group GATHER_GROUP + group, ``pool`` slots), thread and
    in-host stage (passing.torch.network.GatherLane)."""
    gather_group = GATHER_GROUP + group
    stream, answer = job.join(gather_group, worker, workers, pool)
    membership = job.membership(gather_group, worker, stream, answer)
    gather_in_host = (_cpu_in_host(store, timeout, job.options, layout, f"passing/local/{layout.server}/gather/")
                      if in_host else None)
    runner = InOrder(f"passing-pg{name}-gather")
    return GatherLane(FailoverStage(stream, store, f"passing/fallback/{name}/{gather_group}/", timeout),
                      runner, gather_in_host, membership)


def _job_name(store: dist.Store, rank: int, name: str, options: Options) -> tuple[str, str]:
    """The same job name and secret on every rank of this process group, and new ones per run.
    The secret goes through the c10d store, which the ranks already trust with each other."""
    if rank == 0:
        job = f"{options.job}/pg{name}" if options.job else f"torch-{uuid.uuid4().hex[:12]}/pg{name}"
        store.set(f"passing/job/{name}", json.dumps({"name": job, "secret": control.new_job_secret()}))
    job = json.loads(store.get(f"passing/job/{name}"))
    return str(job["name"]), str(job["secret"])


@dataclass(frozen=True)
class _Job:
    """This process group's job at the controller, as each of its groups (lanes) joins it."""

    name: str
    secret: str
    options: Options
    keys: ClientKeys
    embedded_mode: bool

    def join(self, group: int, worker: int, workers: int, pool: int | None = None,
             streams: int = 1) -> tuple[Group, dict[str, Any]]:
        """Join ``group`` (``streams``: its reduce passes striped over that many, a socket each at consecutive
        ports: passing.stripes) and open its stream."""
        o = self.options
        aggregator = str(SCHEMES[o.scheme].aggregator)
        socks = stripes.bind_streams(str(o.host), streams)
        line: control.Failover | None = None
        try:
            answer = control.join(str(o.controller), self.name, worker, workers, host=str(o.host),
                                  udp_port=socks[0].address[1], secret=self.secret, group=group,
                                  pool=o.pool if pool is None else pool,
                                  aggregator=aggregator, timeout=float(o.join_timeout),
                                  keys=self.keys, streams=streams)
            socks = stripes.sized(socks, int(answer["lanes"]))  # same ports, sized for the aggregator's packets
            line = (control.Failover(str(o.controller), self.name, group, worker, str(answer["token"]),
                                     aggregator=aggregator, after=float(o.failover_after),
                                     keys=self.keys) if o.failover_after else None)
            stream = Group.from_answer(answer, bind=socks[0], streams=streams, stream_sockets=socks[1:] or None,
                                       scale=o.scale,
                                       on_overflow=str(o.on_overflow), rto=float(o.rto), timeout=float(o.timeout),
                                       engine=str(o.engine), failover=line, io=str(o.io))
        except BaseException:
            for sock in socks:
                sock.close()
            if line is not None:
                line.close()  # its heartbeats would keep a group that never formed looking alive
            raise
        return stream, answer

    def membership(self, group: int, worker: int, stream: Group, answer: dict[str, Any]) -> Membership:
        return Membership(str(self.options.controller), self.name, group, worker, str(answer["token"]), self.keys,
                          stream, float(self.options.report_interval), embedded=self.embedded_mode)
