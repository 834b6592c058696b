"""What operators read (docs/control.md: status, stats, metrics): the controller's view of its
aggregators and groups, and the aggregators' counters, read when asked (on a pool thread: a
PS that does not answer delays nobody else)."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from . import counters
from .p4runtime import SwitchError
from .ps_control import PsControl
from .schema import RequestError
from .state import State
from .store import Record
from .switch import SwitchLink
from .topology import SWITCH, Topology, is_switch
from .tree_placement import nodes_of

log = logging.getLogger("passing_controller")

FINISHED_RETENTION = 300.0  # s a finished group stays in `metrics`, so a scrape sees its final counters


class Readout:
    def __init__(self, topo: Topology, state: State, switch: SwitchLink, ps: PsControl,
                 switches: dict[str, SwitchLink] | None = None) -> None:
        """``switches``: every switch's session by control name (default: ``switch``, the one)."""
        self.topo, self.state, self.switch, self.ps = topo, state, switch, ps
        self.switches = switches if switches is not None else {SWITCH: switch}

    def idle(self) -> bool:
        """No group is running, being placed or ended, or waiting for workers."""
        s = self.state
        with s.lock:
            return not (s.records or s.pending or s.admitting or s.ending)

    def status(self) -> dict[str, Any]:
        s = self.state
        with s.lock:
            return {
                "switch": "connected" if self.switch.session is not None else f"unavailable: {self.switch.error}",
                "slots": s.allocator.slots, "free_slots": s.allocator.free(),
                "free_ranges": s.allocator.free_ranges(),
                "jobs": [{"job": r.job_name, "group": r.group, "job_id": r.job_id, "mode": r.mode, "base": r.base,
                          "pool": r.pool, "generation": r.generation, "workers": len(r.workers),
                          "aggregator": r.aggregator["data"], "control": r.control, "lanes": r.lanes(self.topo.lanes),
                          **({"tree": r.aggregator["tree"]} if r.mode == "tree" else {}),
                          **({"stripes": r.stripes} if r.stripes else {})}
                         for r in self._running_records()],
                "pending": [{"job": k[0], "group": k[1], "joined": sorted(p.members), "workers": p.workers}
                            for k, p in s.pending.items()],
                "aggregators": self.aggregators(),
                "refused": dict(s.refused),
                "fabric": self.fabric(),
                **({"switches": self.named_switches()} if self.topo.switches else {}),
            }

    def named_switches(self) -> dict[str, str]:
        """Each named switch (topology "switches"): "connected", or "unavailable: " and why."""
        out = {}
        for name in self.topo.switches:
            link = self.switches[self.topo.switches[name].name]
            out[name] = "connected" if link.session is not None else f"unavailable: {link.error}"
        return out

    def trees_running(self) -> bool:
        with self.state.lock:
            return any(r.mode == "tree" for r in self._running_records())

    def status_with_nodes(self) -> dict[str, Any]:
        """(pool thread) ``status``, each tree's nodes with their counters read now (node_counters: a node
        whose PS does not answer within the check timeout shows its error)."""
        out = self.status()
        with self.state.lock:
            trees = {r.job_id: r for r in self._running_records() if r.mode == "tree"}
        ps_jobs, ps_errors = self._read_ps(list(trees.values()))
        for job in out["jobs"]:
            if job["job_id"] in trees and "tree" in job:
                read = {n["name"]: n for n in node_counters(trees[job["job_id"]], ps_jobs, ps_errors)}
                job["tree"] = [{**node, **{k: v for k, v in read.get(node["name"], {}).items()
                                           if k in ("counters", "error")}} for node in job["tree"]]
        return out

    def fabric(self) -> list[dict[str, Any]]:
        """The topology's racks (docs/control.md, Fabric): each node, its role, aggregator, hosts and uplink."""
        if self.topo.fabric is None:
            return []
        return [{"name": n.name, "role": "leaf" if n.leaf else "root", "aggregator": n.aggregator,
                 "hosts": list(n.hosts), "uplink": n.uplink} for n in self.topo.fabric.nodes.values()]

    def _running_records(self) -> list[Record]:
        return sorted((r for r in self.state.records.values() if r.job_id not in self.state.ending),
                      key=lambda r: r.job_id)

    def aggregators(self) -> list[dict[str, Any]]:
        """Every aggregator of the topology: up, or down since when and why (from the store)."""
        with self.state.lock:
            down = self.state.store.down()
        out = []
        names = (["switch"] if self.topo.p4runtime is not None else []) \
            + [view.name for view in self.topo.switches.values()] + [p.control for p in self.topo.ps]
        for name in names:
            entry: dict[str, Any] = {"aggregator": name, "state": "up"}
            if is_switch(name):  # what its program is: the lanes every group on it gets
                entry.update(chip=self.topo.view(name).chip, lanes=self.topo.view(name).lanes)
            if is_switch(name) and self.switches[name].session is None:
                entry.update(state="down", reason=self.switches[name].error)
            if name in down:
                since, retry_at, reason = down[name]
                entry.update(state="down", since=since, retry_at=retry_at, reason=reason)
            out.append(entry)
        return out

    def stats(self, job_id: int | None = None) -> dict[str, Any]:
        """The aggregators' counters of every running group (or one), read now. A PS that does not
        answer is named with its error, and the rest are still read."""
        out: dict[str, Any] = {}
        with self.state.lock:
            records = [r for r in self._running_records() if job_id is None or r.job_id == job_id]
        switch_reads = self._read_switches(records, totals=job_id is None)
        if switch_reads.get(SWITCH) is not None:
            out["switch_totals"] = counters.totals_of(switch_reads[SWITCH])
        ps_jobs, ps_errors = self._read_ps(records)
        for r in records:
            switch_read = switch_reads.get(r.control)
            if r.mode == "switch":
                if switch_read is not None:
                    out[str(r.job_id)] = counters.job_counters(switch_read, r.job_id)
            elif r.aggregator["control"] in ps_errors:
                out[str(r.job_id)] = {"error": ps_errors[r.aggregator["control"]]}
            else:
                out[str(r.job_id)] = ps_jobs[r.aggregator["control"]].get(str(r.job_id), {})
            if r.mode == "tree":  # each node's: the leaves' and the root's (the job's own are the root's)
                out[str(r.job_id)] = {**out[str(r.job_id)], "nodes": node_counters(r, ps_jobs, ps_errors)}
            if r.stripes and "error" not in out.get(str(r.job_id), {"error": ""}):  # streams 1..: their own jobs'
                out[str(r.job_id)]["streams"] = [
                    counters.job_counters(switch_read, s["job_id"]) if r.mode == "switch" and switch_read is not None
                    else ps_jobs.get(r.aggregator.get("control", ""), {}).get(str(s["job_id"]), {}) for s in r.stripes]
        return out

    def _read_switches(self, records: list[Record],
                       totals: bool = False) -> dict[str, dict[str, dict[int, int]] | None]:
        """The counters of every switch a group of ``records`` runs on flat (the one, a named one), by control
        name, None where unreadable; ``totals``: the one switch's in any case (for ``switch_totals``)."""
        controls = {r.control for r in records if r.mode == "switch"} | ({SWITCH} if totals else set())
        return {control: self._read_switch(control) for control in sorted(controls)}

    def _read_switch(self, control: str = SWITCH) -> dict[str, dict[int, int]] | None:
        link = self.switches.get(control)
        if link is None:
            return None
        with link.lock:
            if link.session is None:
                return None
            try:
                return counters.read_all(link.session)
            except SwitchError as e:
                log.warning("reading the counters of %s: %s", control, e)
                return None

    def _read_ps(self, records: list[Record]) -> tuple[dict[str, dict], dict[str, str]]:
        """The counters of every PS that holds one of ``records`` (each node of a tree): (answers, errors) by
        control endpoint."""
        controls = {r.aggregator["control"] for r in records if r.mode == "ps"}
        controls.update(node["control"] for r in records if r.mode == "tree" for node in nodes_of(r))
        return self._read_nodes(controls, [r.job_id for r in records], self.ps.check_timeout)

    def _read_nodes(self, controls: set[str], job_ids: list[int], timeout: float,
                    **fields: Any) -> tuple[dict[str, dict], dict[str, str]]:
        """Each aggregator's ``stats`` (``fields``: the request's), all asked at once, so that nodes that do
        not answer cost one ``timeout`` however many they are: (answers, errors) by control endpoint. The
        switches (a tree's nodes) answer with their counters of ``job_ids``, as a PS's stats would."""
        answers: dict[str, dict] = {}
        errors: dict[str, str] = {}

        def read(control: str) -> None:
            if is_switch(control):
                switch_read = self._read_switch(control)
                if switch_read is None:
                    errors[control] = f"the counters of {control} could not be read (unreachable)"
                else:
                    answers[control] = {str(j): counters.job_counters(switch_read, j) for j in job_ids}
                return
            try:
                answers[control] = self.ps.request(control, "stats", timeout=timeout, **fields)["jobs"]
            except (OSError, RequestError) as e:  # a PS that does not answer shows no counters, the rest do
                errors[control] = str(e)
                log.warning("PS %s: %s", control, e)

        if controls:
            with ThreadPoolExecutor(len(controls)) as pool:
                list(pool.map(read, sorted(controls)))
        return answers, errors

    def metrics(self) -> dict[str, Any]:
        """Everything the Prometheus endpoint and `passing-ctl top` show (docs/control.md, metrics):
        the aggregators with their slots, every running group (and those finished in the last
        FINISHED_RETENTION s) with its aggregator's counters and its workers' reports."""
        s = self.state
        now = time.time()
        with s.lock:
            s.finished = [g for g in s.finished if now - g["ended"] < FINISHED_RETENTION]
            records = self._running_records()
        switch_reads = self._read_switches(records)
        ps_jobs, ps_errors = self._read_ps(records)
        with s.lock:
            groups = []
            for r in records:
                job_counters: dict[str, int] = {}
                switch_read = switch_reads.get(r.control)
                for job_id in [r.job_id] + [stripe["job_id"] for stripe in r.stripes]:  # every stream's, added up
                    if r.mode == "switch":
                        read = counters.job_counters(switch_read, job_id) if switch_read is not None else {}
                    else:
                        read = ps_jobs.get(r.aggregator["control"], {}).get(str(job_id), {})
                    for name, value in read.items():
                        if isinstance(value, int):
                            job_counters[name] = job_counters.get(name, 0) + value
                nodes = node_counters(r, ps_jobs, ps_errors) if r.mode == "tree" else None
                groups.append(self.group_metrics(r, job_counters, running=True, nodes=nodes))
            slots = []
            for entry in self.aggregators():
                name = entry["aggregator"]
                allocator = s.allocator_for(name)
                slots.append({**entry, "kind": "switch" if is_switch(name) else "ps", "slots": allocator.slots,
                              "free_slots": allocator.free()})
            out: dict[str, Any] = {
                "time": now, "aggregators": slots, "groups": groups + s.finished,
                "pending": len(s.pending), "admitted": dict(s.admitted), "joins_failed": s.joins_failed,
                "refused": dict(s.refused),
            }
        if switch_reads.get(SWITCH) is not None:
            out["switch_totals"] = counters.totals_of(switch_reads[SWITCH])
        return out

    def group_metrics(self, r: Record, job_counters: dict[str, int], running: bool,
                      nodes: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """(lock held) One group as `metrics` shows it; a tree's with its ``nodes`` (node_counters)."""
        return {"job": r.job_name, "group": r.group, "job_id": r.job_id, "generation": r.generation,
                "mode": r.mode, "aggregator": r.control, "pool": r.pool,
                "workers": len(r.workers), "running": running, "counters": job_counters,
                **({"nodes": nodes} if nodes is not None else {}),
                "hosts": {str(w): stats for w, stats in sorted(self.state.reports.get(r.job_id, {}).items())}}

    def final_counters(self, r: Record) -> dict[str, int]:
        """The group's aggregator counters as it ends (for `metrics`); {} when they cannot be read."""
        try:
            if r.mode == "switch":  # the one switch, or a named one
                link = self.switches.get(r.control)
                if link is None:
                    return {}
                with link.lock:
                    return counters.for_job(link.session, r.job_id) if link.session is not None else {}
            # a live PS answers in milliseconds; a dead one must not hold the teardown for long
            return self.ps.request(r.aggregator["control"], "stats", timeout=1.0, job=r.job_id)["jobs"][str(r.job_id)]
        except (OSError, RequestError, SwitchError, KeyError) as e:
            log.info("final counters of job id %d: %s", r.job_id, e)
            return {}

    def final_nodes(self, r: Record, down: frozenset[str] = frozenset()) -> list[dict[str, Any]] | None:
        """A tree's node counters as it ends (for `metrics`; None for a group of one aggregator): the nodes
        are asked at once, a node known dead (``down``) not at all, and one that does not answer within a
        second shows its error, the others their counters."""
        if r.mode != "tree":
            return None
        asked = {node["control"] for node in nodes_of(r) if node["control"] not in down}
        answers, errors = self._read_nodes(asked, [r.job_id], 1.0, job=r.job_id)
        errors.update({control: "known down" for control in down})
        return node_counters(r, answers, errors)


def node_counters(r: Record, ps_jobs: dict[str, dict], ps_errors: dict[str, str]) -> list[dict[str, Any]]:
    """Each node of a tree record, the leaves in order and the root last (docs/control.md, stats): its
    ``name``, ``role``, ``aggregator`` (control endpoint) and ``counters`` (that aggregator's counters of the
    job: the flat ones and a tree's ``sent_up``, ``answered``, ``late_answer``), or ``error`` where the
    node's aggregator did not answer."""
    out = []
    for node in nodes_of(r):
        entry: dict[str, Any] = {"name": node["name"], "role": node["role"], "aggregator": node["control"]}
        if node["control"] in ps_errors:
            entry["error"] = ps_errors[node["control"]]
        else:
            entry["counters"] = ps_jobs.get(node["control"], {}).get(str(r.job_id), {})
        out.append(entry)
    return out
