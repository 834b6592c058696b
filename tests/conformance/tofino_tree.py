"""The Tofino 2 program's tree sequences held against the reference's roles (docs/tofino.md, "Sequences"; made by
p4/testgen_tofino_tree.py): packets chained through the registers, each a pinned P4Testgen run of the tofino2
target, compared where the ingress hands the packet to the traffic manager (the model's egress does nothing:
docs/tofino.md, "Executed by P4Testgen").

One reference engine holds the sequence's jobs in their roles (tree_sequences.engine_for) and takes the packets
in order. For each vector:

1. its registers are what the earlier vectors wrote (the chain);
2. what the ingress emits, and where it sends it, is the reference's emissions as one packet to the traffic
   manager (``expect``):
   * the replicas of a completion, of the root's answer at a leaf or of a relay: one multicast (a drop in the
     model) with the bridged flag the egress replicates by (``result_multicast``, ``relay``), the RESULT's header
     and sums (the worker field is each replica's, the egress's to write); where some replicas are ACKs (an
     OWNER_ONLY round), the one RESULT goes to the owner the owner map names (``tree_bridged_h.owner_rid``), and at
     a leaf ``tree_bridged_h.owner_only`` says so; a leaf's GATHER's copy up is its group's uplink replica
     (``tree_bridged_h.relay_up``);
   * a packet up (a leaf's partial, first or re-sent, a NACK for another rack): out of the uplink's port with the
     level's fields and the frame addressed to the root in the ingress (go_up); RETRANSMIT of a re-sent partial is
     added in the egress (``tree_bridged_h.resend``), its IPv4 checksum written by the egress deparser;
   * an answer to a retransmission: back to its port (``bridged_h.answer``), the RESULT's sums, an ACK decided in
     the ingress (``tree_bridged_h.ack``) and cut by the egress;
   * nothing: a drop, no replication flag;
3. the registers it leaves (its initial ones with its ``writes``) are the reference's slot/sets after it, through
   the abstraction of testgen.concretize, and at a leaf job's slot/set ``slot_phase`` whether the root answered
   (0 no, 1 a RESULT, 2 an ACK). Every slot/set either side changed is compared.
"""

from __future__ import annotations

import struct

import numpy as np

from passing import wire
from passing.aggregator import engine as reference

from . import testgen, tree_sequences, tree_vectors
from .tree_vectors import Divergence

tool = testgen.tool
SLOTS, INT32, ETH, IPV4, UDP = testgen.SLOTS, testgen.INT32, testgen.ETH, testgen.IPV4, testgen.UDP
NO_RID = 0xFFFF  # PASSING_NO_RID: the owner map names no worker here
KINDS = {wire.DATA: "DATA", wire.RESULT: "RESULT", wire.ACK: "ACK", wire.GATHER: "GATHER", wire.NACK: "NACK"}


def reference_index(index: int) -> int:
    """The reference's slot/set of Tofino's ``set * 1024 + base + slot``."""
    return (index % SLOTS) * 2 + index // SLOTS


def tofino_index(k: int) -> int:
    """Tofino's slot/set of the reference's ``(base + slot) * 2 + set`` (reference_index's inverse)."""
    return (k % 2) * SLOTS + k // 2


def _registers(vector: dict, index: int, lanes: int) -> dict[str, object]:
    """The registers of slot/set ``index`` before the packet, as the vector sets them (0 where it does not)."""
    state = testgen.tna_state(vector, index, lanes)
    state["slot_phase"] = int(testgen.registers(vector, "slot_phase").get(index, 0))
    return state


def _reference_view(engine: reference.AggregationEngine, index: int, lanes: int, leaf: bool) -> dict[str, object]:
    """A reference slot/set as Tofino's registers (testgen.concretize; a slot/set no round of any allocation
    touched holds 0), and at a leaf's slot/set ``slot_phase``."""
    k = reference_index(index)
    view = testgen.SlotView(int(engine.state_epoch[k]), int(engine.tag[k]) % INT32, int(engine.bitmap[k]),
                            bool(engine.overflow[k]), engine.acc[k, :lanes])
    out = testgen.concretize(view, max(view.epoch, 0), int(view.overflow), lanes)
    if leaf:
        out["slot_phase"] = int(engine.phase[k])
    return out


def _headers(raw: bytes, lanes: int) -> tuple[dict[str, dict[str, int]], list[int] | None]:
    """The headers the T2NA parser extracts (a header-only datagram's PASSING header too), and the lanes."""
    p = testgen.parse(raw, lanes)
    headers = dict(p.headers)
    if "passing_h" not in headers and (only := testgen.header_only(raw)) is not None:
        headers["passing_h"] = only
    return headers, p.lanes


def _tree_bridged(tree: tree_vectors.TreeJob, down: bool, owner_rid: int, **flags: int) -> dict[str, int]:
    """tree_bridged_h as the ingress hands it on: a tree job's packet, the owner map's worker for its owner, a
    leaf's uplink (what comes down carries the uplink entry's checks there: not compared), the flags given."""
    out = {"tree": 1, "owner_rid": owner_rid, "pad": 0, "resend": 0, "relay_up": 0, "owner_only": 0, "ack": 0}
    if not down:
        up = tree.spec.up if tree.spec.role == "leaf" else None
        address = tree.up if up is not None else None
        out.update(up_job=up.job if up else 0, up_generation=up.generation if up else 0,
                   up_worker=up.worker if up else 0, up_mac=address.mac if address else 0,
                   up_ip=address.ip if address else 0)
    out.update(flags)
    return out


def _owner_rid(tree: tree_vectors.TreeJob, owner: int) -> int:
    owners = tree.spec.owners
    worker = owners[owner] if owners is not None and owner < len(owners) else -1
    return worker if worker >= 0 else NO_RID


def _sums(datagram: bytes, lanes: int) -> list[int]:
    return list(struct.unpack_from(f">{lanes}I", datagram, wire.HEADER_SIZE))


def expect(vector: dict, engine: reference.AggregationEngine, lanes: int) -> testgen.Expected:
    """What the ingress hands the traffic manager for the vector's packet, from the reference's emissions for it
    (the module's docstring); the engine takes the packet."""
    raw = bytes.fromhex(vector["input"]["packet"])
    port = int(vector["input"]["port"])
    headers, in_lanes = _headers(raw, lanes)
    hdr = headers["passing_h"]
    tree = tree_vectors.down_job(vector, hdr, port)
    down = tree is not None
    if tree is None:
        job = testgen.job_view(vector, hdr["job"], hdr["generation"], hdr["worker"], port)
        if job is None:
            raise tree_vectors.Outside("a tree sequence's packet of no live allocation")
        tree = tree_vectors.tree_job(vector, job.spec, job.group)
    role = "down" if down else tree.spec.role
    # the engine's own job (the sequence's allocation: its origins are the workers' ports)
    spec = next(s for s in engine.jobs() if s.job == tree.spec.job)
    datagram = raw[ETH + IPV4 + UDP:][:wire.HEADER_SIZE if in_lanes is None else wire.packet_size(lanes)]
    before = engine.counters(spec.job)
    emitted = tree_vectors.run(engine, datagram, port, lanes)
    verdict = ", ".join(tree_vectors.verdict(engine, spec.job, before))
    kind = KINDS.get(hdr["type"], "?")
    owner_rid = _owner_rid(tree, hdr["owner"])
    bridged = testgen._bridged(port)
    replicas = [(dest, d) for dest, d, multicast in emitted if multicast]
    unicast = [(dest, d) for dest, d, multicast in emitted if not multicast]
    up = [d for dest, d in unicast if spec.up is not None and dest == spec.up.source]
    answers = [(dest, d) for dest, d in unicast if spec.up is None or dest != spec.up.source]
    if not emitted:
        return testgen.Expected(f"{role}: the state machine drops it ({verdict})", "drop")
    if answers and (len(answers) > 1 or replicas or up or answers[0][0] != port):
        raise Divergence(f"{role}: the reference answers {[dest for dest, _ in answers]} beside "
                         f"{len(replicas)} replicas and {len(up)} packets up")
    if len(up) > 1:
        raise Divergence(f"{role}: the reference sends {len(up)} packets up for one")
    if replicas:  # one multicast: the replicas' RESULT (or the header alone, every replica an ACK)
        types = {unpack(d)["type"] for _, d in replicas}
        results = [(dest, d) for dest, d in replicas if unpack(d)["type"] != wire.ACK]
        relayed = hdr["type"] in (wire.GATHER, wire.NACK)
        first = unpack(results[0][1] if results else replicas[0][1])
        passing = {**first, "worker": hdr["worker"]}  # each replica's worker: the egress writes it
        flags: dict[str, int] = {}
        if wire.ACK in types and wire.RESULT in types:  # an OWNER_ONLY round: the sums for its owner alone
            owners = {spec.sources.index(dest) if dest in spec.sources else dest for dest, _ in results}
            if len(results) != 1 or owners != {owner_rid}:
                raise Divergence(f"{role}: the reference's RESULT goes to {sorted(owners)}, the owner map's "
                                 f"worker is {owner_rid}")
            if spec.role == "leaf":  # a root's RESULT keeps the flag, which the egress reads
                flags["owner_only"] = 1
        if relayed and up:
            flags["relay_up"] = 1
        headers.update(bridged_h={**bridged, "relay" if relayed else "result_multicast": 1}, passing_h=passing,
                       tree_bridged_h=_tree_bridged(tree, down, owner_rid, **flags))
        what = "relayed" if relayed else "a completed round: multicast"
        return testgen.Expected(f"{role}: {what} ({kind}; {verdict})", "multicast", None, headers,
                                _sums(results[0][1], lanes) if results else None)
    if up:  # go_up: the level's fields and the root's addresses, in the ingress
        sent = unpack(up[0])
        resend = int(bool(sent["flags"] & wire.FLAG_RETRANSMIT)) if sent["type"] == wire.DATA else 0
        eth, ip, udp = headers["ethernet_h"], headers["ipv4_h"], headers["udp_h"]
        headers.update(
            bridged_h=bridged, passing_h={**sent, "flags": sent["flags"] & ~wire.FLAG_RETRANSMIT if resend else
                                          sent["flags"]},
            ethernet_h={**eth, "src_addr": eth["dst_addr"], "dst_addr": tree.up.mac},
            ipv4_h={k: v for k, v in {**ip, "src_addr": ip["dst_addr"], "dst_addr": tree.up.ip}.items()
                    if k != "hdr_checksum"},  # the egress deparser's
            udp_h={**udp, "src_port": wire.UDP_PORT, "dst_port": wire.UDP_PORT, "checksum": 0},
            tree_bridged_h=_tree_bridged(tree, down, owner_rid, resend=resend))
        rule = "a leaf's partial up" if hdr["type"] == wire.DATA else f"a leaf's {kind} up"
        return testgen.Expected(f"{role}: {rule} ({verdict}): to the uplink's port", "port", tree.up.port, headers,
                                _sums(up[0], lanes))
    answer = unpack(answers[0][1])  # a retransmission answered: its port; an ACK is cut by the egress
    ack = answer["type"] == wire.ACK
    k = reference_index(int(vector["slot_set"]))
    sums = [int(v) % INT32 for v in engine.acc[k, :lanes]] if ack else _sums(answers[0][1], lanes)
    headers.update(bridged_h={**bridged, "answer": 1}, passing_h={**answer, "type": wire.RESULT},
                   tree_bridged_h=_tree_bridged(tree, down, owner_rid, ack=int(ack)))
    return testgen.Expected(f"{role}: a retransmission to a completed round: answered ({verdict})", "port", port,
                            headers, sums)


def unpack(datagram: bytes) -> dict[str, int]:
    return tool.unpack("passing_h", datagram)


def check_tree_sequence(chain: list[dict], lanes: int) -> list[str]:
    """The rules of a chain of vectors, in order; raises Divergence where the program and the reference part."""
    engine, leaf_slots = tree_sequences.engine_for(chain[0], lanes)
    leaf_sets = {tofino_index(k) for k in leaf_slots}
    state: dict[tuple[str, int], object] = {}
    rules = []
    for vector in chain:
        where = f"sequence {vector['sequence']} step {vector['step']}"
        index = int(vector["slot_set"])
        present = {r["register"].split(".")[-1] for r in vector["registers"]}  # what the path reads
        for name, value in _registers(vector, index, lanes).items():
            if name in present and value != state.get((name, index), tool.unwritten(name)):
                raise Divergence(f"{where}: {name} starts at {value}, the sequence left "
                                 f"{state.get((name, index), tool.unwritten(name))}")
        before = (engine.state_epoch.copy(), engine.tag.copy(), engine.bitmap.copy(), engine.overflow.copy(),
                  engine.phase.copy(), engine.acc.copy())
        try:
            want = expect(vector, engine, lanes)
            testgen.compare(vector, want)
            emitted = {e["header"] for e in (vector["ingress"] or {}).get("emit", [])}
            if want.to != "drop" and want.lanes is None and "lanes_h" in emitted:
                raise Divergence(f"{want.rule}: a header-only packet emitted with lanes")
        except Divergence as e:
            raise Divergence(f"{where}: {e}") from e
        rules.append(want.rule)
        touched = set()
        for w in vector["writes"]:
            key = (w["register"], w["index"])
            state[key] = tool.written(w["register"], state.get(key, tool.unwritten(w["register"])), w["fields"])
            touched.add(w["index"])
        after = (engine.state_epoch, engine.tag, engine.bitmap, engine.overflow, engine.phase, engine.acc)
        for b, a in zip(before, after):
            changed = b != a
            for k in np.flatnonzero(changed.any(axis=1) if changed.ndim > 1 else changed).tolist():
                touched.add(tofino_index(k))
        for index in sorted(touched):
            leaf = index in leaf_sets
            ref = _reference_view(engine, index, lanes, leaf)
            program = {name: state.get((name, index), tool.unwritten(name)) for name in ref}
            wrong = [name for name in ref if program[name] != ref[name]]
            if wrong:
                raise Divergence(f"{where} ({rules[-1]}): slot/set {index} after the packet: {wrong[0]} = "
                                 f"{program[wrong[0]]}, the reference's {ref[wrong[0]]}")
    return rules
