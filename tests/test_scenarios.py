"""The scenario table of the aggregation state machine (docs/protocol.md) against the pure engines
and the real UDP aggregator, numpy and native."""

from __future__ import annotations

import os

import pytest

from passing import native
from tests.conformance.runner import run_scenario, scapy_builder, wire_builder
from tests.conformance.scenarios import SCENARIOS
from tests.conformance.targets import EngineTarget, UdpAggregatorTarget
from tests.conformance.tree_scenarios import TREE_SCENARIOS

SOFTWARE = [s for s in SCENARIOS if not s.switch_only] + list(TREE_SCENARIOS)  # trees: BMv2 too (bmv2_tests)
ENGINES = ["numpy", pytest.param("native", marks=pytest.mark.skipif(not native.available(),
                                                                   reason="the native library is not built"))]


@pytest.mark.parametrize("scenario", SOFTWARE, ids=lambda s: s.name)
@pytest.mark.parametrize("lanes", [4, 64])
@pytest.mark.parametrize("engine", ENGINES)
def test_engine(scenario, lanes, engine):
    run_scenario(EngineTarget(lanes=lanes, engine=engine), scenario, wire_builder)


# tests/test_xdp.py runs this module in a network namespace, the aggregator in another over AF_XDP:
# "NAMESPACE AGGREGATOR_IP THIS_IP"
XDP_TARGET = os.environ.get("PASSING_SCENARIOS_OVER_XDP", "").split()


@pytest.fixture(scope="module", params=ENGINES)
def udp_target(request):
    if XDP_TARGET:
        if request.param != "native":
            pytest.skip("the numpy engine has no AF_XDP path")
        namespace, aggregator_host, host = XDP_TARGET
        target = UdpAggregatorTarget(lanes=64, engine="native", extra_args=["--io", "xdp"], host=host,
                                     namespace=namespace, aggregator_host=aggregator_host)
        assert target.io == "xdp"
    else:
        target = UdpAggregatorTarget(lanes=64, engine=request.param)
    yield target
    target.close()


@pytest.mark.parametrize("scenario", SOFTWARE, ids=lambda s: s.name)
def test_udp_aggregator(udp_target, scenario):
    """Packets built by the scapy layer, sent from real sockets to a real aggregator process."""
    run_scenario(udp_target, scenario, scapy_builder)


def test_the_switch_skips_only_what_it_cannot_do():
    """Lanes per allocation is the one scenario a switch (one lane count) skips; BMv2 runs the rest. The tree's
    table is apart until the P4 programs take the roles."""
    assert [s.name for s in SCENARIOS if s.software_only] == ["lanes_per_allocation"]
    assert not any(s.tree for s in SCENARIOS) and all(s.tree for s in TREE_SCENARIOS)


def test_table_covers_the_design():
    names = {s.name for s in SCENARIOS}
    required = {
        "basic_reduction", "retransmit_after_completion", "retransmit_before_completion", "both_sets_in_flight",
        "slot_reuse_many_rounds", "slot_reuse_by_next_job", "late_packet_of_previous_allocation",
        "stale_packet", "unknown_job", "unadmitted_source",
        "slot_out_of_range", "overflow", "single_worker", "max_workers", "normal_forwarding", "lanes_per_allocation",
        # sharded data parallelism (docs/protocol.md, Kinds)
        "owner_only_round", "owner_only_rotating_owners", "owner_only_overflow", "owner_only_owner_not_a_worker",
        "gather_relay", "gather_admission",
    }
    assert required <= names
