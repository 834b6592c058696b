"""The tree's scenario table (tests/conformance/tree_scenarios.py) on one BMv2 switch taking the leaf role:
the origin "root" is a host on the leaf's uplink port, which receives the partials and sends the root's
answers (the three-switch tree: test_tree_bmv2.py)."""

from __future__ import annotations

import pytest

from tests.conformance.runner import run_scenario, scapy_builder
from tests.conformance.tree_scenarios import TREE_SCENARIOS

HOSTS = 6  # four hosts carry the workers' origins, the fifth is the root, the sixth the stranger

# The rows that need an owner map (OWNER_ONLY rounds, GATHER and NACK across racks, the root's map): the
# switch program takes none yet, and rejects those packets in a tree job (docs/protocol.md, On a switch).
NEEDS_OWNER_MAP = {"tree_leaf_overflow_and_owner_elsewhere", "tree_leaf_gather_and_nack_across_racks",
                   "tree_root_owner_map"}


@pytest.fixture(scope="module")
def target(network, switch):
    from .target import Bmv2Target

    return Bmv2Target(network, switch, root=True)


def test_the_rows_left_out_are_rows_of_the_table():
    assert NEEDS_OWNER_MAP <= {s.name for s in TREE_SCENARIOS}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scenario", [s for s in TREE_SCENARIOS if s.name not in NEEDS_OWNER_MAP],
                         ids=lambda s: s.name)
def test_tree_scenario_on_a_bmv2_leaf(target, scenario):
    try:
        run_scenario(target, scenario, scapy_builder)
    finally:
        changed = target.rebase()
    assert not changed, f"{scenario.name}: counter cells changed that no step accounted for: {changed}"
