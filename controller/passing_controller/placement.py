"""Where a group runs (docs/control.md, "Which aggregator"): the one policy that orders the
aggregators (``candidates``), admitting a whole group on the first that takes it (the switch's
table entries, or a PS's ``add_job``), the answer its workers get, and freeing an allocation.

A join (membership.py) and a move (failover.py) both place a group through ``allocate``. It
runs on a pool thread: the lock is taken for the state only, never while an aggregator is asked.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from .allocation import MAX_JOB_ID
from .allocator import SlotAllocator, SlotsExhausted
from .fabric import FabricError
from .keys import digest
from .p4runtime import SwitchError
from .ps_control import PsControl
from .readout import Readout
from .schema import RequestError
from .state import PS_SLOTS, PendingGroup, State, allocation_key
from .store import Record
from .switch import GROUP_CONTROLS, SWITCH_RETRY_SECONDS, SwitchLink, allocations
from .topology import SWITCH, SWITCH_PREFIX, PsEndpoint, Topology, is_switch, ps_pool
from .tree_placement import TreePlacement, TreeRefused, tree_plan, worker_answer

log = logging.getLogger("passing_controller")

UDP_PORT = 9877  # docs/protocol.md: the aggregator's PASSING port
MAX_POOL = 65536
AGGREGATOR_RETRY_SECONDS = 30.0  # a PS that failed goes last in the order for this long
MAX_FLAT = 32  # workers of a group on one aggregator (its bitmap); more only across racks (a tree)


class AggregatorFailed(RuntimeError):
    """One aggregator could not take a group (the text says which and why); the next one is tried."""


class Placement:
    def __init__(self, topo: Topology, state: State, switch: SwitchLink, ps: PsControl, readout: Readout,
                 default_pool: int, switches: dict[str, SwitchLink] | None = None) -> None:
        """``switches``: every switch's session by control name (default: ``switch``, the one)."""
        self.topo, self.state, self.switch, self.ps, self.readout = topo, state, switch, ps, readout
        self.switches = switches if switches is not None else {SWITCH: switch}
        self.default_pool = default_pool
        self.trees = TreePlacement(topo, state, ps, default_pool, switch, switches)

    def largest_pool(self) -> int:
        """The largest pool any aggregator of the topology could give one group."""
        return max([self.topo.slots if self.topo.p4runtime else 0] + [v.slots for v in self.topo.switches.values()]
                   + ([PS_SLOTS] if self.topo.ps else []))

    def allocate(self, name: str, group: int, pending: PendingGroup, tokens: dict[int, str] | None = None,
                 exclude: frozenset[str] = frozenset(), workers: list[dict] | None = None) -> tuple[Record, str]:
        """Admit the group on the first aggregator that takes it, the whole group on one
        (``exclude``: aggregators not to try, such as the one a move leaves for being down).
        Runs on a pool thread: the lock is taken for the state only."""
        s = self.state
        ids: list[tuple[int, int]] = []  # (job id, generation) of each stream, the group's own first
        try:
            with s.lock:
                for _ in range(pending.streams):
                    ids.append(s.store.claim_job_id(MAX_JOB_ID, busy=s.claimed | s.ending))
                    s.claimed.add(ids[-1][0])
                (job_id, generation), extra = ids[0], ids[1:]
            if workers is None:
                assert tokens is not None
                workers = [{"index": w, "host": self.topo.host(str(req["host"])).name,
                            "udp_port": int(req["udp_port"]), "token": digest(tokens[w])}
                           for w, (_, req) in sorted(pending.members.items())]
            switch = self.flat_switch(workers)
            order = self.candidates(job_id, pending.aggregator, switch)
            tried: list[str] = []
            placed = self._tree(job_id, name, group, generation, pending, workers, exclude, tried)
            if placed is not None:
                return placed
            if len(workers) > MAX_FLAT:
                raise RequestError(f"{len(workers)} workers: a group on one aggregator takes at most {MAX_FLAT}; "
                                   "more need racks of a fabric (docs/control.md, Fabric)"
                                   + (": " + "; ".join(tried) if tried else ""))
            for aggregator in order:
                if aggregator in exclude:
                    tried.append(f"{aggregator} is down")
                    continue
                try:
                    if is_switch(aggregator):
                        record = self._allocate_switch(aggregator, job_id, name, group, generation,
                                                       pending.pool or self.default_pool, workers, extra)
                    else:
                        record = self._allocate_ps(self.ps.endpoint(aggregator), job_id, name, group, generation,
                                                   pending.pool, workers, extra)
                except AggregatorFailed as e:
                    tried.append(str(e))
                    continue
                if record.mode == "switch":
                    return record, "in-network aggregation on " + ("the switch" if aggregator == SWITCH else aggregator)
                if pending.aggregator == "ps":
                    why = ["a software aggregator (PS), as the job asked"]
                elif switch is None:
                    why = [self._no_switch(workers)]
                else:
                    why = []
                return record, "; ".join(why + tried)
            if not tried:
                raise RequestError("no aggregator can serve it: the topology has no switch and no PS fallback")
            raise RequestError("no aggregator can take the group: " + "; ".join(tried))
        finally:
            with s.lock:
                s.claimed.difference_update(i for i, _ in ids)

    def _tree(self, job_id: int, name: str, group: int, generation: int, pending: PendingGroup,
              workers: list[dict], exclude: frozenset[str], tried: list[str]) -> tuple[Record, str] | None:
        """A group whose workers sit under several leaves of the fabric: its tree, or None (placed flat as
        today: under one leaf, no fabric, or a tree that could not be placed, why in ``tried``)."""
        try:
            p = tree_plan(self.topo, workers)
            if p is None:
                return None
            if pending.streams > 1:
                raise TreeRefused(f"a group of {pending.streams} streams is placed on one aggregator (a tree "
                                  "carries one stream per group)")
            record = self.trees.allocate(p, job_id, name, group, generation, pending.pool, workers, exclude,
                                         switch_allowed=pending.aggregator != "ps")
        except (FabricError, TreeRefused) as e:
            tried.append(f"no tree across racks: {e}")
            return None
        with self.state.lock:
            self._add(record)
        racks = ", ".join(f"{n['name']} ({len(n['workers'])})" for n in record.aggregator["tree"][:-1])
        return record, f"a tree across racks: leaves {racks} under root {record.aggregator['tree'][-1]['name']}"

    def flat_switch(self, workers: list[dict]) -> str | None:
        """The switch a group on one aggregator may aggregate on (its control name): the topology's one
        switch, or the named switch that every one of its workers sits on (docs/control.md, "Several
        switches"); None: no switch can (no switch, or its workers sit on several named ones)."""
        if self.topo.p4runtime is not None:
            return SWITCH
        on = {self.topo.host(w["host"]).switch for w in workers}
        return SWITCH_PREFIX + on.pop() if len(on) == 1 and None not in on else None

    def _no_switch(self, workers: list[dict]) -> str:
        """Why no switch could take a group on one aggregator (flat_switch gave None)."""
        if not self.topo.switches:
            return "no switch in the topology"
        on = sorted({str(self.topo.host(w["host"]).switch) for w in workers})
        return f"its workers sit on several switches ({', '.join(on)}): a switch serves a group of its own hosts"

    def candidates(self, job_id: int, wanted: str, switch: str | None = SWITCH) -> list[str]:
        """The aggregators to try for a group, in order: the one policy for choosing an aggregator.

        The switch first when the group may use it (``switch``: flat_switch's, the one switch or the
        named one its workers sit on), then every PS of the topology, starting at
        job id mod their number (so groups spread over them); a PS that failed lately and is
        not yet due for a retry, or one whose liveness is being checked, goes last, still tried
        before the group is refused."""
        usable = switch is not None and (switch != SWITCH or self.topo.p4runtime is not None)
        order = [switch] if wanted == "any" and usable else []
        ps = [p.control for p in self.topo.ps]
        if ps:
            k = job_id % len(ps)
            order += ps[k:] + ps[:k]
        with self.state.lock:
            down, now = self.state.store.down(), time.time()
            suspect = set(self.state.suspect)
        # (a switch keeps its place: it fails at once while it is down, see _allocate_switch)
        resting = {a for a, (_, retry_at, _) in down.items() if retry_at > now and not is_switch(a)} | suspect
        return [a for a in order if a not in resting] + [a for a in order if a in resting]

    def _allocate_switch(self, switch: str, job_id: int, name: str, group: int, generation: int, pool: int,
                         workers: list[dict], extra: list[tuple[int, int]]) -> Record:
        """The group flat on ``switch`` (control name: the one "switch", or a named "switch:NAME", its
        own session, view and slots)."""
        s, link, view, what = self.state, self.switches[switch], self.topo.view(switch), switch  # "switch", "switch:s1"
        with link.lock:
            link.connect_if_due()
            if link.session is None:
                raise AggregatorFailed(f"{what} unreachable: {link.error}")
            with s.lock:
                bases = _take_ranges(s.allocator_for(switch), pool, 1 + len(extra), f"{what} slots exhausted")
            # the lanes of the switch's program (its chip's, topology.CHIP_LANES), kept with the allocation; a
            # named switch's record names it (Record.control), the one switch's names none (as before)
            r = Record(job_id, name, group, "switch", generation, bases[0], pool, workers,
                       {"data": f"{view.aggregation_ip}:{UDP_PORT}", "lanes": view.lanes,
                        **({} if switch == SWITCH else {"control": switch}), **_stripes(extra, bases)})
            streams = allocations(view, r)  # one per stream, each with its job id and slots
            try:
                for a in streams:
                    for control in GROUP_CONTROLS:
                        control.install(link.session, a)
            except SwitchError as e:
                for a in streams:  # what went in of it
                    for control in GROUP_CONTROLS:
                        try:
                            control.remove(link.session, a)
                        except SwitchError:
                            pass
                with s.lock:
                    for base in bases:
                        s.allocator_for(switch).release(base)
                    s.store.mark_down(switch, str(e), time.time(), SWITCH_RETRY_SECONDS)
                raise AggregatorFailed(f"{what} refused the group's entries: {e}") from None
        with s.lock:
            self._add(r)
            s.store.mark_up(switch)
        log.info("job %s group %d -> %s slots %s (job ids %s generation %d)", name, group, switch,
                 ", ".join(f"{b}..{b + pool - 1}" for b in bases), [job_id] + [i for i, _ in extra], generation)
        return r

    def _allocate_ps(self, ps: PsEndpoint, job_id: int, name: str, group: int, generation: int,
                     pool: int | None, workers: list[dict], extra: list[tuple[int, int]]) -> Record:
        s = self.state
        bases: list[int] = []  # each stream's slots, once allocated: released if the PS then fails
        added: list[int] = []  # the streams' job ids the PS took: removed if a later one fails
        try:
            lanes = ps.lanes(self.ps.request(ps.control, "ping"))  # the largest the PS and the path MTU take
            pool = pool or ps_pool(lanes, len(workers), self.default_pool)
            with s.lock:
                allocator = s.ps_allocators.setdefault(ps.control, SlotAllocator(PS_SLOTS))
                bases = _take_ranges(allocator, pool, 1 + len(extra), f"PS {ps.control}")
            for stream, (stream_job, stream_generation) in enumerate([(job_id, generation)] + extra):
                addresses = [f"{self.topo.host(w['host']).ip}:{w['udp_port'] + stream}" for w in workers]
                self.ps.request(ps.control, "add_job",
                                job={"job": stream_job, "base": bases[stream], "pool": pool, "workers": addresses,
                                     "generation": stream_generation, "lanes": lanes})
                added.append(stream_job)
        except (OSError, RequestError) as e:  # down (TimeoutError is an OSError), hanging, or refusing
            for stream_job in added:
                try:
                    self.ps.request(ps.control, "remove_job", job=stream_job)
                except (OSError, RequestError):
                    pass  # down: it holds nothing anyway
            with s.lock:
                for base in bases:
                    allocator.release(base)
                s.store.mark_down(ps.control, str(e), time.time(), AGGREGATOR_RETRY_SECONDS)
            log.warning("PS %s failed to admit job %s group %d: %s", ps.control, name, group, e)
            raise AggregatorFailed(f"PS {ps.control}: {e}") from None
        r = Record(job_id, name, group, "ps", generation, bases[0], pool, workers,
                   {"data": ps.data, "control": ps.control, "lanes": lanes, **_stripes(extra, bases)})
        with s.lock:
            s.store.mark_up(ps.control)
            self._add(r)
        log.info("job %s group %d -> PS %s", name, group, ps.data)
        return r

    def _add(self, r: Record) -> None:
        self.state.store.add(r)
        self.state.records[(r.job_name, r.group)] = r

    def worker_answer(self, record: Record, reason: str, worker: int) -> dict[str, Any]:
        """A join answer's part for group worker ``worker`` (its token aside): a tree's worker is told its
        leaf, its index there and its number in the group (tree_placement.worker_answer)."""
        out = {**self.answer(record, reason), "worker": worker}
        return {**out, **worker_answer(record, worker)} if record.mode == "tree" else out

    def answer(self, record: Record, reason: str) -> dict[str, Any]:
        """The part of a join (or move) answer that is the same for every worker of the group."""
        host, port = record.aggregator["data"].rsplit(":", 1)
        return {"mode": record.mode, "reason": reason, "job": record.job_name, "group": record.group,
                "job_id": record.job_id, "generation": record.generation, "workers": len(record.workers),
                "pool": record.pool, "lanes": record.lanes(self.topo.lanes),
                "aggregators": [{"host": host, "port": int(port), "pool": record.pool}],
                "streams": record.streams,  # stream s (1..): its job id and generation, from udp_port + s
                "stream_jobs": [[stripe["job_id"], stripe["generation"]] for stripe in record.stripes]}

    # ---- freeing an allocation -------------------------------------------------------------

    def begin_teardown(self, r: Record) -> None:
        """(lock held) From now on the group is not running for anybody; its state here goes (the
        heartbeats of a group being moved stay: its workers go on)."""
        s = self.state
        s.ending.add(r.job_id)
        s.leaving.pop(r.job_id, None)
        if not any(key[:2] == (r.job_name, r.group) for key in s.moving):
            for w in range(len(r.workers)):
                s.last_seen.pop((r.job_name, r.group, w), None)
        s.stuck.pop((r.job_name, r.group, allocation_key(r.job_id, r.generation)), None)

    def teardown(self, r: Record, reachable: bool = True, down: frozenset[str] = frozenset()) -> None:
        """Free a group's allocation (pool thread): its entries or its PS job where the aggregator
        still answers (``reachable=False``: it is known dead, so nobody waits for it; ``down``: the nodes
        of a tree known dead), its slots in any case. Its slots and job id are free only once the
        aggregator has let go of them."""
        s = self.state
        with s.lock:
            self.begin_teardown(r)
        if r.mode == "tree" and not reachable:
            down = frozenset(node["control"] for node in r.aggregator["tree"])
        final_nodes = self.readout.final_nodes(r, down)  # a tree's, node by node (None: one aggregator)
        if final_nodes is not None:  # the group's own are its root's
            final = final_nodes[-1].get("counters", {})
        else:
            final = self.readout.final_counters(r) if reachable and r.aggregator.get("control") not in down else {}
        if r.mode == "tree":
            self.trees.teardown(r, down)
        elif r.mode == "switch":
            link = self.switches.get(r.control)  # None: a switch the topology no longer names
            if link is not None:
                with link.lock:
                    if link.session is not None and reachable:
                        try:
                            for a in allocations(self.topo.view(r.control), r):  # every stream's
                                for control in GROUP_CONTROLS:
                                    control.remove(link.session, a)
                        except SwitchError as e:  # reconciliation removes them once the switch is back
                            log.warning("%s did not remove job id %d: %s", r.control, r.job_id, e)
        elif reachable:
            try:
                for stream_job in [r.job_id] + [stripe["job_id"] for stripe in r.stripes]:
                    self.ps.request(r.aggregator["control"], "remove_job", job=stream_job)
            except (OSError, RequestError) as e:  # a dead PS holds nothing: the group ends anyway
                with s.lock:
                    s.store.mark_down(r.aggregator["control"], str(e), time.time(), AGGREGATOR_RETRY_SECONDS)
                log.warning("PS %s did not remove job id %d: %s", r.aggregator["control"], r.job_id, e)
        with s.lock:
            metrics = self.readout.group_metrics(r, final, running=False, nodes=final_nodes)
            s.reports.pop(r.job_id, None)
            if r.mode == "tree":
                self.trees.release(r)
            else:
                allocator = s.allocator_for(r.control)
                for base in [r.base] + [stripe["base"] for stripe in r.stripes]:
                    allocator.release(base)
            s.store.remove(r.job_id)
            if s.records.get((r.job_name, r.group)) is r:
                del s.records[(r.job_name, r.group)]
            s.ending.discard(r.job_id)
            s.finished.append({**metrics, "ended": time.time()})  # for `metrics`, a while


def _take_ranges(allocator: SlotAllocator, pool: int, streams: int, who: str) -> list[int]:
    """(lock held) ``streams`` ranges of ``pool`` slots, one per stream of a group, or AggregatorFailed with none
    taken."""
    bases: list[int] = []
    try:
        for _ in range(streams):
            bases.append(allocator.allocate(pool))
    except SlotsExhausted as e:
        for base in bases:
            allocator.release(base)
        wanted = f" ({streams} streams of {pool} slots)" if streams > 1 else ""
        raise AggregatorFailed(f"{who}: {e}{wanted}") from None
    return bases


def _stripes(extra: list[tuple[int, int]], bases: list[int]) -> dict[str, Any]:
    """A record's ``stripes`` (store.Record.stripes): streams 1.. with their job ids, generations and slots."""
    if not extra:
        return {}
    return {"stripes": [{"job_id": job_id, "generation": generation, "base": base}
                        for (job_id, generation), base in zip(extra, bases[1:])]}
