"""Start PASSING's services and torchrun-like rank processes on this machine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from passing.launch import start_aggregator

from .processes import stop_processes

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[1]


def ensure_keys() -> Path:
    """The control plane's keys for a demo or benchmark run (docs/security.md): $PASSING_KEYS
    when it names a directory, else a key directory of this run's own, removed at exit. Every
    service and worker this process starts finds it through $PASSING_KEYS, and the workers that
    join through a controller share one job secret ($PASSING_JOB_SECRET)."""
    import atexit
    import shutil

    from passing_controller.keys import keygen

    if not os.environ.get("PASSING_KEYS"):
        directory = Path(tempfile.mkdtemp(prefix="passing-keys-"))
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
        keygen(directory / "keys")
        os.environ["PASSING_KEYS"] = str(directory / "keys")
    os.environ.setdefault("PASSING_JOB_SECRET", os.urandom(16).hex())
    return Path(os.environ["PASSING_KEYS"])


def free_tcp_port(host: str = "127.0.0.1") -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_controller(topology: dict[str, Any], workdir: Path, listen: str, extra: Sequence[str] = (),
                     popen=subprocess.Popen) -> tuple[subprocess.Popen, dict[str, Any]]:
    """`passing-controller` on ``topology``; returns the process and its ready line."""
    (workdir / "topology.json").write_text(json.dumps(topology))
    proc = popen([str(BIN / "passing-controller"), "--topology", str(workdir / "topology.json"), "--store",
                  str(workdir / "controller.sqlite"), "--listen", listen, *extra], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line:
        proc.wait()
        raise RuntimeError(f"passing-controller exited with {proc.returncode} before it was ready")
    return proc, json.loads(line)


@dataclass
class LocalServices:
    """``ps`` software aggregators and a PS-only controller on loopback (no switch)."""

    ps: int = 1
    aggregator_args: list[str] = field(default_factory=list)
    popen: Any = subprocess.Popen  # what starts them (the tests fork them: tests/cluster.service_popen)

    def __post_init__(self) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="passing-services-")
        self.procs: list[subprocess.Popen] = []
        self.endpoints: list[dict[str, str]] = []  # PS i's data and control endpoints (procs[i])
        try:
            for _ in range(self.ps):
                proc, ready = start_aggregator(self.aggregator_args, popen=self.popen)
                self.procs.append(proc)
                self.endpoints.append({"data": ready["data"], "control": ready["control"]})
            self.controller = f"tcp://127.0.0.1:{free_tcp_port()}"
            proc, self.ready = start_controller({"ps": self.endpoints}, Path(self._tmp.name), self.controller,
                                                popen=self.popen)
            self.procs.append(proc)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        stop_processes(self.procs)
        self._tmp.cleanup()

    def __enter__(self) -> LocalServices:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def rank_env(server: int, local_rank: int, servers: int, ranks: int, master: str,
             extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment torchrun gives rank ``local_rank`` of node ``server``."""
    host, port = master.rsplit(":", 1)
    env = dict(os.environ)
    env.update({
        "RANK": str(server * ranks + local_rank), "WORLD_SIZE": str(servers * ranks), "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(ranks), "GROUP_RANK": str(server), "MASTER_ADDR": host, "MASTER_PORT": port,
        "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
    })
    env.update(extra or {})
    return env


def launch_ranks(argv: Sequence[str], servers: int, ranks: int, extra: dict[str, str] | None = None,
                 popen_for_server=None, env_for_server=None, master_host: str = "127.0.0.1") -> list[subprocess.Popen]:
    """s × n processes running ``argv``, rank-major by server as torchrun numbers them.

    ``popen_for_server(i)`` runs server i's ranks elsewhere (a network namespace) and
    ``env_for_server(i)`` adds variables for them; rank 0 (on server 0, at
    ``master_host``) hosts torch's rendezvous store.
    """
    master = f"{master_host}:{free_tcp_port()}"
    procs = []
    for s in range(servers):
        popen = popen_for_server(s) if popen_for_server else subprocess.Popen
        env = {**(extra or {}), **(env_for_server(s) if env_for_server else {})}
        for j in range(ranks):
            procs.append(popen(list(argv), env=rank_env(s, j, servers, ranks, master, env),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def collect(procs: Sequence[subprocess.Popen], timeout: float) -> list[tuple[int, dict[str, Any] | None, str]]:
    """(returncode, last stdout line as JSON or None, stderr) of every process; kills stragglers."""
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:  # where each one hangs, if it dumps its stacks on SIGUSR1 (tests/torch_worker.py)
                if q.poll() is None:
                    q.send_signal(signal.SIGUSR1)
            time.sleep(1.0)
            for q in procs:
                q.kill()
            stdout, stderr = p.communicate()
            stderr += f"\n(killed after {timeout:g} s)"
        lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
        out.append((p.returncode, json.loads(lines[-1]) if lines else None, stderr))
    return out
