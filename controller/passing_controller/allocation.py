"""A job group's allocation on the switch: what every control of the P4 program needs."""

from __future__ import annotations

from dataclasses import dataclass

from .topology import Host

MAX_JOB_ID = 32766


@dataclass(frozen=True)
class Worker:
    index: int
    host: Host
    udp_port: int  # the worker's UDP source port: RESULTs go back to it


@dataclass(frozen=True)
class Allocation:
    job: int  # the wire's job id of this group
    epoch: int  # unique per allocation: a reused range never adds onto old data
    base: int  # first slot
    pool: int  # slots
    workers: tuple[Worker, ...]

    @property
    def full(self) -> int:
        return (1 << len(self.workers)) - 1

    @property
    def group(self) -> int:
        """Multicast group of the job's workers; group 1 floods broadcasts, and P4Runtime on BMv2
        reserves groups from 32768 on: job ids are 1..MAX_JOB_ID."""
        return self.job + 1
