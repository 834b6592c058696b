"""Programs the P4 `admission` table: (job, generation, worker, ingress port) -> the job's allocation."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .allocation import Allocation

if TYPE_CHECKING:  # the session needs the switch extra; importing this module does not
    from p4.v1 import p4runtime_pb2

    from .session import Switch

TABLE = "PassingIngress.admission"
ACTION = "PassingIngress.admit"


def entries(switch: Switch, a: Allocation) -> list[p4runtime_pb2.Entity]:
    return [
        switch.table_entry(
            TABLE,
            {"job": a.job, "generation": a.generation, "worker": w.index, "ingress_port": w.host.port},
            ACTION,
            {"base": a.base, "pool": a.pool, "full": a.full, "epoch": a.epoch, "group": a.group},
        )
        for w in a.workers
    ]


def install(switch: Switch, a: Allocation) -> None:
    switch.write([switch.update("insert", e) for e in entries(switch, a)])


def remove(switch: Switch, a: Allocation) -> None:
    switch.write([switch.update("delete", e) for e in entries(switch, a)])
