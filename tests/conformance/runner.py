"""Plays a scenario of ``scenarios.py`` against any target and checks every answer.

A target implements: ``lanes``, ``admit(job)``, ``remove(job_id)``,
``send(origin, payload_bytes)``, ``collect() -> [((job, worker), payload_bytes)]``
(the RESULTs delivered since the last call, once the target has processed
everything sent) and ``counters() -> {name: total}``. Payload bytes are the UDP
payload: the PASSING header and values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from passing import wire

from .scenarios import COUNTER_NAMES, Admit, Job, Remove, Scenario, Send

Origin = tuple[int, int] | str
Builder = Callable[..., bytes]


class Target(Protocol):
    lanes: int

    def admit(self, job: Job) -> None: ...
    def remove(self, job: int) -> None: ...
    def send(self, origin: Origin, payload: bytes) -> None: ...
    def collect(self) -> list[tuple[Origin, bytes]]: ...
    def counters(self) -> dict[str, int]: ...


def wire_builder(*, lanes: int, values: tuple[int, ...], **header: int) -> bytes:
    """A packet built by passing.wire."""
    return wire.encode(payload=pattern(values, lanes), lanes=lanes, **header).tobytes()


def scapy_builder(*, lanes: int, values: tuple[int, ...], **header: int) -> bytes:
    """The same packet built by the scapy layer (cross-checks the two definitions)."""
    from passing.scapy_layer import Passing

    return bytes(Passing(values=[int(v) for v in pattern(values, lanes)], **header))


def pattern(values: tuple[int, ...], lanes: int) -> np.ndarray:
    return np.resize(np.asarray(values, dtype=np.int64), lanes)


def run_scenario(target: Target, scenario: Scenario, build: Builder = wire_builder) -> None:
    jobs = {j.job: j for j in scenario.jobs}
    for j in scenario.jobs:
        target.admit(j)
    try:
        for i, step in enumerate(scenario.steps):
            if isinstance(step, Admit):
                target.admit(step.job)
                jobs[step.job.job] = step.job
            elif isinstance(step, Remove):
                target.remove(step.job)
                del jobs[step.job]
            else:
                _play(target, jobs, step, f"{scenario.name} step {i}", build)
    finally:
        for job in list(jobs):
            target.remove(job)


def _play(target: Target, jobs: dict[int, Job], step: Send, where: str, build: Builder) -> None:
    pool = jobs[step.job].pool if step.job in jobs else 1
    slot = step.psn % pool if step.slot is None else step.slot
    set_ = (step.psn // pool) % 2 if step.set is None else step.set
    header = {"op": step.op, "job": step.job, "slot": slot, "set": set_, "psn": step.psn}
    before = target.counters()
    origin = step.origin if step.origin is not None else (step.job, step.worker)
    target.send(origin, build(lanes=target.lanes, values=step.values, type=wire.DATA, worker=step.worker,
                              flags=step.flags, **header))
    got = target.collect()
    want = [
        ((r.job, w), build(lanes=target.lanes, values=r.values, type=wire.RESULT, worker=w, flags=r.flags,
                           **{**header, "op": r.op, "job": r.job, "psn": r.psn}))
        for r in step.expect
        for w in r.to
    ]
    if sorted(got) != sorted(want):
        raise AssertionError(
            f"{where}: sent {step}\n got  {_describe(got, target.lanes)}\n want {_describe(want, target.lanes)}"
        )
    after = target.counters()
    delta = {k: after[k] - before[k] for k in COUNTER_NAMES}
    expected = {k: step.counters.get(k, 0) for k in COUNTER_NAMES}
    if delta != expected:
        raise AssertionError(f"{where}: sent {step}\n counters changed by {delta}\n expected {expected}")


def _describe(packets: list[tuple[Origin, bytes]], lanes: int) -> list[str]:
    out = []
    for dest, raw in sorted(packets):
        try:
            p = wire.decode(raw, lanes)[0]
            h = p["hdr"]
            out.append(f"to {dest}: type={h['type']} job={h['job']} worker={h['worker']} psn={h['psn']} "
                       f"slot={h['slot']} set={h['set']} flags={h['flags']} values={p['payload'][:4].tolist()}...")
        except wire.WireError as e:
            out.append(f"to {dest}: malformed ({e})")
    return out
