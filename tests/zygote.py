"""Rank processes forked from one that imported torch already: a test's ranks start in
milliseconds instead of seconds (importing torch costs 1-2 s of CPU per process, and on 2 cores
an 8-rank launch spent 10 s importing it 8 times over).

``Zygote(preload)`` starts ``python -m tests.zygote MODULE...``, which imports the modules and
then, for every request on its stdin, forks a child that runs ``python -m MODULE ARGS`` as a
fresh process would: its own environment, argv, stdout and stderr (``PIPE``: files the test reads
back once it ended; ``live_stdout=True``: a pipe read while it runs, as ``proc.stdout``; ``None``:
the zygote's stderr, which is the test session's, as a Popen child inherits the caller's).
The zygote reaps its children and reports their exit status. ``Zygote.popen`` has
``subprocess.Popen``'s call signature and returns an object with the part of its interface
the tests use (``communicate``, ``poll``, ``wait``, ``returncode``, ``pid``, ``stdout``,
``send_signal``, ``kill``, ``terminate``), so it drops into
``cluster.local.launch_ranks(popen_for_server=...)`` and ``passing.launch.start_aggregator(popen=...)``.

``Zygote.popen(..., netns=NAME)`` puts the child in network namespace NAME (as ``ip netns exec``
would; root only): the ranks of an emulated cluster (cluster/netns.py) are forked too.

Only for processes that would exec this same interpreter with ``-m``, or a console script of its
environment (``passing-controller``: its entry point is called as the script would call it);
torchrun is started as before.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


class ForkedProcess:
    """A child of the zygote, seen through the slice of ``subprocess.Popen`` the tests use."""

    def __init__(self, zygote: Zygote, pid: int, out: Path | None, err: Path | None, text: bool,
                 stdout: Any = None) -> None:
        self.zygote, self.pid, self.out, self.err, self.text = zygote, pid, out, err, text
        self.stdout = stdout  # the live pipe's reading end, or None
        self.returncode: int | None = None
        self.args = ["<forked>", str(pid)]

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.status(self.pid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.zygote.status(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.returncode

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        """Waits for the end, then reads: a live stdout must not fill its pipe (64 KiB) meanwhile."""
        self.wait(timeout)
        if self.stdout is not None:
            with self.stdout:
                out = self.stdout.read()
        else:
            out = self._read(self.out)
        return out, self._read(self.err)

    def _read(self, path: Path | None) -> Any:
        if path is None:
            return None
        return path.read_text() if self.text else path.read_bytes()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class Zygote:
    """One preloaded process that forks the tests' rank processes."""

    def __init__(self, preload: Sequence[str], env: dict[str, str] | None = None) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="passing-zygote-")
        self._proc = subprocess.Popen([sys.executable, "-m", "tests.zygote", *preload], cwd=REPO,
                                      env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self._lock = threading.Lock()  # one request at a time; its answer is the next "forked" line
        self._changed = threading.Condition()
        self._exited: dict[int, int] = {}
        self._forked: list[int] = []
        self._count = 0
        self._reader = threading.Thread(target=self._read, name="zygote-reader", daemon=True)
        self._reader.start()
        if not self._wait_for(lambda: self._ready, 120):
            raise RuntimeError("the zygote did not get ready (preloading failed?)")

    _ready = False

    def _read(self) -> None:
        for line in self._proc.stdout:
            event = json.loads(line)
            with self._changed:
                if event["event"] == "ready":
                    self._ready = True
                elif event["event"] == "forked":
                    self._forked.append(event["pid"])
                    # an earlier child's status under the same pid (pids wrap: 32768 here) is not this one's
                    self._exited.pop(event["pid"], None)
                elif event["event"] == "exited":
                    self._exited[event["pid"]] = event["status"]
                self._changed.notify_all()
        with self._changed:
            self._ready = False
            self._changed.notify_all()

    def _wait_for(self, predicate, timeout: float | None) -> bool:
        with self._changed:
            return self._changed.wait_for(predicate, timeout)

    def popen(self, argv: Sequence[str], env: dict[str, str] | None = None, stdout: Any = None, stderr: Any = None,
              text: bool = False, netns: str | None = None, live_stdout: bool = False, **_: Any) -> ForkedProcess:
        """``argv``: [python, "-m", module, *args], as subprocess.Popen would run it; ``netns``: the
        network namespace (an ``ip netns`` name) to run it in; ``live_stdout``: stdout is a pipe,
        ``proc.stdout``, read while the child runs (a service's ready line)."""
        if len(argv) >= 3 and argv[1] == "-m":
            run = {"module": argv[2], "argv": list(argv[3:])}
        elif (entry := console_script(argv[0])) is not None:
            run = {"entry": entry, "script": str(argv[0]), "argv": list(argv[1:])}
        else:
            raise ValueError(f"the zygote runs `python -m MODULE ...` or a console script only, not {list(argv)}")
        with self._lock:
            self._count += 1
            out, err, fifo = (Path(self._dir.name) / f"{self._count}.{name}" for name in ("out", "err", "fifo"))
            out = out if stdout is not None and not live_stdout else None
            err = err if stderr is not None else None
            reading = None
            if live_stdout:  # opened before the zygote opens its writing end: neither open waits
                os.mkfifo(fifo, 0o600)
                reading = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
            request = {**run, "env": dict(env if env is not None else os.environ),
                       "stdout": str(out) if out else None, "stderr": str(err) if err else None, "netns": netns,
                       "stdout_fifo": str(fifo) if live_stdout else None}
            with self._changed:
                self._forked.clear()
            try:
                self._proc.stdin.write(json.dumps(request) + "\n")
                self._proc.stdin.flush()
                if not self._wait_for(lambda: self._forked or not self._ready, 30) or not self._forked:
                    raise RuntimeError("the zygote did not fork")
            except BaseException:
                if reading is not None:
                    os.close(reading)
                raise
            live = None
            if reading is not None:  # the child holds the writing end now: reads wait for its output
                os.set_blocking(reading, True)
                live = os.fdopen(reading, "r" if text else "rb")
                fifo.unlink()
            return ForkedProcess(self, self._forked[0], out, err, text, live)

    def status(self, pid: int, timeout: float | None) -> int | None:
        """The child's exit code (negative: the signal that ended it), or None while it runs."""
        self._wait_for(lambda: pid in self._exited or not self._ready, timeout)
        return self._exited.get(pid)

    def close(self) -> None:
        self._proc.stdin.close()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._dir.cleanup()


# What the torch tests' ranks import. torch._dynamo is torch's lazy import that DDP's and FSDP's
# first construction triggers: 1 s of CPU in each rank otherwise, 2-3 s of a 4-rank test's time.
TORCH_PRELOAD = ("tests.torch_worker", "tests.torch_sharded_worker", "tests.torch_contract_worker", "demo.train",
                 "sklearn.datasets", "torch._dynamo")
CLI_PRELOAD = ("passing.cli", "passing_controller.cli")  # workers, aggregators, controllers (tests/cluster.py)
_shared: dict[tuple[str, ...], Zygote] = {}


def console_script(path: str | os.PathLike) -> str | None:
    """"module:function" of ``path`` when it is a console script of this environment, else None."""
    from importlib.metadata import entry_points

    path = Path(path)
    if path.parent != Path(sys.executable).parent:
        return None
    found = entry_points(group="console_scripts", name=path.name)
    return next(iter(found)).value if found else None


def shared(preload: tuple[str, ...]) -> Zygote:
    """The test session's zygote for these modules (started at the first call, closed at exit)."""
    if preload not in _shared:
        _shared[preload] = Zygote(preload)
        atexit.register(_shared[preload].close)
    return _shared[preload]


def torch_ranks(_server: int = 0) -> Callable[..., ForkedProcess]:
    """The popen of the torch zygote: ``launch_ranks(..., popen_for_server=torch_ranks)``."""
    return shared(TORCH_PRELOAD).popen


def torch_ranks_in(namespaces: Sequence[str]) -> Callable[[int], Callable[..., ForkedProcess]]:
    """``popen_for_server`` for an emulated cluster: server i's ranks forked into network namespace
    ``namespaces[i]`` (``EmulatedNetwork.hosts[name].namespace``)."""
    popen = shared(TORCH_PRELOAD).popen
    return lambda server: lambda argv, **kw: popen(argv, netns=namespaces[server], **kw)


# ---- the zygote process -------------------------------------------------------------------------


def _enter_netns(name: str) -> None:
    """setns(2) into the network namespace ``ip netns add NAME`` made (os.setns is Python 3.12's)."""
    import ctypes

    clone_newnet = 0x40000000
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, clone_newnet) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into network namespace {name}: {os.strerror(errno)}")
    finally:
        os.close(fd)


def _child(request: dict[str, Any], live_stdout: int | None) -> None:
    """In the forked child: become `python -m MODULE ARGS` with the request's environment and files."""
    import runpy
    import traceback

    code = 0
    try:
        if live_stdout is not None:
            os.dup2(live_stdout, 1)
            os.close(live_stdout)
        elif request["stdout"] is None:  # the zygote's stdout carries its events: its stderr stands in
            os.dup2(2, 1)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            if path is None:
                continue  # the live pipe, or the zygote's own stderr
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(f, fd)
            os.close(f)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        if request.get("netns"):  # the child is single-threaded: the whole process enters it
            _enter_netns(request["netns"])
        os.environ.clear()
        os.environ.update(request["env"])
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        if "entry" in request:  # what the console script does: sys.exit(function())
            import importlib

            sys.argv = [request["script"], *request["argv"]]
            module, function = request["entry"].split(":")
            sys.exit(getattr(importlib.import_module(module), function)())
        sys.argv = [request["module"], *request["argv"]]
        sys.modules.pop(request["module"], None)  # run as __main__, as `python -m` does (runpy warns otherwise)
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def main() -> None:
    import importlib

    for module in sys.argv[1:]:
        importlib.import_module(module)
    report_lock = threading.RLock()  # the fork reports while it holds it

    def report(event: dict[str, Any]) -> None:
        with report_lock:
            sys.stdout.write(json.dumps(event) + "\n")
            sys.stdout.flush()

    children: set[int] = set()

    def reap() -> None:
        """Report every child that ended (a thread: no work in a signal handler)."""
        while True:
            try:
                pid, status = os.wait()
            except ChildProcessError:
                if sys.stdin.closed:
                    return
                time.sleep(0.01)
                continue
            children.discard(pid)
            report({"event": "exited", "pid": pid, "status": os.waitstatus_to_exitcode(status)})

    report({"event": "ready"})
    reaper: threading.Thread | None = None
    for line in sys.stdin:
        request = json.loads(line)
        live_stdout = None
        if request["stdout_fifo"]:  # the test holds the reading end open: this open does not wait
            live_stdout = os.open(request["stdout_fifo"], os.O_WRONLY | os.O_NONBLOCK)
            os.set_blocking(live_stdout, True)
        with report_lock:  # no thread is inside a write of sys.stdout: its buffer's lock is free in the child
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(request, live_stdout)
            # said under the lock: the reaper (which reports under it too) cannot say this pid exited before
            report({"event": "forked", "pid": pid})
        if live_stdout is not None:
            os.close(live_stdout)
        children.add(pid)
        if reaper is None:  # started after the first fork: the children inherit no extra thread
            reaper = threading.Thread(target=reap, daemon=True)
            reaper.start()
    sys.stdin.close()
    deadline = time.monotonic() + 10
    while children and time.monotonic() < deadline:
        time.sleep(0.05)


if __name__ == "__main__":
    main()
