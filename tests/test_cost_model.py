"""The emulated cluster's cost model and switch kinds (bench/cost_model.py, bench/emulated_cluster.py): a switch
kind's packets are its program's lanes (passing_controller.topology.CHIP_LANES), and the model counts
their frames."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import cost_model  # noqa: E402
import emulated_cluster  # noqa: E402
import emulated_run  # noqa: E402

from passing import wire  # noqa: E402
from passing_controller.topology import CHIP_LANES  # noqa: E402


def test_frames_are_the_wire_packet_plus_ethernet_ip_udp():
    assert (cost_model.FRAME, cost_model.PAYLOAD) == (314, 256)  # the 64-lane default, as before
    for lanes in (64, 128):
        assert cost_model.frame(lanes) == wire.packet_size(lanes) + 14 + 20 + 8
    assert cost_model.frame(128) == 570 and cost_model.payload(128) == 512


def test_128_lanes_halve_the_packets_and_shrink_the_frames_overhead():
    elements = 255_570  # ResNet50 / 100, the emulated cluster's workload
    at = {lanes: cost_model.predict("passing", elements, cost_model.Setup(4, 2, 100.0, 256, rtt_s=1e-3, lanes=lanes))
          for lanes in (64, 128)}
    ring = cost_model.predict("ring", elements, cost_model.Setup(4, 2, 100.0, 256, rtt_s=1e-3))
    assert at[64].link_bytes == 2 * cost_model.packets(elements // 2) * 314  # 2 ranks, each its half (even)
    assert at[128].link_bytes == 2 * cost_model.packets(elements // 2, 128) * 570
    assert at[128].network_s / at[64].network_s == pytest.approx(570 / 2 / 314, rel=1e-3)  # 0.908
    assert ring.network_s / at[64].network_s == pytest.approx(1.52, abs=0.01)
    assert ring.network_s / at[128].network_s == pytest.approx(1.68, abs=0.01)
    line = {lanes: cost_model.bottleneck_packets_per_s("passing", cost_model.Setup(4, 2, 100.0, lanes=lanes))
            for lanes in (64, 128)}
    assert line[128] / line[64] == pytest.approx(314 / 570)


def test_the_emulated_switch_kinds_are_the_programs_lane_counts():
    assert {kind: CHIP_LANES[kind] for kind in emulated_cluster.SWITCH_KINDS} == {"tofino": 64, "tofino2": 64}
    assert emulated_cluster.switch_kind_label("tofino2") == ("emulated Tofino 2 (tofino2, 64 lanes): a software "
                                                             "aggregator at that lane count, nothing more")
    # the 10G-equivalent link: the same bytes in flight at either lane count
    assert (emulated_cluster.pool_for(100.0, 64), emulated_cluster.pool_for(100.0, 128)) == (256, 128)
    # the 1G-equivalent: the queue
    assert (emulated_cluster.pool_for(10.0, 64), emulated_cluster.pool_for(10.0, 128)) == (128, 64)
    assert emulated_run.Bandwidth("10G", 100.0, 128).lanes == 128


def test_across_racks_the_tree_carries_one_gradient_on_every_uplink_and_the_ring_its_2_n_minus_1_over_n():
    """predict_racks (bench/emulated_racks.py's model): 4 racks x 2 servers at 100 Mbit/s. Not oversubscribed
    (uplinks of 200 Mbit/s) the server links set every scheme's pace; at 4:1 (50 Mbit/s) the uplinks do, and
    each scheme's time grows by what its uplink carries: the tree one gradient's packets, the ring
    2(N - 1)/N of the gradient, the hierarchical ring 2(R - 1)/R of it, the PS two gradients (its own link
    still the bottleneck)."""
    elements = 255_570
    k = cost_model.packets(elements) * cost_model.FRAME * 8 / 100e6  # one gradient's packets at 100 Mbit/s
    one, four = (cost_model.Racks(4, 2, 100.0, 200.0 / o, pool=256, rtt_s=1e-3) for o in (1, 4))
    assert one.oversubscription == 1 and four.oversubscription == 4 and four.servers == 8
    tree1, tree4 = (cost_model.predict_racks("tree", elements, r) for r in (one, four))
    assert tree1.seconds == pytest.approx(k) and tree1.link == "server link"
    assert tree4.seconds == pytest.approx(2 * k) and tree4.link == "uplink"  # 50 Mbit/s: twice as long
    ring1, ring4 = (cost_model.predict_racks("ring", elements, r) for r in (one, four))
    tcp = (cost_model.TCP_FRAME + cost_model.TCP_ACK_SHARE) / cost_model.TCP_PAYLOAD
    assert ring1.seconds == pytest.approx(2 * 7 / 8 * 4 * elements * tcp * 8 / 100e6)
    assert ring4.seconds == pytest.approx(2 * ring1.seconds) and ring4.link == "uplink"
    hring4 = cost_model.predict_racks("hring", elements, four)  # in-rack halves at B, the racks' rings at U
    inside = 2 * 0.5 * 4 * elements * tcp * 8 / 100e6
    assert hring4.seconds == pytest.approx(inside + 2 * 3 / 4 * 4 * elements * tcp * 8 / 50e6)
    ps4 = cost_model.predict_racks("ps", elements, four)
    assert ps4.seconds == pytest.approx(8 * k) and ps4.link == "PS link"  # 8 gradients on its own link
    assert ring4.seconds / tree4.seconds == pytest.approx(ring1.seconds / tree1.seconds)
    with pytest.raises(ValueError, match="across racks"):
        cost_model.predict_racks("switchml", elements, one)


def test_the_latency_model_is_the_rings_2_n_minus_1_steps_against_two_levels_of_one_round_trip():
    assert [cost_model.ring_steps(n) for n in (2, 8, 32)] == [2, 14, 62]
    assert cost_model.predict_latency("ring", 32, step_s=1e-3, round_trip_s=5e-3) == pytest.approx(0.062)
    assert cost_model.predict_latency("tree", 32, step_s=1e-3, round_trip_s=5e-3) == pytest.approx(0.010)
