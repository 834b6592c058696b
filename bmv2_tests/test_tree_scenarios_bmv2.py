"""The tree's scenario table (tests/conformance/tree_scenarios.py) on one BMv2 switch taking the leaf role:
the origin "root" is a host on the leaf's uplink port, which receives the partials and sends the root's
answers (the three-switch tree: test_tree_bmv2.py)."""

from __future__ import annotations

import pytest

from tests.conformance.runner import run_scenario, scapy_builder
from tests.conformance.tree_scenarios import TREE_SCENARIOS

HOSTS = 6  # four hosts carry the workers' origins, the fifth is the root, the sixth the stranger



@pytest.fixture(scope="module")
def target(network, switch):
    from .target import Bmv2Target

    return Bmv2Target(network, switch, root=True)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scenario", TREE_SCENARIOS, ids=lambda s: s.name)
def test_tree_scenario_on_a_bmv2_leaf(target, scenario):
    try:
        run_scenario(target, scenario, scapy_builder)
    finally:
        changed = target.rebase()
    assert not changed, f"{scenario.name}: counter cells changed that no step accounted for: {changed}"
