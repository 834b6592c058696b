"""One rank of a differential launch: ``python -m tests.differential.rank SPEC.json``.

Started by oracle.py with torchrun's environment (cluster.local.rank_env), forked from the torch
zygote (tests/zygote.py). The spec (JSON) says: ``backend`` ("gloo" or "passing"), ``mode`` (for
the record), ``layout``, ``programs`` (to run, in order: each a ``seed``, and a shrunk one's
``keep``, the ids of the ops it keeps), ``plain`` (fault programs),
``timeout`` (the process group's, seconds), ``slack`` (seconds past an op's bound before the
watchdog ends the process), ``out`` (the results' directory), ``side_port`` (a TCPStore the driver
serves, for the ranks' agreement after each program and for nothing else) and
``fault`` (None, or what to do at op ``op`` of program ``seed``: kind "raise", "skip", "kill" on
rank ``rank``; "aggregator" on rank 0: touch ``marker`` and wait for the driver to strike).

Per program, per op, it records the outputs (dtype, shape, bytes; a view's whole base tensor) when
the op completes, or the error (type, message, how long the call took to raise); extras: the
value a ``then`` callback saw, a future's value, outputs read right after a barrier, whether
``is_completed()`` holds after the wait. An error in an op the program did not mean to be invalid
ends the program on that rank (the group may be out of step); after each program the ranks agree
through the side store, and where any of them had such an error every rank re-initialises the
default process group, so one broken program does not take the rest of the launch with it.

After the last program: destroy_process_group, then what survives it against a baseline taken
before init: Python threads, OS threads, open fds (socket, anon inode, shm, pipe, file) and
mappings of shared segments (/dev/shm, memfd).

Never hangs: a watchdog thread ends the process (exit code 97, partial results written, stacks
on stderr) when an op runs past ``timeout + slack``; faulthandler's own timer ends it 20 s later
should the watchdog thread never get the GIL.
"""

from __future__ import annotations

import faulthandler
import json
import os
import pickle
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import passing.torch  # noqa: F401  registers backend "passing"
from tests.differential.program import Op, Program, generate, group_members, make_tensor, trec

HUNG = 97  # exit code of a rank the watchdog ended
POLL_SECONDS = 3.0  # how long a wait by is_completed() polls before it waits

warnings.filterwarnings("ignore", category=FutureWarning)  # torch's deprecation notes on every call
warnings.filterwarnings("ignore", category=UserWarning)


# ---- records ------------------------------------------------------------------------------------


def digest(value: Any) -> list[dict[str, Any]]:
    """A future's value: its tensors in order, however nested."""
    if isinstance(value, torch.Tensor):
        return [trec(value)]
    if isinstance(value, list | tuple):
        return [r for v in value for r in digest(v)]
    return []


def new_record(kind: str, status: str) -> dict[str, Any]:
    return {"kind": kind, "status": status, "values": {}, "aux": {}, "started": time.time()}


def erec(e: BaseException, seconds: float, where: str) -> dict[str, Any]:
    return {"type": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__], "message": str(e)[:600],
            "seconds": seconds, "where": where, "at": time.time()}


def snapshot() -> dict[str, Any]:
    """What this process holds now: Python and OS threads, open fds, shared segments mapped."""
    fds: dict[str, str] = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # the directory's own fd, closed meanwhile
    with open("/proc/self/maps") as f:
        maps = sorted({line.split(None, 5)[-1].strip() for line in f if "/dev/shm" in line or "memfd:" in line})
    return {"threads": sorted(t.name for t in threading.enumerate()), "tasks": len(os.listdir("/proc/self/task")),
            "fds": fds, "maps": maps}


def fd_kind(target: str) -> str:
    if target.startswith("socket:"):
        return "socket"
    if target.startswith("anon_inode:"):
        return "anon:" + target.removeprefix("anon_inode:").strip("[]")
    if "/dev/shm" in target or "memfd:" in target:
        return "shm"
    if target.startswith("pipe:"):
        return "pipe"
    return "file"


def leftover(baseline: dict[str, Any], now: dict[str, Any]) -> dict[str, Any]:
    """What ``now`` holds beyond ``baseline``."""
    threads = list(now["threads"])
    for name in baseline["threads"]:
        if name in threads:
            threads.remove(name)
    fds = sorted(f"{fd_kind(t)} {t}" for fd, t in now["fds"].items() if baseline["fds"].get(fd) != t)
    return {"threads": threads, "tasks": max(0, now["tasks"] - baseline["tasks"]), "fds": fds,
            "maps": [m for m in now["maps"] if m not in baseline["maps"]]}


def settled_leftover(baseline: dict[str, Any], wait: float) -> dict[str, Any]:
    """The leftover once the process has let go (threads end, sockets close a moment after a destroy):
    nothing left, or only fds and the same for 1 s, or ``wait`` s passed. A thread, task or mapping left
    waits for the deadline: on a loaded machine a thread's end can take longer than a second."""
    deadline = time.monotonic() + wait
    left, same_since = leftover(baseline, snapshot()), time.monotonic()
    while left["threads"] or left["fds"] or left["maps"] or left["tasks"]:
        time.sleep(0.1)
        now = leftover(baseline, snapshot())
        if now != left:
            left, same_since = now, time.monotonic()
        elif time.monotonic() > deadline or (time.monotonic() - same_since > 1.0 and not (
                left["threads"] or left["maps"] or left["tasks"])):
            break
    return left


# ---- the watchdog -------------------------------------------------------------------------------


class Watchdog:
    """Ends the process when an armed deadline passes: the rank hangs, which is itself the finding."""

    def __init__(self, on_fire: Callable[[str], None]) -> None:
        self.on_fire = on_fire
        self.deadline: float | None = None
        self.what = ""
        threading.Thread(target=self._run, name="differential-watchdog", daemon=True).start()

    def arm(self, seconds: float, what: str) -> None:
        self.what = what
        self.deadline = time.monotonic() + seconds
        faulthandler.dump_traceback_later(seconds + 20, exit=True)  # should this thread never run again

    def disarm(self) -> None:
        self.deadline = None
        faulthandler.cancel_dump_traceback_later()

    def _run(self) -> None:
        while True:
            time.sleep(0.2)
            deadline = self.deadline
            if deadline is not None and time.monotonic() > deadline:
                sys.stderr.write(f"\nwatchdog: {self.what} is past its bound; stacks:\n")
                faulthandler.dump_traceback(all_threads=True)
                try:
                    self.on_fire(self.what)
                finally:
                    sys.stderr.flush()
                    os._exit(HUNG)


# ---- one program --------------------------------------------------------------------------------


class Pending:
    """An async op not waited yet."""

    def __init__(self, op: Op, record: dict[str, Any], handle: Any, how: str, outputs: dict[str, torch.Tensor],
                 chained: Any = None) -> None:
        self.op, self.record, self.handle, self.how, self.outputs = op, record, handle, how, outputs
        self.chained = chained  # the then-chain's last future


class FaultInjected(Exception):
    """The fault a spec asked this rank to raise."""


REDUCE = {name: getattr(dist.ReduceOp, name) for name in ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR",
                                                            "BXOR")}


class Runner:
    """Runs one program on this rank and records it."""

    def __init__(self, program: Program, rank: int, backend: str, timeout: float, slack: float,
                 watchdog: Watchdog, fault: dict[str, Any] | None, reinit: Callable[[], None]) -> None:
        self.program, self.rank, self.backend = program, rank, backend
        self.timeout, self.slack, self.watchdog, self.fault, self.reinit = timeout, slack, watchdog, fault, reinit
        self.groups: dict[str, Any] = {}  # group ref -> ProcessGroup (this rank's)
        self.made: list[Any] = []  # groups this program made, destroyed at its end
        self.pending: dict[int, Pending] = {}
        self.result: dict[str, Any] = {"seed": program.seed, "records": {}, "stopped": None, "fault_at": None,
                                       "started": time.time(), "ended": None}

    # -- helpers --

    def tensor(self, op: Op, spec: dict[str, Any], salt: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        return make_tensor(self.program.seed, op.id, self.rank, spec, salt)

    def group(self, ref: str) -> Any:
        return None if ref == "world" else self.groups[ref]

    def members(self, ref: str) -> list[int] | None:
        return group_members(self.program, ref, self.rank)

    # -- the program --

    def run(self) -> dict[str, Any]:
        for op in self.program.ops:
            if self.fault is not None and self.fault["op"] == op.id:
                self.strike()
            record = new_record(op.kind, "skip")
            self.result["records"][op.id] = record
            self.watchdog.arm(self.timeout + self.slack, f"seed {self.program.seed} op {op.id} ({op.kind})")
            try:
                self.execute(op, record)
            finally:
                self.watchdog.disarm()
            record["ended"] = time.time()
            if record.get("error") is not None and op.kind != "invalid":
                self.result["stopped"] = op.id  # the group may be out of step: nothing more of this program
                break
        else:
            self.wait_rest()
            self.destroy_groups()
        self.result["ended"] = time.time()
        return self.result

    def wait_rest(self) -> None:
        """Works a shrunk program never waits: waited at its end, in issue order (a generated program
        waits every work itself)."""
        if self.pending:
            op = Op(-1, "wait", {"works": sorted(self.pending)})
            record = new_record("wait", "ok")
            self.result["records"][-1] = record
            self.watchdog.arm(self.timeout + self.slack, f"seed {self.program.seed}: the works left")
            try:
                self.do_wait(op, record)
            finally:
                self.watchdog.disarm()

    def strike(self) -> None:
        """The fault, at the start of its op."""
        kind = self.fault["kind"]
        self.result["fault_at"] = time.time()
        if kind == "aggregator":  # the driver kills or stops the aggregator, and says when
            marker = Path(self.fault["marker"])
            marker.touch()
            done = marker.with_suffix(".done")
            deadline = time.monotonic() + 30
            while not done.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            if done.exists():
                self.result["fault_at"] = float(done.read_text() or time.time())
            return
        raise FaultInjected(kind)  # the launch's main loop does the rest (raise, skip, kill)

    def execute(self, op: Op, record: dict[str, Any]) -> None:
        if op.kind in ("new_group", "mesh", "reinit"):
            record["status"] = "ok"
            start = time.monotonic()
            try:
                getattr(self, f"do_{op.kind}")(op)
            except Exception as e:  # recorded: the compare decides
                record.update(status="error", error=erec(e, time.monotonic() - start, "call"))
            return
        if op.kind in ("wait", "poll"):
            record["status"] = "ok"
            getattr(self, f"do_{op.kind}")(op, record)
            return
        members = self.members(op.args["group"])
        if members is None:
            return  # not a member: "skip"
        record["status"] = "ok"
        start = time.monotonic()
        try:
            issued = getattr(self, f"do_{op.kind}")(op, members, record)
        except Exception as e:  # recorded: the compare decides
            record.update(status="error", error=erec(e, time.monotonic() - start, "call"))
            return
        record["call_seconds"] = time.monotonic() - start
        if issued is None:
            return
        handle, how, outputs = issued
        if handle is None or not op.args.get("async"):  # completed in the call (or the call waits itself)
            self.complete(record, outputs)
            return
        pending = Pending(op, record, handle, how, outputs)
        if op.args["wait"] == "then" and how == "work":
            try:
                pending.chained = self.chain(handle.get_future(), record, op.args["then"])
            except Exception as e:  # gloo has no future for some works: recorded, waited with wait()
                record["aux"]["get_future_error"] = erec(e, 0.0, "get_future")
        self.pending[op.id] = pending

    def complete(self, record: dict[str, Any], outputs: dict[str, torch.Tensor]) -> None:
        record["values"] = {name: trec(t) for name, t in outputs.items()}
        record["completed"] = time.time()

    def chain(self, fut: Any, record: dict[str, Any], count: int) -> Any:
        """``count`` callbacks chained with then(): they record what they see and transform it, nothing more."""
        def first(f: Any) -> int:
            value = f.value()
            record["aux"]["then_value"] = digest(value)
            return sum(t.numel() for t in _tensors(value))

        def second(f: Any) -> int:
            record["aux"]["then_second"] = f.value()
            return f.value() + 1

        chained = fut.then(first)
        return chained.then(second) if count > 1 else chained

    # -- waiting --

    def do_wait(self, op: Op, record: dict[str, Any]) -> None:
        import random

        ids = [w for w in op.args["works"] if w in self.pending]
        random.Random(hash((self.program.seed, op.id, self.rank))).shuffle(ids)  # each rank its own order
        record["order"] = ids
        for w in ids:
            p = self.pending.pop(w)
            start = time.monotonic()
            try:
                self.wait_one(p)
            except Exception as e:  # the op's own error, where its wait raised it
                p.record.update(status="error", error=erec(e, time.monotonic() - start, "wait"))
                record["error"] = {"in": w, **p.record["error"]}
                record["status"] = "error"
                return
            p.record["wait_seconds"] = time.monotonic() - start
            self.complete(p.record, p.outputs)

    def wait_one(self, p: Pending) -> None:
        style = p.op.args["wait"]
        aux = p.record["aux"]
        if p.how == "future":  # all_reduce_coalesced(async_op=True) returns a torch.Future
            aux["future_value"] = digest(p.handle.wait())
            return
        works = p.handle.works if p.how == "cm" else [p.handle]
        if style == "future":
            for w in works:
                try:
                    fut = w.get_future()
                except Exception as e:  # gloo has no future for some works
                    aux["get_future_error"] = erec(e, 0.0, "get_future")
                    w.wait()
                    continue
                aux.setdefault("future_value", []).extend(digest(fut.wait()))
        elif style == "then" and p.chained is not None:
            aux["then_result"] = p.chained.wait()
        elif style == "poll":  # bounded: gloo's reduce_scatter works never say they completed (torch 2.13)
            deadline = time.monotonic() + POLL_SECONDS
            while not all(w.is_completed() for w in works) and time.monotonic() < deadline:
                time.sleep(0.001)
            aux["poll_saw_completion"] = all(w.is_completed() for w in works)
        p.handle.wait()
        aux["completed_after_wait"] = all(w.is_completed() for w in works)

    def do_poll(self, op: Op, record: dict[str, Any]) -> None:
        for w in op.args["works"]:
            p = self.pending.get(w)
            if p is None:
                continue
            try:
                if p.how == "future":
                    p.handle.done()
                else:
                    for work in p.handle.works if p.how == "cm" else [p.handle]:
                        work.is_completed()
            except Exception as e:  # recorded on the op polled
                p.record["aux"]["poll_error"] = erec(e, 0.0, "is_completed")

    def read_after_barrier(self, op: Op) -> None:
        """gloo's barrier waited for the group's earlier works: their outputs are final now, unwaited."""
        for w in op.args["read"]:
            p = self.pending.get(w)
            if p is not None:
                p.record["aux"]["after_barrier"] = {name: trec(t) for name, t in p.outputs.items()}

    # -- structure --

    def do_reinit(self, op: Op) -> None:
        self.reinit()

    def do_new_group(self, op: Op) -> None:
        # the launch's timeout, as the default group's: a fault's bound holds in a subgroup too (without it
        # torch gives a subgroup 30 minutes, and gloo waits that long for a rank that skipped a call)
        g = dist.new_group(op.args["ranks"], timeout=timedelta(seconds=self.timeout))
        if self.rank in op.args["ranks"]:
            self.groups[f"g{op.id}"] = g
            self.made.append(g)

    def do_mesh(self, op: Op) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", tuple(op.args["shape"]))
        for dim in (0, 1):
            g = mesh.get_group(dim)
            self.groups[f"m{op.id}.{dim}"] = g
            if g is not dist.distributed_c10d._get_default_group() and g not in self.made:
                self.made.append(g)  # (a dimension over every rank is the default group itself)

    def destroy_groups(self) -> None:
        """The program's own groups go with it (a launch runs many programs)."""
        for g in self.made:
            self.watchdog.arm(self.timeout + self.slack, f"seed {self.program.seed}: destroy a subgroup")
            start = time.monotonic()
            try:
                dist.destroy_process_group(g)
            except Exception as e:  # recorded: a destroy that fails is a finding too
                self.result.setdefault("destroy_errors", []).append(erec(e, time.monotonic() - start, "destroy"))
            finally:
                self.watchdog.disarm()
            self.result.setdefault("destroy_seconds", []).append(time.monotonic() - start)
        self.made.clear()

    # -- collectives: each returns (handle, how, outputs) or None --

    def do_all_reduce(self, op: Op, members: list[int], record: dict[str, Any]) -> Any:
        a = op.args
        base, t = self.tensor(op, a["tensor"])
        record["absmax"] = _absmax(t)
        try:
            work = dist.all_reduce(t, op=REDUCE[a["op"]], group=self.group(a["group"]), async_op=a["async"])
        except RuntimeError as e:
            if not (a["op"] == "AVG" and self.backend == "gloo" and "AVG" in str(e) and t.is_floating_point()):
                raise
            # a gloo without AVG: the reference is its SUM divided by the group size (oracle.py)
            record["aux"]["avg_by_sum"] = erec(e, 0.0, "call")
            base, t = self.tensor(op, a["tensor"])
            dist.all_reduce(t, group=self.group(a["group"]))
            t.div_(len(members))
            return None, "work", {"tensor": base}
        return work, "work", {"tensor": base}

    def do_all_reduce_coalesced(self, op: Op, members: list[int], record: dict[str, Any]) -> Any:
        a = op.args
        pairs = [self.tensor(op, spec, salt=i) for i, spec in enumerate(a["tensors"])]
        handle = dist.all_reduce_coalesced([t for _, t in pairs], op=REDUCE[a["op"]], group=self.group(a["group"]),
                                           async_op=a["async"])
        return handle, "future", {f"t{i}": b for i, (b, _) in enumerate(pairs)}

    def do_reduce_scatter_tensor(self, op: Op, members: list[int], record: dict[str, Any]) -> Any:
        a = op.args
        in_base, inp = self.tensor(op, a["input"])
        out_base, out = self.tensor(op, a["output"], salt=1)
        record["absmax"] = _absmax(inp)
        work = dist.reduce_scatter_tensor(out, inp, op=REDUCE[a["op"]], group=self.group(a["group"]),
                                          async_op=a["async"])
        return work, "work", {"output": out_base, "input": in_base}

    def do_reduce_scatter(self, op: Op, members: list[int], record: dict[str, Any]) -> Any:
        a = op.args
        inputs = [self.tensor(op, a["input"], salt=2 + i)[1] for i in range(len(members))]
        out_base, out = self.tensor(op, a["output"], salt=1)
        record["absmax"] = max(_absmax(t) for t in inputs)
        work = dist.reduce_scatter(out, inputs, op=REDUCE[a["op"]], group=self.group(a["group"]), async_op=a["async"])
        return work, "work", {"output": out_base, **{f"input{i}": t for i, t in enumerate(inputs)}}

    def do_all_gather(self, op: Op, members: list[int], record: dict[str, Any]) -> Any:
        a = op.args
        in_base, inp = self.tensor(op, a["input"])
        outs = [self.tensor(op, a["output"], salt=1 + i) for i in range(len(members))]
        work = dist.all_gather([v for _, v in outs], inp, group=self.group(a["group"]), async_op=a["async"])
        return work, "work", {"input": in_base, **{f"output{i}": b for i, (b, _) in enumerate(outs)}}

    def do_all_gather_into_tensor(self, op: Op, members: list[int], record: dict[str, Any]) -> Any:
        a = op.args
        in_base, inp = self.tensor(op, a["input"])
        out_base, out = self.tensor(op, a["output"], salt=1)
        work = dist.all_gather_into_tensor(out, inp, group=self.group(a["group"]), async_op=a["async"])
        return work, "work", {"output": out_base, "input": in_base}

    def do_coalesced(self, op: Op, members: list[int], record: dict[str, Any]) -> Any:
        a = op.args
        g = self.group(a["group"])
        outputs: dict[str, torch.Tensor] = {}
        absmax = 0.0
        with dist._coalescing_manager(group=g, async_ops=a["async"]) as cm:
            for i, item in enumerate(a["items"]):
                if a["inner"] == "all_reduce":
                    base, t = self.tensor(op, item["tensor"], salt=2 * i)
                    absmax = max(absmax, _absmax(t))
                    dist.all_reduce(t, op=REDUCE[a["op"]], group=g)
                    outputs[f"tensor{i}"] = base
                    continue
                in_base, inp = self.tensor(op, item["input"], salt=2 * i)
                out_base, out = self.tensor(op, item["output"], salt=2 * i + 1)
                if a["inner"] == "all_gather_into_tensor":
                    dist.all_gather_into_tensor(out, inp, group=g)
                else:
                    absmax = max(absmax, _absmax(inp))
                    dist.reduce_scatter_tensor(out, inp, op=REDUCE[a["op"]], group=g)
                outputs[f"output{i}"] = out_base
                outputs[f"input{i}"] = in_base
        record["absmax"] = absmax
        return (cm if a["async"] else None), "cm", outputs

    def do_broadcast(self, op: Op, members: list[int], record: dict[str, Any]) -> Any:
        a = op.args
        base, t = self.tensor(op, a["tensor"])
        work = dist.broadcast(t, group=self.group(a["group"]), group_src=a["src"], async_op=a["async"])
        return work, "work", {"tensor": base}

    def do_reduce(self, op: Op, members: list[int], record: dict[str, Any]) -> Any:
        a = op.args
        base, t = self.tensor(op, a["tensor"])
        work = dist.reduce(t, op=REDUCE[a["op"]], group=self.group(a["group"]), group_dst=a["dst"],
                           async_op=a["async"])
        mine = members.index(self.rank) == a["dst"]
        return work, "work", {"tensor": base} if mine else {}  # only dst's tensor is defined after a reduce

    def do_gather(self, op: Op, members: list[int], record: dict[str, Any]) -> Any:
        a = op.args
        _, t = self.tensor(op, a["tensor"])
        mine = members.index(self.rank) == a["dst"]
        gathered = [torch.zeros_like(t) for _ in members] if mine else None
        work = dist.gather(t, gathered, group=self.group(a["group"]), group_dst=a["dst"], async_op=a["async"])
        return work, "work", {f"g{i}": x for i, x in enumerate(gathered or [])}

    def do_scatter(self, op: Op, members: list[int], record: dict[str, Any]) -> Any:
        a = op.args
        _, out = self.tensor(op, a["tensor"])
        mine = members.index(self.rank) == a["src"]
        parts = [self.tensor(op, a["tensor"], salt=1 + i)[1] for i in range(len(members))] if mine else None
        work = dist.scatter(out, parts, group=self.group(a["group"]), group_src=a["src"], async_op=a["async"])
        return work, "work", {"out": out}

    def do_all_to_all(self, op: Op, members: list[int], record: dict[str, Any]) -> Any:
        a = op.args
        me = members.index(self.rank)
        sizes = a["sizes"]
        inputs = [self.tensor(op, {**a["tensor"], "shape": [sizes[me][q]]}, salt=q)[1] for q in range(len(members))]
        outputs = [torch.zeros(sizes[q][me], dtype=inputs[0].dtype) for q in range(len(members))]
        work = dist.all_to_all(outputs, inputs, group=self.group(a["group"]), async_op=a["async"])
        return work, "work", {f"o{q}": t for q, t in enumerate(outputs)}

    def do_all_to_all_single(self, op: Op, members: list[int], record: dict[str, Any]) -> Any:
        a = op.args
        me = members.index(self.rank)
        sizes, row = a["sizes"], list(a["row"])
        _, inp = self.tensor(op, {**a["tensor"], "shape": [sum(sizes[me]), *row]})
        out = torch.zeros([sum(sizes[q][me] for q in range(len(members))), *row], dtype=inp.dtype)
        splits: dict[str, Any] = {} if a["even"] else {
            "input_split_sizes": sizes[me], "output_split_sizes": [sizes[q][me] for q in range(len(members))]}
        work = dist.all_to_all_single(out, inp, group=self.group(a["group"]), async_op=a["async"], **splits)
        return work, "work", {"out": out}

    def do_barrier(self, op: Op, members: list[int], record: dict[str, Any]) -> Any:
        a = op.args
        work = dist.barrier(group=self.group(a["group"]), async_op=a["async"])
        if not a["async"]:
            self.read_after_barrier(op)
        return work, "work", {}

    def do_objects(self, op: Op, members: list[int], record: dict[str, Any]) -> Any:
        a = op.args
        g = self.group(a["group"])
        me = members.index(self.rank)

        def obj(i: int = 0) -> dict[str, Any]:
            import random

            r = random.Random(hash((self.program.seed, op.id, self.rank, i)))
            return {"rank": self.rank, "i": i, "blob": r.randbytes(a["sizes"][self.rank])}

        which = a["which"]
        if which == "all_gather_object":
            out: Any = [None] * len(members)
            dist.all_gather_object(out, obj(), group=g)
        elif which == "broadcast_object_list":
            out = [obj(i) for i in range(a["count"])]
            dist.broadcast_object_list(out, group=g, group_src=a["root"])
        elif which == "gather_object":
            out = [None] * len(members) if me == a["root"] else None
            dist.gather_object(obj(), out, group=g, group_dst=a["root"])
        else:
            out = [None]
            dist.scatter_object_list(out, [obj(i) for i in range(len(members))] if me == a["root"] else None,
                                     group=g, group_src=a["root"])
        record["objects"] = out
        return None

    def do_invalid(self, op: Op, members: list[int], record: dict[str, Any]) -> Any:
        """Calls gloo refuses on every rank at call time; any error recorded, the program goes on."""
        a = op.args
        g, n, k = self.group(a["group"]), len(members), a["size"]
        what = a["what"]
        if what == "rst_size":
            dist.reduce_scatter_tensor(torch.zeros(k + 1), torch.ones(k * n), group=g)
        elif what == "rst_dtype":
            dist.reduce_scatter_tensor(torch.zeros(k, dtype=torch.float64), torch.ones(k * n), group=g)
        elif what == "agt_size":
            dist.all_gather_into_tensor(torch.zeros(k * n + 1), torch.ones(k), group=g)
        elif what == "agt_dtype":
            dist.all_gather_into_tensor(torch.zeros(k * n, dtype=torch.float64), torch.ones(k), group=g)
        elif what == "ag_uneven":
            dist.all_gather([torch.zeros(k + i) for i in range(n)], torch.ones(k), group=g)
        elif what == "band_float":
            dist.all_reduce(torch.ones(k), op=dist.ReduceOp.BAND, group=g)
        elif what == "arc_mixed":
            dist.all_reduce_coalesced([torch.ones(k), torch.ones(k, dtype=torch.float64)], group=g)
        elif what == "bcast_src":
            dist.broadcast(torch.ones(k), group=g, group_src=n)
        elif what == "rs_list_len":
            dist.reduce_scatter(torch.zeros(k), [torch.zeros(k)] * (n + 1), group=g)
        elif what == "agt_0dim":
            dist.all_gather_into_tensor(torch.zeros(n), torch.tensor(1.0), group=g)
        return None


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    return []


def _absmax(t: torch.Tensor) -> float:
    """The largest finite |x| of a float tensor (the quantization bound's x_max), 0 for others."""
    if not t.is_floating_point() or t.numel() == 0:
        return 0.0
    finite = t.double().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    return float(finite.abs().max())


# ---- the launch ---------------------------------------------------------------------------------


def main() -> None:
    started = time.time()
    spec = json.loads(Path(sys.argv[1]).read_text())
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # cluster.local.collect asks before it kills
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = Path(spec["out"])
    timeout, slack = float(spec["timeout"]), float(spec["slack"])
    fault = spec.get("fault")
    mine = fault if fault is not None and fault["rank"] == rank else None
    summary: dict[str, Any] = {"rank": rank, "mode": spec["mode"], "backend": spec["backend"], "programs": 0,
                               "reinits": 0, "leftovers": [], "status": "running", "init_seconds": [],
                               "started": started}
    current: dict[str, Any] = {}

    def write(name: str, data: Any) -> None:
        tmp = out / f".{name}.tmp"
        tmp.write_bytes(pickle.dumps(data))
        tmp.rename(out / name)

    def on_fire(what: str) -> None:
        summary["status"] = f"hung: {what}"
        if current:
            current["stopped"] = "hung"
            write(f"rank{rank}-{current['index']}.pkl", current)
        write(f"rank{rank}.pkl", summary)
        if current and fault is None:  # the others need not wait for this rank's word any longer
            side.set(f"status/{current['index']}/{rank}", "hung")

    watchdog = Watchdog(on_fire)
    side = dist.TCPStore("127.0.0.1", spec["side_port"], world, False, timedelta(seconds=timeout + slack))
    summary["side_store_at"] = time.time()
    baseline = snapshot()

    def init() -> None:
        watchdog.arm(timeout + slack, "init_process_group")
        start = time.monotonic()
        try:
            dist.init_process_group(spec["backend"], timeout=timedelta(seconds=timeout))
        finally:
            watchdog.disarm()
        summary["init_seconds"].append(time.monotonic() - start)
        pg = dist.distributed_c10d._get_default_group()
        if spec["backend"] == "passing":  # what the driver holds to the options (keep_on_gloo: no gather lane)
            summary.setdefault("groups", []).append({
                "mode": pg.mode, "gather_lane": pg.gather_lane is not None,
                "keep_on_gloo": list(pg.options.keep_on_gloo)})

    def destroy(settle: float) -> None:
        watchdog.arm(timeout + slack, "destroy_process_group")
        try:
            dist.destroy_process_group()
        finally:
            watchdog.disarm()
        summary["leftovers"].append(settled_leftover(baseline, settle))

    def reinit() -> None:
        destroy(3.0)
        # every rank's destroy has returned, rank 0's store with it, before any rank makes the new group: one
        # that re-initialises at once may meet rank 0's old store (torch's race, on any backend: seen on gloo
        # itself on a loaded machine). tests/test_torch_contract.py holds passing to the immediate re-init.
        keys = [f"reinit/{summary['reinits']}/{r}" for r in range(world)]
        side.set(keys[rank], "1")
        watchdog.arm(timeout + slack, "the ranks' barrier before init_process_group")
        try:
            side.wait(keys, timedelta(seconds=timeout))
        finally:
            watchdog.disarm()
        init()
        summary["reinits"] += 1

    init()
    for index, entry in enumerate(spec["programs"]):
        seed = entry["seed"]
        program = generate(seed, tuple(spec["layout"]), plain=spec.get("plain", False))
        if entry.get("keep") is not None:  # a shrunk program
            program = program.keeping(set(entry["keep"]))
        fault_here = mine if mine is not None and mine["seed"] == seed else None
        runner = Runner(program, rank, spec["backend"], timeout, slack, watchdog, fault_here, reinit)
        current.clear()
        current.update(runner.result, index=index)
        runner.result = current
        try:
            result = runner.run()
        except FaultInjected:
            summary["status"] = f"fault {fault_here['kind']}"
            current["stopped"] = "fault"
            write(f"rank{rank}-{index}.pkl", current)
            write(f"rank{rank}.pkl", summary)
            if fault_here["kind"] == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault_here["kind"] == "skip":  # issues nothing more; the others must not wait for it forever
                time.sleep(float(fault_here.get("sleep", timeout + slack + 10)))
                os._exit(0)
            faulthandler.dump_traceback_later(timeout + slack, exit=True)  # its exit must not hang either
            raise  # "raise": the exception ends the process as an uncaught one does
        summary["programs"] += 1
        write(f"rank{rank}-{index}.pkl", result)
        if fault is not None:
            continue  # a fault launch: no agreement with a rank that may be gone
        # every rank learns whether any had an error outside the deliberately invalid calls
        side.set(f"status/{index}/{rank}", "error" if result["stopped"] is not None else "ok")
        # a peer still busy finishes, or its watchdog ends it and says so here: wait long
        agreement = 5 * (timeout + slack)
        watchdog.arm(agreement + slack, f"the ranks' agreement after seed {seed}")
        try:
            side.wait([f"status/{index}/{r}" for r in range(world)], timedelta(seconds=agreement))
            statuses = [side.get(f"status/{index}/{r}").decode() for r in range(world)]
        except Exception as e:  # a rank is gone (its watchdog ended it): the launch ends here
            summary["status"] = f"peers lost after seed {seed}: {e}"
            write(f"rank{rank}.pkl", summary)
            os._exit(0)
        finally:
            watchdog.disarm()
        if "hung" in statuses:  # a rank is gone: no init_process_group can meet it again
            summary["status"] = f"peers lost after seed {seed}: rank {statuses.index('hung')} hung"
            write(f"rank{rank}.pkl", summary)
            os._exit(0)
        if "error" in statuses:
            reinit()
    if fault is not None:  # the group may have lost a rank: gloo cannot shut down cleanly then
        summary["status"] = "done"
        write(f"rank{rank}.pkl", summary)
        sys.stdout.flush()
        os._exit(0)
    summary["destroy_at"] = time.time()
    destroy(3.0)
    # then the last program's works, futures and tensors go, as a user's do once its function returns: what
    # they reached (gloo's connections through its works, on either backend) must be gone then
    runner = result = program = None
    current.clear()
    summary["released"] = settled_leftover(baseline, 10.0)
    summary["status"] = "done"
    summary["finished"] = time.time()
    write(f"rank{rank}.pkl", summary)


if __name__ == "__main__":
    main()
