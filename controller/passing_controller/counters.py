"""Reads the P4 program's outcome counters, per job and in total."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the session needs the switch extra; importing this module does not
    from .session import Switch

MAX_JOBS = 1024  # PASSING_MAX_JOBS in p4/include/constants.p4: counters are indexed by job mod this
INGRESS = ("received", "rejected", "aggregated", "completed", "duplicate", "duplicate_answered", "stale",
           "overflow", "relayed")
EGRESS = ("results_sent",)
NAMES = tuple(f"PassingIngress.{n}" for n in (*INGRESS, "malformed")) + tuple(f"PassingEgress.{n}" for n in EGRESS)
# the tree roles' counters (docs/protocol.md, "Trees across racks"): read where the program has them (the
# v1model and Tofino 2 programs; the Tofino 1 program takes no roles)
TREE = ("sent_up", "answered", "late_answer")


def ingress(switch: Switch) -> tuple[str, ...]:
    """The ingress counters this switch's program has: INGRESS, and TREE's where it takes the roles."""
    return INGRESS + tuple(n for n in TREE if switch.has_counter(f"PassingIngress.{n}"))


def read_all(switch: Switch) -> dict[str, dict[int, int]]:
    """counter name -> {index: packets}; 'malformed' has index 0 only."""
    out = {name: switch.read_counter(f"PassingIngress.{name}") for name in ingress(switch)}
    out.update({name: switch.read_counter(f"PassingEgress.{name}") for name in EGRESS})
    out["malformed"] = switch.read_counter("PassingIngress.malformed")
    return out


def read_indices(switch: Switch, indices: set[int]) -> dict[str, dict[int, int]]:
    """``read_all``'s answer restricted to the given counter indices (job ids mod MAX_JOBS), in one read."""
    names = ingress(switch)
    cells = [(f"PassingIngress.{name}", i) for name in names for i in sorted(indices)]
    cells += [(f"PassingEgress.{name}", i) for name in EGRESS for i in sorted(indices)]
    cells.append(("PassingIngress.malformed", 0))
    read = switch.read_counter_cells(cells)
    full_names = tuple(f"PassingIngress.{n}" for n in (*names, "malformed")) + tuple(
        f"PassingEgress.{n}" for n in EGRESS)
    return {full.split(".", 1)[1]: {i: n for (counter, i), n in read.items() if counter == full}
            for full in full_names}


def totals(switch: Switch) -> dict[str, int]:
    return totals_of(read_all(switch))


def totals_of(all_counters: dict[str, dict[int, int]]) -> dict[str, int]:
    """Every counter summed over its indices, out of ``read_all``'s answer."""
    return {name: sum(per_index.values()) for name, per_index in all_counters.items()}


def for_job(switch: Switch, job: int) -> dict[str, int]:
    return job_counters(read_all(switch), job)


def job_counters(all_counters: dict[str, dict[int, int]], job: int) -> dict[str, int]:
    """One job's counters out of ``read_all``'s answer."""
    index = job % MAX_JOBS
    return {name: per_index.get(index, 0) for name, per_index in all_counters.items() if name != "malformed"}
