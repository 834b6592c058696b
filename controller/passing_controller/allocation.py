"""A job group's allocation on the switch: what every control of the P4 program needs."""

from __future__ import annotations

from dataclasses import dataclass

from .topology import Host

# Job ids index the switch's per-job counters (PASSING_MAX_JOBS = 1024 entries: live
# groups never share one) and name multicast groups (id + 1; group 1 floods). 0 is never
# used: a job id 0 of generation 0 would make epoch 0, what unwritten registers hold.
MAX_JOB_ID = 1023


@dataclass(frozen=True)
class Worker:
    index: int
    host: Host
    udp_port: int  # the worker's UDP source port: RESULTs go back to it


@dataclass(frozen=True)
class Allocation:
    job: int  # the wire's job id of this group
    generation: int  # which allocation of this job id: on the wire, checked at admission
    base: int  # first slot
    pool: int  # slots
    workers: tuple[Worker, ...]

    @property
    def epoch(self) -> int:
        """What the switch records in a slot/set about the allocation that wrote it: unique per
        allocation, so a reused range never adds onto old data (the same rule as the PS engine).
        Never 0, what unwritten registers hold: job ids start at 1."""
        return self.job << 16 | self.generation

    @property
    def full(self) -> int:
        return (1 << len(self.workers)) - 1

    @property
    def group(self) -> int:
        """Multicast group of the job's workers; group 1 floods broadcasts (P4Runtime on BMv2
        reserves groups from 32768 on)."""
        return self.job + 1
