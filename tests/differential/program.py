"""Random programs of torch.distributed collectives, the same on every rank.

``generate(seed, layout)`` makes a ``Program``: a list of ``Op`` from ``random.Random(seed)`` alone,
so every rank (and the driver, which regenerates programs to format, shrink and check them) builds
the very same one. ``layout`` is (servers, ranks per server), torchrun's numbering: rank r is local
rank r % ranks of server r // ranks.

An op's tensors come from ``make_tensor(seed, op id, rank, spec)``: a torch generator seeded by the
program's seed, the op's id and the rank, so the driver can regenerate every rank's inputs and
compute an expected value on its own (``expected_reduction``), where gloo itself is known to be
wrong (strided views: gloo sums or copies the storage as if it were contiguous).

Values are mostly small integers held in float tensors ("int"): sums of those are exact in any
order and through a power-of-two quantization scale, so results must be gloo's bits. Some are
normal floats ("normal", "special": with NaN, infinities and -0.0): their SUM/AVG through PASSING
is compared within the quantization bound (oracle.py).

Op kinds (``Op.args["group"]``: "world", "g<id>" a ``new_group`` made by op <id>, "m<id>.<dim>" a
dimension of the 2-D device mesh op <id> made; only members issue an op on a group):

- collectives: all_reduce, all_reduce_coalesced, reduce_scatter_tensor, reduce_scatter (list),
  all_gather (list), all_gather_into_tensor, coalesced (``_coalescing_manager`` around
  all_gather_into_tensor / reduce_scatter_tensor / all_reduce, as FSDP calls them), broadcast,
  reduce, gather, scatter, all_to_all, all_to_all_single, barrier (``read``: the pending works of
  its group whose outputs are recorded right after it, before their wait), the object
  collectives; ``async`` ones are waited later by a ``wait`` op, by style: ``wait()``,
  ``get_future().wait()``, a ``then`` chain, ``is_completed()`` polls, or first read after a
  barrier;
- ``wait`` (works waited in an order of each rank's own), ``poll`` (``is_completed()`` of pending
  works, nothing recorded: the answer depends on timing);
- ``invalid``: calls that gloo refuses on every rank at call time, the same way on each;
- structure: ``reinit`` (destroy_process_group and init_process_group again: only first),
  ``new_group``, ``mesh`` (init_device_mesh("cpu", shape)).

Subgroups have the same number of ranks on every server they span: PASSING refuses others with
OptionError by design (docs/torch.md, Limits), which is no divergence to report.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from typing import Any

Layout = tuple[int, int]  # (servers, ranks per server)

FLOATS = ("float32", "float16", "bfloat16", "float64")
INTS = ("int32", "int64", "uint8")
PASSING_FLOATS = ("float32", "float16", "bfloat16")  # what PASSING streams itself (SUM, AVG)
REDUCE_OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")
BITWISE = ("BAND", "BOR", "BXOR")
WAIT_STYLES = ("wait", "future", "then", "poll", "barrier")


@dataclass(frozen=True)
class Op:
    id: int  # stable under shrinking: inputs are seeded by it
    kind: str
    args: dict[str, Any] = field(default_factory=dict)


@dataclass
class Program:
    seed: int
    layout: Layout
    ops: list[Op]

    @property
    def world(self) -> int:
        return self.layout[0] * self.layout[1]

    def op(self, op_id: int) -> Op:
        return next(o for o in self.ops if o.id == op_id)

    def keeping(self, ids: set[int]) -> Program:
        """The program with only the ops whose ids are in ``ids`` (shrinking)."""
        return replace(self, ops=[o for o in self.ops if o.id in ids])


# ---- groups ---------------------------------------------------------------------------------------


def group_members(program: Program, ref: str, rank: int) -> list[int] | None:
    """The global ranks of the group ``ref`` that ``rank`` is in (sorted), or None: not a member."""
    if ref == "world":
        return list(range(program.world))
    if ref.startswith("g"):
        ranks = program.op(int(ref[1:])).args["ranks"]
        return list(ranks) if rank in ranks else None
    op_id, dim = ref[1:].split(".")
    a, b = program.op(int(op_id)).args["shape"]
    if dim == "0":  # mesh = arange(world).view(a, b): dim 0 groups are its columns
        return [i * b + rank % b for i in range(a)]
    return [rank // b * b + j for j in range(b)]


def group_size(program: Program, ref: str) -> int:
    """The size of every group of ``ref`` (a mesh dimension's groups all have the same)."""
    if ref == "world":
        return program.world
    if ref.startswith("g"):
        return len(program.op(int(ref[1:])).args["ranks"])
    op_id, dim = ref[1:].split(".")
    return program.op(int(op_id)).args["shape"][int(dim)]


# ---- tensors ---------------------------------------------------------------------------------------


def _mix(*parts: int) -> int:
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = (h ^ (p & 0xFFFFFFFFFFFFFFFF)) * 0x100000001B3 & 0xFFFFFFFFFFFFFFFF
    return h & 0x7FFFFFFFFFFFFFFF


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def make_tensor(seed: int, op_id: int, rank: int, spec: dict[str, Any], salt: int = 0) -> tuple[Any, Any]:
    """(base, view) of tensor ``spec`` for ``rank``: ``view`` is what the collective gets, ``base``
    the storage around it (the same tensor for a contiguous spec), recorded whole so that a write
    outside the view shows. Every element of the base is seeded, padding included."""
    import torch

    dtype = getattr(torch, spec["dtype"])
    shape = list(spec["shape"])
    view_kind = spec.get("view", "contig")
    n = _numel(shape)
    if view_kind == "offset":
        before, after = spec["pad"]
        total = before + n + after
    elif view_kind == "step":
        total = spec["pad"][0] + n * spec["step"]
    elif view_kind == "slice2d":
        total = shape[0] * (shape[1] + 2)
    else:
        total = n
    g = torch.Generator().manual_seed(_mix(seed, op_id, rank, salt))
    values = spec.get("values", "int")
    if spec["dtype"] == "bool":
        flat = torch.randint(0, 2, (total,), generator=g).bool()
    elif values == "int":
        lo, hi = spec["range"]
        flat = torch.randint(lo, hi + 1, (total,), generator=g, dtype=torch.int64).to(dtype)
    else:
        flat = torch.randn(total, generator=g, dtype=torch.float64) * spec.get("scale", 1.0)
        if values == "special" and total:
            picks = torch.randint(0, total, (max(1, total // 50),), generator=g)
            kinds = torch.randint(0, 4, (picks.numel(),), generator=g)
            for p, k in zip(picks.tolist(), kinds.tolist(), strict=True):
                flat[p] = (float("nan"), float("inf"), float("-inf"), -0.0)[k]
        flat = flat.to(dtype)
    base = flat.view(shape) if view_kind == "contig" else flat
    if view_kind == "transpose":  # shape is the view's: the base is its transpose, contiguous
        base = flat.view(shape[1], shape[0])
    elif view_kind == "slice2d":  # rows of a wider matrix: neither contiguous nor dense
        base = flat.view(shape[0], shape[1] + 2)
    return base, apply_view(base, spec)


def apply_view(base: Any, spec: dict[str, Any]) -> Any:
    """The view of ``spec`` into its base tensor (make_tensor's, or one decoded from a record)."""
    shape = list(spec["shape"])
    view_kind = spec.get("view", "contig")
    if view_kind == "contig":
        return base.view(shape)
    if view_kind == "offset":
        before = spec["pad"][0]
        return base[before:before + _numel(shape)].view(shape)
    if view_kind == "step":
        return base[spec["pad"][0]::spec["step"]][:_numel(shape)]
    if view_kind == "transpose":
        return base.t()
    if view_kind == "slice2d":
        return base[:, 1:shape[1] + 1]
    raise ValueError(f"unknown view {view_kind}")


def trec(t: Any) -> dict[str, Any]:
    """A tensor as recorded: dtype, shape and its elements' bytes (row-major)."""
    import torch

    c = torch.empty(t.shape, dtype=t.dtype).copy_(t.detach())  # a one-element view with a step is "contiguous"
    return {"dtype": str(c.dtype).removeprefix("torch."), "shape": tuple(c.shape),
            "data": c.reshape(-1).view(torch.uint8).numpy().tobytes() if c.numel() else b""}


def dense(spec: dict[str, Any]) -> bool:
    """Whether a view covers its own storage without gaps (gloo handles those right)."""
    return spec.get("view", "contig") in ("contig", "offset", "transpose")


def expected_reduction(program: Program, op: Op, rank: int, members: list[int]) -> Any:
    """The base tensor ``rank`` should hold after all_reduce ``op`` among ``members``, computed from
    every member's regenerated input, independently of any backend: the view's elements reduced
    (in float64/int64, exact for integer values), the rest of the base untouched."""
    import torch

    spec = op.args["tensor"]
    views = [make_tensor(program.seed, op.id, r, spec)[1] for r in members]
    name = op.args["op"]
    wide = torch.float64 if views[0].is_floating_point() else torch.int64
    stack = torch.stack([v.to(wide) for v in views]) if views[0].dtype != torch.bool else torch.stack(views)
    if name in ("SUM", "AVG"):
        out = stack.sum(0) if stack.dtype != torch.bool else stack.any(0)
        if name == "AVG":
            out = out / len(members)
    elif name == "PRODUCT":
        out = stack.prod(0) if stack.dtype != torch.bool else stack.all(0)
    elif name == "MIN":
        out = stack.amin(0) if stack.dtype != torch.bool else stack.all(0)
    elif name == "MAX":
        out = stack.amax(0) if stack.dtype != torch.bool else stack.any(0)
    else:
        out = stack[0].clone()
        for v in stack[1:]:
            out = {"BAND": out & v, "BOR": out | v, "BXOR": out ^ v}[name]
    base, view = make_tensor(program.seed, op.id, rank, spec)
    view.copy_(out.to(view.dtype))
    return base


# ---- generation ------------------------------------------------------------------------------------


class _Gen:
    """The state of one program's generation."""

    def __init__(self, seed: int, layout: Layout, plain: bool) -> None:
        self.r = random.Random(seed)
        self.seed, self.layout, self.plain = seed, layout, plain
        self.world = layout[0] * layout[1]
        self.ops: list[Op] = []
        self.groups: list[str] = ["world"]
        self.pending: list[tuple[int, str, str]] = []  # (work id, group, wait style) not waited yet

    def add(self, kind: str, **args: Any) -> Op:
        op = Op(len(self.ops), kind, args)
        self.ops.append(op)
        return op

    def program(self) -> Program:
        return Program(self.seed, self.layout, self.ops)

    # -- shapes and tensors --

    def numel(self) -> int:
        u = self.r.random()
        if u < 0.45:
            return self.r.randint(1, 64)
        if u < 0.8:
            return self.r.randint(65, 4096) | 1  # odd sizes: chunks that do not split evenly
        if u < 0.95:
            return self.r.randint(4097, 30_000)
        return self.r.randint(30_001, 100_000)

    def shape(self) -> list[int]:
        u = self.r.random()
        if u < 0.07:
            return []  # 0-dim
        if u < 0.12:
            return self.r.choice([[0], [3, 0], [0, 5]])
        n = self.numel()
        if self.r.random() < 0.25 and n > 4:
            for d in (2, 3, 5, 7, 4):
                if n % d == 0:
                    return [n // d, d]
        return [n]

    def values(self, dtype: str, op: str, spec: dict[str, Any]) -> None:
        """Fill ``spec``'s values: integers in a range whose reduction stays exact and in range."""
        if dtype == "bool":
            spec["values"] = "int"
            return
        if dtype in FLOATS and op in ("SUM", "AVG", "MIN", "MAX", "COPY") and self.r.random() < 0.22:
            # NaN and infinities only where IEEE says what comes out (MIN/MAX of a NaN is the order's)
            spec["values"] = "special" if op in ("SUM", "AVG", "COPY") and self.r.random() < 0.15 else "normal"
            spec["scale"] = self.r.choice([1e-3, 0.5, 1.0, 30.0, 1e3])
            return
        spec["values"] = "int"
        if op == "PRODUCT":
            spec["range"] = [0, 3] if dtype == "uint8" else [-2, 2]
        elif op in BITWISE:
            spec["range"] = [0, 255] if dtype == "uint8" else [-(1 << 20), 1 << 20]
        elif dtype == "uint8":
            spec["range"] = [0, 40]
        elif op in ("MIN", "MAX", "COPY", "OUT"):
            spec["range"] = [-100, 100] if dtype != "uint8" else [0, 255]
        else:
            spec["range"] = [-8, 8]

    def tensor(self, dtype: str, shape: list[int], op: str = "COPY", views: tuple[str, ...] = ("contig",)
               ) -> dict[str, Any]:
        """A tensor spec of ``dtype`` and ``shape`` with one of ``views`` (each only where the shape allows)."""
        spec: dict[str, Any] = {"dtype": dtype, "shape": list(shape)}
        view = self.r.choice(views) if self.r.random() < 0.45 else "contig"
        if view == "step" and len(shape) != 1:
            view = "offset"
        if view in ("transpose", "slice2d") and (len(shape) != 2 or _numel(shape) == 0):
            view = "offset"
        spec["view"] = view
        if view == "offset":
            spec["pad"] = [self.r.randint(0, 9), self.r.randint(0, 9)]
        elif view == "step":
            spec["pad"] = [self.r.randint(0, 3)]
            spec["step"] = self.r.randint(2, 3)
        self.values(dtype, op, spec)
        return spec

    def dtype(self, op: str) -> str:
        if op in BITWISE:
            return self.r.choice(("int32", "int64", "uint8", "bool"))
        if op == "AVG":
            return self.r.choices(FLOATS, weights=(6, 2, 2, 1))[0]
        return self.r.choices((*FLOATS, *INTS, "bool"), weights=(12, 2, 2, 2, 1, 2, 1, 1))[0]

    def reduce_op(self, dtype: str | None = None) -> str:
        if dtype in INTS or dtype == "bool":
            return self.r.choice(("SUM", "PRODUCT", "MIN", "MAX", *BITWISE))
        return self.r.choices(REDUCE_OPS, weights=(10, 5, 1, 2, 2, 1, 1, 1))[0]

    # -- groups and asynchrony --

    def group(self) -> str:
        if len(self.groups) == 1 or self.r.random() < 0.6:
            return "world"
        return self.r.choice(self.groups[1:])

    def size(self, ref: str) -> int:
        return group_size(self.program(), ref)

    def asynchrony(self, poll: bool = True) -> dict[str, Any]:
        """Sync, or async with a wait style; ``poll``: whether is_completed() polls may wait it (gloo's
        reduce_scatter works never say they completed: a poll would only time out)."""
        if self.r.random() < 0.45:
            return {"async": False}
        style = self.r.choices(WAIT_STYLES, weights=(7, 4, 3, 2 if poll else 0, 4))[0]
        return {"async": True, "wait": style, "then": self.r.randint(1, 2) if style == "then" else 0}

    def issued(self, op: Op) -> None:
        if op.args.get("async"):
            self.pending.append((op.id, op.args["group"], op.args["wait"]))

    def maybe_wait(self) -> None:
        """Now and then: wait some pending works (not the ones a barrier is to read first), or poll them."""
        waitable = [p for p in self.pending if p[2] != "barrier"]
        if waitable and self.r.random() < 0.3:
            chosen = self.r.sample(waitable, self.r.randint(1, len(waitable)))
            self.add("wait", works=[w for w, _, _ in chosen])
            self.pending = [p for p in self.pending if p not in chosen]
        elif self.pending and self.r.random() < 0.1:
            self.add("poll", works=[w for w, _, _ in self.pending])

    # -- ops --

    def structure(self) -> None:
        servers, ranks = self.layout
        if not self.plain and self.r.random() < 0.06:
            self.add("reinit")
        for _ in range(self.r.choice((0, 0, 0, 1, 1, 2))):
            chosen = sorted(self.r.sample(range(servers), self.r.randint(1, servers)))
            per = self.r.randint(1, ranks)
            members = sorted(s * ranks + j for s in chosen for j in self.r.sample(range(ranks), per))
            op = self.add("new_group", ranks=members)
            self.groups.append(f"g{op.id}")
        if self.world > 1 and self.r.random() < 0.15:
            shapes = [(a, self.world // a) for a in range(1, self.world + 1) if self.world % a == 0]
            op = self.add("mesh", shape=list(self.r.choice(shapes)))
            self.groups += [f"m{op.id}.0", f"m{op.id}.1"]

    def collective(self) -> None:
        kinds = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter", "all_gather", "all_gather_into_tensor",
                 "coalesced", "all_reduce_coalesced", "broadcast", "reduce", "gather", "scatter", "all_to_all",
                 "all_to_all_single", "barrier", "objects", "invalid")
        weights = (30, 10, 4, 6, 9, 6, 2, 6, 2, 2, 2, 2, 3, 5, 4, 0 if self.plain else 4)
        kind = self.r.choices(kinds, weights=weights)[0]
        ref = self.group()
        n = self.size(ref)
        getattr(self, f"op_{kind}")(ref, n)

    def op_all_reduce(self, ref: str, n: int) -> None:
        op = self.reduce_op()
        dtype = self.dtype(op)
        if dtype in INTS or dtype == "bool":
            op = self.reduce_op(dtype)
        views = ("offset", "step", "transpose", "slice2d")
        self.issued(self.add("all_reduce", group=ref, op=op, tensor=self.tensor(dtype, self.shape(), op, views),
                             **self.asynchrony()))

    def chunk(self) -> list[int]:
        """The per-rank part of a reduce_scatter_tensor / all_gather_into_tensor: split along dim 0."""
        k = 0 if self.r.random() < 0.04 else max(1, self.numel() // max(1, self.world))
        return [k] if self.r.random() < 0.8 else [k, self.r.choice((2, 3))]

    def rs_op(self, dtype: str) -> str:
        if dtype in PASSING_FLOATS or dtype == "float64":
            return self.r.choices(("SUM", "AVG", "MAX", "MIN"), weights=(6, 3, 1, 1))[0]
        return self.r.choice(("SUM", "MAX", "MIN"))

    def sharded_dtype(self) -> str:
        return self.r.choices(("float32", "bfloat16", "float16", "float64", "int64", "uint8"),
                              weights=(10, 3, 1, 1, 1, 1))[0]

    def op_reduce_scatter_tensor(self, ref: str, n: int) -> None:
        dtype = self.sharded_dtype()
        op = self.rs_op(dtype)
        chunk = self.chunk()
        self.issued(self.add("reduce_scatter_tensor", group=ref, op=op,
                             input=self.tensor(dtype, [chunk[0] * n, *chunk[1:]], op, ("offset",)),
                             output=self.tensor(dtype, chunk, "OUT", ("offset", "step")),
                             **self.asynchrony(poll=False)))

    def op_reduce_scatter(self, ref: str, n: int) -> None:
        dtype = self.sharded_dtype()
        op = self.rs_op(dtype)
        shape = [max(1, self.numel() // max(1, self.world))]
        self.issued(self.add("reduce_scatter", group=ref, op=op, input=self.tensor(dtype, shape, op),
                             output=self.tensor(dtype, shape, "OUT", ("offset", "step")),
                             **self.asynchrony(poll=False)))

    def op_all_gather(self, ref: str, n: int) -> None:
        dtype = self.r.choice((*FLOATS, *INTS, "bool"))
        shape = self.shape() if self.r.random() < 0.3 else [max(1, self.numel() // max(1, self.world))]
        self.issued(self.add("all_gather", group=ref, input=self.tensor(dtype, shape, "COPY", ("offset", "step")),
                             output=self.tensor(dtype, shape, "OUT", ("offset", "step")), **self.asynchrony()))

    def op_all_gather_into_tensor(self, ref: str, n: int) -> None:
        dtype = self.r.choices((*FLOATS, *INTS, "bool"), weights=(10, 2, 3, 1, 1, 1, 1, 1))[0]
        chunk = self.chunk()
        self.issued(self.add("all_gather_into_tensor", group=ref,
                             input=self.tensor(dtype, chunk, "COPY", ("offset", "step")),
                             output=self.tensor(dtype, [chunk[0] * n, *chunk[1:]], "OUT", ("offset",)),
                             **self.asynchrony()))

    def op_coalesced(self, ref: str, n: int) -> None:
        inner = self.r.choice(("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce"))
        dtype = self.r.choices(("float32", "bfloat16", "float64", "int64"), weights=(8, 3, 1, 1))[0]
        op = self.rs_op(dtype) if inner != "all_gather_into_tensor" else "COPY"
        items = []
        for _ in range(self.r.randint(1, 3)):
            chunk = self.chunk()
            whole = [chunk[0] * n, *chunk[1:]]
            if inner == "all_gather_into_tensor":
                items.append({"input": self.tensor(dtype, chunk),
                              "output": self.tensor(dtype, whole, "OUT", ("offset",))})
            elif inner == "reduce_scatter_tensor":
                items.append({"input": self.tensor(dtype, whole, op),
                              "output": self.tensor(dtype, chunk, "OUT", ("offset",))})
            else:
                items.append({"tensor": self.tensor(dtype, self.shape() if self.r.random() < 0.3 else chunk, op)})
        a = self.asynchrony(poll=inner != "reduce_scatter_tensor")
        if a["async"] and a["wait"] == "then":
            a.update(wait="future", then=0)  # a coalesced work's future is waited, its value not chained
        self.issued(self.add("coalesced", group=ref, inner=inner, op=op, items=items, **a))

    def op_all_reduce_coalesced(self, ref: str, n: int) -> None:
        dtype = self.r.choice(("float32", "float64", "int64"))
        op = self.r.choice(("SUM", "MAX", "MIN"))
        tensors = [self.tensor(dtype, self.shape(), op) for _ in range(self.r.randint(1, 3))]
        # its async form returns a Future, not a Work (torch's deprecated API): waited as one
        a = {"async": True, "wait": "future", "then": 0} if self.r.random() < 0.4 else {"async": False}
        self.issued(self.add("all_reduce_coalesced", group=ref, op=op, tensors=tensors, **a))

    def op_broadcast(self, ref: str, n: int) -> None:
        dtype = self.r.choice((*FLOATS, *INTS, "bool"))
        self.issued(self.add("broadcast", group=ref, src=self.r.randrange(n),
                             tensor=self.tensor(dtype, self.shape(), "COPY", ("offset", "step", "transpose",
                                                                              "slice2d")), **self.asynchrony()))

    def op_reduce(self, ref: str, n: int) -> None:
        op = self.reduce_op()
        dtype = self.dtype(op)
        if dtype in INTS or dtype == "bool":
            op = self.reduce_op(dtype)
        self.issued(self.add("reduce", group=ref, dst=self.r.randrange(n), op=op,
                             tensor=self.tensor(dtype, self.shape(), op), **self.asynchrony()))

    def op_gather(self, ref: str, n: int) -> None:
        dtype = self.r.choice(("float32", "int64", "bfloat16"))
        self.issued(self.add("gather", group=ref, dst=self.r.randrange(n), tensor=self.tensor(dtype, self.shape()),
                             **self.asynchrony()))

    def op_scatter(self, ref: str, n: int) -> None:
        dtype = self.r.choice(("float32", "int64", "uint8"))
        self.issued(self.add("scatter", group=ref, src=self.r.randrange(n), tensor=self.tensor(dtype, self.shape()),
                             **self.asynchrony()))

    def op_all_to_all(self, ref: str, n: int) -> None:
        dtype = self.r.choice(("float32", "int64", "float16"))
        k = self.r.randint(0, 50)
        sizes = [[k] * n for _ in range(n)]  # sizes[from][to]: gloo's list form takes one size only
        self.issued(self.add("all_to_all", group=ref, sizes=sizes, tensor=self.tensor(dtype, [1]),
                             **self.asynchrony()))

    def op_all_to_all_single(self, ref: str, n: int) -> None:
        dtype = self.r.choice(("float32", "int64", "bfloat16", "float64"))
        row = self.r.choice(([], [], [3]))
        if self.r.random() < 0.5:
            k = self.r.randint(0, 40)
            sizes = [[k] * n for _ in range(n)]
            even = True
        else:
            sizes = [[self.r.randint(0, 40) for _ in range(n)] for _ in range(n)]
            even = False
        self.issued(self.add("all_to_all_single", group=ref, sizes=sizes, even=even, row=row,
                             tensor=self.tensor(dtype, [1]), **self.asynchrony()))

    def op_barrier(self, ref: str, n: int) -> None:
        read = [w for w, g, _ in self.pending if g == ref]
        if read or self.r.random() < 0.5:
            # gloo's barrier waits for every earlier work of its group: their outputs are complete after it,
            # read then, before their own wait (which may come later, in any order)
            self.add("barrier", group=ref, read=read, **{"async": False})
            self.pending = [(w, g, "wait" if g == ref and s == "barrier" else s) for w, g, s in self.pending]
        else:
            self.issued(self.add("barrier", group=ref, read=[], **self.asynchrony()))

    def op_objects(self, ref: str, n: int) -> None:
        which = self.r.choice(("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list"))
        sizes = [self.r.choice((0, 3, 100, 5000)) for _ in range(self.world)]
        self.add("objects", group=ref, which=which, root=self.r.randrange(n), sizes=sizes, count=self.r.randint(1, 3))

    def op_invalid(self, ref: str, n: int) -> None:
        what = self.r.choice(("rst_size", "rst_dtype", "agt_size", "agt_dtype", "ag_uneven", "band_float",
                              "arc_mixed", "bcast_src", "rs_list_len", "agt_0dim"))
        self.add("invalid", group=ref, what=what, size=self.r.randint(1, 9), **{"async": False})

    def finish(self) -> None:
        for ref in sorted({g for _, g, s in self.pending if s == "barrier"}):
            self.add("barrier", group=ref, read=[w for w, g, _ in self.pending if g == ref], **{"async": False})
        if self.pending:
            self.add("wait", works=[w for w, _, _ in self.pending])
        self.pending = []


def generate(seed: int, layout: Layout, plain: bool = False) -> Program:
    """The program of ``seed`` for ``layout``; ``plain``: no deliberately invalid call and no
    re-initialisation (a fault injection's program)."""
    g = _Gen(seed, layout, plain)
    g.structure()
    for _ in range(g.r.randint(3, 8 if plain else 14)):
        g.collective()
        g.maybe_wait()
    g.finish()
    return g.program()


# ---- formatting ---------------------------------------------------------------------------------


def _tensor_text(spec: dict[str, Any]) -> str:
    text = f"{spec['dtype']}{list(spec['shape'])}"
    view = spec.get("view", "contig")
    if view == "offset":
        text += f"@offset{spec['pad'][0]}+{spec['pad'][1]}"
    elif view == "step":
        text += f"@[{spec['pad'][0]}::{spec['step']}]"
    elif view != "contig":
        text += f"@{view}"
    values = spec.get("values", "int")
    text += f"~int{spec['range']}" if values == "int" and "range" in spec else "" if values == "int" \
        else f"~{values}*{spec.get('scale', 1)}"
    return text


def format_op(op: Op) -> str:
    a = dict(op.args)
    parts = [f"{op.id:3d}: {op.kind}"]
    for key in ("group", "inner", "op", "which", "what", "src", "dst", "root", "ranks", "shape", "works", "read"):
        if key in a:
            parts.append(f"{key}={a.pop(key)}")
    for key in ("tensor", "input", "output"):
        if key in a:
            parts.append(f"{key}={_tensor_text(a.pop(key))}")
    if "tensors" in a:
        parts.append("tensors=[" + ", ".join(_tensor_text(t) for t in a.pop("tensors")) + "]")
    if "items" in a:
        parts.append("items=[" + ", ".join(" -> ".join(_tensor_text(t) for t in item.values())
                                          for item in a.pop("items")) + "]")
    if a.pop("async", False):
        parts.append(f"async wait={a.pop('wait')}" + (f" then x{a['then']}" if a.get("then") else ""))
    a.pop("then", None)
    a.pop("wait", None)
    parts += [f"{k}={v}" for k, v in a.items()]
    return " ".join(parts)


def format(program: Program) -> str:
    """One line per op: enough to read a failure and replay it (seed and layout regenerate it)."""
    servers, ranks = program.layout
    lines = [f"program seed={program.seed} layout={servers}x{ranks} ({len(program.ops)} ops)"]
    lines += [format_op(op) for op in program.ops]
    return "\n".join(lines)
