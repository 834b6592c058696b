"""The scenario table of tests/conformance, the very same rows, on BMv2 in Mininet."""

from __future__ import annotations

import time

import pytest

from tests.conformance.runner import run_scenario, scapy_builder
from tests.conformance.scenarios import SCENARIOS

HOSTS = 5  # four hosts carry the workers' origins, the fifth is the stranger


@pytest.fixture(scope="module")
def target(network, switch):
    from .target import Bmv2Target

    return Bmv2Target(network, switch)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scenario", [s for s in SCENARIOS if not s.switch_only and not s.software_only],
                         ids=lambda s: s.name)
def test_scenario_on_bmv2(target, scenario):
    try:
        run_scenario(target, scenario, scapy_builder)
    finally:
        changed = target.rebase()  # every cell read again: the next scenario starts from them
    # the steps read the cells of their packets' job ids: the counters' totals moved by their
    # deltas only if no other cell moved, and none moved after the last step read them
    assert not changed, f"{scenario.name}: counter cells changed that no step accounted for: {changed}"


@pytest.mark.timeout(60)
def test_normal_forwarding(network, switch):
    """Non-PASSING traffic crosses the switch by plain L2 forwarding."""
    a, b = network.agent("h1"), network.agent("h2")
    b.call(op="bind", key="plain", port=5555)
    a.call(op="bind", key="plain-src", port=5556)
    a.call(op="send", key="plain-src", to="10.0.0.2:5555", payload=b"hello over L2".hex())
    deadline = time.monotonic() + 5
    got = []
    while not got and time.monotonic() < deadline:
        got = b.call(op="drain")["received"]
        time.sleep(0.05)
    assert got and bytes.fromhex(got[0][1]) == b"hello over L2" and got[0][2] == "10.0.0.1:5556"
