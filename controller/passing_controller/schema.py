"""The controller's reading of control messages (docs/control.md): the mechanics are the
protocol's (``passing_protocol.rpc``: one JSON object of bounded size and depth, no NaN or
Infinity, every field of its type and in range), here bound to the controller's error,
``RequestError``, whose text goes back to the sender; nothing else escapes. And what is the
controller's own: the shapes of its names, hosts and secrets, and ``Unauthorized``."""

from __future__ import annotations

import re
from functools import partial
from typing import Any

from passing_protocol import rpc
from passing_protocol.rpc import MessageError

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,199}")  # job names: printable, no spaces, ≤ 200
HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9.:-]{0,252}")  # a host name or address
SECRET = re.compile(r"[0-9a-f]{32,128}")  # hex: tokens and job secrets


class RequestError(MessageError):
    """A request the controller refuses; the text goes back to the host. Two refusals are worded
    as the controller has always worded them (the aggregator's words are MessageError's)."""

    @staticmethod
    def not_integer(name: str, lo: int, hi: int, value: Any) -> str:
        return f"{name} must be an integer in {lo}..{hi}, got {rpc.show(value)}"

    @staticmethod
    def constant(name: str) -> str:
        return f"request is not JSON: {name} is not a number a control message may carry"


class Unauthorized(RequestError):
    """A request this client's role may not make."""


parse = partial(rpc.parse, error=RequestError)
integer = partial(rpc.integer, error=RequestError)
number = partial(rpc.number, error=RequestError)
text = partial(rpc.text, error=RequestError)
choice = partial(rpc.choice, error=RequestError)
counters = partial(rpc.counters, error=RequestError)
