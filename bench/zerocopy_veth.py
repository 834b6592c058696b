"""MSG_ZEROCOPY against a plain copy on a veth pair (issue 46): is it worth a place in the host's UDP path?

One sender (core 0, namespace W) sends GSO messages of 128 x 272 bytes (128 packets of 64 lanes) to one receiver
(core 1, namespace A, UDP_GRO on) for ``--messages`` messages, with and without MSG_ZEROCOPY (SO_ZEROCOPY, the
completions read from the error queue as they come), alternating ``--rounds`` times. The figure is the payload
per second of the sender's own CPU time (user + system; on veth the receive softirq of its packets runs on its
core and is charged to it, as in section 8 of bench/core.py). Root (network namespaces). Run by hand:
``sudo .venv/bin/python bench/zerocopy_veth.py``; docs/benchmarks.md has the figures.
"""

from __future__ import annotations

import argparse
import os
import resource
import select
import socket
import struct
import subprocess
import sys
import time

SO_ZEROCOPY, MSG_ZEROCOPY, SOL_UDP, UDP_SEGMENT, UDP_GRO = 60, 0x4000000, 17, 103, 104
PACKET, SEGMENTS, PORT = 272, 128, 9000
SENDER_IP, RECEIVER_IP = "10.58.0.1", "10.58.0.2"


def receive(total: int) -> None:
    """The receiver: reads until ``total`` bytes came or 3 s passed without any; prints what it got."""
    r = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    r.setsockopt(SOL_UDP, UDP_GRO, 1)
    r.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    r.bind((RECEIVER_IP, PORT))
    r.settimeout(3)
    print("ready", flush=True)
    got, buf = 0, bytearray(65536)
    try:
        while got < total:
            got += r.recv_into(buf)
    except TimeoutError:
        pass
    print(f"received {got} bytes", flush=True)


def drain_completions(s: socket.socket) -> None:
    while True:
        try:
            s.recvmsg(0, 256, socket.MSG_ERRQUEUE | socket.MSG_DONTWAIT)
        except OSError:
            return


def send(zerocopy: bool, messages: int) -> None:
    """The sender: ``messages`` GSO messages; prints its CPU time and the payload rate per CPU second."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    if zerocopy:
        s.setsockopt(socket.SOL_SOCKET, SO_ZEROCOPY, 1)
    s.connect((RECEIVER_IP, PORT))
    data = bytearray(os.urandom(PACKET * SEGMENTS))
    cmsg = [(SOL_UDP, UDP_SEGMENT, struct.pack("=H", PACKET))]
    flags = MSG_ZEROCOPY if zerocopy else 0
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for i in range(messages):
        while True:
            try:
                s.sendmsg([data], cmsg, flags)
                break
            except OSError:  # ENOBUFS or EAGAIN: the completions' memory (zero-copy) or the buffer is full
                if zerocopy:
                    drain_completions(s)
                select.select([s], [], [], 0.001)
        if zerocopy and i % 8 == 7:
            drain_completions(s)
    t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    user, system = r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime
    print(f"{'zerocopy' if zerocopy else 'copy':>8}: user {user:.3f} s, system {system:.3f} s, "
          f"{messages * len(data) * 8 / (user + system) / 1e9:6.2f} Gbit/s per sender CPU second, wall {t1 - t0:.2f} s",
          flush=True)


def sh(*args: str) -> None:
    subprocess.run(list(args), check=True, capture_output=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--messages", type=int, default=30000)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    if os.geteuid() != 0:
        print("zerocopy_veth: needs root (network namespaces)", file=sys.stderr)
        return 1
    tag = f"zc{os.getpid()}"
    sender_ns, receiver_ns = f"{tag}-w", f"{tag}-a"
    made: list[str] = []
    try:
        for ns in (sender_ns, receiver_ns):
            sh("ip", "netns", "add", ns)
            made.append(ns)
            sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        sh("ip", "link", "add", f"{tag}w", "netns", sender_ns, "type", "veth", "peer", "name", f"{tag}a", "netns",
           receiver_ns)
        for ns, dev, ip in ((sender_ns, f"{tag}w", SENDER_IP), (receiver_ns, f"{tag}a", RECEIVER_IP)):
            sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{ip}/24", "dev", dev)
            sh("ip", "netns", "exec", ns, "ip", "link", "set", dev, "up")
        total = args.messages * PACKET * SEGMENTS
        print(f"load average {os.getloadavg()[0]:.2f}")
        for _ in range(args.rounds):
            for zerocopy in (False, True):
                rcv = subprocess.Popen(["ip", "netns", "exec", receiver_ns, "taskset", "-c", "1", sys.executable,
                                        __file__, "--receive", str(total)], stdout=subprocess.PIPE, text=True)
                assert rcv.stdout is not None
                rcv.stdout.readline()
                subprocess.run(["ip", "netns", "exec", sender_ns, "taskset", "-c", "0", sys.executable, __file__,
                                "--send", str(int(zerocopy)), str(args.messages)], check=True)
                print(f"{'':>10}{rcv.communicate(timeout=60)[0].strip()}", flush=True)
        print(f"load average {os.getloadavg()[0]:.2f}")
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--receive":
        receive(int(sys.argv[2]))
    elif len(sys.argv) == 4 and sys.argv[1] == "--send":
        send(bool(int(sys.argv[2])), int(sys.argv[3]))
    else:
        sys.exit(main())
