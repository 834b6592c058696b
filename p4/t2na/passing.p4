/* PASSING data plane for Tofino 2 (T2NA): the wire format and state machine of
 * p4/v1model/passing.p4 (docs/protocol.md), with the control-plane names of both other
 * programs, built from the Tofino 1 program's shared parts (p4/include/tofino_*.p4: the
 * registers that decide a round, the tables, the egress addressing). What Tofino 2 changes
 * (docs/tofino.md, "Tofino 2"):
 *   - 20 MAU stages of 4 stateful ALUs (SALUs) per gress: the round is decided in stages 0 to
 *     3 as on Tofino 1, and the lane pairs follow from stage 4, four per stage (72 lanes: 36
 *     pairs in stages 4 to 12). The SALUs would take 128 lanes; the PHV holds 72 (below);
 *   - a SALU returns up to four words: every lane pair returns both its sums in the one pass,
 *     so no packet is recirculated (Tofino 1 sends the completing packet round again);
 *   - the egress deparser truncates (mtu_trunc_len): an OWNER_ONLY round's replicas for the
 *     workers that are not its owner leave as header-only ACKs;
 *   - the owner of an OWNER_ONLY DATA is checked against the job's workers in the table that
 *     runs round_check (stage 1), so the check costs no stage: one whose owner is not a
 *     worker is rejected and touches no register.
 * A saturated lane is not flagged (one saturated word per lane, as on Tofino 1); the host
 * reads a SUM lane at an int32 bound as overflow.
 */

/* Lanes per packet of the Tofino 2 program: the one place this number is written (the
 * Makefile's TOFINO2_LANES default reads it here). The most that fit: the SALUs would take
 * 128 (64 pairs in stages 4 to 19), but every lane lives in a PHV container that an action
 * can write, and those run out after 72 (docs/tofino.md, "Tofino 2"). */
#define PASSING_T2NA_LANES 72
#ifndef PASSING_LANES
#define PASSING_LANES PASSING_T2NA_LANES
#endif

#include <core.p4>
#include <t2na.p4>

#include "../include/headers.p4"
#include "../include/lanes.p4"
#include "../include/parser.p4"
#include "../include/testgen.p4"

/* The round is decided in stages 0 to 3 (PassingIngress.apply); lane pair k runs in stage
 * 4 + k / 4, pinned as on Tofino 1 so that the outcome tables do not take the lanes' SALUs. */
#define PASSING_FIRST_LANE_STAGE 4

#include "../include/tofino_common.p4"  /* slot sets, lane ops, verdicts, register entries */

/* a retransmission to a completed round: the stored pair, unchanged */
#define LANE_READ 4

/* An ACK is Ethernet (14) + IPv4 (20) + UDP (8) + the PASSING header (16) = 58 bytes. The
 * deparser's truncation length counts the frame with its 4-byte FCS, and a frame is at least
 * 64 bytes: truncated to 64, an ACK carries 2 bytes of padding behind its datagram, which
 * the IPv4 and UDP lengths leave out. */
#define PASSING_ACK_TRUNC_LEN 64
#if 14 + 20 + 8 + 16 + 4 > PASSING_ACK_TRUNC_LEN || 14 + PASSING_UDP_LENGTH + 20 + 4 <= PASSING_ACK_TRUNC_LEN
#error "PASSING_ACK_TRUNC_LEN must keep the headers and cut the lanes"
#endif

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
    bit<8> owner_only;   /* the packet's OWNER_ONLY flag, carried into its RESULT for the egress */
    bit<8> round_overflow;
    bit<8> result_flags; /* the RESULT's flags: the round's OVERFLOW and the packet's OWNER_ONLY */
    bit<8> fresh;
    bit<8> lane_op;
    bit<8> verdict;
    bit<1> admitted;     /* admission hit: (job, generation, worker, ingress port) is admitted */
    bit<1> relay_ok;     /* a GATHER of the sender's own piece, or a NACK to another worker of the job */
    PASSING_TESTGEN_METADATA
}

struct egress_metadata_t {
    bit<32> job_index;  /* counter index: a plain field, as Tofino wants */
    bit<16> to_owner;   /* a replica's worker (its replication id) ^ owner, 0 for the owner's */
    bit<16> sender_to_owner;  /* an answer's worker (its sender) ^ owner, 0 for the owner's */
}

parser TnaIngressParser(packet_in pkt, out headers_t hdr, out ingress_metadata_t meta,
                        out ingress_intrinsic_metadata_t ig_intr_md) {
    PassingParser() passing_parser;
    state start {
        pkt.extract(ig_intr_md);
        pkt.advance(PORT_METADATA_SIZE);
        passing_parser.apply(pkt, hdr, true);  /* one pass: no packet comes back with a bridged header */
        transition accept;
    }
}

control PassingIngress(inout headers_t hdr, inout ingress_metadata_t meta,
                       in ingress_intrinsic_metadata_t ig_intr_md,
                       in ingress_intrinsic_metadata_from_parser_t ig_prsr_md,
                       inout ingress_intrinsic_metadata_for_deparser_t ig_dprsr_md,
                       inout ingress_intrinsic_metadata_for_tm_t ig_tm_md) {
    #include "../include/tofino_round.p4"  /* counters; slot_tag, slot_bitmap, slot_overflow */

    /* Lane pair k: lanes 2k and 2k + 1 in one register. A Tofino 2 SALU returns up to four
     * words, so add / max / read return both lanes (write returns none: the packet already
     * carries what it wrote). */
    #define LANE_PAIR(k, a, b)                                                                   \
    Register<lane_pair_t, bit<32>>(PASSING_SLOT_SETS) lane_pair_##k;                             \
    RegisterAction<lane_pair_t, bit<32>, bit<32>>(lane_pair_##k) pair_write_##k = {              \
        void apply(inout lane_pair_t value) {                                                    \
            PASSING_ASSUME(PASSING_PIN_PAIR(k, value))                                           \
            value.first = (int<32>)hdr.lanes.value_##a;                                          \
            value.second = (int<32>)hdr.lanes.value_##b;                                         \
        }                                                                                        \
    };                                                                                           \
    RegisterAction<lane_pair_t, bit<32>, bit<32>>(lane_pair_##k) pair_add_##k = {                \
        void apply(inout lane_pair_t value, out bit<32> first, out bit<32> second) {             \
            PASSING_TESTGEN_PAIR_READ(k, value)                                                  \
            value.first = value.first |+| (int<32>)hdr.lanes.value_##a;                          \
            value.second = value.second |+| (int<32>)hdr.lanes.value_##b;                        \
            first = (bit<32>)value.first;                                                        \
            second = (bit<32>)value.second;                                                      \
        }                                                                                        \
    };                                                                                           \
    RegisterAction<lane_pair_t, bit<32>, bit<32>>(lane_pair_##k) pair_max_##k = {                \
        void apply(inout lane_pair_t value, out bit<32> first, out bit<32> second) {             \
            PASSING_TESTGEN_PAIR_READ(k, value)                                                  \
            if ((int<32>)hdr.lanes.value_##a > value.first) {                                    \
                value.first = (int<32>)hdr.lanes.value_##a;                                      \
            }                                                                                    \
            if ((int<32>)hdr.lanes.value_##b > value.second) {                                   \
                value.second = (int<32>)hdr.lanes.value_##b;                                     \
            }                                                                                    \
            first = (bit<32>)value.first;                                                        \
            second = (bit<32>)value.second;                                                      \
        }                                                                                        \
    };                                                                                           \
    RegisterAction<lane_pair_t, bit<32>, bit<32>>(lane_pair_##k) pair_read_##k = {               \
        void apply(inout lane_pair_t value, out bit<32> first, out bit<32> second) {             \
            PASSING_TESTGEN_PAIR_READ(k, value)                                                  \
            first = (bit<32>)value.first;                                                        \
            second = (bit<32>)value.second;                                                      \
        }                                                                                        \
    };                                                                                           \
    action lane_write_##k() { pair_write_##k.execute(meta.slot_set); }                            \
    action lane_add_##k() {                                                                      \
        hdr.lanes.value_##a = pair_add_##k.execute(meta.slot_set, hdr.lanes.value_##b);          \
    }                                                                                            \
    action lane_max_##k() {                                                                      \
        hdr.lanes.value_##a = pair_max_##k.execute(meta.slot_set, hdr.lanes.value_##b);          \
    }                                                                                            \
    action lane_read_##k() {                                                                     \
        hdr.lanes.value_##a = pair_read_##k.execute(meta.slot_set, hdr.lanes.value_##b);         \
    }                                                                                            \
    @stage(PASSING_FIRST_LANE_STAGE + k / 4)  /* four pairs (SALUs) per stage */                 \
    table lane_op_##k {                                                                          \
        key = { meta.lane_op: exact; }                                                           \
        actions = { lane_write_##k; lane_add_##k; lane_max_##k; lane_read_##k; NoAction; }       \
        const entries = {                                                                        \
            LANE_WRITE: lane_write_##k();                                                        \
            LANE_ADD: lane_add_##k();                                                            \
            LANE_MAX: lane_max_##k();                                                            \
            LANE_READ: lane_read_##k();                                                          \
        }                                                                                        \
        const default_action = NoAction();                                                       \
        size = 4;                                                                                \
    }
    FOR_EACH_PAIR(LANE_PAIR)
    #define LANE_PAIR_APPLY(k, a, b) lane_op_##k.apply();

    #include "../include/tofino_tables.p4"  /* admission ... contribution */

    /* ---- the owner of an OWNER_ONLY DATA is a worker of the job, or the round is refused ---- */
    /* `full` comes from admission in stage 0 and round_check runs in stage 1: the check is the
     * match of the table that runs round_check, so it costs no stage. The owner's bit in `full`
     * is a ternary entry, as in relay_check; a DATA without OWNER_ONLY matches the first. */
    action check_round() {
        /* the entry of meta.slot_set, formed by the hash unit: no stage to wait */
        meta.fresh = round_check.execute(slot_set_index.get(
            {hdr.passing.set[0:0], meta.base_plus_slot[PASSING_SLOT_BITS - 1:0]}));
    }
    action owner_refused() {
    }
    #define OWNER_WORKER_ENTRY(i) (PASSING_FLAG_OWNER_ONLY &&& PASSING_FLAG_OWNER_ONLY, 32w1 << i &&& 32w1 << i, i): check_round();
    table owner_check {
        key = {
            hdr.passing.flags: ternary;
            meta.full: ternary;
            hdr.passing.owner: ternary;
        }
        actions = { check_round; @defaultonly owner_refused; }
        const entries = {
            (0 &&& PASSING_FLAG_OWNER_ONLY, _, _): check_round();
            PASSING_IDS_32(OWNER_WORKER_ENTRY)
        }
        const default_action = owner_refused();
        size = 33;
    }

    /* A retransmission to a completed round gets the stored result: every pair returns it. */
    action answer_from_round() {
        meta.lane_op = LANE_READ;
        meta.verdict = VERDICT_ANSWER;
    }

    /* a table of its own, apart from the SALUs of the fresh branch (as on Tofino 1) */
    action start_round() {
        meta.bitmap = meta.worker_bit;
        meta.lane_op = LANE_WRITE;
        meta.verdict = VERDICT_CONTRIBUTED;
    }
    @hidden table start_round_table {
        actions = { start_round; }
        const default_action = start_round();
    }

    /* The RESULT keeps the round's OWNER_ONLY flag until the egress, which makes each replica
     * for a worker other than the owner an ACK and clears the flag (docs/protocol.md: a RESULT
     * or ACK carries the round's OVERFLOW alone). */
    action complete_round() {
        hdr.passing.type = PASSING_TYPE_RESULT;
        hdr.passing.flags = meta.result_flags;
        ig_tm_md.mcast_grp_a = meta.group;
        hdr.bridged.result_multicast = 1;
    }
    /* a retransmission to a completed round: answer this worker alone (the egress swaps the
     * addresses, and makes it an ACK if the round is OWNER_ONLY and the worker not its owner) */
    action answer_sender() {
        hdr.passing.type = PASSING_TYPE_RESULT;
        hdr.passing.flags = meta.result_flags;
        hdr.bridged.answer = 1;
        ig_tm_md.ucast_egress_port = ig_intr_md.ingress_port;
    }

    apply {
        /* As on Tofino 1, the round is decided in 4 stages: stage 0 looks up and checks the
         * headers, stage 1 owner_check (round_check), stage 2 bitmap_start/join, stage 3 the
         * contribution table; the lane pairs follow from stage 4 (4 to 12 for 72 lanes). */
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
        meta.verdict = VERDICT_NONE;
        PASSING_TESTGEN_INPUT

        /* ---- stage 0: lookups and header checks ---- */
        bool well_formed = false;
        bool relay_kind = false;
        bool slot_in_table = false;
        if (hdr.passing.isValid()) {
            meta.job_index = (bit<32>)(hdr.passing.job & (PASSING_MAX_JOBS - 1));
            meta.flagged = hdr.passing.flags & PASSING_FLAG_OVERFLOW;
            meta.owner_only = hdr.passing.flags & PASSING_FLAG_OWNER_ONLY;
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
        meta.slot_set = (bit<32>)(hdr.passing.set[0:0] ++ meta.base_plus_slot[PASSING_SLOT_BITS - 1:0]);

        bool to_aggregator = false;
        if (ig_prsr_md.parser_err == 0 && hdr.udp.isValid() && hdr.udp.dst_port == PASSING_UDP_PORT) {
            /* a table is applied in an `if` of its own on Tofino, not inside a && chain */
            if (aggregator_address.apply().hit) {
                to_aggregator = true;
                /* ---- stages 1 to 3: the round ---- */
                /* admitted, and slot < pool: slots_left = pool - slot is in 1 .. pool */
                if (well_formed && slot_in_table && meta.slots_left != 0 && meta.slots_left[15:15] == 0) {
                    switch (owner_check.apply().action_run) {
                        check_round: {
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
                        }
                        owner_refused: {
                            meta.verdict = VERDICT_REJECTED;  /* no register touched */
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
        if (ig_prsr_md.parser_err != 0 || (to_aggregator && !well_formed && !relay_kind)) {
            malformed.count(0);
            drop();
        } else if (!to_aggregator && hdr.ethernet.isValid()) {
            l2_forward.apply();
        }
        if (to_aggregator && (well_formed || relay_kind)) {
            received.count(meta.job_index);
        }

        /* ---- where the packet goes ---- */
        /* apart from the actions below: flags shares its container with op, so they set it whole */
        meta.result_flags = meta.round_overflow | meta.owner_only;
        if (meta.verdict == VERDICT_CONTRIBUTED) {
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

        /* ---- the lanes (from stage 4; independent of the outcomes above) ---- */
        FOR_EACH_PAIR(LANE_PAIR_APPLY)
    }
}

control TnaIngressDeparser(packet_out pkt, inout headers_t hdr, in ingress_metadata_t meta,
                           in ingress_intrinsic_metadata_for_deparser_t ig_dprsr_md) {
    apply {
        pkt.emit(hdr.bridged);
        pkt.emit(hdr.ethernet);
        pkt.emit(hdr.ipv4);
        pkt.emit(hdr.udp);
        pkt.emit(hdr.passing);
        pkt.emit(hdr.lanes);
    }
}

/* The egress parses the headers alone; the lanes stay payload, which the deparser's
 * truncation cuts off an ACK. */
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

    /* the answer to a retransmission goes to its sender: the sender against the owner (in
     * the hash unit: worker and owner do not line up for an ALU or a gateway either) */
    action compare_sender_with_owner() {
        @in_hash { meta.sender_to_owner = (bit<16>)hdr.passing.worker ^ (bit<16>)hdr.passing.owner; }
    }

    /* An OWNER_ONLY round's RESULT for a worker that is not its owner: the header alone
     * (docs/protocol.md, Kinds). The deparser cuts the packet after the PASSING header. */
    action make_ack() {
        hdr.passing.type = PASSING_TYPE_ACK;
        hdr.passing.flags = hdr.passing.flags & PASSING_FLAG_OVERFLOW;
        hdr.ipv4.total_len = 20 + 8 + 16;
        hdr.udp.length = 8 + 16;
        eg_dprsr_md.mtu_trunc_len = PASSING_ACK_TRUNC_LEN;
    }
    /* the owner's RESULT: the round's OVERFLOW alone */
    action owner_result() {
        hdr.passing.flags = hdr.passing.flags & PASSING_FLAG_OVERFLOW;
    }

    apply {
        if (hdr.passing.isValid()) {
            meta.job_index = (bit<32>)(hdr.passing.job & (PASSING_MAX_JOBS - 1));
        }
        /* a replica's worker is its replication id, an answer's its sender: both, into two fields */
        compare_with_owner();
        compare_sender_with_owner();
        /* result_rewrite is applied in one place, as on BMv2 (a table with one successor) */
        bool addressed = false;  /* a replica for one worker: result_rewrite addresses it */
        bool sent = false;
        if (hdr.bridged.flood == 1 && eg_intr_md.egress_port == hdr.bridged.ingress_port) {
            drop();  /* a flood never goes back where it came from */
        } else if (hdr.bridged.relay == 1) {
            /* a GATHER to every worker but its sender (= its owner), a NACK to its owner alone */
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
            /* a RESULT of an OWNER_ONLY round (a relayed packet is no RESULT) */
            if (hdr.passing.type == PASSING_TYPE_RESULT && (hdr.passing.flags & PASSING_FLAG_OWNER_ONLY) != 0) {
                if ((hdr.bridged.answer == 0 && meta.to_owner != 0)
                        || (hdr.bridged.answer == 1 && meta.sender_to_owner != 0)) {
                    make_ack();
                } else {
                    owner_result();
                }
            }
        }
        hdr.bridged.setInvalid();
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
        pkt.emit(hdr.ethernet);
        pkt.emit(hdr.ipv4);
        pkt.emit(hdr.udp);
        pkt.emit(hdr.passing);
    }
}

Pipeline(TnaIngressParser(), PassingIngress(), TnaIngressDeparser(),
         TnaEgressParser(), PassingEgress(), TnaEgressDeparser()) pipe;

Switch(pipe) main;
