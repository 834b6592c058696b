"""Options of the "passing" backend: pg_options, keyword arguments or PASSING_* variables.

Precedence: a field set in ``Options(...)`` (given as ``pg_options``) wins over the
environment variable, which wins over the default. docs/torch.md lists them all.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, fields
from typing import Any

from .. import native, wire
from ..native import ENGINES
from ..stripes import default_streams

MAX_STREAMS = 16  # the controller's (a join's "streams": docs/control.md)


@dataclass(frozen=True)
class Scheme:
    """One of the schemes of docs/torch.md ("Schemes"): in-host stage or not, and which aggregator."""

    in_host: bool  # reduce-scatter / all-gather among the ranks of a server around the network stage
    aggregator: str | None  # "any": the switch if it can serve, else a PS; "ps": a PS; None: plain gloo


SCHEMES: dict[str, Scheme] = {
    "passing": Scheme(in_host=True, aggregator="any"),
    "psring": Scheme(in_host=True, aggregator="ps"),
    "switchml": Scheme(in_host=False, aggregator="any"),
    "ps": Scheme(in_host=False, aggregator="ps"),
    "ring": Scheme(in_host=False, aggregator=None),
}


REDUCE_SCATTER, ALL_GATHER = SHARDED_COLLECTIVES = ("reduce_scatter", "all_gather")  # what keep_on_gloo may name
# With no controller configured: "off", the network stage is a collective among the peers (no
# aggregator, so as fast as gloo); "ps", rank 0 runs an embedded controller and software aggregator.
EMBEDDED = ("off", "ps")
DEVICE_BACKENDS = ("auto", "nccl", "gloo")  # what carries CUDA tensors where PASSING does not


class OptionError(ValueError):
    """An option with a value the backend cannot use."""


@dataclass(frozen=True)
class Options:
    """Every field left at None is taken from its PASSING_* variable, else the default."""

    controller: str | None = None  # PASSING_CONTROLLER: the controller's ZeroMQ endpoint; unset: no aggregator
    embedded: str | None = None  # PASSING_EMBEDDED: with no controller, "off" (peers sum over gloo/NCCL) or "ps"
    # (rank 0 runs an embedded controller and software aggregator)
    scheme: str | None = None  # PASSING_SCHEME: passing | psring | switchml | ps | ring
    scale: str | float | None = None  # PASSING_SCALE: "auto" or a fixed scale such as 1e8
    on_overflow: str | None = None  # PASSING_ON_OVERFLOW: raise | auto (redo an overflowing call in auto)
    pool: int | None = None  # PASSING_POOL: slots per group (default: the controller's)
    timeout: float | None = None  # PASSING_TIMEOUT: seconds a packet may stay unanswered (at most the process
    # group's timeout)
    join_timeout: float | None = None  # PASSING_JOIN_TIMEOUT: seconds to wait for the group to join (at most the
    # process group's timeout)
    rto: float | None = None  # PASSING_RTO: the least a silent stream waits before it resends on a loss-free path
    host: str | None = None  # PASSING_HOST: this rank's IP for PASSING traffic
    server: str | None = None  # PASSING_SERVER: which server this rank is on
    job: str | None = None  # PASSING_JOB: job name at the controller (default: a fresh one per run)
    engine: str | None = None  # PASSING_ENGINE: host streaming engine, auto | native | numpy
    io: str | None = None  # PASSING_IO: I/O path, auto (AF_XDP beside the UDP socket where it can run) | udp | xdp
    streams: int | None = None  # PASSING_STREAMS: streams (a thread, socket and job each) a rank's reduce passes
    # are striped over, 1..16 (passing.stripes; default: from link_gbit where given, else 1)
    link_gbit: float | None = None  # PASSING_LINK_GBIT: a rank's share of its server's link, Gbit/s each way: the
    # default streams are stripes.default_streams(link_gbit, 64) (native engine; unset: 1 stream)
    failover_after: float | None = None  # PASSING_FAILOVER_AFTER: silent this long, move the group (0: never;
    # default: 5 s, or half the timeout when that is shorter)
    report_interval: float | None = None  # PASSING_REPORT_INTERVAL: s between reports to the controller (0: at leave)
    mtu: int | None = None  # PASSING_MTU: path MTU to rank 0's embedded aggregator (default: its interface's)
    keep_on_gloo: tuple[str, ...] | str | None = None  # PASSING_KEEP_ON_GLOO: sharded collectives that stay on the
    # device's backend, comma-separated: reduce_scatter, all_gather (default: none)
    shared_memory: str | None = None  # PASSING_SHARED_MEMORY: where the ranks of a server share the in-host stage's
    # segment (a tmpfs directory; default /dev/shm), or "off": a ring over loopback TCP instead
    device_backend: str | None = None  # PASSING_DEVICE_BACKEND: what carries CUDA tensors' collectives that PASSING
    # does not stream, and their in-host and peer stages: nccl, gloo (ranks that share a GPU, which NCCL refuses;
    # the in-host stage then goes through host memory), or auto (default: NCCL where torch has it, else gloo)

    DEFAULTS = {"controller": None, "embedded": "off", "scheme": "passing", "scale": "auto", "on_overflow": "raise",
                "pool": None, "timeout": 300.0, "join_timeout": 120.0, "rto": 1.0, "host": None, "server": None,
                "job": None, "engine": "auto", "io": "auto", "streams": None, "link_gbit": None,
                "failover_after": None, "report_interval": 10.0, "mtu": None, "keep_on_gloo": (),
                "shared_memory": "/dev/shm", "device_backend": "auto"}

    def resolve(self, environ: dict[str, str] | None = None, limit: float | None = None) -> Options:
        """A copy with every field filled in, checked. ``limit``: the process group's timeout in seconds, which
        bounds every wait of the network stage as it bounds gloo's collectives: ``timeout`` and ``join_timeout``
        are at most that (and ``failover_after`` below ``timeout``)."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                raw = env.get(f"PASSING_{f.name.upper()}")
                value = self._parse(f.name, raw) if raw not in (None, "") else self.DEFAULTS[f.name]
            values[f.name] = value
        keep = values["keep_on_gloo"]
        values["keep_on_gloo"] = tuple(v.strip() for v in (keep.split(",") if isinstance(keep, str) else keep)
                                       if v.strip())
        if limit is not None and limit > 0:
            values["timeout"] = min(values["timeout"], limit)
            values["join_timeout"] = min(values["join_timeout"], limit)
            if values["failover_after"] is not None and values["failover_after"] >= values["timeout"]:
                values["failover_after"] = values["timeout"] / 2
        if values["failover_after"] is None:
            values["failover_after"] = min(5.0, values["timeout"] / 2)
        if values["streams"] is None:  # from the link where it is given, on the engine that can stripe
            link, engine = values["link_gbit"], values["engine"]
            native_here = engine == "native" or (engine == "auto" and native.available())
            values["streams"] = default_streams(link, wire.DEFAULT_LANES) if link and link > 0 and native_here else 1
        if values["server"] is None:
            # torchrun's node rank names the server; without torchrun, the machine does.
            values["server"] = env.get("GROUP_RANK") or socket.gethostname()
        if values["host"] is None and values["scheme"] != "ring" and values["controller"] is not None:
            values["host"] = route_source(values["controller"])  # embedded: once rank 0 says where it is
        out = Options(**values)
        out._check()
        return out

    @staticmethod
    def _parse(name: str, raw: str) -> Any:
        try:
            if name in ("pool", "mtu", "streams"):
                return int(raw)
            if name in ("timeout", "join_timeout", "rto", "failover_after", "report_interval", "link_gbit"):
                return float(raw)
            if name == "scale":
                return raw if raw == "auto" else float(raw)
        except ValueError:
            raise OptionError(f"PASSING_{name.upper()}={raw!r} is not a number") from None
        return raw

    def _check(self) -> None:
        if self.embedded not in EMBEDDED:
            raise OptionError(f"embedded must be one of {', '.join(EMBEDDED)}; got {self.embedded!r}")
        if self.embedded == "ps" and self.controller is not None:
            raise OptionError(f"embedded='ps' (PASSING_EMBEDDED) starts a controller in rank 0, and a controller "
                              f"is configured ({self.controller}): set one or the other")
        if self.scheme not in SCHEMES:
            raise OptionError(f"scheme must be one of {', '.join(SCHEMES)}; got {self.scheme!r}")
        if self.scale != "auto" and not (isinstance(self.scale, (int, float)) and self.scale > 0):
            raise OptionError(f"scale must be 'auto' or a positive number; got {self.scale!r}")
        if self.engine not in ENGINES:
            raise OptionError(f"engine must be one of {', '.join(ENGINES)}; got {self.engine!r}")
        if self.io not in ("auto", "udp", "xdp"):
            raise OptionError(f"io must be one of auto, udp, xdp; got {self.io!r}")
        if self.on_overflow not in ("raise", "auto"):
            raise OptionError(f"on_overflow must be 'raise' or 'auto'; got {self.on_overflow!r}")
        if self.pool is not None and not 1 <= self.pool <= 1 << 16:
            raise OptionError(f"pool must be 1..65536; got {self.pool}")
        if not 1 <= self.streams <= MAX_STREAMS:
            raise OptionError(f"streams must be 1..{MAX_STREAMS}; got {self.streams}")
        if self.streams > 1 and (self.engine == "numpy" or not native.available()):
            raise OptionError(f"streams={self.streams} needs the native engine (engine={self.engine!r}"
                              f"{'' if native.available() else ', and the native library is not built'})")
        if self.link_gbit is not None and not self.link_gbit > 0:
            raise OptionError(f"link_gbit must be positive (Gbit/s); got {self.link_gbit}")
        if self.mtu is not None and not 68 <= self.mtu <= 65536:
            raise OptionError(f"mtu must be 68..65536 (bytes of an IPv4 packet); got {self.mtu}")
        for name in ("timeout", "join_timeout", "rto"):
            if not getattr(self, name) > 0:
                raise OptionError(f"{name} must be positive; got {getattr(self, name)}")
        if not 0 <= self.failover_after < self.timeout:
            raise OptionError(f"failover_after must be 0 (off) or below timeout ({self.timeout:g} s); "
                              f"got {self.failover_after}")
        unknown = set(self.keep_on_gloo) - set(SHARDED_COLLECTIVES)
        if unknown:
            raise OptionError(f"keep_on_gloo takes {', '.join(SHARDED_COLLECTIVES)}; got {', '.join(sorted(unknown))}")
        if self.device_backend not in DEVICE_BACKENDS:
            raise OptionError(f"device_backend must be one of {', '.join(DEVICE_BACKENDS)}; "
                              f"got {self.device_backend!r}")
        if self.shared_memory != "off" and not os.path.isabs(str(self.shared_memory)):
            raise OptionError(f"shared_memory must be 'off' or an absolute directory; got {self.shared_memory!r}")
        if not self.report_interval >= 0:
            raise OptionError(f"report_interval must be 0 or more; got {self.report_interval}")


def route_source(endpoint: str) -> str:
    """The local IP address the kernel would send from toward the controller's host."""
    host = endpoint.split("://", 1)[-1].rsplit(":", 1)[0]
    if host in ("*", "0.0.0.0", "localhost"):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # no packet is sent: connect() only picks the route
            return s.getsockname()[0]
    except OSError as e:
        raise OptionError(f"no route to the controller host {host!r} ({e}); set PASSING_HOST") from None
