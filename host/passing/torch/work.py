"""The collectives of a PASSING process group under way: run one at a time, in issue order.

They run on the group's own thread, so that async_op=True overlaps them with the caller;
but a caller that is going to wait (async_op=False), or that waits on the next one before
that thread has taken it, runs it itself: on a loaded machine waking a thread and being
woken back costs milliseconds a call. A work's future is completed once its collective has left
the queue, never on the group's thread nor under its lock: a callback may issue and wait on further
collectives of the group (DDP's comm hooks do), and it holds up nothing else meanwhile.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..errors import PassingError

log = logging.getLogger("passing.torch")


@dataclass
class DeviceTurn:
    """Where and after what a collective on CUDA tensors runs, as NCCL's ProcessGroup has it: an event
    recorded on the caller's current stream when the collective is issued, and the group's own stream
    on that device, which waits for the event before the collective reads its input."""

    device: torch.device
    ready: torch.cuda.Event
    stream: torch.cuda.Stream
    tensors: list[torch.Tensor]

    @property
    def devices(self) -> list[torch.device]:
        return [self.device]

    @classmethod
    def of(cls, tensors: list[torch.Tensor], streams: dict[int, torch.cuda.Stream]) -> DeviceTurn | None:
        """At submission, in the caller's thread: None for CPU tensors. ``streams``: the group's stream of
        each device, made on first use."""
        cuda = [t for t in tensors if t.device.type == "cuda"]
        if not cuda:
            return None
        device = cuda[0].device
        if any(t.device != device for t in cuda):
            devices = sorted({str(t.device) for t in cuda})
            raise ValueError(f"a collective's CUDA tensors must be on one device, not {devices}")
        if device.index not in streams:
            streams[device.index] = torch.cuda.Stream(device=device)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(device))
        return cls(device, ready, streams[device.index], cuda)


@contextmanager
def on_device(turn: DeviceTurn | None, work: PassingWork) -> Iterator[None]:
    """Run a collective's body on its device (nothing for CPU tensors): the device set in this thread
    (the group's own, or a caller's; NCCL's communicators and the caching allocator go by it), the
    group's stream current and waiting for the caller's, the tensors kept from the allocator until that
    stream is done with them, and the work marked ready on that stream."""
    if turn is None:
        yield
        return
    torch.cuda.set_device(turn.device)
    turn.stream.wait_event(turn.ready)
    with torch.cuda.stream(turn.stream):
        yield
    for t in turn.tensors:
        t.record_stream(turn.stream)
    work.stream = turn.stream


class PassingWork(dist.Work):
    """A collective under way. wait() re-raises the very error the operation hit
    (torch's own future-wrapping Work reports success whatever happened).

    Its future is completed by ``complete`` once the collective has left its group's queue, on a
    thread that serves nothing else (passing.torch.work.Completions) or on the caller's own when the
    caller ran it: a callback (DDP's comm hooks chain collectives in ``then`` and wait on them) can
    issue and wait on further collectives of the group. ``devices``: the CUDA devices of its tensors,
    as NCCL's Work has them: the future then makes whoever waits on it, reads its value or chains on
    it wait for the streams the result was produced on (``stream``)."""

    def __init__(self, runner: InOrder | None = None, devices: list[torch.device] | None = None) -> None:
        super().__init__()
        # completed here; ``future``, which is handed out, follows it. torch's set_exception marks a future
        # done with the exception as its *value* (only Python's wait() raises it): C++ readers (DDP's reducer)
        # would take that value for the result, and crash on it. A callback that raises gives ``future`` a
        # real error, which every reader sees.
        self._outcome: torch.futures.Future = torch.futures.Future(devices=devices) if devices \
            else torch.futures.Future()
        self.future: torch.futures.Future = self._outcome.then(_value_or_error)
        self.error: BaseException | None = None
        self.runner = runner  # where it is queued, if it is
        self.stream: torch.cuda.Stream | None = None  # CUDA: the stream its result is ready on, set by its job
        # set once the collective has run: its outputs are written and ``error`` is known, though its future
        # may be completed later (on a completion thread): what a barrier waits for (passing.torch.work.ran)
        self.ran = threading.Event()

    def complete(self, value: Any = None, error: BaseException | None = None) -> None:
        """Publish the outcome; the future's callbacks run in this thread, now. A CUDA result is marked
        ready on ``stream`` (torch records an event on the current stream of each of the devices)."""
        self.finished(error)
        if error is not None:
            self.error = error
            self._outcome.set_exception(error)
        elif self.stream is not None:
            with torch.cuda.stream(self.stream):
                self._outcome.set_result(value)
        else:
            self._outcome.set_result(value)

    def finished(self, error: BaseException | None) -> None:
        """The collective ran (its outputs are written), with ``error`` if it failed."""
        if error is not None:
            self.error = detached(error)
        self.ran.set()

    def fail(self, error: BaseException) -> None:
        self.complete(error=error)

    def wait(self, timeout: timedelta | None = None) -> bool:
        if timeout is not None and timeout.total_seconds() > 0:
            deadline = time.monotonic() + timeout.total_seconds()
            while not self.future.done():  # torch's Future has no timed wait
                if time.monotonic() > deadline:
                    raise TimeoutError(f"collective not done within {timeout.total_seconds():g} s")
                time.sleep(0.001)
        elif self.runner is not None:
            self.runner.run_here(self)  # an untimed wait can run it, if it is next
        try:
            self.future.wait()  # CUDA: makes the current stream wait for the result's
        except BaseException as e:
            if self.error is None:
                raise
            e.__traceback__ = None  # the future's own error (this one's): it passed through this frame alone
            raise raised(self.error) from self.error.__cause__
        return True

    def get_future(self) -> torch.futures.Future:
        return self.future

    def is_completed(self) -> bool:
        return self.future.done()

    def is_success(self) -> bool:
        return self.future.done() and self.error is None

    def exception(self) -> BaseException | None:
        return self.error


def _value_or_error(outcome: torch.futures.Future) -> Any:
    return outcome.value()  # raises the error set_exception left as the value


def detached(error: BaseException, _seen: set[int] | None = None) -> BaseException:
    """``error`` (and the errors it chains) with its traceback kept as a note, not as frames. The frames of a
    failed collective reach its process group (its stages, and the store, whose server in rank 0 must close
    with the group: a new init_process_group would meet the old one), and they form a cycle with the work
    that keeps the error: only the garbage collector, whenever it runs, would let go of them."""
    seen = set() if _seen is None else _seen
    if id(error) in seen:
        return error
    seen.add(id(error))
    if error.__traceback__ is not None:
        where = "".join(traceback.format_tb(error.__traceback__)[-6:]).rstrip()
        error.add_note(f"(raised in the collective at:\n{where})")
        error.__traceback__ = None
    for chained in (error.__cause__, error.__context__):
        if chained is not None:
            detached(chained, seen)
    return error


def raised(error: BaseException) -> BaseException:
    """What a wait raises for a work's ``error``: a copy of it, so that the frames it passes through on the
    way to the caller (which hold the work, and the process group) are never the kept error's (``detached``).
    An error that cannot be copied is raised itself."""
    cls = type(error)
    for base in cls.__mro__:  # as pickle rebuilds one, but without __init__, whose signature may be any
        if "__new__" not in vars(base):
            continue
        try:
            fresh = base.__new__(cls, *error.args)
            fresh.args = error.args
            fresh.__dict__.update(error.__dict__)
        except (TypeError, ValueError, AttributeError):  # the layout wants another base's __new__
            continue
        break
    else:
        return error
    return fresh if str(fresh) == str(error) else error


class Completions:
    """Completes works' futures on threads of its own, in the order given: one thread as a rule, and
    another whenever every one is busy, so that a callback that blocks (waits on a later collective,
    as PowerSGD's does) holds its own thread only, and the completion it waits for finds another.
    Every queued completion has a thread of its own waiting or started for it; a second idle thread
    ends."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._changed = threading.Condition()
        self._queue: deque[tuple[PassingWork, Any, BaseException | None]] = deque()
        self._idle = 0  # threads waiting for a completion
        self._busy = 0  # threads completing one
        self._started = 0
        self._closed = False  # no more completions: the idle thread ends

    def put(self, work: PassingWork, value: Any, error: BaseException | None) -> None:
        with self._changed:
            self._queue.append((work, value, error))
            if len(self._queue) > self._idle:  # every idle thread is spoken for: one more
                self._started += 1
                threading.Thread(target=self._serve, name=f"{self.name}-done{self._started}", daemon=True).start()
            else:
                self._changed.notify()

    def _serve(self) -> None:
        while True:
            with self._changed:
                if not self._queue:
                    if self._idle or self._closed:  # one idle thread is enough; none once closed
                        return
                    self._idle += 1
                    try:
                        while not self._queue and not self._closed:
                            self._changed.wait()
                    finally:
                        self._idle -= 1
                    if not self._queue:
                        return
                work, value, error = self._queue.popleft()
                self._busy += 1
            try:
                work.complete(value, error)
            except BaseException:  # a callback's error is its future's (torch's); nothing may end this thread
                log.exception("passing: completing a collective's future")
            finally:
                with self._changed:
                    self._busy -= 1
                    self._changed.notify_all()

    def drain(self, timeout: float) -> bool:
        """Wait until every completion given has been made (its callbacks returned); whether they were
        within ``timeout`` s (a callback may wait on a collective that never comes)."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._queue and not self._busy, timeout)

    def close(self) -> None:
        """The idle thread ends; a completion still being made finishes on its own thread, which then ends."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()


class InOrder:
    """One process group's collectives, one at a time in issue order: each is taken by the
    group's thread, or by a caller waiting on it when it is next and nothing runs. A job returns
    its work's value or raises its error; the work is completed once the job has left the queue:
    by the caller that ran it, or on the group's completion threads (never the group's own
    thread, which a callback would hold up, nor under its lock)."""

    def __init__(self, name: str) -> None:
        self._changed = threading.Condition()
        self._queue: deque[tuple[PassingWork, Callable[[], Any]]] = deque()
        self._running: PassingWork | None = None
        self._closed = False
        self._completions = Completions(name)
        # a daemon, so that a group never shut down does not hold the interpreter at exit;
        # the backend's finalizer drains it then
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def submit(self, work: PassingWork, job: Callable[[], Any], caller_waits: bool = False) -> None:
        """Queue ``job``, which returns ``work``'s value or raises its error.
        ``caller_waits`` (torch's async_op=False): run it here and now if nothing else is queued
        or running, without waking the group's thread."""
        with self._changed:
            if self._closed:
                raise RuntimeError("the process group is shut down")
            self._queue.append((work, job))
        if caller_waits and self.run_here(work):
            return
        with self._changed:
            self._changed.notify_all()

    def run_here(self, work: PassingWork) -> bool:
        """Run ``work`` in this thread if it is next and nothing runs, and complete it here; whether it did."""
        with self._changed:
            if self._running is not None or not self._queue or self._queue[0][0] is not work:
                return False
            _, job = self._queue.popleft()
            self._running = work
        work.complete(*self._run(work, job))
        return True

    def pending(self) -> list[PassingWork]:
        """The works issued and not yet run: the one running, then the queued ones in issue order."""
        with self._changed:
            return ([self._running] if self._running is not None else []) + [w for w, _ in self._queue]

    def _run(self, work: PassingWork, job: Callable[[], Any]) -> tuple[Any, BaseException | None]:
        value: Any = None
        error: BaseException | None = None
        try:
            value = job()
        except BaseException as e:  # handed to whoever waits on the work
            error = e
        work.finished(error)
        with self._changed:
            self._running = None
            self._changed.notify_all()
        return value, error

    def _serve(self) -> None:
        while True:
            with self._changed:
                while self._running is not None or (not self._queue and not self._closed):
                    self._changed.wait()
                if not self._queue:  # closed, and everything queued has run
                    return
                work, job = self._queue.popleft()
                self._running = work
            self._completions.put(work, *self._run(work, job))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Run what is queued, stop the thread, and complete what ran (callbacks given ``timeout`` s)."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()
        if not self._completions.drain(timeout):
            log.warning("passing: a callback of a collective's future still runs at shutdown, after %g s", timeout)
        self._completions.close()


def wait_ran(works: list[Any], timeout: float) -> None:
    """Wait until each of ``works`` has run, ``timeout`` s at most in all, and raise the first one's error:
    what gloo's barrier does with the collectives issued before it (it waits on each, and fails with it).
    A work that is not a PassingWork is gloo's own, with no future: its wait() finishes it."""
    deadline = time.monotonic() + timeout
    for w in works:
        left = max(0.0, deadline - time.monotonic())
        if not isinstance(w, PassingWork):
            w.wait(timedelta(seconds=left))
            continue
        if not w.ran.wait(left):
            raise PassingError(f"barrier: a collective issued before it did not finish within {timeout:g} s "
                               f"(the process group's timeout)")
        if w.error is not None:
            raise raised(w.error) from w.error.__cause__
