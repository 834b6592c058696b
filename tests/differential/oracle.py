"""The differential fuzzer's driver: random programs (program.py) run by real rank processes
(rank.py) on gloo and on backend "passing", compared by machine (docs/torch.md; the design
guide's "gloo is the oracle").

``run_launch(mode, seeds, layout, fault=None)`` runs programs in one launch of s x n rank
processes forked from the torch zygote (tests/zygote.py, cluster.local.launch_ranks). Modes:
"gloo" (the reference: backend gloo), "ring" (passing, nothing configured), "embedded" (passing,
PASSING_EMBEDDED=ps: rank 0's embedded controller and software aggregator) and "ps" (passing, an
external PS-only controller and software aggregator: cluster.local.LocalServices, forked too).

``compare(reference, candidate)`` lists the ``Divergence``s of a candidate launch from the gloo
launch of the same programs:

- outputs are gloo's bits (NaN payloads aside), and a view's whole base tensor with them (elements
  outside the view untouched), except a SUM/AVG of float32/float16/bfloat16 inputs that are not
  integer-valued: PASSING quantizes those, so they are held within ``tolerance``: the
  quantization bound of tests/torch_worker.py ``bound`` (passing.quantize.error_bound at
  auto_scale's scale) plus float32 rounding of another summation order, plus the dtype's own
  rounding for float16/bfloat16, divided by the group size for AVG; NaN and infinities where gloo
  has them. An AVG of integer values among a group whose size is not a power of two may differ in
  the last place (the division rounds once in float32 and again to the dtype);
- where gloo itself is known to be wrong the expectation is computed independently, from every
  rank's regenerated inputs (``independent``, program.expected_reduction): all_reduce, broadcast
  and the list reduce_scatter of a view that is not dense (a 1-D view with a step, a slice of a
  matrix's rows): gloo sums or copies the storage as if it were contiguous (torch 2.13); gloo's
  own answer is then a note. A float sum computed that way is in another order than anyone's:
  held within the dtype's rounding of n terms;
- every rank of a group holds the same bits after a quantized all_reduce;
- the same ranks raise where gloo raises, with an error of the same family (a usage error:
  ValueError/TypeError...; or a runtime one), and no rank raises where gloo does not; a
  ``get_future()`` that gloo does not implement but passing does is a note, not a divergence;
- the value a ``then`` callback saw and a future's value (what they hold, sorted: backends shape
  a value their own way), outputs read right after a ``barrier()`` without their wait (gloo's
  barrier waits for the group's earlier works), ``is_completed()`` after a wait and while polled;
- no rank hangs (its watchdog ends it past the process group's timeout + slack) or crashes, and
  destroy_process_group of a subgroup takes no more than ``SLACK`` (gloo's is local);
- after destroy_process_group, no more threads, OS threads, fds (by kind) or shared segments
  left than the gloo launch left on the same rank; with PASSING_KEEP_ON_GLOO=all_gather, no
  gather lane.

The reference for AVG. The design guide says gloo has no ReduceOp.AVG on the CPU; torch 2.13's
gloo does (measured here: float dtypes; an integer AVG raises "result type Float can't be cast"),
so gloo's own AVG is the reference, and ``check_reference`` holds the gloo launch to its SUM divided
by the group size (``expected_reduction``, computed from the regenerated inputs, for every
all_reduce of integer values, within the last place where the size is no power of two). With a
gloo that raises on AVG, the gloo rank instead issues a SUM and divides it by the group size,
which is then the reference (rank.py, ``avg_by_sum``).

``compare_fault`` checks a launch with a fault (``fault=``: one rank raises at op k and exits as an
uncaught exception does, skips op k and issues nothing more, or is SIGKILLed at op k; in mode
"ps" the aggregator is SIGKILLed or SIGSTOPped when rank 0 reaches op k): every other rank
completes with gloo's values (those of the fault-free gloo run) or raises, within the bound (the
process group's timeout; ``failover_after`` + 3 s for an aggregator fault) plus ``SLACK``; the
ranks that raise are those that raise when the same fault hits gloo (an aggregator fault: none).

On a divergence ``report`` prints the seed, the mode, the first diverging op, the program and a
replay command (``make fuzz-torch SEED=... MODE=...``), and ``shrink`` looks for a smaller program
that still diverges (the gloo records serve as its reference: an op's inputs depend on its id
alone, not on the ops before it).

CLI (``make fuzz-torch``): ``python -m tests.differential.oracle [--seed S] [--mode M] [--programs N]
[--layout 2x2] [--duration SECONDS] [--faults K] [--fault KIND:WHO:OP]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster.local import LocalServices, ensure_keys, launch_ranks
from tests.differential.program import (
    PASSING_FLOATS,
    Layout,
    Op,
    Program,
    apply_view,
    dense,
    expected_reduction,
    format,
    format_op,
    generate,
    group_members,
    make_tensor,
    trec,
)

MODES = ("ring", "embedded", "ps")  # the candidates; "gloo" is the reference
TIMEOUT = 15.0  # the process group's timeout in a launch without a fault (s)
FAULT_TIMEOUT = 6.0  # ... with one: a skipped call holds the others this long
SLACK = 15.0  # a loaded 2-core machine's margin past any bound (and the watchdog's, past the timeout)
FAILOVER_AFTER = 1.0  # PASSING_FAILOVER_AFTER of a launch with an aggregator fault
RANK = [sys.executable, "-m", "tests.differential.rank"]


# ---- launches -----------------------------------------------------------------------------------


@dataclass
class RankOutcome:
    rank: int
    returncode: int | None
    summary: dict[str, Any] | None  # rank.py's summary, None when it never wrote one
    programs: dict[int, dict[str, Any]]  # program index -> its records
    stderr: str

    @property
    def status(self) -> str:
        if self.summary is None:
            return f"no summary (exit {self.returncode})"
        return self.summary["status"]


@dataclass
class Launch:
    mode: str
    layout: Layout
    programs: list[dict[str, Any]]  # [{"seed": s, "keep": ids or None}]
    fault: dict[str, Any] | None
    plain: bool
    timeout: float
    ranks: list[RankOutcome] = field(default_factory=list)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # the launch's own settings beyond its mode's

    def program(self, index: int) -> Program:
        entry = self.programs[index]
        p = generate(entry["seed"], self.layout, plain=self.plain)
        return p.keeping(set(entry["keep"])) if entry.get("keep") is not None else p

    def result(self, rank: int, seed: int) -> dict[str, Any] | None:
        """Rank ``rank``'s records of the program of ``seed`` (the first such program of the launch)."""
        for index, entry in enumerate(self.programs):
            if entry["seed"] == seed:
                return self.ranks[rank].programs.get(index)
        return None


def mode_env(mode: str) -> dict[str, str]:
    env = {"PASSING_CONTROLLER": "", "PASSING_EMBEDDED": "", "PYTHONFAULTHANDLER": "1", "PYTHONWARNINGS": "ignore"}
    if mode == "embedded":
        env["PASSING_EMBEDDED"] = "ps"
    return env


@contextmanager
def services_for(mode: str) -> Iterator[LocalServices | None]:
    """Mode "ps": a PS-only controller and one software aggregator for the launch, forked."""
    if mode != "ps":
        yield None
        return
    from tests.cluster import service_popen

    ensure_keys()  # the test session's keys (conftest.py), else a directory of this run's own
    with LocalServices(ps=1, popen=service_popen) as services:
        yield services


def run_launch(mode: str, seeds: Sequence[int] | Sequence[dict[str, Any]], layout: Layout,
               fault: dict[str, Any] | None = None, *, plain: bool | None = None,
               timeout: float | None = None, env: dict[str, str] | None = None) -> Launch:
    """Run the programs of ``seeds`` (or program entries {"seed", "keep"}) in one launch of mode
    ``mode`` at ``layout``; ``fault``: {"kind": "raise" | "skip" | "kill", "rank", "seed", "op"} or
    {"kind": "aggregator", "how": "kill" | "stop", "seed", "op"} (mode "ps" only); ``env``: settings
    of the ranks beyond the mode's (PASSING_KEEP_ON_GLOO, say)."""
    from tests.zygote import torch_ranks

    programs = [s if isinstance(s, dict) else {"seed": int(s), "keep": None} for s in seeds]
    plain = fault is not None if plain is None else plain
    timeout = timeout or (FAULT_TIMEOUT if fault is not None else TIMEOUT)
    launch = Launch(mode, tuple(layout), programs, fault, plain, timeout, env=dict(env or {}))
    servers, ranks = layout
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="passing-differential-") as tmp, services_for(mode) as services:
        out = Path(tmp) / "out"
        out.mkdir()
        env = {**mode_env(mode), **launch.env}
        if services is not None:
            env["PASSING_CONTROLLER"] = services.controller
        rank_fault = fault
        if fault is not None and fault["kind"] == "aggregator":
            env["PASSING_FAILOVER_AFTER"] = str(FAILOVER_AFTER)
            rank_fault = {**fault, "rank": 0, "marker": str(Path(tmp) / "strike")}
        side = side_store()  # the driver's: it outlives any rank
        spec = {"backend": "gloo" if mode == "gloo" else "passing", "mode": mode, "layout": list(layout),
                "programs": programs, "plain": plain, "timeout": timeout, "slack": SLACK, "out": str(out),
                "side_port": side.port, "fault": rank_fault}
        (Path(tmp) / "spec.json").write_text(json.dumps(spec))
        procs = launch_ranks([*RANK, str(Path(tmp) / "spec.json")], servers, ranks, env, popen_for_server=torch_ranks)
        striker = None
        if rank_fault is not None and rank_fault["kind"] == "aggregator" and services is not None:
            striker = threading.Thread(target=_strike, args=(Path(rank_fault["marker"]), services, fault["how"], procs),
                                       daemon=True)
            striker.start()
        try:
            codes, stderrs = _collect(procs, _launch_budget(len(programs), timeout), fault)
        finally:
            if services is not None:
                for p in services.procs:  # a stopped aggregator would not hear the SIGTERM of stop()
                    p.send_signal(signal.SIGCONT)
        del side
        for r, (code, err) in enumerate(zip(codes, stderrs, strict=True)):
            launch.ranks.append(_read_rank(out, r, code, err, len(programs)))
    launch.seconds = time.monotonic() - start
    return launch


def side_store() -> Any:
    """A TCPStore the ranks agree through after each program (rank.py): served by the driver, so that
    it outlives any rank."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _launch_budget(programs: int, timeout: float) -> float:
    """How long a launch may take before the driver kills what is left: its ranks' watchdogs end any
    op past timeout + SLACK, so this only catches what they cannot (a stuck exit)."""
    return 90 + 10 * programs + 3 * (timeout + 2 * SLACK)


def _strike(marker: Path, services: LocalServices, how: str, procs: list) -> None:
    """Kill (SIGKILL) or stop (SIGSTOP) the aggregator once rank 0 has touched the marker."""
    while not marker.exists():
        if all(p.poll() is not None for p in procs):
            return
        time.sleep(0.01)
    os.kill(services.procs[0].pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    done = marker.with_suffix(".done")
    done.with_suffix(".tmp").write_text(repr(time.time()))
    done.with_suffix(".tmp").rename(done)


def _collect(procs: list, budget: float, fault: dict[str, Any] | None) -> tuple[list[int | None], list[str]]:
    """Wait for every rank (at most ``budget`` s in all); a rank that skips an op (fault "skip") is
    ended once every other rank has; stragglers past the budget are killed."""
    deadline = time.monotonic() + budget
    skipper = fault["rank"] if fault is not None and fault["kind"] == "skip" else None
    while time.monotonic() < deadline:
        alive = [r for r, p in enumerate(procs) if p.poll() is None]
        if not alive or alive == [skipper]:
            break
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGUSR1)  # the stacks of what hangs (rank.py registers it)
    time.sleep(0.3)
    codes, stderrs = [], []
    for r, p in enumerate(procs):
        killed = p.poll() is None
        if killed:
            p.kill()
        try:
            _, err = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            err = ""
        if killed and r != skipper:
            err = (err or "") + f"\n(killed by the driver after {budget:.0f} s)"
        codes.append(p.returncode)
        stderrs.append(err or "")
    return codes, stderrs


def _read_rank(out: Path, rank: int, code: int | None, stderr: str, programs: int) -> RankOutcome:
    summary = _load(out / f"rank{rank}.pkl")
    found = {i: _load(out / f"rank{rank}-{i}.pkl") for i in range(programs)}
    return RankOutcome(rank, code, summary, {i: r for i, r in found.items() if r is not None}, stderr[-6000:])


def _load(path: Path) -> Any:
    try:
        return pickle.loads(path.read_bytes())
    except (OSError, EOFError, pickle.UnpicklingError):
        return None


# ---- values -------------------------------------------------------------------------------------


def decode(rec: dict[str, Any]) -> Any:
    import torch

    dtype = getattr(torch, rec["dtype"])
    if not rec["data"]:
        return torch.empty(rec["shape"], dtype=dtype)
    if dtype == torch.bool:  # gloo's SUM of bools leaves bytes 2, 3, ... for True: a bool is its byte != 0
        return (torch.frombuffer(bytearray(rec["data"]), dtype=torch.uint8) != 0).reshape(rec["shape"])
    return torch.frombuffer(bytearray(rec["data"]), dtype=dtype).reshape(rec["shape"])


def same_bits(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """The same dtype, shape and bytes, NaN payloads aside."""
    import torch

    if (a["dtype"], tuple(a["shape"])) != (b["dtype"], tuple(b["shape"])):
        return False
    if a["data"] == b["data"]:
        return True
    x, y = decode(a), decode(b)
    if not x.is_floating_point():
        return bool(torch.equal(x, y))  # (bools by value)
    both = x.isnan() & y.isnan()
    return bool(((x == y) | both).all()) and bool((x.signbit() == y.signbit())[~both].all())


def within(a: dict[str, Any], b: dict[str, Any], absolute: float, relative: float) -> tuple[bool, float]:
    """Element by element |a - b| <= absolute + relative * |b|, NaN and infinities where the other has
    them; (whether, the largest difference)."""
    if (a["dtype"], tuple(a["shape"])) != (b["dtype"], tuple(b["shape"])):
        return False, math.inf
    x, y = decode(a).double(), decode(b).double()
    if x.numel() == 0:
        return True, 0.0
    if not (bool((x.isnan() == y.isnan()).all()) and bool((x.isposinf() == y.isposinf()).all())
            and bool((x.isneginf() == y.isneginf()).all())):
        return False, math.inf
    finite = y.isfinite()
    diff = (x[finite] - y[finite]).abs()
    worst = float(diff.max()) if diff.numel() else 0.0
    return bool((diff <= absolute + relative * y[finite].abs()).all()), worst


EPS = {"float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7, "float64": 2.0**-52}


def tolerance(op: Op, name: str, n: int, absmax: float) -> tuple[float, float] | None:
    """(absolute, relative) tolerance of output ``name`` of ``op`` among ``n`` ranks, or None: gloo's bits.
    Only a SUM/AVG of float32/float16/bfloat16 is quantized (and, with nothing configured, summed in
    another order); integer-valued inputs stay exact through a power-of-two scale."""
    a = op.args
    if op.kind not in ("all_reduce", "reduce_scatter_tensor", "reduce_scatter", "coalesced"):
        return None
    if a["op"] not in ("SUM", "AVG") or name.startswith("input"):
        return None
    specs = [a["tensor"]] if "tensor" in a else [a["input"]] if "input" in a else \
        [item.get("tensor", item.get("input")) for item in a["items"]]
    dtype = specs[0]["dtype"]
    if dtype not in PASSING_FLOATS:
        return None
    integer_valued = all(s.get("values", "int") == "int" for s in specs)
    if integer_valued and (a["op"] == "SUM" or n & (n - 1) == 0):
        return None
    if integer_valued:  # AVG by a group size that is no power of two: the last place
        return 0.0, 2 * EPS[dtype]
    from tests.torch_worker import bound

    total = n * absmax
    absolute = bound(absmax, n, n, n) + (n + 1) * EPS[dtype] * total
    if a["op"] == "AVG":
        return absolute / n + EPS[dtype] * total / n, 2 * EPS[dtype]
    return absolute, 2 * EPS[dtype]


def family(error: dict[str, Any]) -> str:
    """An error's family: a usage error (the call was wrong) or a runtime one."""
    usage = {"ValueError", "TypeError", "IndexError", "KeyError", "AssertionError"}
    return "usage" if usage & set(error["mro"]) else "runtime"


# ---- the comparison -----------------------------------------------------------------------------


@dataclass
class Divergence:
    mode: str
    layout: Layout
    seed: int | None  # None: about the launch as a whole (a leak)
    op: int | None
    rank: int | None
    what: str  # its kind: "value", "raises", "no-error", "error-family", "hang", "leak", ...
    detail: str
    keep: list[int] | None = None  # the program's kept ops, where it was shrunk
    fault: dict[str, Any] | None = None  # the fault of a fault launch
    env: dict[str, str] | None = None  # the launch's own settings (Launch.env)

    def line(self) -> str:
        where = f"seed {self.seed}" if self.seed is not None else "launch"
        if self.op is not None:
            where += f" op {self.op}"
        if self.rank is not None:
            where += f" rank {self.rank}"
        return f"[{self.mode} {self.layout[0]}x{self.layout[1]}] {where}: {self.what}: {self.detail}"


def _error_text(e: dict[str, Any]) -> str:
    return f"{e['type']}: {e['message'][:240]} (after {e['seconds']:.2f} s, at {e['where']})"


def compare(reference: Launch, candidate: Launch, notes: list[str] | None = None) -> list[Divergence]:
    """The candidate launch's divergences from the gloo launch of the same programs (module docstring)."""
    notes = candidate.notes if notes is None else notes
    out: list[Divergence] = []
    for index, entry in enumerate(candidate.programs):
        out += compare_program(reference, candidate, index, entry["seed"], notes)
    for rank in candidate.ranks:  # a launch that ended early: said once, where it ended
        if rank.status != "done" and not rank.status.startswith("hung"):
            missing = [e["seed"] for i, e in enumerate(candidate.programs) if i not in rank.programs]
            out.append(Divergence(candidate.mode, candidate.layout, missing[0] if missing else None, None, rank.rank,
                                  "launch ended", f"{rank.status} (exit {rank.returncode}); {len(missing)} programs "
                                  f"not run; stderr: {rank.stderr[-1500:]}"))
    out += compare_leftovers(reference, candidate)
    for rank in candidate.ranks:
        for group in (rank.summary or {}).get("groups", []):
            if "all_gather" in group["keep_on_gloo"] and group["gather_lane"]:
                out.append(Divergence(candidate.mode, candidate.layout, None, None, rank.rank, "keep_on_gloo",
                                      "keep_on_gloo names all_gather, yet the process group set up a gather lane"))
                break
    return out


def compare_program(reference: Launch, candidate: Launch, index: int, seed: int, notes: list[str]
                    ) -> list[Divergence]:
    program = candidate.program(index)
    world = program.world
    out: list[Divergence] = []

    def div(op: int | None, rank: int | None, what: str, detail: str) -> None:
        out.append(Divergence(candidate.mode, candidate.layout, seed, op, rank, what, detail,
                              candidate.programs[index].get("keep"), env=candidate.env))

    refs = [reference.result(r, seed) for r in range(world)]
    cands = [candidate.ranks[r].programs.get(index) for r in range(world)]
    for r in range(world):
        if refs[r] is None:
            notes.append(f"seed {seed}: the gloo run has no result of rank {r} ({reference.ranks[r].status})")
            return out
        if cands[r] is None and candidate.ranks[r].status == "done":
            div(None, r, "no result", f"rank {r} wrote none for this program; stderr: "
                                      f"{candidate.ranks[r].stderr[-1500:]}")
    if any(c is None for c in cands):
        return out
    for r in range(world):
        if cands[r]["stopped"] == "hung":  # the watchdog ended it: its status says where
            status = candidate.ranks[r].status
            match = re.search(r"op (\d+) \(", status)
            div(int(match.group(1)) if match else None, r, "hang",
                f"{status} (past the process group's timeout {candidate.timeout:g} s + {SLACK:g} s); the stacks' "
                f"end: {candidate.ranks[r].stderr[-2500:]}")
    for r in range(world):
        slowest = max(cands[r].get("destroy_seconds", []), default=0.0)
        if slowest > SLACK:  # gloo's destroy_process_group of a subgroup is local: milliseconds
            div(None, r, "slow destroy", f"destroy_process_group of a subgroup took {slowest:.1f} s on rank {r} "
                                         f"(gloo's: {max(refs[r].get('destroy_seconds', []), default=0.0):.2f} s)")
        for e in cands[r].get("destroy_errors", []):
            div(None, r, "destroy raises", f"destroy_process_group of a subgroup raised {_error_text(e)}")
    for r in range(world):
        if refs[r]["stopped"] is not None:
            notes.append(f"seed {seed}: the gloo run stopped at op {refs[r]['stopped']} on rank {r}: "
                         f"{refs[r]['records'][refs[r]['stopped']].get('error')}")
    for op in program.ops:
        for r in range(world):
            rr, cr = refs[r]["records"].get(op.id), cands[r]["records"].get(op.id)
            if rr is None:
                continue  # the reference never got there
            if cr is None:
                continue  # it stopped earlier (an error, reported there) or hung (below)
            _compare_op(program, op, r, rr, cr, refs, cands, div, notes, candidate.mode)
        _compare_among_ranks(program, op, cands, div)
    return out


def _compare_op(program: Program, op: Op, r: int, rr: dict[str, Any], cr: dict[str, Any], refs: list, cands: list,
                div: Any, notes: list[str], mode: str) -> None:
    rerr, cerr = rr.get("error"), cr.get("error")
    if rr["status"] == "skip" and cr["status"] == "skip":
        return
    if op.kind == "wait":
        return  # a wait's errors are its works' own, compared there
    if rerr is not None and cerr is not None:
        if family(rerr) != family(cerr):
            div(op.id, r, "error-family", f"gloo raised {_error_text(rerr)}; passing raised {_error_text(cerr)}")
        return
    if rerr is not None:
        div(op.id, r, "no-error", f"gloo raises {_error_text(rerr)}; passing completed")
        return
    if cerr is not None:
        div(op.id, r, "raises", f"passing raised {_error_text(cerr)}; gloo completed")
        return
    if rr["status"] != cr["status"]:
        div(op.id, r, "status", f"gloo: {rr['status']}, passing: {cr['status']}")
        return
    if op.args.get("async") and ("completed" not in rr or "completed" not in cr):
        return  # issued, never waited: its program stopped first (an error, reported where it happened)
    if "objects" in rr and rr["objects"] != cr.get("objects"):
        div(op.id, r, "value", f"objects differ: gloo {_short(rr['objects'])}, passing {_short(cr.get('objects'))}")
    members = group_members(program, op.args.get("group", "world"), r) or []
    expected = independent(program, op, r, members)
    want = dict(rr["values"])  # what the candidate must hold: gloo's outputs, or the expectation
    for name, value in expected.items():
        if name in want and not _matches(op, name, want[name], value, members, refs, computed=True):
            notes.append(f"seed {program.seed} op {op.id} rank {r}: gloo's {name} is wrong (a known gloo "
                         f"bug with a view that is not dense: {op.args[_spec_key(op)].get('view')})")
        want[name] = value
    for name in sorted(set(want) | set(cr["values"])):
        a, b = cr["values"].get(name), want.get(name)
        if a is None or b is None:
            div(op.id, r, "value", f"output {name} recorded by {'gloo' if a is None else 'passing'} only")
            continue
        if not _matches(op, name, a, b, members, refs, computed=name in expected):
            div(op.id, r, "value", f"{name}: {_value_diff(a, b)}"
                                   + (" (the expectation computed from the inputs)" if name in expected else ""))
    _compare_aux(op, r, rr, cr, members, refs, div, notes, want, expected)


def _spec_key(op: Op) -> str:
    return "tensor" if "tensor" in op.args else "output"


def _matches(op: Op, name: str, got: dict[str, Any], want: dict[str, Any], members: list[int], refs: list,
             computed: bool = False) -> bool:
    """Whether output ``name`` agrees with ``want``: gloo's, or (``computed``) the expectation computed
    from the inputs, whose sum of floats that are not integers is in another order: the dtype's
    rounding of n terms of at most absmax stands in for gloo's bits there."""
    absmax = max((refs[m]["records"][op.id].get("absmax", 0.0) for m in members), default=0.0)
    tol = tolerance(op, name, len(members), absmax)
    spec = op.args.get("tensor", op.args.get("input", {}))
    if computed and op.kind in ("all_reduce", "reduce_scatter") and op.args["op"] in ("SUM", "AVG") and \
            spec.get("values") != "int":
        n = len(members)
        rounding = (n + 1) * EPS.get(spec["dtype"], 0.0) * n * absmax
        tol = (max(tol[0], rounding), tol[1]) if tol is not None else (rounding, 2 * EPS.get(spec["dtype"], 0.0))
    if tol is None:
        return same_bits(got, want)
    return within(got, want, *tol)[0]


def _value_diff(got: dict[str, Any], want: dict[str, Any]) -> str:
    if (got["dtype"], tuple(got["shape"])) != (want["dtype"], tuple(want["shape"])):
        return f"passing {got['dtype']}{list(got['shape'])}, expected {want['dtype']}{list(want['shape'])}"
    x, y = decode(got).reshape(-1), decode(want).reshape(-1)
    if x.is_floating_point():
        bad = ((x != y) & ~(x.isnan() & y.isnan())) | (x.signbit() != y.signbit())
    else:
        bad = x != y
    idx = bad.nonzero().reshape(-1)
    if idx.numel() == 0:
        return "equal bits but outside the tolerance"  # (unreachable for exact compares)
    first = int(idx[0])
    worst = float((x.double() - y.double()).abs().nan_to_num(0.0).max()) if x.numel() else 0.0
    return (f"{idx.numel()} of {x.numel()} elements differ, first at flat index {first}: passing "
            f"{x[first].item()!r}, expected {y[first].item()!r}; largest |diff| {worst:.6g}; "
            f"passing[:6]={x[:6].tolist()} expected[:6]={y[:6].tolist()}")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) < 200 else text[:200] + "..."


def _flat(recs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A future's value as one record: every element of its tensors, sorted. Backends shape a value
    their own way (gloo's coalesced all_gather gives each rank's chunks of every output, passing the
    outputs; gloo's all_gather_into_tensor its chunks): what must agree is what it holds. Sorting keeps
    two values that agree element by element within a tolerance within it."""
    import torch

    if not recs:
        return None
    dtypes = {r["dtype"] for r in recs}
    if len(dtypes) != 1:
        return {"dtype": "mixed:" + ",".join(sorted(dtypes)), "shape": (len(recs),), "data": b""}
    flat = torch.cat([decode(r).reshape(-1) for r in recs])
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    return trec(flat.sort().values)


def _compare_aux(op: Op, r: int, rr: dict[str, Any], cr: dict[str, Any], members: list[int], refs: list,
                 div: Any, notes: list[str], want: dict[str, Any], expected: dict[str, Any]) -> None:
    """The extras: futures, then() callbacks, reads after a barrier, is_completed(). ``want``: the
    outputs the candidate must hold; ``expected``: those of them computed from the inputs."""
    ra, ca = dict(rr["aux"]), cr["aux"]
    if "tensor" in expected:  # the future holds the view: of the expectation, not of gloo's wrong answer
        view = trec(apply_view(decode(expected["tensor"]), op.args["tensor"]))
        for key in ("then_value", "future_value"):
            if key in ra:
                ra[key] = [view]
    if "get_future_error" in ca and "get_future_error" not in ra:
        div(op.id, r, "raises", f"get_future() raised {_error_text(ca['get_future_error'])}; gloo's work has one")
    elif "get_future_error" in ra and "get_future_error" not in ca:
        notes.append(f"{op.kind}: gloo's work has no future ({ra['get_future_error']['message'][:60]}), "
                     f"passing's has one")
    if "poll_error" in ca and "poll_error" not in ra:
        div(op.id, r, "raises", f"is_completed() raised {_error_text(ca['poll_error'])}")
    if ra.get("completed_after_wait") and ca.get("completed_after_wait") is False:
        div(op.id, r, "completion", "is_completed() is False after wait() returned")
    if ra.get("poll_saw_completion") and ca.get("poll_saw_completion") is False:
        div(op.id, r, "completion", "is_completed() polled for 3 s never said True (gloo's did)")
    for key in ("then_value", "future_value"):
        if key in ra and key in ca:
            got, want = _flat(ca[key]), _flat(ra[key])
            if (got is None) != (want is None) or (got is not None and not _matches_flat(op, got, want, members, refs)):
                what = "the value a then() callback saw" if key == "then_value" else "the future's value"
                div(op.id, r, "future", f"{what}: {_value_diff(got, want) if got and want else (got, want)}")
    for key in ("then_result", "then_second"):
        if key in ra and key in ca and ra[key] != ca[key]:
            div(op.id, r, "future", f"{key}: gloo {ra[key]!r}, passing {ca[key]!r}")
    if "after_barrier" in ra:
        got = ca.get("after_barrier", {})
        for name in ra["after_barrier"]:
            if name in got and name in want and not _matches(op, name, got[name], want[name], members, refs,
                                                             computed=name in expected):
                div(op.id, r, "barrier", f"{name} read right after barrier() (gloo's barrier waits for the group's "
                                         f"earlier works): {_value_diff(got[name], want[name])}")


def _matches_flat(op: Op, got: dict[str, Any], want: dict[str, Any], members: list[int], refs: list) -> bool:
    if got["dtype"] != want["dtype"] or math.prod(got["shape"]) != math.prod(want["shape"]):
        return False
    tol = tolerance(op, "tensor" if "tensor" in op.args else "output", len(members), max(
        (refs[m]["records"][op.id].get("absmax", 0.0) for m in members), default=0.0))
    return within(got, want, *tol)[0] if tol is not None else within(got, want, 0.0, 0.0)[0]


def independent(program: Program, op: Op, rank: int, members: list[int]) -> dict[str, dict[str, Any]]:
    """Expected outputs computed from the regenerated inputs, where gloo is known to be wrong: views
    that are not dense in all_reduce, broadcast and the list reduce_scatter (module docstring)."""

    if not members:
        return {}
    a = op.args
    if op.kind == "all_reduce" and not dense(a["tensor"]):
        return {"tensor": trec(expected_reduction(program, op, rank, members))}
    if op.kind == "broadcast" and not dense(a["tensor"]):
        src = members[a["src"]]
        base, view = make_tensor(program.seed, op.id, rank, a["tensor"])
        view.copy_(make_tensor(program.seed, op.id, src, a["tensor"])[1])
        return {"tensor": trec(base)}
    if op.kind == "reduce_scatter" and not dense(a["output"]) and a["op"] in ("SUM", "AVG", "MAX", "MIN"):
        import torch

        me = members.index(rank)
        parts = torch.stack([make_tensor(program.seed, op.id, q, a["input"], salt=2 + me)[1].double()
                             for q in members])
        reduced = {"SUM": parts.sum(0), "AVG": parts.sum(0) / len(members), "MAX": parts.amax(0),
                   "MIN": parts.amin(0)}[a["op"]]
        base, view = make_tensor(program.seed, op.id, rank, a["output"], salt=1)
        view.copy_(reduced.to(view.dtype))
        return {"output": trec(base)}
    return {}


def _compare_among_ranks(program: Program, op: Op, cands: list, div: Any) -> None:
    """A quantized all_reduce leaves the same bits on every rank of its group."""
    if op.kind != "all_reduce" or tolerance(op, "tensor", 2, 1.0) is None:
        return
    views: dict[tuple[int, ...], list[tuple[int, bytes]]] = {}
    for r, result in enumerate(cands):
        rec = result["records"].get(op.id)
        if rec is None or rec["status"] != "ok" or "tensor" not in rec["values"]:
            continue
        members = tuple(group_members(program, op.args["group"], r) or ())
        view = apply_view(decode(rec["values"]["tensor"]), op.args["tensor"])
        views.setdefault(members, []).append((r, trec(view)["data"]))
    for members, seen in views.items():
        if len({d for _, d in seen}) > 1:
            div(op.id, None, "ranks-disagree", f"the ranks of group {list(members)} hold different results of "
                                               f"one all_reduce (ranks {[r for r, _ in seen]})")


def _counts(left: dict[str, Any]) -> dict[str, int]:
    counts = {"threads": len(left["threads"]), "os-threads": left["tasks"], "shm-maps": len(left["maps"])}
    for fd in left["fds"]:
        kind = fd.split(" ", 1)[0]
        counts[f"fd:{kind}"] = counts.get(f"fd:{kind}", 0) + 1
    return counts


def compare_leftovers(reference: Launch, candidate: Launch) -> list[Divergence]:
    """After destroy_process_group: no more left behind than gloo leaves on the same rank (the most it
    leaves over the launch's init/destroy cycles), after each destroy of the candidate's. After the last
    one the rank still holds its last program's works, which reach the backend's connections (gloo's own
    too; passing has more of them: its peer groups'): sockets are compared once those are released."""
    out = []
    for rank in candidate.ranks:
        ref = reference.ranks[rank.rank].summary or {}
        summary = rank.summary or {}
        worst: dict[str, int] = {}
        for left in ref.get("leftovers", []):
            for k, v in _counts(left).items():
                worst[k] = max(worst.get(k, 0), v)
        lefts = summary.get("leftovers", [])
        released = "released" in summary and "released" in ref
        for i, left in enumerate(lefts):
            over = {k: v for k, v in _counts(left).items() if v > worst.get(k, 0)
                    and not (k == "fd:socket" and released and i == len(lefts) - 1)}
            if over:  # the first destroy that leaks says it, and how it grows over the launch's cycles
                growth = [{k: _counts(x).get(k, 0) for k in over} for x in lefts]
                out.append(Divergence(candidate.mode, candidate.layout, None, None, rank.rank, "leak",
                                      f"after destroy_process_group #{i + 1} of {len(lefts)}: {over}, where gloo "
                                      f"leaves at most { {k: worst.get(k, 0) for k in over} } (after each destroy: "
                                      f"{growth}); threads {left['threads']}, fds {left['fds'][:8]}, "
                                      f"maps {left['maps'][:4]}", env=candidate.env))
                break
        if released:
            gloo = _counts(ref["released"])
            left = summary["released"]
            over = {k: v for k, v in _counts(left).items() if v > gloo.get(k, 0)}
            if over:
                out.append(Divergence(candidate.mode, candidate.layout, None, None, rank.rank, "leak",
                                      f"once the last program's works are released: {over}, where gloo leaves "
                                      f"{ {k: gloo.get(k, 0) for k in over} }; threads {left['threads']}, fds "
                                      f"{left['fds'][:8]}, maps {left['maps'][:4]}", env=candidate.env))
    return out


# ---- faults -------------------------------------------------------------------------------------


def plan_faults(seed: int, count: int, layout: Layout, modes: Sequence[str] = MODES) -> list[dict[str, Any]]:
    """``count`` faults, the kinds in turn (raise, skip, kill; and the aggregator killed or stopped where
    mode "ps" runs), each at a collective of its program (``seed`` + i) that the struck rank takes
    part in, past the program's first third."""
    r = random.Random(seed)
    kinds = ("raise", "skip", "kill", "aggregator") if "ps" in modes else ("raise", "skip", "kill")
    faults: list[dict[str, Any]] = []
    j = 0  # the next program's seed is seed + j: one where the struck rank has no collective is passed over
    while len(faults) < count:
        i, j = len(faults), j + 1
        program = generate(seed + j - 1, layout, plain=True)
        kind = kinds[i % len(kinds)]
        rank = 0 if kind == "aggregator" else r.randrange(program.world)
        ops = [op for op in program.ops if op.kind not in ("wait", "poll", "new_group", "mesh", "reinit")
               and group_members(program, op.args["group"], rank) is not None]
        if not ops:
            continue
        # where PASSING's own stages are in the way, the others blocked in them (a call that waits)
        ops = [op for op in ops if streamed(op) and not op.args["async"]] or [op for op in ops if streamed(op)] or ops
        op = r.choice(ops[len(ops) // 3:] or ops)
        fault = {"kind": kind, "rank": rank, "seed": seed + j - 1, "op": op.id}
        if kind == "aggregator":
            fault["how"] = ("kill", "stop")[(i // len(kinds)) % 2]
        faults.append(fault)
    return faults


def streamed(op: Op) -> bool:
    """Whether PASSING's own stages (not gloo's) run ``op`` on the whole group: a float SUM/AVG all_reduce
    or reduce_scatter, an all_gather (docs/torch.md)."""
    a = op.args
    if a.get("group") != "world":
        return False
    if op.kind in ("all_reduce", "reduce_scatter_tensor", "reduce_scatter"):
        spec = a.get("tensor", a.get("input"))
        return a["op"] in ("SUM", "AVG") and spec["dtype"] in PASSING_FLOATS
    return op.kind in ("all_gather", "all_gather_into_tensor", "coalesced")


def parse_fault(text: str, seed: int) -> dict[str, Any]:
    """``raise:RANK:OP``, ``skip:RANK:OP``, ``kill:RANK:OP`` or ``aggregator:kill|stop:OP`` (the CLI's --fault)."""
    kind, who, op = text.split(":")
    if kind == "aggregator":
        return {"kind": kind, "rank": 0, "how": who, "seed": seed, "op": int(op)}
    return {"kind": kind, "rank": int(who), "seed": seed, "op": int(op)}


def fault_arg(fault: dict[str, Any]) -> str:
    who = fault["how"] if fault["kind"] == "aggregator" else fault["rank"]
    return f"{fault['kind']}:{who}:{fault['op']}"


def fault_bound(fault: dict[str, Any], timeout: float) -> float:
    """How long after a fault every other rank must have completed or raised (before SLACK)."""
    return FAILOVER_AFTER + 3.0 if fault["kind"] == "aggregator" else timeout


def compare_fault(reference: Launch | None, candidate: Launch, clean: Launch) -> list[Divergence]:
    """A fault launch against gloo: ``reference`` the same fault on gloo (None for an aggregator fault:
    gloo has none, and nobody raises), ``clean`` gloo's fault-free run of the program (the values)."""
    fault = candidate.fault
    assert fault is not None
    seed, program = fault["seed"], candidate.program(0)
    struck = fault.get("rank", 0) if fault["kind"] != "aggregator" else None
    bound = fault_bound(fault, candidate.timeout)
    out: list[Divergence] = []

    def div(op: int | None, rank: int | None, what: str, detail: str) -> None:
        out.append(Divergence(candidate.mode, candidate.layout, seed, op, rank, what,
                              f"{detail} [fault {_fault_text(fault)}]", fault=fault))

    moment = None
    source = candidate.ranks[struck if struck is not None else 0].programs.get(0)
    if source is not None:
        moment = source.get("fault_at")
    if moment is None:
        div(fault["op"], struck, "fault", f"the fault never struck: {candidate.ranks[struck or 0].status}")
        return out

    def raisers(launch: Launch | None) -> set[int]:
        if launch is None:
            return set()
        return {r for r in range(program.world) if r != struck and any(
            rec.get("error") for rec in (launch.ranks[r].programs.get(0) or {}).get("records", {}).values())}

    for r in range(program.world):
        if r == struck:
            continue
        outcome = candidate.ranks[r]
        result = outcome.programs.get(0)
        if outcome.status != "done" or result is None:
            if "hung" in outcome.status and reference is not None and reference.ranks[r].status == outcome.status:
                continue  # gloo waits there too: a DeviceMesh's groups get torch's 30-minute default timeout
            div(None, r, "hang" if "hung" in outcome.status else "no result",
                f"rank {r}: {outcome.status}; stderr: {outcome.stderr[-1200:]}")
            continue
        ended = result["ended"] or time.time()
        if ended - moment > bound + SLACK:
            div(None, r, "slow", f"rank {r} ended its program {ended - moment:.1f} s after the fault "
                                 f"(bound {bound:.0f} s + {SLACK:.0f} s)")
        clean_result = clean.result(r, seed)
        if clean_result is None:
            div(None, r, "no reference", f"gloo's fault-free run has no result of rank {r}: {clean.ranks[r].status}")
            continue
        clean_records = clean_result["records"]
        for op in program.ops:
            rec = result["records"].get(op.id)
            want = clean_records.get(op.id)
            if rec is None or want is None or rec["status"] != "ok" or want["status"] != "ok":
                if rec is not None and rec.get("error") and rec["error"]["at"] - moment > bound + SLACK:
                    div(op.id, r, "slow", f"raised {rec['error']['at'] - moment:.1f} s after the fault "
                                          f"(bound {bound:.0f} s + {SLACK:.0f} s): {_error_text(rec['error'])}")
                continue
            members = group_members(program, op.args.get("group", "world"), r) or []
            refs = [clean.result(m, seed) for m in range(program.world)]
            expected = independent(program, op, r, members)
            for name, got in rec["values"].items():
                w = expected.get(name, want["values"].get(name))
                if w is not None and not _matches(op, name, got, w, members, refs, computed=name in expected):
                    div(op.id, r, "wrong value", f"{name} after the fault: {_value_diff(got, w)}")
    gloo_raisers, passing_raisers = raisers(reference), raisers(candidate)
    if gloo_raisers != passing_raisers:
        div(None, None, "raising ranks", f"on gloo ranks {sorted(gloo_raisers)} raise, on passing "
                                         f"{sorted(passing_raisers)}")
    return out


def _fault_text(fault: dict[str, Any]) -> str:
    if fault["kind"] == "aggregator":
        return f"aggregator {fault['how']} when rank 0 reaches op {fault['op']}"
    return f"rank {fault['rank']} {fault['kind']} at op {fault['op']}"


# ---- reporting and shrinking --------------------------------------------------------------------


def replay_command(seed: int, mode: str, layout: Layout, fault: dict[str, Any] | None = None,
                   env: dict[str, str] | None = None) -> str:
    command = "".join(f"{k}={v} " for k, v in (env or {}).items())
    command += f"make fuzz-torch SEED={seed} MODE={mode} LAYOUT={layout[0]}x{layout[1]}"
    return command + (f" FAULT={fault_arg(fault)}" if fault is not None else "")


def record_json(divergences: list[Divergence], path: str, plain: bool = False) -> None:
    """Append each divergence to ``path`` as a JSON line, with its op as formatted (FUZZ_REPORT)."""
    with open(path, "a") as f:
        for d in divergences:
            op = None
            if d.seed is not None and d.op is not None:
                program = generate(d.seed, d.layout, plain=plain)
                op = format_op(program.op(d.op)) if any(o.id == d.op for o in program.ops) else None
            f.write(json.dumps({"mode": d.mode, "layout": f"{d.layout[0]}x{d.layout[1]}", "seed": d.seed, "op": d.op,
                                "rank": d.rank, "what": d.what, "detail": d.detail[:600], "formatted": op,
                                "replay": replay_command(d.seed, d.mode, d.layout, d.fault, d.env)
                                if d.seed is not None else None}) + "\n")


def report(divergences: list[Divergence], plain: bool = False) -> str:
    """Each diverging program once: its first divergence, the others listed, the program, the replay."""
    lines: list[str] = []
    by_program: dict[tuple[str, Layout, int | None], list[Divergence]] = {}
    for d in divergences:
        by_program.setdefault((d.mode, d.layout, d.seed), []).append(d)
    for (mode, layout, seed), found in by_program.items():
        found.sort(key=lambda d: (d.op if d.op is not None else 1 << 30, d.rank if d.rank is not None else -1))
        first = found[0]
        lines.append(f"DIVERGENCE {first.line()}")
        lines += [f"    also: {d.line()}" for d in found[1:8]]
        if len(found) > 8:
            lines.append(f"    ... and {len(found) - 8} more")
        if seed is not None:
            program = generate(seed, layout, plain=plain)
            if first.keep is not None:
                program = program.keeping(set(first.keep))
            lines.append(format(program))
            lines.append(f"replay: {replay_command(seed, mode, layout, first.fault, first.env)}")
    return "\n".join(lines)


def shrink(reference: Launch, divergence: Divergence, budget: float) -> Program | None:
    """A smaller program of the divergence's seed that still diverges the same way (the same kind, at the
    same op): first cut after the diverging op (after the barrier that reads it, for a read after a
    barrier), then drop earlier ops, halves first, then smaller pieces, while it still does, within
    ``budget`` seconds. The gloo launch's records stand in for a reference of every smaller program
    (an op's inputs depend on the seed, its id and the rank alone)."""
    if divergence.seed is None or divergence.op is None:
        return None
    deadline = time.monotonic() + budget
    full = generate(divergence.seed, divergence.layout, plain=reference.plain)
    ref = _as_single(reference, divergence.seed)

    def still(keep: list[int]) -> bool:
        if time.monotonic() > deadline:
            return False
        cand = run_launch(divergence.mode, [{"seed": divergence.seed, "keep": keep}], divergence.layout,
                          plain=reference.plain, env=divergence.env)
        found = compare_program(ref, cand, 0, divergence.seed, [])
        return any(d.what == divergence.what and d.op == divergence.op for d in found)

    last = divergence.op
    if divergence.what == "barrier":
        last = next((o.id for o in full.ops if o.kind == "barrier" and divergence.op in o.args.get("read", [])), last)
    keep = [op.id for op in full.ops if op.id <= last]
    if len(keep) < len(full.ops) and not still(keep):
        keep = [op.id for op in full.ops]
    needed = {divergence.op, last}
    chunk = max(1, len(keep) // 2)
    while chunk >= 1 and time.monotonic() < deadline:
        removable = [i for i in keep if i not in needed and not _used(full, i, keep)]
        for start in range(0, len(removable), chunk):
            trial = [i for i in keep if i not in removable[start:start + chunk]]
            if trial != keep and not any(_used(full, i, trial) for i in set(keep) - set(trial)) and still(trial):
                keep = trial
        chunk //= 2
    return full.keeping(set(keep))


def _used(program: Program, op_id: int, keep: list[int]) -> bool:
    """Whether op ``op_id`` makes a group that a kept op still uses."""
    op = program.op(op_id)
    if op.kind not in ("new_group", "mesh"):
        return False
    return any(o.args.get("group", "").startswith((f"g{op_id}", f"m{op_id}.")) and o.args.get("group") in (
        f"g{op_id}", f"m{op_id}.0", f"m{op_id}.1") for o in program.ops if o.id in keep and o.id != op_id)


def _as_single(launch: Launch, seed: int) -> Launch:
    """The launch seen as one of the program of ``seed`` alone (program index 0)."""
    index = next(i for i, e in enumerate(launch.programs) if e["seed"] == seed)
    ranks = [RankOutcome(r.rank, r.returncode, r.summary, {0: r.programs[index]} if index in r.programs else {},
                         r.stderr) for r in launch.ranks]
    return Launch(launch.mode, launch.layout, [launch.programs[index]], launch.fault, launch.plain, launch.timeout,
                  ranks, launch.seconds)


# ---- campaigns ----------------------------------------------------------------------------------


def differential(seeds: Sequence[int], layout: Layout, modes: Sequence[str] = MODES, log: Any = print,
                 reference: Launch | None = None) -> tuple[Launch, list[Divergence], list[Launch]]:
    """gloo's launch of ``seeds`` (unless given), each mode's, and their divergences."""
    if reference is None:
        reference = run_launch("gloo", seeds, layout)
        log(f"gloo {layout[0]}x{layout[1]}: {len(seeds)} programs in {reference.seconds:.1f} s")
        for problem in check_reference(reference):
            log(f"note: {problem}")
    found: list[Divergence] = []
    launches = []
    for mode in modes:
        cand = run_launch(mode, seeds, layout)
        launches.append(cand)
        divs = compare(reference, cand)
        log(f"{mode} {layout[0]}x{layout[1]}: {len(seeds)} programs in {cand.seconds:.1f} s, "
            f"{len(divs)} divergences, {len(set(cand.notes))} notes")
        found += divs
    return reference, found, launches


def check_reference(reference: Launch) -> list[str]:
    """The gloo launch itself: every rank done, and every all_reduce of integer values over a dense view
    (AVG included) as computed from the inputs. A problem here is the fuzzer's own (or gloo's): it is
    no divergence of passing, and a launch with one is no reference."""

    problems = [f"gloo rank {r.rank}: {r.status}\n{r.stderr[-2000:]}" for r in reference.ranks if r.status != "done"]
    for index, entry in enumerate(reference.programs):
        program = reference.program(index)
        for op in program.ops:
            spec = op.args.get("tensor", {})
            if op.kind != "all_reduce" or not dense(spec) or spec.get("values") != "int":
                continue
            for rank in range(program.world):
                result = reference.ranks[rank].programs.get(index)
                rec = result and result["records"].get(op.id)
                if not rec or rec["status"] != "ok" or "tensor" not in rec["values"]:
                    continue
                members = group_members(program, op.args["group"], rank) or []
                want = trec(expected_reduction(program, op, rank, members))
                last_place = op.args["op"] == "AVG" and len(members) & (len(members) - 1) != 0
                ok = within(rec["values"]["tensor"], want, 0.0, 2 * EPS[spec["dtype"]])[0] if last_place \
                    else same_bits(rec["values"]["tensor"], want)
                if not ok:
                    problems.append(f"gloo seed {entry['seed']} op {op.id} rank {rank}: {op.args['op']} is not what "
                                    f"the inputs give: {_value_diff(rec['values']['tensor'], want)}")
    return problems


def faults_campaign(seed: int, count: int, layout: Layout, modes: Sequence[str] = MODES, log: Any = print
                    ) -> tuple[list[Divergence], int]:
    """``count`` planned faults, each on gloo (rank faults) and on every mode that has it; returns the
    divergences and how many fault launches of passing ran."""
    faults = plan_faults(seed, count, layout, modes)
    clean = run_launch("gloo", sorted({f["seed"] for f in faults}), layout, plain=True)
    found: list[Divergence] = []
    launched = 0
    for fault in faults:
        gloo = None if fault["kind"] == "aggregator" else run_launch("gloo", [fault["seed"]], layout, fault)
        for mode in modes:
            if fault["kind"] == "aggregator" and mode != "ps":
                continue
            cand = run_launch(mode, [fault["seed"]], layout, fault)
            launched += 1
            divs = compare_fault(gloo, cand, clean)
            log(f"fault {_fault_text(fault)} seed {fault['seed']} {mode}: {cand.seconds:.1f} s, "
                f"{len(divs)} divergences")
            found += divs
    return found, launched


# ---- the CLI (make fuzz-torch) ------------------------------------------------------------------


def replay_fault(fault: dict[str, Any], layout: Layout, modes: Sequence[str]) -> int:
    clean = run_launch("gloo", [fault["seed"]], layout, plain=True)
    print(format(clean.program(0)), flush=True)
    gloo = None if fault["kind"] == "aggregator" else run_launch("gloo", [fault["seed"]], layout, fault)
    found = []
    for mode in modes:
        if fault["kind"] == "aggregator" and mode != "ps":
            continue
        cand = run_launch(mode, [fault["seed"]], layout, fault)
        divs = compare_fault(gloo, cand, clean)
        print(f"fault {_fault_text(fault)} {mode}: {cand.seconds:.1f} s, {len(divs)} divergences", flush=True)
        found += divs
    if found:
        print(report(found, plain=True), flush=True)
    return 1 if found else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.differential.oracle",
                                     description="passing vs gloo: random torch.distributed programs")
    parser.add_argument("--seed", type=int, default=None, help="the first program's seed (default: random)")
    parser.add_argument("--mode", default="all", help="ring, embedded, ps, or all")
    parser.add_argument("--layout", default="2x2", help="servers x ranks per server")
    parser.add_argument("--programs", type=int, default=1, help="programs per launch")
    parser.add_argument("--duration", type=float, default=0.0, help="soak: new seeds until this many seconds passed")
    parser.add_argument("--faults", type=int, default=0, help="fault launches to run too")
    parser.add_argument("--fault", default="", help="replay a fault: raise|skip|kill:RANK:OP, aggregator:kill|stop:OP")
    parser.add_argument("--shrink", type=float, default=120.0, help="seconds to spend shrinking a divergence")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    modes = MODES if args.mode == "all" else tuple(args.mode.split(","))
    layout = tuple(int(x) for x in args.layout.split("x"))
    print(f"fuzz-torch: seed {seed}, modes {','.join(modes)}, layout {args.layout}", flush=True)
    start = time.monotonic()
    total: list[Divergence] = []
    if args.fault:
        return replay_fault(parse_fault(args.fault, seed), layout, modes)
    while True:
        seeds = list(range(seed, seed + args.programs))
        reference, found, _ = differential(seeds, layout, modes, log=lambda m: print(m, flush=True))
        total += found
        if found:
            print(report(found), flush=True)
            first = min(found, key=lambda d: (d.seed if d.seed is not None else 1 << 62, d.op or 0))
            if args.shrink > 0 and first.op is not None:
                small = shrink(reference, first, args.shrink)
                if small is not None:
                    print(f"shrunk ({first.what} at op {first.op} in mode {first.mode}):\n{format(small)}", flush=True)
        seed += args.programs
        if time.monotonic() - start >= args.duration:
            break
    if args.faults:
        found, _ = faults_campaign(seed, args.faults, layout, modes, log=lambda m: print(m, flush=True))
        total += found
        if found:
            print(report(found, plain=True), flush=True)
    print(f"fuzz-torch: {len(total)} divergences in {time.monotonic() - start:.0f} s", flush=True)
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
