"""What the controller knows of its groups: the one lock, the SQLite store and the in-memory view.

Every part of the controller (membership.py, placement.py, failover.py, readout.py, the serving
loop) reads and writes this state with ``lock`` held, and none holds the lock while it waits on
an aggregator (docs/control.md, "Threads"). A group under way is marked (``admitting``,
``ending``, ``moving``) so that no request sees it half done. The comments say which part
writes what.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .allocator import SlotAllocator
from .store import Record, Store

PS_SLOTS = 4096  # the controller's view of a software aggregator's slots


def allocation_key(job_id: int, generation: int) -> int:
    """One allocation of a group, as the failover state keys it (``State.stuck`` and the rest): its job
    id and generation together (a group that moved has a new job id whose generation may be the old one's)."""
    return job_id << 16 | generation


@dataclass
class PendingGroup:
    workers: int
    pool: int | None  # None: the job asked for none, the aggregator's default (ps_pool on a PS)
    deadline: float
    aggregator: str  # "any": the switch when it can serve, else a PS; "ps": a PS in any case
    secret: str = ""  # digest of the job secret the first joiner gave: the others must know it
    streams: int = 1  # the group's streams (a join's "streams"): a job id and slots each, on one aggregator
    members: dict[int, tuple[bytes, dict]] = field(default_factory=dict)  # worker -> (identity, request)


class State:
    def __init__(self, store: str | Path, switch_slots: int, ps_controls: list[str],
                 named_switches: dict[str, int] | None = None) -> None:
        """Opens the store and restores the running groups it holds, with their slots. ``named_switches``:
        the slots of each named switch (topology "switches"), by its control name ("switch:NAME")."""
        self.lock = threading.RLock()  # the state below and the store; never held while waiting on I/O
        self.store = Store(store)
        # placement: the slots of every aggregator, and the running groups (the store's, in memory)
        self.allocator = SlotAllocator(switch_slots)
        self.ps_allocators = {control: SlotAllocator(PS_SLOTS) for control in ps_controls}
        self.ps_allocators.update({control: SlotAllocator(slots) for control, slots in (named_switches or {}).items()})
        self.records: dict[tuple[str, int], Record] = {}
        self.claimed: set[int] = set()  # job ids of groups being placed, not in the store yet
        self.ending: set[int] = set()  # job ids being torn down
        # membership: joins under way and leaves
        self.pending: dict[tuple[str, int], PendingGroup] = {}
        self.admitting: set[tuple[str, int]] = set()  # complete groups being placed on an aggregator
        self.leaving: dict[int, set[int]] = {}  # job id -> workers that left (the group goes when all have)
        # For `metrics` (memory only: counters restart with the controller, as Prometheus expects):
        self.reports: dict[int, dict[int, dict[str, float]]] = {}  # job id -> worker -> its latest report
        self.finished: list[dict[str, Any]] = []  # groups torn down lately, with their final counters
        self.admitted = {"switch": 0, "ps": 0, "tree": 0}  # groups allocated since start (joins and moves), by mode
        self.joins_failed = 0  # groups no aggregator could take since start (joins and moves)
        # requests refused, by why ("internal": a bug of ours, logged with its request)
        self.refused = {"malformed": 0, "unauthorized": 0, "invalid": 0, "internal": 0}
        # failover (docs/control.md): heartbeats, the reports of silent groups, and what was decided
        self.started = self.stalled_until = time.monotonic()  # heartbeats count from the later of these
        self.last_seen: dict[tuple[str, int, int], tuple[float, float]] = {}  # worker -> (when, interval)
        # (job, group, allocation_key) -> worker -> (call, when it last said so)
        self.stuck: dict[tuple[str, int, int], dict[int, tuple[int, float]]] = {}
        self.decided: dict[tuple[str, int, int], tuple[float, dict]] = {}  # same key -> (when, decision)
        self.moving: dict[tuple[str, int, int], list[tuple[bytes, int]]] = {}  # same key -> who waits for it
        self.moving_tokens: dict[tuple[str, int, int], list[str]] = {}  # same key -> its workers' token digests
        self.suspect: set[str] = set()  # aggregators being checked: tried last meanwhile
        for r in self.store.all():
            self.records[(r.job_name, r.group)] = r
            if r.mode == "tree":  # slots at every node of a tree across racks (tree_placement.nodes_of)
                for node in r.aggregator["tree"]:
                    self.allocator_for(node["control"]).reserve(node["base"], r.pool)
                continue
            allocator = self.allocator_for(r.control)  # the one switch's, a named switch's, a PS's
            for base in [r.base] + [stripe["base"] for stripe in r.stripes]:  # each stream's slots
                allocator.reserve(base, r.pool)

    def close(self) -> None:
        with self.lock:
            self.store.close()

    def allocator_for(self, control: str) -> SlotAllocator:
        """(lock held) The slots of an aggregator by its control name: the one switch's, a named switch's, a
        PS's (one the topology no longer names gets a PS's slots: a group the store still holds there)."""
        if control == "switch":
            return self.allocator
        return self.ps_allocators.setdefault(control, SlotAllocator(PS_SLOTS))
