"""The software aggregator's control channel (docs/protocol.md, "Software aggregator control
channel"): job objects as JSON, the configuration file, and the client the CLI, the
controller's tests and the benchmarks use."""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path
from typing import Any

from passing_protocol import rpc
from passing_protocol.keys import ClientKeys

from .. import wire
from ..transport import pack_address, parse_endpoint, unpack_address
from .engine import ConfigError, JobSpec
from .jobs import OWNERS, ROLES, Uplink

MAX_DATAGRAM = 65507  # the largest UDP payload over IPv4
JOB_KEYS = {"job", "base", "pool", "workers", "generation", "lanes", "role", "owners", "up"}


def worker_origin(text: str) -> int:
    """A worker's 'ip:port' as the packed origin the aggregator admits and sends RESULTs to: a
    unicast address and a port a datagram can come from and go to (not port 0, not 0.0.0.0,
    a broadcast or a multicast address), else ConfigError."""
    host, port = parse_endpoint(text, wire.UDP_PORT)
    packed = pack_address(host, port)
    ip = ipaddress.IPv4Address(packed >> 16)
    if not 0 < port < 1 << 16:
        raise ConfigError(f"worker {text!r}: UDP port {port} outside 1..65535 (no datagram comes from port 0)")
    if ip.is_unspecified or ip.is_multicast or ip == ipaddress.IPv4Address("255.255.255.255"):
        raise ConfigError(f"worker {text!r}: {ip} is not a host's address")
    return packed


def job_from_json(obj: dict[str, Any]) -> JobSpec:
    """{"job": 1, "base": 0, "pool": 256, "workers": ["10.0.0.1:20000", ...], "generation": 7?, "lanes": 364?,
    "role": "flat"|"leaf"|"root"?, "owners": [0, 0, 1, ...]?, "up": {"job", "generation", "worker", "root"}?}
    (docs/protocol.md, "Trees across racks": a leaf's ``up`` names its root's job, generation, its own worker
    there and the root's "ip:port")"""
    if not isinstance(obj, dict):
        raise ConfigError("a job entry must be a JSON object")
    unknown = set(obj) - JOB_KEYS
    if unknown:
        raise ConfigError(f"job entry: unknown keys {sorted(unknown)[:8]}")
    try:
        workers = obj["workers"]
        if not isinstance(workers, list) or not 1 <= len(workers) <= wire.MAX_WORKERS \
                or not all(isinstance(w, str) for w in workers):
            raise ConfigError(f"'workers' must be a list of 1..{wire.MAX_WORKERS} 'ip:port' strings")
        sources = [worker_origin(w) for w in workers]
        role = obj.get("role", "flat")
        if role not in ROLES:
            raise ConfigError(f"'role' must be one of {list(ROLES)}")
        owners = obj.get("owners")
        if owners is not None and (not isinstance(owners, list) or len(owners) > OWNERS
                                   or not all(type(o) is int for o in owners)):
            raise ConfigError(f"'owners' must be a list of at most {OWNERS} integers")
        return JobSpec(
            job=rpc.integer(obj, "job", 0, (1 << 16) - 1), base=rpc.integer(obj, "base", 0, 1 << 31, default=0),
            pool=rpc.integer(obj, "pool", 1, 1 << 31), sources=sources,
            generation=rpc.integer(obj, "generation", 0, wire.GENERATIONS - 1, default=None),
            lanes=rpc.integer(obj, "lanes", 1, (MAX_DATAGRAM - wire.HEADER_SIZE) // 4, default=None),
            role=role, owners=owners, up=uplink_from_json(obj.get("up")),
        )
    except KeyError as e:
        raise ConfigError(f"job entry lacks {e}") from None
    except (TypeError, ValueError, OSError) as e:
        raise ConfigError(f"bad job entry: {e}") from None


def uplink_from_json(obj: Any) -> Uplink | None:
    if obj is None:
        return None
    if not isinstance(obj, dict) or set(obj) != {"job", "generation", "worker", "root"} \
            or not isinstance(obj["root"], str):
        raise ConfigError("'up' must be {\"job\", \"generation\", \"worker\", \"root\": \"ip:port\"}")
    return Uplink(job=rpc.integer(obj, "job", 0, (1 << 16) - 1),
                  generation=rpc.integer(obj, "generation", 0, wire.GENERATIONS - 1),
                  worker=rpc.integer(obj, "worker", 0, wire.MAX_WORKERS - 1), source=worker_origin(obj["root"]))


def job_to_json(spec: JobSpec) -> dict[str, Any]:
    out: dict[str, Any] = {
        "job": spec.job, "base": spec.base, "pool": spec.pool, "generation": spec.generation, "lanes": spec.lanes,
        "workers": ["{}:{}".format(*unpack_address(s)) for s in spec.sources],
    }
    if spec.role != "flat" or spec.owners is not None:  # a flat job's object reads as it always did
        out["role"] = spec.role
        out["owners"] = spec.owners
    if spec.up is not None:
        out["up"] = {"job": spec.up.job, "generation": spec.up.generation, "worker": spec.up.worker,
                     "root": "{}:{}".format(*unpack_address(spec.up.source))}
    return out


def load_config(path: str | Path) -> dict[str, Any]:
    """The aggregator config file: {"lanes": 64, "max_lanes": 1024, "slots": 4096, "jobs": [...]}."""
    try:
        config = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read aggregator config {path}: {e}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: the config must be a JSON object")
    unknown = set(config) - {"lanes", "max_lanes", "slots", "jobs"}
    if unknown:
        raise ConfigError(f"{path}: unknown keys {sorted(unknown)}")
    return config


class ControlClient:
    """Talks to an aggregator's control socket (used by the CLI, tests and benchmarks) with the
    controller's key: the only one an aggregator admits (default: the key directory's)."""

    def __init__(self, endpoint: str, timeout: float = 5.0, keys: ClientKeys | None = None) -> None:
        self.endpoint, self.timeout = endpoint, timeout
        self.keys = keys or ClientKeys.load(role="controller", server="aggregator")

    def request(self, cmd: str, **fields: Any) -> dict[str, Any]:
        reply = rpc.call(self.endpoint, {"version": rpc.AGGREGATOR_VERSION, "cmd": cmd, **fields}, self.timeout,
                         self.keys)
        if not reply.get("ok"):
            raise ConfigError(f"aggregator refused {cmd}: {reply.get('error')}")
        return reply
