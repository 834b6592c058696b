"""A Mininet network of hosts around one BMv2 `simple_switch_grpc`, programmed over P4Runtime.

Mininet traps (docs/bmv2.md): never `mn -c`, always `net.stop()`; no OVS is needed
(`controller=None` and our own Switch subclass); offloads are turned off on every veth
so BMv2, which reads raw frames, sees real checksummed single packets.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BUILD = REPO / "build" / "v1model"
AGGREGATION_MAC = "02:00:00:00:00:fe"
AGGREGATION_IP = "10.0.0.254"


def import_mininet():
    """Mininet comes from Debian's package (system site-packages), not from PyPI."""
    try:
        import mininet.net  # noqa: F401
    except ImportError:
        sys.path.append("/usr/lib/python3/dist-packages")
        import mininet.net  # noqa: F401
    return mininet


def missing_requirements() -> str | None:
    """Why the BMv2 suite cannot run here, or None."""
    if os.geteuid() != 0:
        return "BMv2 tests need root (Mininet network namespaces)"
    for tool in ("simple_switch_grpc", "p4c-bm2-ss", "mnexec", "ethtool"):
        if shutil.which(tool) is None:
            return f"{tool} not found (docs/bmv2.md: install BMv2, p4c and Mininet from upstream)"
    try:
        import_mininet()
    except ImportError:
        return "the mininet Python package is not importable (apt-get install mininet)"
    return None


def compile_p4() -> tuple[Path, Path]:
    """`make p4`: BMv2 JSON and P4Info in build/v1model."""
    subprocess.run(["make", "-s", "p4"], cwd=REPO, check=True)
    return BUILD / "passing.p4info.txtpb", BUILD / "passing.json"


def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process(process: subprocess.Popen) -> None:
    """A switch process asked to stop, killed if it has not within 10 s, and reaped."""
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def host_mac(i: int) -> str:
    return f"02:00:00:00:00:{i:02x}"


@dataclass
class HostInfo:
    name: str
    mac: str
    ip: str
    port: int  # switch port


class Agent:
    """The JSON-lines agent (bmv2_tests/agent.py) inside one host."""

    def __init__(self, host) -> None:
        self.proc = host.popen([sys.executable, str(Path(__file__).with_name("agent.py"))],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def call(self, **request) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("host agent exited")
        reply = json.loads(line)
        if not reply["ok"]:
            raise RuntimeError(f"host agent: {reply['error']}")
        return reply

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(5)


def make_switch_class():
    import_mininet()
    from mininet.node import Switch

    class BMv2Switch(Switch):
        """Starts simple_switch_grpc on the switch's interfaces, with no program:
        the controller pushes the pipeline over P4Runtime."""

        def __init__(self, name, grpc_port: int, log_dir: str, **params):
            super().__init__(name, **params)
            self.grpc_port = grpc_port
            self.log_dir = log_dir
            self.process: subprocess.Popen | None = None

        def start(self, controllers):
            ports = [f"{port}@{intf.name}" for intf, port in self.ports.items() if intf.name != "lo"]
            for intf in self.intfList():
                if intf.name != "lo":
                    _no_offload(intf.name)
            args = ["simple_switch_grpc", "--device-id", "0", "--no-p4", "--thrift-port", str(free_tcp_port())]
            if os.environ.get("PASSING_BMV2_LOG"):  # per-packet logging slows BMv2 down many times
                args += ["--log-file", os.path.join(self.log_dir, self.name), "--log-flush"]
            for p in ports:
                args += ["-i", p]
            args += ["--", "--grpc-server-addr", f"127.0.0.1:{self.grpc_port}"]
            with open(os.path.join(self.log_dir, f"{self.name}.out"), "w") as output:  # the child keeps its copy
                self.process = subprocess.Popen(args, stdout=output, stderr=subprocess.STDOUT)

        def stop(self, deleteIntfs=True):
            if self.process is not None:
                stop_process(self.process)
                self.process = None
            super().stop(deleteIntfs)

    return BMv2Switch


def _no_offload(intf: str) -> None:
    subprocess.run(["ethtool", "-K", intf, "tx", "off", "rx", "off", "tso", "off", "gso", "off", "gro", "off"],
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_for_grpc(switch, grpc_port: int, log_dir: str, timeout: float = 60) -> None:
    """Until the switch listens (a loaded machine, the rest of CI's suite beside it, has taken over
    20 s to start it); a switch that exited, or never listens, is an error that says what it wrote
    (the log directory goes with the network)."""
    deadline = time.monotonic() + timeout
    process = switch.process
    while time.monotonic() < deadline and (process is None or process.poll() is None):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", grpc_port)) == 0:
                return
        time.sleep(0.1)
    state = "running" if process is None or process.poll() is None else f"exited with {process.returncode}"
    try:
        said = Path(log_dir, f"{switch.name}.out").read_text()[-2000:]
    except OSError as e:
        said = f"(no output: {e})"
    raise RuntimeError(f"simple_switch_grpc {switch.name} did not listen on {grpc_port} within {timeout:g} s "
                       f"({state}); it wrote: {said}")


def prepare_hosts(net, hosts: list[HostInfo], arp: dict[str, dict[str, str]]) -> None:
    """Offloads and IPv6 off on every host's interface, and static ARP: every other host, and the
    addresses ``arp[host name]`` gives it (its aggregator's)."""
    for info in hosts:
        h = net.get(info.name)
        intf = h.defaultIntf().name
        h.cmd(f"ethtool -K {intf} tx off rx off tso off gso off gro off")
        h.cmd(f"sysctl -qw net.ipv6.conf.{intf}.disable_ipv6=1")  # no IPv6 chatter through the switch
        for ip, mac in arp.get(info.name, {}).items():
            h.setARP(ip, mac)
        for other in hosts:
            if other is not info:
                h.setARP(other.ip, other.mac)


def start_ps(node, ip: str) -> subprocess.Popen:
    """A software aggregator (PS) on Mininet host ``node``: data at ``ip``:9877, control at tcp://``ip``:9878;
    returns once it says it is ready."""
    proc = node.popen([sys.executable, "-m", "passing.cli", "aggregator", "serve", "--listen", f"{ip}:9877",
                       "--control", f"tcp://{ip}:9878"], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line or json.loads(line).get("event") != "ready":
        proc.kill()
        raise RuntimeError(f"the PS at {ip} did not start: {line!r}")
    return proc


class MininetWithAgents:
    """What a Mininet network of these tests shares: ``net``, ``log_dir`` and each host's packet agent, made on
    first use and closed with the network."""

    net: Any
    log_dir: str
    agents: dict[str, Agent]

    def agent(self, host: str) -> Agent:
        if host not in self.agents:
            self.agents[host] = Agent(self.net.get(host))
        return self.agents[host]

    def stop(self) -> None:
        for a in self.agents.values():
            try:
                a.close()
            except Exception:  # best effort on the way out
                a.proc.kill()
        self.net.stop()
        shutil.rmtree(self.log_dir, ignore_errors=True)


class Bmv2Network(MininetWithAgents):
    """n hosts h1..hn on switch ports 1..n, all in 10.0.0.0/24, and the switch.

    ``extra`` adds named hosts after them, e.g. a PS host, or a host in the root
    namespace (``root=True``) where the controller runs: it reaches the switch's gRPC
    port on localhost and the hosts through the switch.
    """

    def __init__(self, hosts: int, extra: tuple[tuple[str, str, bool], ...] = ()) -> None:
        import_mininet()
        from mininet.net import Mininet

        self.log_dir = tempfile.mkdtemp(prefix="passing-bmv2-")
        self.grpc_port = free_tcp_port()
        BMv2Switch = make_switch_class()
        self.net = Mininet(controller=None, build=False, autoSetMacs=False, autoStaticArp=False)
        self.agents: dict[str, Agent] = {}
        try:
            self._start(hosts, extra, BMv2Switch)
        except BaseException:
            self.stop()  # a half-built network would leave veths behind and break the next run
            raise

    def _start(self, hosts: int, extra: tuple[tuple[str, str, bool], ...], BMv2Switch: type) -> None:
        self.switch = self.net.addSwitch("s1", cls=BMv2Switch, grpc_port=self.grpc_port, log_dir=self.log_dir)
        self.hosts: list[HostInfo] = []
        specs = [(f"h{i}", f"10.0.0.{i}", False) for i in range(1, hosts + 1)] + list(extra)
        for i, (name, ip, root) in enumerate(specs, start=1):
            info = HostInfo(name, host_mac(i), ip, i)
            self.net.addHost(info.name, ip=f"{info.ip}/24", mac=info.mac, inNamespace=not root)
            self.net.addLink(info.name, "s1", port2=i)
            self.hosts.append(info)
        self.net.build()
        self.net.start()
        prepare_hosts(self.net, self.hosts, {h.name: {AGGREGATION_IP: AGGREGATION_MAC} for h in self.hosts})
        self._wait_for_grpc()

    def _wait_for_grpc(self) -> None:
        wait_for_grpc(self.switch, self.grpc_port, self.log_dir)

    @property
    def p4runtime_address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def topology(self) -> dict:
        """The controller's topology file for this network."""
        return {
            "switch": {"p4runtime": self.p4runtime_address, "device_id": 0, "aggregation_mac": AGGREGATION_MAC,
                       "aggregation_ip": AGGREGATION_IP},
            "hosts": [{"name": h.name, "mac": h.mac, "ip": h.ip, "port": h.port} for h in self.hosts],
        }

