"""The test session's control-plane keys (made by conftest.py): operator requests, and
controllers built in-process with the session's key directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from passing import control
from passing_protocol.keys import ClientKeys, default_dir, load_public


def operator_keys() -> ClientKeys:
    return ClientKeys.load(role="operator")


def ask(endpoint: str, cmd: str, timeout: float = 10.0, **fields: Any) -> dict[str, Any]:
    """An operator's request (status, stats, metrics, ending a group)."""
    return control.request(endpoint, cmd, timeout=timeout, keys=operator_keys(), **fields)


def controller(topology: Any, store: str | Path, listen: str = "tcp://127.0.0.1:*", pipeline: Any = None,
               **kwargs: Any) -> Any:
    """A ``passing_controller.service.Controller`` with the session's keys."""
    from passing_controller.keys import ServerKeys
    from passing_controller.service import Controller

    directory = default_dir()
    return Controller(topology, pipeline, store, listen, ServerKeys.controller(directory),
                      load_public(directory / "aggregator.key"), **kwargs)
