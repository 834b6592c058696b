"""PASSING's services on a cluster of racks (cluster/netns.RackNetwork), as bench/emulated_racks.py and
tests/test_torch_tree_netns.py run them: software aggregators in the network's namespaces (a rack's leaf
namespace, the spine, a host), and a controller in the spine namespace on a topology whose fabric names a
PS leaf per rack and a PS root, with spare PSs that no node of the fabric names (docs/control.md)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .local import start_controller
from .netns import RackNetwork

PORT = 9877  # every aggregator's data port, at its namespace's address

Popen = Callable[..., subprocess.Popen]  # (where, argv, **kwargs): RackNetwork.popen or a wrapper of it


def start_aggregator_in(popen: Popen, where: str, ip: str, control: str, extra: Sequence[str] = ()
                        ) -> tuple[subprocess.Popen, dict[str, str]]:
    """`passing.cli aggregator serve` in ``where`` (a host, a leaf or "switch"), listening at ``ip``; returns
    the process (``ip netns exec`` execs it: its pid is the aggregator's) and its data and control endpoints
    as a topology's "ps" entry names them."""
    proc = popen(where, [sys.executable, "-m", "passing.cli", "aggregator", "serve", "--listen", f"{ip}:{PORT}",
                         "--control", control, *extra], stdout=subprocess.PIPE, text=True)
    if not proc.stdout.readline():
        proc.wait(10)
        raise RuntimeError(f"the aggregator in {where} exited with {proc.returncode} before it was ready")
    return proc, {"data": f"{ip}:{PORT}", "control": control}


def rack_hosts(net: RackNetwork, rack: int) -> list[str]:
    """The addresses of rack ``rack``'s servers (hosts r<rack>s<i>), in order."""
    return [h.ip for name, h in net.hosts.items() if name.startswith(f"r{rack}s")]


def fabric_topology(net: RackNetwork, leaves: Sequence[dict[str, str]], root: dict[str, str],
                    spares: Sequence[dict[str, str]] = ()) -> dict[str, Any]:
    """The controller's topology: ``leaves[k]`` (an aggregator's endpoints) rack k's node, over its servers,
    uplinked to the spine, whose node is ``root``; ``spares``, named by no node, may take a node's place."""
    fabric = [{"name": f"rack{k}", "ps": leaf["data"], "uplink": "spine", "hosts": rack_hosts(net, k)}
              for k, leaf in enumerate(leaves)]
    return {"ps": [*leaves, root, *spares], "fabric": [*fabric, {"name": "spine", "ps": root["data"]}]}


def start_spine_controller(net: RackNetwork, topology: dict[str, Any], workdir: Path, port: int,
                           extra: Sequence[str] = ()) -> tuple[subprocess.Popen, str]:
    """`passing-controller` on ``topology`` in the spine namespace, listening on its bridge's address at
    ``port`` (files in ``workdir``); returns the process and its endpoint."""
    endpoint = f"tcp://{net.switch.ip}:{port}"
    proc, _ = start_controller(topology, workdir, endpoint, extra,
                               popen=lambda argv, **kw: net.popen("switch", argv, **kw))
    return proc, endpoint
