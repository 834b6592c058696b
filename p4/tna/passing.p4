/* PASSING data plane for Tofino 1 (TNA): the same wire format and state machine as
 * p4/v1model/passing.p4 (docs/protocol.md), with the same control-plane names for
 * tables, actions and counters, so one controller programs both (docs/tofino.md).
 *
 * A Tofino stateful ALU (SALU) accesses one register entry per packet, updates at most
 * 64 bits and returns one 32-bit word; a pipe has 12 stages of 4 SALUs per gress. So:
 *   - the per slot/set state is split into registers that each decide one thing:
 *       slot_tag      (tag, epoch): does this packet start a new round?  -> fresh
 *       slot_bitmap   (bitmap, psn): bitmap before this worker's bit, or 0 when stale
 *       slot_overflow the round's OVERFLOW flag
 *   - the lanes live in pairs: register lane_pair_<k> holds lanes 2k and 2k + 1 and one
 *     SALU adds both (64 lanes = 32 SALUs), but returns only the sum of lane 2k + 1. The
 *     packet that completes a round therefore makes a second pass (recirculation), in
 *     which every pair returns the sum of lane 2k; then it is multicast. Only that one
 *     packet per round, and a retransmission answered from a completed round, make it.
 * A saturated lane is not flagged here (one output word per SALU); the host reads a SUM
 * lane at an int32 bound as overflow (docs/tofino.md).
 *
 * GATHER and NACK (docs/protocol.md, Kinds) touch no register: admitted, they go to the
 * job's multicast group and the egress keeps the replicas they are for. An OWNER_ONLY
 * round's RESULT is multicast as any, whole to every worker: a Tofino 1 egress cannot cut
 * the lanes off the non-owners' copies to make them ACKs (docs/tofino.md).
 */
#include <core.p4>
#include <tna.p4>

#include "../include/headers.p4"
#include "../include/lanes.p4"
#include "../include/parser.p4"
#include "../include/testgen.p4"

/* The pipe-local port that loops a packet back into its ingress (68 in every pipe of a
 * Tofino 1); the pipe is the top two bits of a 9-bit port. */
const bit<7> PASSING_RECIRCULATION_PORT = 68;

/* The round is decided in stages 0 to 3 (see PassingIngress.apply); lane pair k runs in
 * stage 4 + k / 4. Pinned, because the compiler would otherwise fill stages 4 and 5 with
 * the outcome tables first and push the last pairs past stage 11. */
#define PASSING_FIRST_LANE_STAGE 4

#include "../include/tofino_common.p4"  /* slot sets, lane ops, verdicts, register entries */

/* the second pass's lane op (Tofino 1 only) */
#define LANE_HARVEST 4

struct ingress_metadata_t {
    bit<16> base_plus_slot;
    bit<16> slots_left;  /* pool - slot: the slot is in the pool iff this is in 1..pool */
    bit<32> full;
    bit<32> epoch;
    bit<16> group;
    bit<32> worker_bit;
    bit<32> job_index;
    bit<32> slot_set;
    bit<32> old_bitmap;
    bit<32> bitmap;
    bit<8> flagged;
    bit<8> round_overflow;
    bit<8> fresh;
    bit<8> lane_op;
    bit<8> verdict;
    bit<1> admitted;     /* admission hit: (job, generation, worker, ingress port) is admitted */
    bit<1> relay_ok;     /* a GATHER of the sender's own piece, or a NACK to another worker of the job */
    bit<1> second_pass;  /* set by the parser: a recirculated packet */
    PASSING_TESTGEN_METADATA
}

struct egress_metadata_t {
    bit<32> job_index;  /* counter index: a plain field, as Tofino wants */
    bit<16> to_owner;   /* a relayed packet's replica: egress_rid ^ owner, 0 for the owner's */
}

parser TnaIngressParser(packet_in pkt, out headers_t hdr, out ingress_metadata_t meta,
                        out ingress_intrinsic_metadata_t ig_intr_md) {
    PassingParser() passing_parser;
    state start {
        pkt.extract(ig_intr_md);
        pkt.advance(PORT_METADATA_SIZE);
        meta.second_pass = 0;  /* Tofino does not zero user metadata by itself */
        transition select(ig_intr_md.ingress_port) {
            (bit<9>)PASSING_RECIRCULATION_PORT &&& 0x7f: parse_second_pass;
            default: parse_packet;
        }
    }
    state parse_second_pass {
        pkt.extract(hdr.bridged);  /* only a recirculated packet carries it in */
        meta.second_pass = 1;
        transition parse_packet;
    }
    state parse_packet {
        passing_parser.apply(pkt, hdr, true);
        transition accept;
    }
}

control PassingIngress(inout headers_t hdr, inout ingress_metadata_t meta,
                       in ingress_intrinsic_metadata_t ig_intr_md,
                       in ingress_intrinsic_metadata_from_parser_t ig_prsr_md,
                       inout ingress_intrinsic_metadata_for_deparser_t ig_dprsr_md,
                       inout ingress_intrinsic_metadata_for_tm_t ig_tm_md) {
    #include "../include/tofino_round.p4"  /* counters; slot_tag, slot_bitmap, slot_overflow */

    /* Lane pair k: lanes 2k and 2k + 1 in one register. write / add / max update both and
     * return lane 2k + 1; harvest (second pass) returns lane 2k. */
    #define LANE_PAIR(k, a, b)                                                                   \
    Register<lane_pair_t, bit<32>>(PASSING_SLOT_SETS) lane_pair_##k;                             \
    RegisterAction<lane_pair_t, bit<32>, int<32>>(lane_pair_##k) pair_write_##k = {              \
        void apply(inout lane_pair_t value, out int<32> second) {                                \
            PASSING_ASSUME(PASSING_PIN_PAIR(k, value))                                           \
            value.first = (int<32>)hdr.lanes.value_##a;                                          \
            value.second = (int<32>)hdr.lanes.value_##b;                                         \
            second = value.second;                                                               \
        }                                                                                        \
    };                                                                                           \
    RegisterAction<lane_pair_t, bit<32>, int<32>>(lane_pair_##k) pair_add_##k = {                \
        void apply(inout lane_pair_t value, out int<32> second) {                                \
            PASSING_TESTGEN_PAIR_READ(k, value)                                                  \
            value.first = value.first |+| (int<32>)hdr.lanes.value_##a;                          \
            value.second = value.second |+| (int<32>)hdr.lanes.value_##b;                        \
            second = value.second;                                                               \
        }                                                                                        \
    };                                                                                           \
    RegisterAction<lane_pair_t, bit<32>, int<32>>(lane_pair_##k) pair_max_##k = {                \
        void apply(inout lane_pair_t value, out int<32> second) {                                \
            PASSING_TESTGEN_PAIR_READ(k, value)                                                  \
            if ((int<32>)hdr.lanes.value_##a > value.first) {                                    \
                value.first = (int<32>)hdr.lanes.value_##a;                                      \
            }                                                                                    \
            if ((int<32>)hdr.lanes.value_##b > value.second) {                                   \
                value.second = (int<32>)hdr.lanes.value_##b;                                     \
            }                                                                                    \
            second = value.second;                                                               \
        }                                                                                        \
    };                                                                                           \
    RegisterAction<lane_pair_t, bit<32>, int<32>>(lane_pair_##k) pair_harvest_##k = {            \
        void apply(inout lane_pair_t value, out int<32> first) {                                 \
            PASSING_TESTGEN_PAIR_READ(k, value)                                                  \
            first = value.first;                                                                 \
        }                                                                                        \
    };                                                                                           \
    action lane_write_##k() { hdr.lanes.value_##b = (bit<32>)pair_write_##k.execute(meta.slot_set); } \
    action lane_add_##k() { hdr.lanes.value_##b = (bit<32>)pair_add_##k.execute(meta.slot_set); } \
    action lane_max_##k() { hdr.lanes.value_##b = (bit<32>)pair_max_##k.execute(meta.slot_set); } \
    action lane_harvest_##k() { hdr.lanes.value_##a = (bit<32>)pair_harvest_##k.execute(meta.slot_set); } \
    @stage(PASSING_FIRST_LANE_STAGE + k / 4)  /* four pairs (SALUs) per stage */                 \
    table lane_op_##k {                                                                          \
        key = { meta.lane_op: exact; }                                                           \
        actions = { lane_write_##k; lane_add_##k; lane_max_##k; lane_harvest_##k; NoAction; }    \
        const entries = {                                                                        \
            LANE_WRITE: lane_write_##k();                                                        \
            LANE_ADD: lane_add_##k();                                                            \
            LANE_MAX: lane_max_##k();                                                            \
            LANE_HARVEST: lane_harvest_##k();                                                    \
        }                                                                                        \
        const default_action = NoAction();                                                       \
        size = 4;                                                                                \
    }
    FOR_EACH_PAIR(LANE_PAIR)
    #define LANE_PAIR_APPLY(k, a, b) lane_op_##k.apply();

    #include "../include/tofino_tables.p4"  /* admission ... contribution */

    /* A retransmission to a completed round gets the stored result: adding zeros returns
     * each pair's lane 2k + 1, the second pass its lane 2k. */
    #define CLEAR_LANE(i) hdr.lanes.value_##i = 0;
    action answer_from_round() {
        FOR_EACH_LANE(CLEAR_LANE)
        meta.lane_op = LANE_ADD;
        meta.verdict = VERDICT_ANSWER;
    }

    /* a RESULT to the recirculation port of this pipe, for the second pass */
    action to_second_pass(bit<16> group) {
        hdr.passing.type = PASSING_TYPE_RESULT;
        hdr.passing.flags = meta.round_overflow;
        hdr.bridged.second_pass = 1;
        hdr.bridged.group = group;
        ig_tm_md.ucast_egress_port = ig_intr_md.ingress_port[8:7] ++ PASSING_RECIRCULATION_PORT;
    }

    /* a table of its own, apart from the SALUs of the fresh branch (a table cannot both
     * address a register through the hash unit and carry these constants) */
    action start_round() {
        meta.bitmap = meta.worker_bit;
        meta.lane_op = LANE_WRITE;
        meta.verdict = VERDICT_CONTRIBUTED;
    }
    @hidden table start_round_table {
        actions = { start_round; }
        const default_action = start_round();
    }

    /* one action each, so that each takes one table beside the lanes (a counter needs a
     * table of its own: its index comes through the hash unit, the port through action data) */
    action complete_round() {
        to_second_pass(meta.group);
    }
    /* a retransmission to a completed round: answer this worker alone (the egress swaps
     * the addresses once the second pass has collected the sums) */
    action answer_sender() {
        hdr.bridged.answer = 1;
        to_second_pass(0);
    }

    apply {
        /* The lanes need 8 of the 12 stages (32 pair SALUs, 4 per stage), so the round is
         * decided in 4: stage 0 looks up and checks the headers, all in parallel; stage 1
         * round_check; stage 2 bitmap_start/join; stage 3 the contribution table. The lanes
         * follow in stages 4 to 11, and the outcomes (counters, where the packet goes) run
         * beside them. Hence one gateway in front of round_check, on flags from stage 0,
         * and the other outcomes decided apart. */
        if (meta.second_pass == 0) {
            hdr.bridged.setValid();
            hdr.bridged.pad0 = 0;
            hdr.bridged.pad1 = 0;
            hdr.bridged.ingress_port = ig_intr_md.ingress_port;
            hdr.bridged.slot_set = 0;
            hdr.bridged.group = 0;
            hdr.bridged.second_pass = 0;
            hdr.bridged.result_multicast = 0;
            hdr.bridged.answer = 0;
            hdr.bridged.flood = 0;
            hdr.bridged.relay = 0;
            meta.lane_op = LANE_NONE;
        } else {
            meta.lane_op = LANE_HARVEST;
        }
        meta.verdict = VERDICT_NONE;
#if PASSING_TESTGEN == 1
        PASSING_ASSUME(meta.second_pass == 0);
#elif PASSING_TESTGEN == 2
        /* what to_second_pass sends: a RESULT, flagged for the second pass, a slot/set of the
         * table, and a group exactly when it is no answer */
        PASSING_ASSUME(meta.second_pass == 1 && hdr.bridged.second_pass == 1 && hdr.bridged.pad0 == 0
                       && hdr.bridged.pad1 == 0 && hdr.bridged.flood == 0 && hdr.bridged.relay == 0
                       && hdr.bridged.result_multicast == 0 && hdr.bridged.slot_set < 2 * PASSING_SLOTS
                       && (hdr.bridged.answer == 1) == (hdr.bridged.group == 0)
                       && hdr.passing.isValid() && hdr.passing.type == PASSING_TYPE_RESULT);
#endif
        PASSING_TESTGEN_INPUT

        /* ---- stage 0: lookups and header checks ---- */
        bool well_formed = false;
        bool relay_kind = false;
        bool slot_in_table = false;
        if (hdr.passing.isValid()) {
            meta.job_index = (bit<32>)(hdr.passing.job & (PASSING_MAX_JOBS - 1));
            meta.flagged = hdr.passing.flags & PASSING_FLAG_OVERFLOW;
            admission.apply();
            worker_bit.apply();
            PASSING_TESTGEN_MEMBER(meta.admitted, meta.full, meta.worker_bit)
            if (hdr.passing.version == PASSING_VERSION && hdr.passing.type == PASSING_TYPE_DATA) {
                well_formed = true;
            }
            if (hdr.passing.version == PASSING_VERSION
                    && (hdr.passing.type == PASSING_TYPE_GATHER || hdr.passing.type == PASSING_TYPE_NACK)) {
                relay_kind = true;
            }
            if (hdr.passing.slot[15:PASSING_SLOT_BITS] == 0) {
                slot_in_table = true;
            }
        }
        if (meta.second_pass == 1) {
            meta.slot_set = (bit<32>)hdr.bridged.slot_set;
        } else {
            meta.slot_set = (bit<32>)(hdr.passing.set[0:0] ++ meta.base_plus_slot[PASSING_SLOT_BITS - 1:0]);
            /* here, in the hash unit, not in to_second_pass: there meta.slot_set's slices would be
             * more sources than an action may have for the container bridged.slot_set shares with
             * bridged.group */
            @in_hash { hdr.bridged.slot_set = (bit<16>)(hdr.passing.set[0:0] ++ meta.base_plus_slot[PASSING_SLOT_BITS - 1:0]); }
        }

        bool to_aggregator = false;
        if (meta.second_pass == 0 && ig_prsr_md.parser_err == 0
                && hdr.udp.isValid() && hdr.udp.dst_port == PASSING_UDP_PORT) {
            /* a table is applied in an `if` of its own on Tofino, not inside a && chain;
             * the round hangs off its hit directly, which costs no stage */
            if (aggregator_address.apply().hit) {
                to_aggregator = true;
                /* ---- stages 1 to 3: the round ---- */
                /* admitted, and slot < pool: slots_left = pool - slot is in 1 .. pool
                 * (reject sets it to 0) */
                if (well_formed && slot_in_table && meta.slots_left != 0 && meta.slots_left[15:15] == 0) {
                    /* the entry of meta.slot_set, formed by the hash unit: no stage to wait */
                    meta.fresh = round_check.execute(slot_set_index.get(
                        {hdr.passing.set[0:0], meta.base_plus_slot[PASSING_SLOT_BITS - 1:0]}));
                    if (meta.fresh == 1) {
                        bitmap_start.execute(meta.slot_set);
                        meta.round_overflow = overflow_start.execute(meta.slot_set);
                        start_round_table.apply();
                    } else {
                        meta.old_bitmap = bitmap_join.execute(meta.slot_set);
                        if (meta.old_bitmap != 0) {
                            meta.round_overflow = overflow_join.execute(meta.slot_set);
                        }
                        if (meta.old_bitmap == meta.full) {
                            answer_from_round();
                        } else {
                            contribution.apply();  /* stale, duplicate, or add / max */
                        }
                    }
                } else if (well_formed) {
                    meta.verdict = VERDICT_REJECTED;
                } else if (relay_kind) {
                    /* no register: stage 1 (relay_check needs `full` from admission) */
                    relay_check.apply();
                    if (meta.admitted == 1 && meta.relay_ok == 1) {
                        meta.verdict = VERDICT_RELAY;
                    } else {
                        meta.verdict = VERDICT_REJECTED;
                    }
                }
            }
        }

        /* ---- not for the round: malformed, or plain forwarding ---- */
        if (meta.second_pass == 1) {
            /* the second pass of a completed round or an answer (below) */
        } else if (ig_prsr_md.parser_err != 0 || (to_aggregator && !well_formed && !relay_kind)) {
            malformed.count(0);
            drop();
        } else if (!to_aggregator && hdr.ethernet.isValid()) {
            l2_forward.apply();
        }
        if (to_aggregator && (well_formed || relay_kind)) {
            received.count(meta.job_index);
        }

        /* ---- where the packet goes ---- */
        if (meta.second_pass == 1) {
            hdr.bridged.second_pass = 0;
            if (hdr.bridged.group != 0) {
                ig_tm_md.mcast_grp_a = hdr.bridged.group;
                hdr.bridged.result_multicast = 1;
            } else {
                ig_tm_md.ucast_egress_port = hdr.bridged.ingress_port;
            }
        } else if (meta.verdict == VERDICT_CONTRIBUTED) {
            aggregated.count(meta.job_index);
            if (meta.flagged != 0) {
                overflow.count(meta.job_index);
            }
            if (meta.bitmap == meta.full) {
                completed.count(meta.job_index);
                complete_round();
            } else {
                drop();
            }
        } else if (meta.verdict == VERDICT_ANSWER) {
            duplicate_answered.count(meta.job_index);
            answer_sender();
        } else if (meta.verdict == VERDICT_DUPLICATE) {
            duplicate.count(meta.job_index);
            drop();
        } else if (meta.verdict == VERDICT_STALE) {
            stale.count(meta.job_index);
            drop();
        } else if (meta.verdict == VERDICT_REJECTED) {
            rejected.count(meta.job_index);
            drop();
        } else if (meta.verdict == VERDICT_RELAY) {
            relayed.count(meta.job_index);
            relay();
        }

        /* ---- the lanes (stages 4 to 11; independent of the outcomes above) ---- */
        FOR_EACH_PAIR(LANE_PAIR_APPLY)
    }
}

control TnaIngressDeparser(packet_out pkt, inout headers_t hdr, in ingress_metadata_t meta,
                           in ingress_intrinsic_metadata_for_deparser_t ig_dprsr_md) {
    apply {
        /* the unicast answer swaps addresses: the IPv4 checksum stays right */
        pkt.emit(hdr.bridged);
        pkt.emit(hdr.ethernet);
        pkt.emit(hdr.ipv4);
        pkt.emit(hdr.udp);
        pkt.emit(hdr.passing);
        pkt.emit(hdr.lanes);
    }
}

/* The egress parses the headers alone: an OWNER_ONLY round's replicas are all whole RESULTs
 * here. An ACK would need the lanes cut off the non-owners' copies, which a Tofino 1 egress
 * parser cannot reach (they end 321 bytes in; it parses 160): a worker that is not the owner
 * takes the RESULT as it takes an ACK (docs/protocol.md, Kinds). */
parser TnaEgressParser(packet_in pkt, out headers_t hdr, out egress_metadata_t meta,
                       out egress_intrinsic_metadata_t eg_intr_md) {
    PassingParser() passing_parser;
    state start {
        pkt.extract(eg_intr_md);
        pkt.extract(hdr.bridged);
        passing_parser.apply(pkt, hdr, false);  /* headers only: the lanes stay payload */
        transition accept;
    }
}

control PassingEgress(inout headers_t hdr, inout egress_metadata_t meta,
                      in egress_intrinsic_metadata_t eg_intr_md,
                      in egress_intrinsic_metadata_from_parser_t eg_prsr_md,
                      inout egress_intrinsic_metadata_for_deparser_t eg_dprsr_md,
                      inout egress_intrinsic_metadata_for_output_port_t eg_oport_md) {
    #include "../include/tofino_egress.p4"  /* results_sent, result_rewrite, answer_to_sender, compare_with_owner */

    apply {
        if (hdr.passing.isValid()) {
            meta.job_index = (bit<32>)(hdr.passing.job & (PASSING_MAX_JOBS - 1));
        }
        if (hdr.bridged.second_pass == 1) {
            /* to the recirculation port: the bridged header goes along into the second pass */
        } else {
            /* result_rewrite is applied in one place, as on BMv2 (a table with one successor) */
            bool addressed = false;  /* a replica for one worker: result_rewrite addresses it */
            bool sent = false;
            if (hdr.bridged.flood == 1 && eg_intr_md.egress_port == hdr.bridged.ingress_port) {
                drop();  /* a flood never goes back where it came from */
            } else if (hdr.bridged.relay == 1) {
                /* a GATHER to every worker but its sender (= its owner), a NACK to its owner alone */
                compare_with_owner();
                /* spelt as ANDs and ORs of comparisons, the form a gateway takes */
                if ((hdr.passing.type == PASSING_TYPE_GATHER && meta.to_owner == 0)
                        || (hdr.passing.type != PASSING_TYPE_GATHER && meta.to_owner != 0)) {
                    drop();
                } else {
                    addressed = true;
                }
            } else if (hdr.bridged.answer == 1) {
                answer_to_sender();
                sent = true;
            } else if (hdr.bridged.result_multicast == 1) {
                addressed = true;
            }
            if (addressed) {
                if (result_rewrite.apply().hit) {
                    sent = true;
                }
            }
            if (sent) {
                results_sent.count(meta.job_index);
            }
            hdr.bridged.setInvalid();
        }
    }
}

control TnaEgressDeparser(packet_out pkt, inout headers_t hdr, in egress_metadata_t meta,
                          in egress_intrinsic_metadata_for_deparser_t eg_dprsr_md) {
    Checksum() ipv4_checksum;
    apply {
        if (hdr.ipv4.isValid()) {
            hdr.ipv4.hdr_checksum = ipv4_checksum.update({
                hdr.ipv4.version, hdr.ipv4.ihl, hdr.ipv4.diffserv, hdr.ipv4.total_len,
                hdr.ipv4.identification, hdr.ipv4.flags, hdr.ipv4.frag_offset, hdr.ipv4.ttl,
                hdr.ipv4.protocol, hdr.ipv4.src_addr, hdr.ipv4.dst_addr});
        }
        pkt.emit(hdr.bridged);  /* valid only on the way to the second pass */
        pkt.emit(hdr.ethernet);
        pkt.emit(hdr.ipv4);
        pkt.emit(hdr.udp);
        pkt.emit(hdr.passing);
    }
}

Pipeline(TnaIngressParser(), PassingIngress(), TnaIngressDeparser(),
         TnaEgressParser(), PassingEgress(), TnaEgressDeparser()) pipe;

Switch(pipe) main;
