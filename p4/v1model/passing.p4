/* PASSING data plane for BMv2 (v1model): the aggregation state machine of
 * docs/protocol.md in registers, the stateless relay of GATHER and NACK, plus plain L2
 * forwarding for all other traffic. A job takes a tree role (docs/protocol.md, "Trees across
 * racks") by the entries of tree_role and uplink: a leaf sends a completed round's partial up
 * and multicasts what comes down from its root; a root is a flat job whose workers are leaves.
 *
 * Control-plane names (tables, actions, registers, counters) are shared with the TNA
 * program wherever the behaviour is the same; the controller programs both alike. */
#include <core.p4>
#include <v1model.p4>

#include "../include/headers.p4"
#include "../include/lanes.p4"
#include "../include/parser.p4"
#include "../include/testgen.p4"

#define PASSING_SLOT_SETS (2 * PASSING_SLOTS)
/* A leaf's multicast group holds, besides its servers, one replica out of its uplink port with this
 * replication id: a server's GATHER's copy up (tree_roles.py); every other packet drops it in egress. */
#define PASSING_UP_RID 255
#define PASSING_NO_RID 0xFFFF  /* an owner that is no replica of the job's group */

struct metadata_t {
    bit<32> base;        /* first slot of the job's range */
    bit<16> pool;        /* slots of the job */
    bit<32> full;        /* bitmap with every worker's bit */
    bit<32> epoch;       /* unique per allocation */
    bit<16> group;       /* multicast group of the job's workers */
    bit<32> worker_bit;  /* 1 << worker, from the table worker_bit (0 for worker >= 32) */
    bit<32> owner_bit;   /* 1 << owner, from the table owner_bit (0 for owner >= 32) */
    bit<32> job_index;   /* counter index */
    bit<32> slot_set;    /* (base + slot) * 2 + set */
    bit<32> lane_base;   /* slot_set * PASSING_LANES */
    bit<1> admitted;
    bit<1> result_multicast;  /* a completed round: egress rewrites each replica */
    bit<1> owner_only;        /* of an OWNER_ONLY round: egress makes the non-owners' replicas ACKs */
    bit<1> relay;             /* a GATHER or NACK: egress keeps the replicas it goes to, addressed */
    bit<1> flood;
    /* a leaf job (tree_role): where its partials go */
    bit<1> leaf;
    bit<1> root;
    bit<16> up_job;
    bit<16> up_generation;
    bit<8> up_worker;
    bit<9> up_port;
    bit<48> up_mac;
    bit<32> up_ip;
    /* what comes down (uplink): the leaf job it answers, what the root's packet must say */
    bit<16> leaf_job;
    bit<16> leaf_generation;
    /* the owner map of a tree job (owner_map): the owner's worker here, or up */
    bit<16> map_job;      /* the job whose map is read: the packet's, or the leaf job of what comes down */
    bit<1> owner_mapped;  /* owner_map hit with a worker */
    bit<8> owner_worker;
    bit<1> owner_up;      /* owner_map hit with up: a server of another rack */
    bit<16> owner_rid;    /* the owner's replication id (its worker here), PASSING_NO_RID for none */
    bit<1> relay_up;      /* a GATHER from a leaf's server: its group's uplink replica goes up */
}

parser V1Parser(packet_in pkt, out headers_t hdr, inout metadata_t meta, inout standard_metadata_t sm) {
    PassingParser() passing_parser;
    state start {
        hdr.bridged.setInvalid();  /* TNA only */
        passing_parser.apply(pkt, hdr, true);
        /* a root's ACK comes down to a leaf as the header alone, which the shared parser leaves as payload */
        transition select(hdr.udp.isValid(), hdr.udp.dst_port, hdr.udp.length) {
            (true, PASSING_UDP_PORT, 8 + 16): parse_header_only;
            default: accept;
        }
    }
    state parse_header_only {
        pkt.extract(hdr.passing);  /* lanes invalid: the ingress drops any other kind of this length */
        transition accept;
    }
}

control V1VerifyChecksum(inout headers_t hdr, inout metadata_t meta) {
    apply { }
}

control PassingIngress(inout headers_t hdr, inout metadata_t meta, inout standard_metadata_t sm) {
    /* ---- state per slot and set ---- */
    register<bit<32>>(PASSING_SLOT_SETS) slot_epoch;
    register<bit<32>>(PASSING_SLOT_SETS) slot_tag;
    register<bit<32>>(PASSING_SLOT_SETS) slot_bitmap;
    register<bit<8>>(PASSING_SLOT_SETS) slot_overflow;
    /* a leaf job's round: 0 until the root's answer comes down, then 1 (a RESULT) or 2 (an ACK: the slot
     * holds a partial); a flat job's rounds never read it */
    register<bit<8>>(PASSING_SLOT_SETS) slot_phase;
    register<bit<32>>(PASSING_SLOT_SETS * PASSING_LANES) lane_acc;

    /* ---- outcomes, per job (index = job id mod PASSING_MAX_JOBS) ---- */
    counter(1, CounterType.packets) malformed;
    counter(PASSING_MAX_JOBS, CounterType.packets) received;
    counter(PASSING_MAX_JOBS, CounterType.packets) rejected;
    counter(PASSING_MAX_JOBS, CounterType.packets) aggregated;
    counter(PASSING_MAX_JOBS, CounterType.packets) completed;
    counter(PASSING_MAX_JOBS, CounterType.packets) duplicate;
    counter(PASSING_MAX_JOBS, CounterType.packets) duplicate_answered;
    counter(PASSING_MAX_JOBS, CounterType.packets) stale;
    counter(PASSING_MAX_JOBS, CounterType.packets) overflow;
    counter(PASSING_MAX_JOBS, CounterType.packets) relayed;
    counter(PASSING_MAX_JOBS, CounterType.packets) sent_up;      /* partials (first, re-sent), GATHER and NACK copies */
    counter(PASSING_MAX_JOBS, CounterType.packets) answered;     /* the root's RESULTs and ACKs that answered a round */
    counter(PASSING_MAX_JOBS, CounterType.packets) late_answer;  /* the root's RESULTs and ACKs nothing waited for */

    action drop() {
        mark_to_drop(sm);
    }

    /* ---- admission: (job, generation, worker, ingress port) -> the job's allocation ---- */
    action admit(bit<32> base, bit<16> pool, bit<32> full, bit<32> epoch, bit<16> group) {
        /* P4Testgen's in_domain run only (p4/include/testgen.p4): what the controller writes */
        PASSING_TESTGEN_ADMISSION(base, pool, full, epoch, group)
        meta.admitted = 1;
        meta.base = base;
        meta.pool = pool;
        meta.full = full;
        meta.epoch = epoch;
        meta.group = group;
    }
    action reject() {
        meta.admitted = 0;
    }
    table admission {
        key = {
            hdr.passing.job: exact @name("job");
            hdr.passing.generation: exact @name("generation");  /* a late packet of an earlier allocation: rejected */
            hdr.passing.worker: exact @name("worker");
            sm.ingress_port: exact @name("ingress_port");
        }
        actions = { admit; @defaultonly reject; }
        const default_action = reject();
        size = 4096;
    }

    /* ---- the job's tree role: none (flat), a leaf with its uplink, or a root ---- */
    action leaf(bit<16> up_job, bit<16> up_generation, bit<8> up_worker, bit<9> port, bit<48> mac, bit<32> ip) {
        meta.leaf = 1;
        meta.up_job = up_job;
        meta.up_generation = up_generation;
        meta.up_worker = up_worker;
        meta.up_port = port;
        meta.up_mac = mac;
        meta.up_ip = ip;
    }
    action root() {
        meta.root = 1;
    }
    table tree_role {
        key = { hdr.passing.job: exact @name("job"); }
        actions = { leaf; root; @defaultonly NoAction; }
        const default_action = NoAction();
        size = 1024;
    }

    /* ---- what comes down: a RESULT or ACK of the root's job (up_job), or a GATHER or NACK of it on the
     * uplink port -> the leaf job it is for. Keyed by the job alone (one leaf job of a root job per switch):
     * a RESULT or ACK of a known up_job from another port, of another generation or for another leaf is
     * rejected, counted on the leaf job; of no up_job, malformed */
    action from_uplink(bit<9> port, bit<16> generation, bit<8> worker, bit<16> leaf_job, bit<16> leaf_generation,
                       bit<32> base, bit<16> pool, bit<32> full, bit<32> epoch, bit<16> group) {
        meta.admitted = 1;
        meta.up_port = port;
        meta.up_generation = generation;
        meta.up_worker = worker;
        meta.leaf_job = leaf_job;
        meta.leaf_generation = leaf_generation;
        meta.base = base;
        meta.pool = pool;
        meta.full = full;
        meta.epoch = epoch;
        meta.group = group;
    }
    table uplink {
        key = { hdr.passing.job: exact @name("job"); }
        actions = { from_uplink; @defaultonly NoAction; }
        const default_action = NoAction();
        size = 1024;
    }

    /* ---- a tree job's owner map: an owner (a server's number in the whole job) -> its worker here (a
     * leaf: its rack's server; a root: the leaf of its rack), or up (a leaf: another rack's server); no
     * entry: no owner of the job. A flat job's map is the identity, with no entries (owner_bit) ---- */
    action owner_worker(bit<8> worker) {
        meta.owner_mapped = 1;
        meta.owner_worker = worker;
    }
    action owner_up() {
        meta.owner_up = 1;
    }
    table owner_map {
        key = {
            meta.map_job: exact @name("job");
            hdr.passing.owner: exact @name("owner");
        }
        actions = { owner_worker; owner_up; @defaultonly NoAction; }
        const default_action = NoAction();
        size = 4096;
    }

    /* ---- which IPv4 address is the switch's aggregator: PASSING traffic to any other
     * address (a PS host, say) is ordinary traffic ---- */
    table aggregator_address {
        key = { hdr.ipv4.dst_addr: exact @name("ip"); }
        actions = { NoAction; }
        const default_action = NoAction();
        size = 16;
    }

    /* ---- plain L2 forwarding for everything that is not PASSING DATA ---- */
    action forward(bit<9> port) {
        sm.egress_spec = port;
    }
    action flood() {
        sm.mcast_grp = PASSING_FLOOD_GROUP;
        meta.flood = 1;
    }
    table l2_forward {
        key = { hdr.ethernet.dst_addr: exact @name("dst_addr"); }
        actions = { forward; flood; drop; }
        const default_action = drop();
        size = 1024;
    }

    /* 1 << worker and 1 << owner: constant tables, as on TNA (which shifts by constants only), because
     * P4Testgen's bmv2 model cannot shift by a field narrower than the value (a Z3 sort mismatch) and
     * p4c-bm2-ss forbids a wider shift amount. A worker or owner >= 32 has no bit: the default leaves
     * the metadata at 0, which is what the shift gave. */
    action set_worker_bit(bit<32> worker_bit) {
        meta.worker_bit = worker_bit;
    }
    #define WORKER_BIT_ENTRY(i) i: set_worker_bit(32w1 << i);
    table worker_bit {
        key = { hdr.passing.worker: exact; }
        actions = { set_worker_bit; @defaultonly NoAction; }
        const entries = { PASSING_IDS_32(WORKER_BIT_ENTRY) }
        const default_action = NoAction();
        size = 32;
    }
    action set_owner_bit(bit<32> owner_bit) {
        meta.owner_bit = owner_bit;
    }
    #define OWNER_BIT_ENTRY(i) i: set_owner_bit(32w1 << i);
    table owner_bit {
        key = { hdr.passing.owner: exact; }
        actions = { set_owner_bit; @defaultonly NoAction; }
        const entries = { PASSING_IDS_32(OWNER_BIT_ENTRY) }
        const default_action = NoAction();
        size = 32;
    }

    /* A lane of a new round or of a contribution: first write, saturating add, or max. */
    #define LANE_UPDATE(i) {                                                           \
        bit<32> cur;                                                                   \
        lane_acc.read(cur, meta.lane_base + (i));                                      \
        bit<32> inc = hdr.lanes.value_##i;                                              \
        bit<32> updated = inc;                                                            \
        if (!fresh) {                                                                  \
            if (hdr.passing.op == PASSING_OP_MAX) {                                    \
                if ((int<32>)cur > (int<32>)inc) { updated = cur; }                       \
            } else {                                                                   \
                int<32> saturated = (int<32>)cur |+| (int<32>)inc;                     \
                if (saturated != (int<32>)cur + (int<32>)inc) { lane_overflow = 1; }   \
                updated = (bit<32>)saturated;                                          \
            }                                                                          \
        }                                                                              \
        lane_acc.write(meta.lane_base + (i), updated);                                  \
        hdr.lanes.value_##i = updated;                                                   \
    }
    /* An OWNER_ONLY round's answer to a worker that is not its owner: the header alone. */
    action make_ack() {
        hdr.lanes.setInvalid();
        hdr.passing.type = PASSING_TYPE_ACK;
        hdr.ipv4.total_len = hdr.ipv4.total_len - 4 * PASSING_LANES;
        hdr.udp.length = hdr.udp.length - 4 * PASSING_LANES;
    }

    /* A lane of a completed round, read back for a retransmitting worker. */
    #define LANE_READ(i) { lane_acc.read(hdr.lanes.value_##i, meta.lane_base + (i)); }
    /* A lane of the root's RESULT, written over a leaf's partial (no add). */
    #define LANE_WRITE(i) { lane_acc.write(meta.lane_base + (i), hdr.lanes.value_##i); }

    /* A leaf's partial (or a NACK for another rack) to its root: the level's fields from tree_role, out of the
     * uplink port, from this switch's aggregation address (the one the packet came to) to the root's. */
    action go_up(bit<8> flags) {
        hdr.passing.job = meta.up_job;
        hdr.passing.generation = meta.up_generation;
        hdr.passing.worker = meta.up_worker;
        hdr.passing.flags = flags;
        sm.egress_spec = meta.up_port;
        hdr.ethernet.src_addr = hdr.ethernet.dst_addr;
        hdr.ethernet.dst_addr = meta.up_mac;
        hdr.ipv4.src_addr = hdr.ipv4.dst_addr;
        hdr.ipv4.dst_addr = meta.up_ip;
        hdr.udp.src_port = PASSING_UDP_PORT;
        hdr.udp.dst_port = PASSING_UDP_PORT;
        hdr.udp.checksum = 0;
    }

    apply {
        if (sm.parser_error != error.NoError) {
            malformed.count(0);
            drop();
        } else if (hdr.udp.isValid() && hdr.udp.dst_port == PASSING_UDP_PORT && aggregator_address.apply().hit) {
            bool ok = hdr.passing.isValid() && hdr.passing.version == PASSING_VERSION;
            bool down = false;  /* from a leaf job's uplink: what its root sends down */
            if (ok && (hdr.passing.type == PASSING_TYPE_RESULT || hdr.passing.type == PASSING_TYPE_ACK
                       || hdr.passing.type == PASSING_TYPE_GATHER || hdr.passing.type == PASSING_TYPE_NACK)) {
                if (uplink.apply().hit) {
                    /* hosts send no RESULT or ACK; a GATHER or NACK of the uplink's job comes down only on the
                     * uplink port (the controller gives a leaf job and its root job one id: a server's own
                     * GATHER carries it too, and takes the flat path) */
                    down = hdr.passing.type == PASSING_TYPE_RESULT || hdr.passing.type == PASSING_TYPE_ACK
                           || sm.ingress_port == meta.up_port;
                }
            }
            meta.map_job = down ? meta.leaf_job : hdr.passing.job;
            if (ok) {
                owner_map.apply();
            }
            if (down) {
                /* the root's answer to a leaf job's round, or a GATHER or NACK relayed down */
                meta.job_index = (bit<32>)meta.leaf_job & (PASSING_MAX_JOBS - 1);
                received.count(meta.job_index);
                bool answer = hdr.passing.type == PASSING_TYPE_RESULT || hdr.passing.type == PASSING_TYPE_ACK;
                bool is_ack = hdr.passing.type == PASSING_TYPE_ACK;
                bool owner_only = (hdr.passing.flags & PASSING_FLAG_OWNER_ONLY) != 0;
                if (sm.ingress_port != meta.up_port || hdr.passing.generation != meta.up_generation
                        || hdr.passing.worker != meta.up_worker
                        || hdr.lanes.isValid() == is_ack  /* the job's lanes; an ACK: the header alone */
                        || (answer && hdr.passing.slot >= meta.pool)
                        || (answer && meta.base + (bit<32>)hdr.passing.slot >= PASSING_SLOTS)
                        /* an OWNER_ONLY round's sums come down only for a server of this rack */
                        || (hdr.passing.type == PASSING_TYPE_RESULT && owner_only && meta.owner_mapped == 0)
                        /* a piece of another rack's server, a NACK to one of this rack */
                        || (hdr.passing.type == PASSING_TYPE_GATHER && meta.owner_up == 0)
                        || (hdr.passing.type == PASSING_TYPE_NACK && meta.owner_mapped == 0)) {
                    rejected.count(meta.job_index);
                    drop();
                } else if (!answer) {
                    relayed.count(meta.job_index);
                    hdr.passing.job = meta.leaf_job;
                    hdr.passing.generation = meta.leaf_generation;
                    meta.owner_rid = meta.owner_mapped == 1 ? (bit<16>)meta.owner_worker : PASSING_NO_RID;
                    sm.mcast_grp = meta.group;
                    meta.relay = 1;
                } else {
                    meta.slot_set = ((meta.base + (bit<32>)hdr.passing.slot) << 1) | (bit<32>)hdr.passing.set[0:0];
                    meta.lane_base = meta.slot_set * PASSING_LANES;
                    bit<32> epoch;
                    bit<32> tag;
                    bit<32> bitmap;
                    bit<8> phase;
                    slot_epoch.read(epoch, meta.slot_set);
                    slot_tag.read(tag, meta.slot_set);
                    slot_bitmap.read(bitmap, meta.slot_set);
                    slot_phase.read(phase, meta.slot_set);
                    if (epoch == meta.epoch && tag == hdr.passing.psn && bitmap == meta.full && phase == 0) {
                        answered.count(meta.job_index);
                        bit<8> flags = hdr.passing.flags & PASSING_FLAG_OVERFLOW;
                        slot_overflow.write(meta.slot_set, flags);
                        if (is_ack) {
                            /* the sums went to another rack: ACKs to every server, and to whatever
                             * retransmits from now on (phase 2: the slot holds a partial) */
                            slot_phase.write(meta.slot_set, 2);
                        } else {
                            FOR_EACH_LANE(LANE_WRITE)
                            slot_phase.write(meta.slot_set, 1);
                            if (owner_only) {  /* the RESULT to the rack's owner, ACKs to the others */
                                meta.owner_only = 1;
                                meta.owner_rid = (bit<16>)meta.owner_worker;
                            }
                        }
                        /* to the leaf's servers as a flat completion's answers: the egress addresses each */
                        hdr.passing.job = meta.leaf_job;
                        hdr.passing.generation = meta.leaf_generation;
                        hdr.passing.flags = flags;
                        sm.mcast_grp = meta.group;
                        meta.result_multicast = 1;
                    } else {
                        late_answer.count(meta.job_index);
                        drop();
                    }
                }
            } else if (!ok || !hdr.lanes.isValid()
                    || (hdr.passing.type != PASSING_TYPE_DATA && hdr.passing.type != PASSING_TYPE_GATHER
                        && hdr.passing.type != PASSING_TYPE_NACK)) {
                malformed.count(0);
                drop();
            } else {
                meta.job_index = (bit<32>)hdr.passing.job & (PASSING_MAX_JOBS - 1);
                received.count(meta.job_index);
                admission.apply();
                tree_role.apply();
                /* whose the owner is: a flat job's, a worker (its bit in the full bitmap, >= 32: none); a
                 * tree job's, what its owner map says (a number in the whole job) */
                owner_bit.apply();
                bool tree = meta.leaf == 1 || meta.root == 1;
                bool owner_is_worker = tree ? meta.owner_mapped == 1 : (meta.full & meta.owner_bit) != 0;
                bool owner_up = meta.leaf == 1 && meta.owner_up == 1;
                /* the owner's replication id: a flat job's is the owner itself, worker or not (as before
                 * the roles: what a flat job does is unchanged); a tree job's, its mapped worker */
                if (!tree) {
                    meta.owner_rid = (bit<16>)hdr.passing.owner;
                } else if (owner_is_worker) {
                    meta.owner_rid = (bit<16>)meta.owner_worker;
                } else {
                    meta.owner_rid = PASSING_NO_RID;
                }
                bit<16> sender = (bit<16>)hdr.passing.worker[6:0];
                bool relay = hdr.passing.type != PASSING_TYPE_DATA;
                bool owner_only = (hdr.passing.flags & PASSING_FLAG_OWNER_ONLY) != 0;
                bit<8> keep_owner_only = owner_only ? PASSING_FLAG_OWNER_ONLY : 8w0;  /* up, and a root's answers */
                bit<8> root_owner_only = meta.root == 1 ? keep_owner_only : 8w0;
                if (meta.admitted == 0
                        || (!relay && hdr.passing.slot >= meta.pool)  /* a relayed kind's slot is no slot */
                        /* an admission entry whose range runs past the registers (the controller never
                         * writes one): BMv2 built without debug checks crashes on an index out of range */
                        || (!relay && meta.base + (bit<32>)hdr.passing.slot >= PASSING_SLOTS)
                        || (!relay && owner_only && !owner_is_worker && !owner_up)
                        /* a GATHER's owner is its sender; a NACK's another worker here, or up */
                        || (hdr.passing.type == PASSING_TYPE_GATHER
                            && ((tree && !owner_is_worker) || meta.owner_rid != sender))
                        || (hdr.passing.type == PASSING_TYPE_NACK && !owner_up
                            && (!owner_is_worker || meta.owner_rid == sender))) {
                    rejected.count(meta.job_index);
                    drop();
                } else if (relay && owner_up) {
                    /* a leaf's NACK to another rack's server: up, as sent but for the level's fields */
                    relayed.count(meta.job_index);
                    sent_up.count(meta.job_index);
                    go_up(hdr.passing.flags);
                } else if (relay) {
                    /* GATHER to every other worker, NACK to its owner: the job's multicast group, the
                     * egress keeps the replicas the packet goes to; no register touched. A leaf's GATHER
                     * also goes up, by its group's uplink replica */
                    relayed.count(meta.job_index);
                    sm.mcast_grp = meta.group;
                    meta.relay = 1;
                    if (meta.leaf == 1 && hdr.passing.type == PASSING_TYPE_GATHER) {
                        sent_up.count(meta.job_index);
                        meta.relay_up = 1;
                    }
                } else {
                    worker_bit.apply();
                    meta.slot_set = ((meta.base + (bit<32>)hdr.passing.slot) << 1) | (bit<32>)hdr.passing.set[0:0];
                    meta.lane_base = meta.slot_set * PASSING_LANES;
                    bit<32> epoch;
                    bit<32> tag;
                    bit<32> bitmap;
                    bit<8> round_overflow;
                    slot_epoch.read(epoch, meta.slot_set);
                    slot_tag.read(tag, meta.slot_set);
                    slot_bitmap.read(bitmap, meta.slot_set);
                    slot_overflow.read(round_overflow, meta.slot_set);
                    bit<8> phase;
                    slot_phase.read(phase, meta.slot_set);
                    bit<32> ahead = hdr.passing.psn - tag;  /* serial-number distance */
                    bool same_epoch = epoch == meta.epoch;
                    bool fresh = !same_epoch || (ahead != 0 && ahead[31:31] == 0);
                    bool same_round = same_epoch && ahead == 0;
                    bool has_bit = (bitmap & meta.worker_bit) != 0;
                    bit<8> flagged = hdr.passing.flags & PASSING_FLAG_OVERFLOW;

                    if (fresh || (same_round && !has_bit)) {
                        bit<1> lane_overflow = 0;
                        FOR_EACH_LANE(LANE_UPDATE)
                        if (fresh) {
                            /* a new round: the first write resets the slot/set */
                            slot_epoch.write(meta.slot_set, meta.epoch);
                            slot_tag.write(meta.slot_set, hdr.passing.psn);
                            slot_phase.write(meta.slot_set, 0);
                            bitmap = meta.worker_bit;
                            round_overflow = flagged;
                        } else {
                            bitmap = bitmap | meta.worker_bit;
                            round_overflow = round_overflow | flagged;
                            if (lane_overflow == 1) {
                                round_overflow = PASSING_FLAG_OVERFLOW;
                            }
                        }
                        if (flagged != 0 || lane_overflow == 1) {
                            overflow.count(meta.job_index);
                        }
                        slot_bitmap.write(meta.slot_set, bitmap);
                        slot_overflow.write(meta.slot_set, round_overflow);
                        aggregated.count(meta.job_index);
                        if (bitmap == meta.full && meta.leaf == 1) {
                            /* complete at a leaf: the partial goes up as one DATA of the root's job */
                            completed.count(meta.job_index);
                            sent_up.count(meta.job_index);
                            go_up(round_overflow | keep_owner_only);
                        } else if (bitmap == meta.full) {
                            completed.count(meta.job_index);
                            hdr.passing.type = PASSING_TYPE_RESULT;
                            hdr.passing.flags = round_overflow | root_owner_only;
                            sm.mcast_grp = meta.group;
                            meta.result_multicast = 1;
                            if (owner_only) {
                                meta.owner_only = 1;
                            }
                        } else {
                            drop();
                        }
                    } else if (same_round && bitmap == meta.full && meta.leaf == 1 && phase == 0) {
                        /* a retransmission to a round complete at a leaf and not answered yet: the
                         * partial goes up again, flagged RETRANSMIT (the hosts' timers clock both levels) */
                        duplicate.count(meta.job_index);
                        sent_up.count(meta.job_index);
                        FOR_EACH_LANE(LANE_READ)
                        go_up(round_overflow | PASSING_FLAG_RETRANSMIT | keep_owner_only);
                    } else if (same_round && bitmap == meta.full) {
                        /* a retransmission to a completed round: answer this worker alone */
                        duplicate_answered.count(meta.job_index);
                        FOR_EACH_LANE(LANE_READ)
                        hdr.passing.type = PASSING_TYPE_RESULT;
                        hdr.passing.flags = round_overflow | root_owner_only;
                        sm.egress_spec = sm.ingress_port;
                        bit<48> mac = hdr.ethernet.dst_addr;
                        hdr.ethernet.dst_addr = hdr.ethernet.src_addr;
                        hdr.ethernet.src_addr = mac;
                        bit<32> ip = hdr.ipv4.dst_addr;
                        hdr.ipv4.dst_addr = hdr.ipv4.src_addr;
                        hdr.ipv4.src_addr = ip;
                        hdr.udp.dst_port = hdr.udp.src_port;
                        hdr.udp.src_port = PASSING_UDP_PORT;
                        hdr.udp.checksum = 0;
                        /* a non-owner of an OWNER_ONLY round, or any worker once a leaf's root answered with an ACK */
                        if ((owner_only && meta.owner_rid != sender) || (meta.leaf == 1 && phase == 2)) {
                            make_ack();
                        }
                    } else if (same_round) {
                        duplicate.count(meta.job_index);
                        drop();
                    } else {
                        stale.count(meta.job_index);
                        drop();
                    }
                }
            }
        } else if (hdr.ethernet.isValid()) {
            l2_forward.apply();
        }
    }
}

control PassingEgress(inout headers_t hdr, inout metadata_t meta, inout standard_metadata_t sm) {
    counter(PASSING_MAX_JOBS, CounterType.packets) results_sent;

    /* Each replica of a completed round goes to one worker: replication id = worker. */
    action to_worker(bit<48> mac, bit<32> ip, bit<16> port) {
        hdr.ethernet.src_addr = hdr.ethernet.dst_addr;  /* the switch's aggregation address */
        hdr.ethernet.dst_addr = mac;
        hdr.ipv4.src_addr = hdr.ipv4.dst_addr;
        hdr.ipv4.dst_addr = ip;
        hdr.udp.src_port = PASSING_UDP_PORT;
        hdr.udp.dst_port = port;
        hdr.udp.checksum = 0;
        hdr.passing.worker = (bit<8>)sm.egress_rid;
    }
    action drop() {
        mark_to_drop(sm);
    }
    /* A leaf's GATHER, its uplink replica: to the root as the level's packet (ingress go_up's rewrite). */
    action to_root() {
        hdr.passing.job = meta.up_job;
        hdr.passing.generation = meta.up_generation;
        hdr.passing.worker = meta.up_worker;
        hdr.ethernet.src_addr = hdr.ethernet.dst_addr;
        hdr.ethernet.dst_addr = meta.up_mac;
        hdr.ipv4.src_addr = hdr.ipv4.dst_addr;
        hdr.ipv4.dst_addr = meta.up_ip;
        hdr.udp.src_port = PASSING_UDP_PORT;
        hdr.udp.dst_port = PASSING_UDP_PORT;
        hdr.udp.checksum = 0;
    }
    /* An OWNER_ONLY round's replica for a worker that is not its owner: the header alone. */
    action make_ack() {
        hdr.lanes.setInvalid();
        hdr.passing.type = PASSING_TYPE_ACK;
        hdr.ipv4.total_len = hdr.ipv4.total_len - 4 * PASSING_LANES;
        hdr.udp.length = hdr.udp.length - 4 * PASSING_LANES;
    }
    table result_rewrite {
        key = {
            hdr.passing.job: exact @name("job");
            sm.egress_rid: exact @name("worker");  /* replication id = worker */
        }
        actions = { to_worker; @defaultonly drop; }
        const default_action = drop();
        size = 4096;
    }

    apply {
        bit<32> job_index = (bit<32>)hdr.passing.job & (PASSING_MAX_JOBS - 1);
        /* result_rewrite is applied in one place: BMv2 takes a table with one successor only */
        bool addressed = false;  /* a replica for one worker: result_rewrite addresses it */
        bool sent = false;
        if (meta.flood == 1 && sm.egress_port == sm.ingress_port) {
            drop();  /* a flood never goes back where it came from */
        } else if (meta.flood == 0 && sm.egress_rid == PASSING_UP_RID) {
            /* a leaf group's uplink replica: a server's GATHER goes up, anything else not */
            if (meta.relay_up == 1) {
                to_root();
            } else {
                drop();
            }
        } else if (meta.relay == 1) {
            /* a GATHER goes to every worker but its sender (= its owner), a NACK to its owner alone:
             * the replication id is the worker (the owner's, as its map says) */
            bool to_owner = sm.egress_rid == meta.owner_rid;
            if ((hdr.passing.type == PASSING_TYPE_GATHER) == to_owner) {
                drop();
            } else {
                addressed = true;
            }
        } else if (hdr.passing.isValid()
                   && (hdr.passing.type == PASSING_TYPE_RESULT || hdr.passing.type == PASSING_TYPE_ACK)) {
            /* a unicast answer was addressed (and made an ACK) in ingress; a replica is addressed here */
            if (meta.result_multicast == 1) {
                addressed = true;
            } else {
                sent = true;
            }
        }
        if (addressed) {
            if (result_rewrite.apply().hit) {
                sent = true;
            }
        }
        if (sent) {
            results_sent.count(job_index);
            if (meta.owner_only == 1 && sm.egress_rid != meta.owner_rid) {
                make_ack();
            }
        }
    }
}

control V1ComputeChecksum(inout headers_t hdr, inout metadata_t meta) {
    apply {
        update_checksum(
            hdr.ipv4.isValid(),
            { hdr.ipv4.version, hdr.ipv4.ihl, hdr.ipv4.diffserv, hdr.ipv4.total_len,
              hdr.ipv4.identification, hdr.ipv4.flags, hdr.ipv4.frag_offset, hdr.ipv4.ttl,
              hdr.ipv4.protocol, hdr.ipv4.src_addr, hdr.ipv4.dst_addr },
            hdr.ipv4.hdr_checksum,
            HashAlgorithm.csum16);
    }
}

control V1Deparser(packet_out pkt, in headers_t hdr) {
    apply {
        pkt.emit(hdr.ethernet);
        pkt.emit(hdr.ipv4);
        pkt.emit(hdr.udp);
        pkt.emit(hdr.passing);
        pkt.emit(hdr.lanes);
    }
}

V1Switch(V1Parser(), V1VerifyChecksum(), PassingIngress(), PassingEgress(), V1ComputeChecksum(), V1Deparser()) main;
