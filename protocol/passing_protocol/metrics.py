"""The Prometheus HTTP server of ``--metrics ADDR:PORT``: the controller's (``passing-controller``,
docs/control.md) and a software aggregator's (``passing-aggregator serve``). What each one
exports is its own (``passing_controller.metrics``, ``passing.metrics``): ``collect`` yields it.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server
from prometheus_client.core import Metric


def parse_address(text: str, example_port: int) -> tuple[str, int]:
    """'ADDR:PORT' (':PORT': every address; port 0: any free one) -> (addr, port), or ValueError.
    ``example_port``: the program's usual port, which the error's example shows."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not port_text.isdigit() or not 0 <= int(port_text) < 65536:
        raise ValueError(f"--metrics wants ADDR:PORT, e.g. 0.0.0.0:{example_port}; got {text!r}")
    return host or "0.0.0.0", int(port_text)


class MetricsServer:
    """An HTTP server answering GET /metrics from ``collect``, in a thread of its own
    (``example_port``: as for ``parse_address``)."""

    def __init__(self, address: str, collect: Callable[[], Iterator[Metric]], example_port: int) -> None:
        host, bound = parse_address(address, example_port)
        registry = CollectorRegistry()
        registry.register(_Collector(collect))
        ProcessCollector(registry=registry)  # process_cpu_seconds_total, resident memory, open fds
        try:
            self.httpd, self.thread = start_http_server(bound, host, registry=registry)
        except (OSError, socket.gaierror) as e:
            raise OSError(f"cannot serve metrics on {address}: {e}") from None
        self.address = "{}:{}".format(*self.httpd.server_address[:2])

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _Collector:
    def __init__(self, collect: Callable[[], Iterator[Metric]]) -> None:
        self.collect = collect
