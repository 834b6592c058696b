"""The collectives of a PASSING process group under way: run one at a time, in issue order.

They run on the group's own thread, so that async_op=True overlaps them with the caller;
but a caller that is going to wait (async_op=False), or that waits on the next one before
that thread has taken it, runs it itself: on a loaded machine waking a thread and being
woken back costs milliseconds a call.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist


class PassingWork(dist.Work):
    """A collective under way. wait() re-raises the very error the operation hit
    (torch's own future-wrapping Work reports success whatever happened)."""

    def __init__(self, runner: InOrder | None = None) -> None:
        super().__init__()
        self.future: torch.futures.Future = torch.futures.Future()
        self.error: BaseException | None = None
        self.runner = runner  # where it is queued, if it is

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.future.set_exception(error)

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
            self.future.wait()
        except BaseException:
            if self.error is None:
                raise
            raise self.error from None
        return True

    def get_future(self) -> torch.futures.Future:
        return self.future

    def is_completed(self) -> bool:
        return self.future.done()

    def is_success(self) -> bool:
        return self.future.done() and self.error is None

    def exception(self) -> BaseException | None:
        return self.error


class InOrder:
    """One process group's collectives, one at a time in issue order: each is taken by the
    group's thread, or by a caller waiting on it when it is next and nothing runs."""

    def __init__(self, name: str) -> None:
        self._changed = threading.Condition()
        self._queue: deque[tuple[PassingWork, Callable[[], None]]] = deque()
        self._running = False
        self._closed = False
        # a daemon, so that a group never shut down does not hold the interpreter at exit;
        # the backend's finalizer drains it then
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def submit(self, work: PassingWork, job: Callable[[], None], caller_waits: bool = False) -> None:
        """Queue ``job``, which completes ``work`` (sets its result or fails it) and raises nothing.
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
        """Run ``work`` in this thread if it is next and nothing runs; whether it did."""
        with self._changed:
            if self._running or not self._queue or self._queue[0][0] is not work:
                return False
            _, job = self._queue.popleft()
            self._running = True
        self._run(job)
        return True

    def _run(self, job: Callable[[], None]) -> None:
        try:
            job()
        finally:
            with self._changed:
                self._running = False
                self._changed.notify_all()

    def _serve(self) -> None:
        while True:
            with self._changed:
                while self._running or (not self._queue and not self._closed):
                    self._changed.wait()
                if not self._queue:  # closed, and everything queued has run
                    return
                work, job = self._queue.popleft()
                self._running = True
            try:
                self._run(job)
            except BaseException as e:  # a job completes its work and raises nothing; should one raise,
                if not work.future.done():  # its work fails and the thread goes on serving the others
                    work.fail(e)

    def shutdown(self) -> None:
        """Run what is queued, then stop the thread."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()
