"""One JSON request/reply over ZeroMQ, authenticated with CURVE, with a deadline: the CLI asks
the controller, the controller asks software aggregators. (The host package has its own twin:
the two distributions share protocols, not code.)"""

from __future__ import annotations

import json
from typing import Any

import zmq

from .keys import ClientKeys

MAX_REPLY_BYTES = 16 * 1024 * 1024  # a status or metrics answer of thousands of groups fits


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, allow_nan=False).encode()


def call(endpoint: str, request: dict[str, Any], timeout: float, keys: ClientKeys) -> dict[str, Any]:
    """Send ``request``, return the reply; TimeoutError when none comes in ``timeout`` s (a
    server that does not know ``keys`` never answers: CURVE drops the connection).

    A fresh REQ socket per call: a lost reply never wedges a later call.
    """
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
    try:
        keys.apply(sock)
        sock.connect(endpoint)
        sock.send(encode(request))
        if not sock.poll(int(timeout * 1000)):
            raise TimeoutError(f"{endpoint} did not answer {request.get('cmd')!r} within {timeout:g} s"
                               " (down, busy, or it does not know this key)")
        try:
            reply = json.loads(sock.recv())
        except ValueError as e:
            raise ConnectionError(f"{endpoint} answered {request.get('cmd')!r} with no JSON: {e}") from None
        if not isinstance(reply, dict):
            raise ConnectionError(f"{endpoint} answered {request.get('cmd')!r} with something that is not an object")
        return reply
    finally:
        sock.close()
