/* PASSING data plane for Tofino 2 (T2NA): the wire format and state machine of
 * p4/v1model/passing.p4 (docs/protocol.md), with the control-plane names of both other
 * programs, built from the Tofino 1 program's shared parts (p4/include/tofino_*.p4: the
 * registers that decide a round, the tables, the egress addressing). What Tofino 2 changes
 * (docs/tofino.md, "Tofino 2"):
 *   - 20 MAU stages of 4 stateful ALUs (SALUs) per gress: the lane pairs take four per stage
 *     after the round is decided. The SALUs would take more lanes than the PHV holds (below);
 *   - a SALU returns up to four words: every lane pair returns both its sums in the one pass,
 *     so no packet is recirculated (Tofino 1 sends the completing packet round again);
 *   - the egress deparser truncates (mtu_trunc_len): an OWNER_ONLY round's replicas for the
 *     workers that are not its owner leave as header-only ACKs;
 *   - the owner of an OWNER_ONLY DATA is checked against the job's workers in the table that
 *     runs round_check, so the check costs no stage: one whose owner is not a worker is
 *     rejected and touches no register.
 *   - the tree roles (docs/protocol.md, "Trees across racks"; docs/tofino.md, "The tree roles"):
 *     a job is a leaf or a root by the entries of tree_role, uplink and owner_map, with the
 *     v1model program's names (p4/include/tofino_tree*.p4); their lookups take stages 1 to 3
 *     (the compiler's placement), so the round is decided in stages 4 to 7 and the 64 lanes
 *     follow in 8 to 15.
 * A saturated lane is not flagged (one saturated word per lane, as on Tofino 1); the host
 * reads a SUM lane at an int32 bound as overflow.
 */

/* Lanes per packet of the Tofino 2 program: the one place this number is written (the
 * Makefile's TOFINO2_LANES default reads it here). The most that fit: every lane lives in a PHV
 * container that an action can write, and those run out first. The flat program held 72; with
 * the tree roles' bridged header (144 bits) and metadata, p4c-barefoot leaves 144 bits of
 * metadata unallocated at 72 lanes, so 64 (docs/tofino.md, "The tree roles"). */
#define PASSING_T2NA_LANES 64
#ifndef PASSING_LANES
#define PASSING_LANES PASSING_T2NA_LANES
#endif

#include <core.p4>
#include <t2na.p4>

#include "../include/headers.p4"
#include "../include/lanes.p4"
#define PASSING_PARSE_HEADER_ONLY  /* the tree roles: a root's ACK comes down to a leaf as the header alone */
#include "../include/parser.p4"
#include "../include/testgen.p4"

/* The round is decided in stages 0 to 7 (PassingIngress.apply: the tree roles' lookups come first);
 * lane pair k runs in stage 8 + k / 4, pinned as on Tofino 1 so that the outcome tables do not take
 * the lanes' SALUs (where the compiler places them unpinned, too). */
#define PASSING_FIRST_LANE_STAGE 8

#include "../include/tofino_common.p4"  /* slot sets, lane ops, verdicts, register entries */
#include "../include/tofino_tree_common.p4"  /* the tree roles: replication ids, verdicts, the bridged tree header */

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
    bit<8> round_flags;  /* the round's OVERFLOW | the packet's OWNER_ONLY (one operation per action) */
    bit<8> fresh;
    bit<8> lane_op;
    bit<8> verdict;
    bit<1> admitted;     /* admission hit: (job, generation, worker, ingress port) is admitted */
    bit<1> relay_ok;     /* a GATHER of the sender's own piece, or a NACK to another worker of the job */
    /* the tree roles (docs/tofino.md, "The tree roles") */
    tree_bridged_h tree; /* to the egress, behind the bridged header */
    bit<1> leaf;         /* tree_role: a leaf job, with its uplink (tree.up_*, up_port) */
    bit<1> root;
    bit<1> owner_mapped; /* owner_map hit with a worker (owner_worker, tree.owner_rid) */
    bit<1> owner_up;     /* owner_map hit with up */
    bit<1> owner_ok;     /* an OWNER_ONLY DATA's owner is a worker here, or (a leaf) up */
    bit<8> owner_worker;
    PortId_t up_port;    /* tree_role's, or (what comes down) uplink's */
    bit<16> map_job;     /* the job whose owner map is read: the packet's, or the leaf job of what comes down */
    bit<16> leaf_job;    /* uplink: the leaf job what comes down is for */
    bit<16> leaf_generation;
    bit<8> up_flags;     /* the flags of a packet a leaf sends up */
    PortId_t up_port_x;        /* uplink: the ingress port ^ the uplink's port (0: on the uplink) */
    bit<16> up_generation_x;   /* uplink: the packet's generation ^ the uplink's */
    bit<8> up_worker_x;        /* uplink: the packet's worker ^ the uplink's */
    bit<8> phase;        /* slot_phase of a complete round at a leaf */
    bit<8> same_round;   /* the root's answer is for the round the slot/set holds */
    bit<8> first_answer; /* ... and answers it */
    PASSING_TESTGEN_METADATA
}

struct egress_metadata_t {
    tree_bridged_h tree;      /* from the ingress: what a tree job's replicas need */
    bit<16> tree_to_owner;    /* a tree job's replica's worker ^ its owner's (owner_map), 0 for the owner's */
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
    #include "../include/tofino_tree.p4"  /* tree_role, uplink, owner_map, slot_phase, go_up */

    /* ---- the owner of an OWNER_ONLY DATA is a worker of the job, or the round is refused ---- */
    /* `full` comes from admission and `owner_ok` from owner_map before the stage of round_check: the
     * check is the match of the table that runs round_check, so it costs no stage. A flat job's
     * owner's bit in `full` is a ternary entry, as in relay_check; a tree job's owner is what its
     * owner map says (owner_ok); a DATA without OWNER_ONLY matches the first. */
    action check_round() {
        /* the entry of meta.slot_set, formed by the hash unit: no stage to wait */
        meta.fresh = round_check.execute(slot_set_index.get(
            {hdr.passing.set[0:0], meta.base_plus_slot[PASSING_SLOT_BITS - 1:0]}));
    }
    action owner_refused() {
    }
    #define OWNER_WORKER_ENTRY(i) (0, PASSING_FLAG_OWNER_ONLY &&& PASSING_FLAG_OWNER_ONLY, 32w1 << i &&& 32w1 << i, i, _): check_round();
    table owner_check {
        key = {
            meta.tree.tree: ternary;
            hdr.passing.flags: ternary;
            meta.full: ternary;
            hdr.passing.owner: ternary;
            meta.owner_ok: ternary;
        }
        actions = { check_round; @defaultonly owner_refused; }
        const entries = {
            (_, 0 &&& PASSING_FLAG_OWNER_ONLY, _, _, _): check_round();
            PASSING_IDS_32(OWNER_WORKER_ENTRY)
            (1, PASSING_FLAG_OWNER_ONLY &&& PASSING_FLAG_OWNER_ONLY, _, _, 1): check_round();
        }
        const default_action = owner_refused();
        size = 34;
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
     * or ACK carries the round's OVERFLOW alone) but a root's (its answers keep it). */
    action complete_round() {
        hdr.passing.type = PASSING_TYPE_RESULT;
        hdr.passing.flags = meta.result_flags;
        ig_tm_md.mcast_grp_a = meta.group;
        hdr.bridged.result_multicast = 1;
    }
    /* a retransmission to a completed round: answer this worker alone (the egress swaps the
     * addresses, and makes it an ACK if the round is OWNER_ONLY and the worker not its owner, or
     * for a tree job if the ingress said so: tree.ack) */
    action answer_sender() {
        hdr.passing.type = PASSING_TYPE_RESULT;
        hdr.passing.flags = meta.result_flags;
        hdr.bridged.answer = 1;
        ig_tm_md.ucast_egress_port = ig_intr_md.ingress_port;
    }

    /* the root's answer to the leaf's servers, as a flat completion's (the egress addresses each replica,
     * and in an OWNER_ONLY round makes the replicas but the owner's ACKs): the round's OVERFLOW alone */
    action answer_down() {
        hdr.passing.flags = meta.flagged;
        ig_tm_md.mcast_grp_a = meta.group;
        hdr.bridged.result_multicast = 1;
    }

    apply {
        /* The tree roles' lookups take stages 1 to 3 (uplink; admission and tree_role, which wait for
         * uplink's answer; owner_map, keyed by the job uplink names), then the round is decided as on
         * Tofino 1 in stages 4 to 7: owner_check (round_check), bitmap_start/join, the contribution
         * table and slot_phase, slot_overflow; the lane pairs follow from stage 8 (8 to 15 for 64 lanes). */
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
        meta.tree.setValid();
        meta.tree.owner_rid = PASSING_NO_RID;
        meta.tree.up_job = 0;
        meta.tree.up_generation = 0;
        meta.tree.up_worker = 0;
        meta.tree.up_mac = 0;
        meta.tree.up_ip = 0;
        meta.tree.pad = 0;
        meta.tree.tree = 0;
        meta.tree.relay_up = 0;
        meta.tree.owner_only = 0;
        meta.tree.ack = 0;
        meta.tree.resend = 0;
        meta.lane_op = LANE_NONE;
        meta.verdict = VERDICT_NONE;
        meta.leaf = 0;
        meta.root = 0;
        meta.owner_mapped = 0;
        meta.owner_up = 0;
        meta.owner_ok = 0;
        meta.phase = 0;
        meta.same_round = 0;
        meta.first_answer = 0;
        PASSING_TESTGEN_INPUT

        /* ---- stage 0: lookups and header checks ---- */
        bool well_formed = false;   /* a DATA with the lanes */
        bool relay_kind = false;    /* a GATHER or NACK with the lanes, not from a leaf job's uplink */
        bool slot_in_table = false;
        bool version_ok = false;
        bool is_answer = false;     /* a RESULT or ACK (hosts send none: the root's, or malformed) */
        bool is_ack = false;
        bool is_gather = false;
        bool is_nack = false;
        bool from_up = false;       /* uplink hit */
        if (hdr.passing.isValid()) {
            meta.job_index = (bit<32>)(hdr.passing.job & (PASSING_MAX_JOBS - 1));
            meta.flagged = hdr.passing.flags & PASSING_FLAG_OVERFLOW;
            meta.owner_only = hdr.passing.flags & PASSING_FLAG_OWNER_ONLY;
            worker_bit.apply();
            if (hdr.passing.version == PASSING_VERSION) {
                version_ok = true;
            }
            if (hdr.passing.type == PASSING_TYPE_RESULT || hdr.passing.type == PASSING_TYPE_ACK) {
                is_answer = true;
            }
            if (hdr.passing.type == PASSING_TYPE_ACK) {
                is_ack = true;
            }
            if (hdr.passing.type == PASSING_TYPE_GATHER) {
                is_gather = true;
            }
            if (hdr.passing.type == PASSING_TYPE_NACK) {
                is_nack = true;
            }
            if (hdr.passing.slot[15:PASSING_SLOT_BITS] == 0) {
                slot_in_table = true;
            }
            /* on the header's fields, not the flags above: a gateway in stage 0 reads no action's result */
            if (hdr.passing.version == PASSING_VERSION
                    && (hdr.passing.type == PASSING_TYPE_RESULT || hdr.passing.type == PASSING_TYPE_ACK
                        || hdr.passing.type == PASSING_TYPE_GATHER || hdr.passing.type == PASSING_TYPE_NACK)) {
                if (uplink.apply().hit) {
                    from_up = true;
                }
            }
        }

        /* ---- stage 1: what comes down from a leaf job's root (uplink), or the packet's own job ---- */
        /* hosts send no RESULT or ACK; a GATHER or NACK of the uplink's job comes down only on the uplink
         * port (a leaf job and its root job may have one id: a server's own GATHER carries it too, and
         * takes the flat path) */
        bool down = false;
        if (from_up && (hdr.passing.type == PASSING_TYPE_RESULT || hdr.passing.type == PASSING_TYPE_ACK
                        || meta.up_port_x == 0)) {
            down = true;
            meta.map_job = meta.leaf_job;
            meta.job_index = (bit<32>)(meta.leaf_job & (PASSING_MAX_JOBS - 1));
            meta.tree.tree = 1;
        } else {
            meta.map_job = hdr.passing.job;
            if (hdr.passing.isValid()) {
                admission.apply();
                tree_role.apply();
                PASSING_TESTGEN_MEMBER(meta.admitted, meta.full, meta.worker_bit)
            }
        }
        if (version_ok && hdr.passing.type == PASSING_TYPE_DATA && hdr.lanes.isValid()) {
            well_formed = true;
        }
        if (!down && version_ok && (is_gather || is_nack) && hdr.lanes.isValid()) {
            relay_kind = true;
        }
        meta.slot_set = (bit<32>)(hdr.passing.set[0:0] ++ meta.base_plus_slot[PASSING_SLOT_BITS - 1:0]);

        /* ---- stage 2: the owner map (a flat job has no entries) ---- */
        if (version_ok) {
            owner_map.apply();
        }

        bool to_aggregator = false;
        if (ig_prsr_md.parser_err == 0 && hdr.udp.isValid() && hdr.udp.dst_port == PASSING_UDP_PORT) {
            /* a table is applied in an `if` of its own on Tofino, not inside a && chain */
            if (aggregator_address.apply().hit) {
                to_aggregator = true;
                if (down) {
                    /* ---- the root's answer to a leaf job's round, or a GATHER or NACK relayed down ---- */
                    if (meta.up_port_x != 0 || meta.up_generation_x != 0 || meta.up_worker_x != 0) {
                        meta.verdict = VERDICT_REJECTED;
                    } else if ((is_ack && hdr.lanes.isValid()) || (!is_ack && !hdr.lanes.isValid())) {
                        meta.verdict = VERDICT_REJECTED;  /* the job's lanes; an ACK: the header alone */
                    } else if (hdr.passing.type == PASSING_TYPE_RESULT && meta.owner_only != 0 && meta.owner_mapped == 0) {
                        meta.verdict = VERDICT_REJECTED;  /* an OWNER_ONLY round's sums: for a server of this rack */
                    } else if (is_gather && meta.owner_up == 0) {
                        meta.verdict = VERDICT_REJECTED;  /* a piece of another rack's server */
                    } else if (is_nack && meta.owner_mapped == 0) {
                        meta.verdict = VERDICT_REJECTED;  /* a NACK to a server of this rack */
                    } else if (!is_answer) {
                        meta.verdict = VERDICT_RELAY;
                    } else if (slot_in_table && meta.slots_left != 0 && meta.slots_left[15:15] == 0) {
                        /* stages 4 to 7: the round the slot/set holds, complete here, not yet answered */
                        meta.same_round = answer_check.execute(answer_set_index.get(
                            {hdr.passing.set[0:0], meta.base_plus_slot[PASSING_SLOT_BITS - 1:0]}));
                        if (meta.same_round == 1) {
                            meta.old_bitmap = bitmap_read.execute(meta.slot_set);
                            if (meta.old_bitmap == meta.full) {
                                if (is_ack) {
                                    meta.first_answer = phase_ack.execute(meta.slot_set);
                                } else {
                                    meta.first_answer = phase_result.execute(meta.slot_set);
                                }
                            }
                        }
                        if (meta.first_answer == 1) {
                            /* a RESULT's lanes and OVERFLOW replace the partial; an ACK's OVERFLOW */
                            meta.round_overflow = overflow_start.execute(meta.slot_set);
                            meta.verdict = VERDICT_ANSWERED;
                            if (!is_ack) {
                                meta.lane_op = LANE_WRITE;
                            }
                        } else {
                            meta.verdict = VERDICT_LATE;
                        }
                    } else {
                        meta.verdict = VERDICT_REJECTED;
                    }
                } else if (well_formed && slot_in_table && meta.slots_left != 0 && meta.slots_left[15:15] == 0) {
                    /* ---- stages 4 to 7: the round ---- */
                    /* admitted, and slot < pool: slots_left = pool - slot is in 1 .. pool */
                    switch (owner_check.apply().action_run) {
                        check_round: {
                            if (meta.fresh == 1) {
                                bitmap_start.execute(meta.slot_set);
                                start_round_table.apply();
                                phase_reset.execute(meta.slot_set);
                                meta.round_overflow = overflow_start.execute(meta.slot_set);
                            } else {
                                meta.old_bitmap = bitmap_join.execute(meta.slot_set);
                                if (meta.old_bitmap == meta.full) {
                                    answer_from_round();
                                    meta.phase = phase_read.execute(meta.slot_set);
                                } else {
                                    contribution.apply();  /* stale, duplicate, or add / max */
                                }
                                if (meta.old_bitmap != 0) {
                                    meta.round_overflow = overflow_join.execute(meta.slot_set);
                                }
                            }
                        }
                        owner_refused: {
                            meta.verdict = VERDICT_REJECTED;  /* no register touched */
                        }
                    }
                } else if (well_formed) {
                    meta.verdict = VERDICT_REJECTED;
                } else if (relay_kind && meta.tree.tree == 1) {
                    /* a tree job's GATHER (the sender's own piece, as its owner map says) or NACK (to
                     * another worker here, or at a leaf up): no register */
                    if (meta.admitted == 0) {
                        meta.verdict = VERDICT_REJECTED;
                    } else if (is_gather) {
                        if (meta.owner_mapped == 1 && meta.owner_worker == hdr.passing.worker) {
                            meta.verdict = VERDICT_RELAY;
                        } else {
                            meta.verdict = VERDICT_REJECTED;
                        }
                    } else if (meta.leaf == 1 && meta.owner_up == 1) {
                        meta.verdict = VERDICT_UP;
                    } else if (meta.owner_mapped == 1 && meta.owner_worker != hdr.passing.worker) {
                        meta.verdict = VERDICT_RELAY;
                    } else {
                        meta.verdict = VERDICT_REJECTED;
                    }
                } else if (relay_kind) {
                    /* no register (relay_check needs `full` from admission) */
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
        if (ig_prsr_md.parser_err != 0 || (to_aggregator && !down && !well_formed && !relay_kind)) {
            malformed.count(0);
            drop();
        } else if (!to_aggregator && hdr.ethernet.isValid()) {
            l2_forward.apply();
        }
        if (to_aggregator && (well_formed || relay_kind || down)) {
            received.count(meta.job_index);
        }

        /* ---- where the packet goes ---- */
        /* apart from the actions below: flags shares its container with op, so they set it whole. A
         * leaf's answers to its servers carry the round's OVERFLOW alone, a root's keep OWNER_ONLY too
         * (docs/protocol.md, "Trees across racks"), as a flat job's until its egress */
        meta.round_flags = meta.round_overflow | meta.owner_only;
        if (meta.leaf == 1) {
            meta.result_flags = meta.round_overflow;
        } else {
            meta.result_flags = meta.round_flags;
        }
        if (meta.verdict == VERDICT_ANSWER && meta.leaf == 1 && meta.phase == 0) {
            /* a leaf's partial sent up again (below): RETRANSMIT is added in the egress (one operation per
             * action here). Not a flat job's answer, whose slot_phase is 0 too */
            meta.up_flags = meta.round_flags;
            meta.tree.resend = 1;
        } else if (meta.verdict == VERDICT_UP) {
            meta.up_flags = hdr.passing.flags;
        } else {
            meta.up_flags = meta.round_flags;
        }
        if (meta.verdict == VERDICT_CONTRIBUTED) {
            aggregated.count(meta.job_index);
            if (meta.flagged != 0) {
                overflow.count(meta.job_index);
            }
            if (meta.bitmap == meta.full) {
                completed.count(meta.job_index);
                if (meta.leaf == 1) {
                    /* complete at a leaf: the partial goes up as one DATA of the root's job */
                    sent_up.count(meta.job_index);
                    go_up();
                } else {
                    complete_round();
                }
            } else {
                drop();
            }
        } else if (meta.verdict == VERDICT_ANSWER) {
            if (meta.leaf == 1 && meta.phase == 0) {
                /* complete at a leaf and not answered yet: the partial goes up again, flagged
                 * RETRANSMIT (the hosts' timers clock both levels) */
                duplicate.count(meta.job_index);
                sent_up.count(meta.job_index);
                go_up();
            } else {
                duplicate_answered.count(meta.job_index);
                answer_sender();
                /* a tree job's ACK: a non-owner of an OWNER_ONLY round (its owner map), or any server once
                 * a leaf's root answered with an ACK (the slot holds a partial) */
                if (meta.tree.tree == 1) {
                    if (meta.leaf == 1 && meta.phase == 2) {
                        meta.tree.ack = 1;
                    } else if (meta.owner_only != 0 && meta.owner_mapped == 0) {
                        meta.tree.ack = 1;
                    } else if (meta.owner_only != 0 && meta.owner_worker != hdr.passing.worker) {
                        meta.tree.ack = 1;
                    }
                }
            }
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
            /* GATHER to every other worker, NACK to its owner: the job's multicast group, the egress
             * keeps the replicas it goes to. A leaf's GATHER also goes up, by its group's uplink replica;
             * what comes down takes the leaf job's names */
            relayed.count(meta.job_index);
            relay();
            if (down) {
                to_leaf_job();
            } else if (meta.leaf == 1 && is_gather) {
                sent_up.count(meta.job_index);
                meta.tree.relay_up = 1;
            }
        } else if (meta.verdict == VERDICT_UP) {
            /* a leaf's NACK to another rack's server: up, as sent but for the level's fields */
            relayed.count(meta.job_index);
            sent_up.count(meta.job_index);
            go_up();
        } else if (meta.verdict == VERDICT_ANSWERED) {
            answered.count(meta.job_index);
            to_leaf_job();
            answer_down();
            if (hdr.passing.type == PASSING_TYPE_RESULT && meta.owner_only != 0) {
                meta.tree.owner_only = 1;  /* the RESULT to the rack's owner, ACKs to the others */
            }
        } else if (meta.verdict == VERDICT_LATE) {
            late_answer.count(meta.job_index);
            drop();
        }

        /* ---- the lanes (from stage 7; independent of the outcomes above) ---- */
        FOR_EACH_PAIR(LANE_PAIR_APPLY)
    }
}

control TnaIngressDeparser(packet_out pkt, inout headers_t hdr, in ingress_metadata_t meta,
                           in ingress_intrinsic_metadata_for_deparser_t ig_dprsr_md) {
    apply {
        pkt.emit(hdr.bridged);
        pkt.emit(meta.tree);
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
        pkt.extract(meta.tree);
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
    #include "../include/tofino_tree_egress.p4"  /* to_root, compare_with_owner_rid */

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
    /* a tree job's ACK: the ingress set its flags (a root's keep OWNER_ONLY, docs/protocol.md) */
    action make_tree_ack() {
        hdr.passing.type = PASSING_TYPE_ACK;
        hdr.ipv4.total_len = 20 + 8 + 16;
        hdr.udp.length = 8 + 16;
        eg_dprsr_md.mtu_trunc_len = PASSING_ACK_TRUNC_LEN;
    }

    /* P4Testgen's egress model reads the input packet's bytes, not what the ingress emitted (docs/tofino.md,
     * "Executed by P4Testgen"), and with the tree roles' egress it finds no path at all for packets the ingress
     * answers (a retransmission to a completed round): its vectors are compared at the traffic manager, so
     * under PASSING_TESTGEN the egress does nothing. */
    apply {
#ifdef PASSING_TESTGEN
        if (false)
#endif
        {
        if (hdr.passing.isValid()) {
            meta.job_index = (bit<32>)(hdr.passing.job & (PASSING_MAX_JOBS - 1));
        }
        /* a replica's worker is its replication id, an answer's its sender: both, into two fields */
        compare_with_owner();
        compare_sender_with_owner();
        compare_with_owner_rid();  /* a tree job's owner: its owner map's worker, from the ingress */
        /* result_rewrite is applied in one place, as on BMv2 (a table with one successor) */
        bool addressed = false;  /* a replica for one worker: result_rewrite addresses it */
        bool sent = false;
        if (hdr.bridged.flood == 1 && eg_intr_md.egress_port == hdr.bridged.ingress_port) {
            drop();  /* a flood never goes back where it came from */
        } else if (hdr.bridged.flood == 0 && eg_intr_md.egress_rid == PASSING_UP_RID) {
            /* a leaf group's uplink replica: a server's GATHER goes up, anything else not */
            if (meta.tree.relay_up == 1) {
                to_root();
            } else {
                drop();
            }
        } else if (hdr.bridged.relay == 1 && meta.tree.tree == 1) {
            /* a tree job's GATHER to every worker but its owner's, a NACK to its owner's alone */
            if ((hdr.passing.type == PASSING_TYPE_GATHER && meta.tree_to_owner == 0)
                    || (hdr.passing.type != PASSING_TYPE_GATHER && meta.tree_to_owner != 0)) {
                drop();
            } else {
                addressed = true;
            }
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
            if (hdr.passing.type != PASSING_TYPE_RESULT) {
                /* an ACK from a leaf's root goes to its servers as it came */
            } else if (meta.tree.tree == 1) {
                /* a tree job's: the unicast answer as the ingress decided; a replica for a worker but
                 * the owner's (owner_map) of a root's OWNER_ONLY round (the flag kept) or of the root's
                 * OWNER_ONLY RESULT at a leaf */
                if (hdr.bridged.answer == 1) {
                    if (meta.tree.ack == 1) {
                        make_tree_ack();
                    }
                } else if (meta.tree_to_owner != 0
                           && ((hdr.passing.flags & PASSING_FLAG_OWNER_ONLY) != 0 || meta.tree.owner_only == 1)) {
                    make_tree_ack();
                }
            } else if ((hdr.passing.flags & PASSING_FLAG_OWNER_ONLY) != 0) {
                if ((hdr.bridged.answer == 0 && meta.to_owner != 0)
                        || (hdr.bridged.answer == 1 && meta.sender_to_owner != 0)) {
                    make_ack();
                } else {
                    owner_result();
                }
            }
        }
        if (meta.tree.resend == 1) {
            hdr.passing.flags = hdr.passing.flags | PASSING_FLAG_RETRANSMIT;  /* a leaf's partial sent up again */
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
        pkt.emit(hdr.ethernet);
        pkt.emit(hdr.ipv4);
        pkt.emit(hdr.udp);
        pkt.emit(hdr.passing);
    }
}

Pipeline(TnaIngressParser(), PassingIngress(), TnaIngressDeparser(),
         TnaEgressParser(), PassingEgress(), TnaEgressDeparser()) pipe;

Switch(pipe) main;
