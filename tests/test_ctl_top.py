"""`passing-ctl top` in a pseudo-terminal: a real controller and aggregator, two workers streaming,
and the screen read through a terminal emulator (pyte) as a person would see it."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import termios
import threading
import time

import numpy as np
import pytest

from cluster.local import BIN, free_tcp_port
from passing import Group
from passing.control import join, leave, report
from passing.launch import free_udp_ports
from tests.cluster import run_threads, start_aggregator, start_controller

pyte = pytest.importorskip("pyte", reason="pyte is not installed (pip install -e 'controller[test]')")

ROWS, COLUMNS = 24, 132


class Terminal:
    """A process on a pty of ROWS x COLUMNS, its output rendered by pyte."""

    def __init__(self, argv: list[str]) -> None:
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, COLUMNS, 0, 0))
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, start_new_session=True,
                                     # curses takes LINES and COLUMNS over the terminal's size (pytest-xdist's
                                     # workers run with COLUMNS set)
                                     env={**os.environ, "TERM": "xterm-256color", "LINES": str(ROWS),
                                          "COLUMNS": str(COLUMNS)})
        os.close(slave)
        self.master = master
        self.screen = pyte.Screen(COLUMNS, ROWS)
        self.stream = pyte.ByteStream(self.screen)

    def pump(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if select.select([self.master], [], [], left)[0]:
                try:
                    self.stream.feed(os.read(self.master, 65536))
                except OSError:  # the process closed the terminal
                    return

    def wait_for(self, check, timeout: float = 20.0) -> list[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.pump(0.2)
            if check(self.screen.display):
                return self.screen.display
        raise AssertionError("screen never showed it:\n" + "\n".join(self.screen.display))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        os.close(self.master)


def job_row(lines: list[str]) -> list[str] | None:
    rows = [line.split() for line in lines if line.startswith("watched ")]
    return rows[0] if rows else None


@pytest.mark.timeout(120)
def test_top_shows_jobs_modes_slots_and_rates(tmp_path):
    agg, ready = start_aggregator()
    ctl, ctl_ready = start_controller({"ps": [{"data": ready["data"], "control": ready["control"]}]}, tmp_path,
                                      f"tcp://127.0.0.1:{free_tcp_port()}")
    endpoint = ctl_ready["endpoint"]
    stop = threading.Event()
    ports = free_udp_ports(2)

    def work(w: int) -> int:
        answer = join(endpoint, "watched", w, 2, host="127.0.0.1", udp_port=ports[w], pool=8, timeout=30)
        token = answer["token"]
        calls = 0
        with Group.from_answer(answer, bind=("127.0.0.1", ports[w]), timeout=10) as g:
            while True:
                data = np.ones(64 * 64, dtype=np.float32)
                data[-1] = 1.0 if stop.is_set() else 0.0  # the workers stop after the same call, whoever saw it
                summed = g.allreduce(data)
                calls += 1
                report(endpoint, "watched", 0, w, token,
                       {**g.stats.as_dict(), "calls": calls, "call_seconds": calls * 0.001})
                if summed[-1] > 0:
                    break
                time.sleep(0.02)
        leave(endpoint, "watched", 0, w, token)
        return calls

    workers = threading.Thread(target=lambda: results.extend(run_threads(work, 2)))
    results: list = []
    term = Terminal([str(BIN / "passing-ctl"), "--controller", endpoint, "top"])
    try:
        workers.start()
        # rates need two answers: wait for a row whose packet rate is a number above 0, drawn to its end
        # (a read of the terminal can end in the middle of a redraw)
        lines = term.wait_for(lambda d: (r := job_row(d)) is not None and r[6] != "-" and float(r[6]) > 0
                              and r[-1] == "running")
        assert lines[0].startswith(f"PASSING top  {endpoint}")
        assert f"ps {ready['control']} up 8/4096 slots used" in lines[1]
        assert "1 on a PS" in lines[2] and "1 ps, 0 waiting" in lines[2]
        header = next(line for line in lines if line.startswith("JOB"))
        assert header.split()[:8] == ["JOB", "GROUP", "ID", "MODE", "SLOTS", "WORKERS", "PKT/S", "ROUNDS/S"]
        row = job_row(lines)
        assert row[1:6] == ["0", "1", "ps", "8", "2"] and row[-1] == "running", row
        assert float(row[7]) > 0 and float(row[9]) > 0  # rounds and calls per second
        stop.set()
        workers.join(30)
        assert all(isinstance(c, int) and c > 0 for c in results), results
        term.wait_for(lambda d: (r := job_row(d)) is not None and r[-1] == "ended")
        os.write(term.master, b"q")
        assert term.proc.wait(10) == 0
    finally:
        stop.set()
        term.close()
        for p in (ctl, agg):
            p.terminate()
            p.wait(10)


def test_top_once_prints_a_frame_and_top_needs_a_terminal(tmp_path):
    agg, ready = start_aggregator()
    ctl, ctl_ready = start_controller({"ps": [{"data": ready["data"], "control": ready["control"]}]}, tmp_path,
                                      f"tcp://127.0.0.1:{free_tcp_port()}")
    try:
        argv = [str(BIN / "passing-ctl"), "--controller", ctl_ready["endpoint"], "top"]
        frame = subprocess.run([*argv, "--once"], capture_output=True, text=True, timeout=30)
        assert frame.returncode == 0 and "(no job groups)" in frame.stdout and "JOB" in frame.stdout, frame.stderr
        piped = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=30)
        assert piped.returncode == 2 and "top needs a terminal" in piped.stderr
    finally:
        for p in (ctl, agg):
            p.terminate()
            p.wait(10)
