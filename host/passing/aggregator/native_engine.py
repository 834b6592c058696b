"""The aggregation engine in C (host/csrc/engine.c, through passing.native), behind the numpy
engine's API (passing.aggregator.engine, the specification it is tested against)."""

from __future__ import annotations

import ctypes
import threading
import weakref

import numpy as np

from .. import native, wire
from .engine import COUNTERS, AggregationEngine, ConfigError, Emission, JobSpec, check_admission
from .jobs import OWNERS, ROLES, Uplink


class NativeAggregationEngine:
    """The same engine in C (host/csrc/engine.c, through passing.native), behind the same API.

    Admission is checked here exactly as the numpy engine checks it (``check_admission``),
    so errors read the same; the C engine re-checks and any refusal it still makes is a bug.
    Every call into C takes the engine's lock: the aggregator's C data path may process
    packets in another thread while this object admits and removes jobs.
    """

    def __init__(self, slots: int, lanes: int = wire.DEFAULT_LANES, max_jobs: int = 1024) -> None:
        if slots < 1 or lanes < 1 or max_jobs < 1:
            raise ConfigError("slots, lanes and max_jobs must be >= 1")
        if max(slots, lanes, max_jobs) >= 1 << 32:
            raise ConfigError("slots, lanes and max_jobs must be < 2**32")
        self._lib = native.lib()
        handle = self._lib.pn_engine_new(slots, lanes, max_jobs)
        if not handle:
            raise MemoryError(f"cannot allocate an engine of {slots} slots x {lanes} lanes")
        self.handle: int = handle
        self._free = weakref.finalize(self, self._lib.pn_engine_free, handle)
        self._free.atexit = False  # at exit a data path thread may still use it; the OS frees it anyway
        self.slots, self.lanes, self.max_jobs = slots, lanes, max_jobs
        self._by_id: dict[int, JobSpec] = {}
        self._last_generation: dict[int, int] = {}
        self._workers = np.zeros(1 << 16, dtype=np.int64)  # job id -> workers (0: none): bounds a batch's RESULTs
        self._down = np.zeros(1 << 16, dtype=np.int64)  # uplink job id -> its leaf's workers (0: none)
        self._lock = threading.Lock()  # the registry, for callers in several threads

    # ---- admission -------------------------------------------------------------

    def add_job(self, spec: JobSpec) -> JobSpec:
        with self._lock:
            check_admission(spec, self._by_id, self.slots, self.lanes, self.max_jobs, self._last_generation)
            sources = np.asarray(spec.sources, dtype=np.int64)
            up = spec.up or Uplink(0, 0, 0, -1)
            tree = native.Tree(ROLES.index(spec.role), (ctypes.c_int32 * OWNERS)(*spec.owner_map().tolist()), up.job,
                               up.generation, up.worker, up.source)
            native.check(self._lib.pn_engine_add_tree_job(self.handle, spec.job, spec.generation, spec.base,
                                                          spec.pool, spec.workers, native.address(sources),
                                                          spec.lanes, ctypes.byref(tree)),
                         f"the native engine refused job {spec.job} that passed admission")
            self._by_id[spec.job] = spec
            self._workers[spec.job] = spec.workers
            if spec.up is not None:  # what comes down names the uplink's job id: room for the leaf's replicas
                self._down[spec.up.job] = spec.workers
            return spec

    def remove_job(self, job: int) -> JobSpec:
        with self._lock:
            if job not in self._by_id:
                raise ConfigError(f"job {job} is not admitted")
            native.check(self._lib.pn_engine_remove_job(self.handle, job), f"the native engine lost job {job}")
            self._workers[job] = 0
            spec = self._by_id.pop(job)
            if spec.up is not None:
                self._down[spec.up.job] = 0
            return spec

    def jobs(self) -> list[JobSpec]:
        with self._lock:
            return sorted(self._by_id.values(), key=lambda s: s.job)

    def counters(self, job: int | None = None) -> dict[str, int]:
        """Totals, or one admitted job's counters (unattributable drops are in totals only)."""
        out = np.zeros(len(COUNTERS), dtype=np.int64)
        with self._lock:
            if job is not None and job not in self._by_id:
                raise ConfigError(f"job {job} is not admitted")
            native.check(self._lib.pn_engine_counters(self.handle, -1 if job is None else job, native.address(out)),
                         "pn_engine_counters")
        return {name: int(out[i]) for i, name in enumerate(COUNTERS)}

    # ---- data path ---------------------------------------------------------------

    def process(self, batch: np.ndarray, sources: np.ndarray, lengths: np.ndarray | None = None) -> Emission:
        """AggregationEngine.process, in C: the same RESULTs (their first ``lengths`` bytes), byte for byte
        and in the same order."""
        n = len(batch)
        batch = np.ascontiguousarray(batch)
        sources = np.ascontiguousarray(sources, dtype=np.int64)
        if lengths is None:
            lengths = np.full(n, batch.dtype.itemsize, dtype=np.uint32)
        else:  # a length past uint32 is malformed all the same
            lengths = np.clip(np.asarray(lengths, dtype=np.int64), 0, 0xFFFFFFFF).astype(np.uint32)
        if sources.shape != (n,) or lengths.shape != (n,):
            raise ValueError("batch, sources and lengths must have one entry per packet")
        emitted = ctypes.c_size_t(0)
        with self._lock:  # no job may come in between sizing the output and processing
            # Room for every RESULT the batch can cause: a job's worker count per packet of that job (a leaf's
            # partial up is one, a host's GATHER there its other workers and one up).
            ids = batch["hdr"]["job"]
            cap = int(np.maximum(self._workers[ids], self._down[ids]).sum()) if n else 0
            out = wire.empty(cap, self.lanes)
            dest = np.empty(cap, dtype=np.int64)
            multicast = np.empty(cap, dtype=np.uint8)
            out_lengths = np.empty(cap, dtype=np.uint32)
            consumed = self._lib.pn_engine_process(
                self.handle, native.address(batch), batch.dtype.itemsize, native.address(lengths),
                native.address(sources), n, native.address(out), native.address(dest), native.address(multicast),
                native.address(out_lengths), cap, ctypes.byref(emitted))
        if consumed != n:
            raise RuntimeError(f"the native engine took {consumed} of {n} packets (out of memory?)")
        k = emitted.value
        return Emission(packets=out[:k], dest=dest[:k], multicast=multicast[:k].astype(bool),
                        lengths=out_lengths[:k].astype(np.int64))


Engine = AggregationEngine | NativeAggregationEngine


def make_engine(slots: int, lanes: int = wire.DEFAULT_LANES, max_jobs: int = 1024, engine: str = "auto") -> Engine:
    """An aggregation engine: ``engine`` "native" (C), "numpy", or "auto" (native where it loads)."""
    if native.use_native(engine):
        return NativeAggregationEngine(slots, lanes, max_jobs)
    return AggregationEngine(slots, lanes, max_jobs)
