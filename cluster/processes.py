"""Stopping what a local deployment started: one rule for cluster/local.py and cluster/netns.py."""

from __future__ import annotations

import subprocess

STOP_GRACE = 10.0  # s a process has to exit after SIGTERM before it is killed


def stop_processes(procs: list[subprocess.Popen], grace: float = STOP_GRACE) -> None:
    """SIGTERM to every process of ``procs`` still running, the last started first (ranks before the
    services they use), then SIGKILL to any that has not exited ``grace`` s later."""
    for p in reversed(procs):
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            p.kill()
