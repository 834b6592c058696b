"""One JSON request/reply over ZeroMQ, with a deadline: the aggregator's and the controller's
control channels both use it."""

from __future__ import annotations

import json
from typing import Any

import zmq


def call(endpoint: str, request: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Send ``request``, return the reply; TimeoutError when none comes in ``timeout`` s.

    A fresh REQ socket per call: a lost reply never wedges a later call.
    """
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(json.dumps(request).encode())
        if not sock.poll(int(timeout * 1000)):
            raise TimeoutError(f"{endpoint} did not answer {request.get('cmd')!r} within {timeout:g} s")
        return json.loads(sock.recv())
    finally:
        sock.close()
