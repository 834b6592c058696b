"""Plays a scenario of ``scenarios.py`` against any target and checks every answer.

A target implements: ``lanes`` (of a job that states none), ``admit(job)``, ``remove(job_id)``,
``send(origin, payload_bytes)``, ``collect() -> [((job, worker), payload_bytes)]``
(the RESULTs delivered since the last call, once the target has processed
everything sent) and ``counters() -> {name: total}``. Payload bytes are the UDP
payload: the PASSING header and values.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

import numpy as np

from passing import wire

from .scenarios import COUNTER_NAMES, TREE_COUNTER_NAMES, Admit, Job, Remove, Scenario, Send

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


GENERATIONS_PER_SCENARIO = 16


def run_scenario(target: Target, scenario: Scenario, build: Builder = wire_builder) -> None:
    """Plays ``scenario``. A target that lives across scenarios keeps its slot state, as a real
    aggregator does, so each scenario's generations are shifted past the previous one's: the
    next scenario's job 1 is a new allocation of job id 1, never the same one again."""
    shift = getattr(target, "generation_shift", 0)
    target.generation_shift = shift + GENERATIONS_PER_SCENARIO  # type: ignore[attr-defined]

    def shifted(job: Job) -> Job:
        assert job.generation < GENERATIONS_PER_SCENARIO
        up = job.up and replace(job.up, generation=(job.up.generation + shift) % wire.GENERATIONS)
        return replace(job, generation=(job.generation + shift) % wire.GENERATIONS, up=up)

    jobs = {j.job: shifted(j) for j in scenario.jobs}
    for j in jobs.values():
        target.admit(j)
    try:
        for i, step in enumerate(scenario.steps):
            if isinstance(step, Admit):
                jobs[step.job.job] = shifted(step.job)
                target.admit(jobs[step.job.job])
            elif isinstance(step, Remove):
                target.remove(step.job)
                del jobs[step.job]
            else:
                if step.generation is not None:
                    step = replace(step, generation=(step.generation + shift) % wire.GENERATIONS)
                _play(target, jobs, step, f"{scenario.name} step {i}", build)
    finally:
        for job in list(jobs):
            target.remove(job)


def _play(target: Target, jobs: dict[int, Job], step: Send, where: str, build: Builder) -> None:
    # a packet from the root names its leaf's uplink job: the leaf's pool, the uplink's generation
    leaf = next((j for j in jobs.values() if j.up is not None and j.up.job == step.job), None)
    from_root = step.origin == "root" and leaf is not None and leaf.up is not None
    pool = jobs[step.job].pool if step.job in jobs else leaf.pool if from_root else 1
    slot = step.psn % pool if step.slot is None else step.slot
    set_ = (step.psn // pool) % 2 if step.set is None else step.set
    generation = jobs[step.job].generation if step.job in jobs else leaf.up.generation if from_root else 0
    header = {"op": step.op, "job": step.job, "slot": slot, "set": set_, "psn": step.psn, "owner": step.owner}
    sent_generation = generation if step.generation is None else step.generation
    before = target.counters()
    origin = step.origin if step.origin is not None else (step.job, step.worker)

    def lanes(job: int) -> int:  # a job's lane count: the target's unless the scenario gives it one
        return (jobs[job].lanes if job in jobs else leaf.lanes if from_root else None) or target.lanes

    packet = build(lanes=step.lanes or lanes(step.job), values=step.values, type=step.kind, worker=step.worker,
                   flags=step.flags, generation=sent_generation, **header)
    target.send(origin, packet[: _length(step.kind)] if from_root else packet)  # a root's ACK: the header alone
    got = target.collect()
    want = [
        ((r.job, w), build(lanes=lanes(r.job), values=r.values, type=r.kind, worker=w, flags=r.flags,
                           generation=jobs[r.job].generation,
                           **{**header, "op": r.op, "job": r.job, "psn": r.psn})[: _length(r.kind)])
        for r in step.expect if not r.up
        for w in r.to
    ] + [
        ("root", build(lanes=lanes(r.job), values=r.values, type=r.kind, worker=jobs[r.job].up.worker,
                       flags=r.flags, generation=jobs[r.job].up.generation,
                       **{**header, "op": r.op, "job": jobs[r.job].up.job, "psn": r.psn}))
        for r in step.expect if r.up
    ]
    if sorted(got, key=_order) != sorted(want, key=_order):
        raise AssertionError(f"{where}: sent {step}\n got  {_describe(got)}\n want {_describe(want)}")
    after = target.counters()
    names = COUNTER_NAMES + tuple(k for k in TREE_COUNTER_NAMES if k in after)
    delta = {k: after[k] - before[k] for k in names}
    expected = {k: step.counters.get(k, 0) for k in names}
    expected["received"] = step.counters.get("received", 0 if step.counters.get("malformed") else 1)
    if delta != expected:
        raise AssertionError(f"{where}: sent {step}\n counters changed by {delta}\n expected {expected}")


def _order(packet: tuple[Origin, bytes]) -> tuple[str, bytes]:
    """A sort key of (destination, bytes) pairs whose destinations are (job, worker) or a name ("root")."""
    return repr(packet[0]), packet[1]


def _length(kind: int) -> int | None:
    """How much of a built packet an answer of this kind is: an ACK is the header alone."""
    return wire.HEADER_SIZE if kind == wire.ACK else None


def _describe(packets: list[tuple[Origin, bytes]]) -> list[str]:
    out = []
    for dest, raw in sorted(packets, key=_order):
        try:
            p = wire.decode(raw, max(1, (len(raw) - wire.HEADER_SIZE) // 4))[0]
            h = p["hdr"]
            out.append(f"to {dest}: type={h['type']} job={h['job']} gen={h['generation']} worker={h['worker']} "
                       f"owner={wire.owner_of(h['set'])} "
                       f"psn={h['psn']} "
                       f"slot={h['slot']} set={h['set'] & 1} flags={h['flags']} values={p['payload'][:4].tolist()}...")
        except wire.WireError as e:
            out.append(f"to {dest}: malformed ({e})")
    return out
