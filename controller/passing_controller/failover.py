"""Failover (docs/control.md, "Failover: moving a running group"), all of it: heartbeats, the
`stuck` reports of a group whose aggregator went silent, the decision (wait, end the group, or
move it), the liveness check of the aggregator, and the move.

The path of a silent group, in this file's order: ``alive`` records heartbeats (``_presumed_dead``
reads them); ``stuck`` gathers the reports and decides; ``_carry_out`` runs the decision on a
pool thread and answers every reporter; ``_move`` checks the aggregator (``_check``), frees the
old allocation and places the group anew through the same policy as a join (placement.py's
``teardown`` and ``allocate``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from . import counters, schema
from .keys import matches
from .membership import AGGREGATOR_CHOICES, MAX_GROUP, MAX_WORKERS, Membership
from .p4runtime import SwitchError
from .placement import AGGREGATOR_RETRY_SECONDS, Placement
from .ps_control import PsControl
from .schema import RequestError
from .serve import InPool, Reply
from .state import PendingGroup, State, allocation_key
from .store import Record, StoreError
from .switch import SWITCH_RETRY_SECONDS, SwitchLink
from .topology import SWITCH, is_switch
from .tree_placement import nodes_of, worker_answer

log = logging.getLogger("passing_controller")

DEAD_AFTER_BEATS = 3  # a worker whose heartbeats stopped this many intervals ago is presumed dead
DECISIONS_KEPT_SECONDS = 600.0  # a move's decision is answered to late reporters this long
# A stuck report counts this long: a worker still stuck asks again every 0.5 s (the hosts' SILENCE_EVERY),
# so an older report is of a silence that ended (its call completed; the worker went on) and must neither
# stand for the worker now nor pull `redo` back to a call the others are past.
REPORT_FRESH_SECONDS = 3.0


class Failover:
    def __init__(self, state: State, membership: Membership, placement: Placement, switch: SwitchLink,
                 ps: PsControl, reply: Reply, in_pool: InPool, switches: dict[str, SwitchLink] | None = None) -> None:
        """``switches``: every switch's session by control name (default: ``switch``, the one)."""
        self.state, self.membership, self.placement, self.switch, self.ps = state, membership, placement, switch, ps
        self.reply, self.in_pool = reply, in_pool
        self.switches = switches if switches is not None else {SWITCH: switch}

    # ---- heartbeats ------------------------------------------------------------------------

    def alive(self, req: dict) -> dict:
        """(lock held) A worker's heartbeat."""
        every = schema.number(req, "every", 0.001, 60.0, default=1.0)
        try:
            r, worker = self.membership.member(req)
            key = (r.job_name, r.group, worker)
        except RequestError:
            key = self._moving_member(req)  # a group being moved: its workers are alive all the same
            if key is None:
                raise
        self.state.last_seen[key] = (time.monotonic(), every)
        return {}

    def _moving_member(self, req: dict) -> tuple[str, int, int] | None:
        """(job, group, worker) of a worker of a group being moved, when its token says so."""
        name, group, worker = req.get("job"), req.get("group", 0), req.get("worker")
        token = req.get("token")
        for (job, grp, _), digests in self.state.moving_tokens.items():
            if (job, grp) == (name, group) and isinstance(worker, int) and 0 <= worker < len(digests) \
                    and isinstance(token, str) and matches(token, digests[worker]):
                return job, grp, worker
        return None

    def stalled(self) -> None:
        """The serving thread was busy: the heartbeats queued meanwhile are no one's fault."""
        self.state.stalled_until = time.monotonic()

    def _presumed_dead(self, name: str, group: int, worker: int) -> bool:
        now = time.monotonic()
        # (a controller that was busy has not read the beats sent meanwhile: they count from the
        # end of that stall)
        when, every = self.state.last_seen.get((name, group, worker), (self.state.started, 1.0))
        return now - max(when, self.state.stalled_until) > DEAD_AFTER_BEATS * every

    # ---- a silent aggregator: the reports, the decision ------------------------------------

    def stuck(self, identity: bytes, req: dict) -> dict | None:
        """(lock held) A worker's aggregator has been silent: "wait" until every worker of the group
        says so (a slow peer is not a failure), then move the whole group at once; a peer whose
        heartbeats stopped ends the group instead. Every reporter of an allocation gets the same
        decision; those who report while it is being carried out get it when it is done."""
        s = self.state
        generation = schema.integer(req, "generation", 0, 0xFFFF)
        job_id = schema.integer(req, "job_id", 0, 0xFFFF)
        call = schema.integer(req, "call", 0, 1 << 62)
        wanted = schema.choice(req, "aggregator", AGGREGATOR_CHOICES, "any")
        name = schema.text(req, "job", schema.NAME, what="a job name")
        group = schema.integer(req, "group", 0, MAX_GROUP, default=0)
        # The allocation, job id and generation: a group that moved has a new job id whose generation may
        # be the old one's (each job id counts its own), and a stuck report of the new allocation must not
        # get the decision kept for the old one.
        key = (name, group, allocation_key(job_id, generation))
        now = time.monotonic()
        for k, (when, _) in list(s.decided.items()):
            if now - when > DECISIONS_KEPT_SECONDS:
                del s.decided[k]
        if key in s.decided or key in s.moving:
            # the allocation is gone (moved or ended): its members' tokens still prove who asks
            worker = schema.integer(req, "worker", 0, MAX_WORKERS - 1)
            members = s.decided[key][1]["members"] if key in s.decided else s.moving_tokens[key]
            if worker >= len(members) or not matches(schema.text(req, "token", schema.SECRET, what="a token"),
                                                     members[worker]):
                raise RequestError(f"job {name!r} group {group}: no worker {worker} with this token")
            if key in s.moving:
                s.moving[key].append((identity, worker))
                return None
            return self._decision_for(s.decided[key][1], worker)
        r, worker = self.membership.member(req)
        if (r.job_id, r.generation) != (job_id, generation):
            raise RequestError(f"job {name!r} group {group} has no allocation of job id {job_id} generation "
                               f"{generation}")
        reports = s.stuck.setdefault(key, {})
        reports[worker] = (call, now)
        for w, (_, when) in list(reports.items()):
            if now - when > REPORT_FRESH_SECONDS:
                del reports[w]
        missing = [w for w in range(len(r.workers)) if w not in reports]
        redo = min(c for c, _ in reports.values())
        decide: Callable[[], dict[str, Any]]
        if missing:
            left = s.leaving.get(r.job_id, set())
            dead = [w for w in missing if w in left or self._presumed_dead(name, group, w)]
            if not dead:
                return {"state": "wait", "waiting_for": missing}
            why = ", ".join(f"worker {w} ({'left the group' if w in left else 'no heartbeat'})" for w in dead)
            decision = {"state": "failed", "redo": redo, "dead": dead,
                        "error": f"job {name!r} group {group}: {why}: the group is ended and its slots freed"}
            log.warning("job %s group %d: %s: ending the group", name, group, why)
            decide = lambda: (self.placement.teardown(r), decision)[1]  # noqa: E731
        else:
            decide = lambda: self._move(r, wanted, redo)  # noqa: E731
        # From here the allocation is going: reporters wait for the decision, with the tokens they had.
        s.moving[key] = [(identity, worker)]
        s.moving_tokens[key] = [w.get("token", "") for w in r.workers]
        self.placement.begin_teardown(r)
        self.in_pool(self._carry_out, key, r, decide)
        return None

    def _carry_out(self, key: tuple[str, int, int], r: Record, decide: Callable[[], dict[str, Any]]) -> None:
        """(pool thread) Carry out a group's decision, then answer everyone who asked meanwhile."""
        s = self.state
        try:
            decision = decide()
        except Exception as e:
            log.exception("job %s group %d: the decision could not be carried out", r.job_name, r.group)
            decision = {"state": "failed", "redo": 0, "dead": [],
                        "error": f"job {r.job_name!r} group {r.group}: the controller failed: {e}"}
        with s.lock:
            if decision["state"] == "failed":  # the group is gone: so are its heartbeats
                for w in range(len(r.workers)):
                    s.last_seen.pop((r.job_name, r.group, w), None)
            decision["members"] = s.moving_tokens.pop(key)
            s.decided[key] = (time.monotonic(), decision)
            s.stuck.pop(key, None)
            waiting = s.moving.pop(key)
        for identity, worker in waiting:
            self.reply(identity, {"ok": True, **self._decision_for(decision, worker)})

    @staticmethod
    def _decision_for(decision: dict, worker: int) -> dict:
        """What one worker is told: a tree's move answer names its leaf and its index there."""
        own = decision["per_worker"][worker] if "per_worker" in decision else {}
        return {**{k: v for k, v in decision.items() if k not in ("members", "per_worker")}, "worker": worker, **own}

    # ---- the move ----------------------------------------------------------------------------

    def _check(self, r: Record) -> dict[str, str]:
        """The group's aggregators that are down, each with why: {} when every one answers (pool thread).
        A tree's nodes are asked at once, so a check takes one ``check_timeout`` however many are down."""
        if r.mode == "switch":  # the one switch, or a named one
            why = self._switch_down(r.control)
            return {} if why is None else {r.control: why}
        nodes = nodes_of(r) if r.mode == "tree" else [{"control": r.aggregator["control"]}]
        with ThreadPoolExecutor(len(nodes)) as pool:
            answers = list(pool.map(self._ping, [n["control"] for n in nodes]))
        return {n["control"]: why for n, why in zip(nodes, answers, strict=True) if why is not None}

    def _switch_down(self, control: str = SWITCH) -> str | None:
        link = self.switches.get(control)
        if link is None:
            return f"{control}: no such switch in the topology"
        what = "switch" if control == SWITCH else control
        with link.lock:
            if link.session is None:
                return f"{what} unreachable: {link.error}"
            try:
                counters.totals(link.session)
            except SwitchError as e:
                link.lost(str(e))
                return f"{what} unreachable: {e}"
        return None

    def _ping(self, control: str) -> str | None:
        if is_switch(control):  # a tree's node on a switch
            return self._switch_down(control)
        try:
            self.ps.request(control, "ping", timeout=self.ps.check_timeout)
        except (OSError, RequestError) as e:
            return f"PS {control}: {e}"
        return None

    def _move(self, r: Record, wanted: str, redo: int) -> dict:
        """Every worker is stuck: a new allocation for the whole group, on the next aggregator
        that can serve (the same one when it still answers and comes first). A tree is placed again
        with a spare PS for each node found down, or flat when none is left and the group fits one
        aggregator (tree_placement.py). Pool thread."""
        s = self.state
        names = [n["control"] for n in nodes_of(r)] if r.mode == "tree" else [r.control]
        with s.lock:
            s.suspect.update(names)
        try:
            down = self._check(r)
        finally:
            with s.lock:
                s.suspect.difference_update(names)
        with s.lock:
            for name, reason in down.items():
                s.store.mark_down(name, reason, time.time(),
                                  SWITCH_RETRY_SECONDS if is_switch(name) else AGGREGATOR_RETRY_SECONDS)
        self.placement.teardown(r, reachable=r.mode == "tree" or not down, down=frozenset(down))
        pending = PendingGroup(len(r.workers), r.pool, 0.0, wanted, streams=r.streams)  # every stream moves
        label = "its tree's nodes" if r.mode == "tree" else names[0]
        why = "; ".join(down.values()) or f"{label} answer, but no RESULT reached any worker"
        try:
            new, reason = self.placement.allocate(r.job_name, r.group, pending, workers=r.workers,
                                                  exclude=frozenset(down))
        except (RequestError, SwitchError, StoreError, OSError) as e:
            with s.lock:
                s.joins_failed += 1
            log.warning("job %s group %d: silent aggregator (%s) and none to move to: %s", r.job_name, r.group,
                        why, e)
            return {"state": "failed", "redo": redo, "dead": [],
                    "error": f"job {r.job_name!r} group {r.group}: {why}; no aggregator left: {e}"}
        with s.lock:
            s.admitted[new.mode] += 1
        log.info("job %s group %d moved from %s (%s) to %s (%s), redoing call %d", r.job_name, r.group,
                 "/".join(names), why, new.aggregator["data"], new.mode, redo)
        decision = {"state": "move", "redo": redo, **self.placement.answer(new, reason=f"moved: {why}; now {reason}")}
        if new.mode == "tree":  # each worker's leaf, its index there, its number (the join answer's)
            decision["per_worker"] = [worker_answer(new, w) for w in range(len(new.workers))]
        return decision
