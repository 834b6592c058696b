/* Inside PassingIngress of a Tofino program that takes the tree roles (p4/t2na), after tofino_round.p4
 * and tofino_tables.p4: the roles' counters, tables and register, with the control-plane names and
 * parameters of p4/v1model/passing.p4 (the controller's tree_roles.py writes the same entries on every
 * target; docs/tofino.md, "The tree roles"). Needs `meta` with leaf, root, up_port, leaf_job,
 * leaf_generation, map_job, owner_mapped, owner_worker, owner_up, owner_ok, up_flags, base_plus_slot,
 * slots_left, full, epoch, group, admitted, slot_set and the bridged `tree` (tofino_tree_common.p4). */
    Counter<bit<32>, bit<32>>(PASSING_MAX_JOBS, CounterType_t.PACKETS) sent_up;      /* partials (first, re-sent), GATHER and NACK copies */
    Counter<bit<32>, bit<32>>(PASSING_MAX_JOBS, CounterType_t.PACKETS) answered;     /* the root's RESULTs and ACKs that answered a round */
    Counter<bit<32>, bit<32>>(PASSING_MAX_JOBS, CounterType_t.PACKETS) late_answer;  /* the root's RESULTs and ACKs nothing waited for */

    /* ---- the job's tree role: none (flat), a leaf with its uplink, or a root ---- */
    action leaf(bit<16> up_job, bit<16> up_generation, bit<8> up_worker, bit<9> port, bit<48> mac, bit<32> ip) {
        PASSING_ASSUME(PASSING_PIN_LEAF)
        meta.leaf = 1;
        meta.tree.tree = 1;
        meta.tree.up_job = up_job;
        meta.tree.up_generation = up_generation;
        meta.tree.up_worker = up_worker;
        meta.up_port = port;
        meta.tree.up_mac = mac;
        meta.tree.up_ip = ip;
    }
    action root() {
        PASSING_ASSUME(PASSING_PIN_ROOT)
        meta.root = 1;
        meta.tree.tree = 1;
    }
    table tree_role {
        key = { hdr.passing.job: exact @name("job"); }
        actions = { leaf; root; @defaultonly NoAction; }
        const default_action = NoAction();
        size = 1024;
    }

    /* ---- what comes down: a RESULT or ACK of the root's job (up_job), or a GATHER or NACK of it on the
     * uplink port -> the leaf job it is for, with the leaf job's allocation (as admission's). Keyed by the
     * job alone (one leaf job of a root job per switch); port, generation and worker are checked apart ---- */
    action from_uplink(bit<9> port, bit<16> generation, bit<8> worker, bit<16> leaf_job, bit<16> leaf_generation,
                       bit<32> base, bit<16> pool, bit<32> full, bit<32> epoch, bit<16> group) {
        PASSING_TESTGEN_UPLINK(leaf_job, leaf_generation, base, pool, full, epoch, group)
        meta.up_port = port;
        meta.tree.up_generation = generation;
        meta.tree.up_worker = worker;
        /* 0 where the packet's field is the uplink's: a gateway compares these with 0, not two fields each
         * (its PHV input is 4 bytes and 12 bits) */
        meta.up_port_x = ig_intr_md.ingress_port ^ port;
        meta.up_generation_x = hdr.passing.generation ^ generation;
        meta.up_worker_x = hdr.passing.worker ^ worker;
        meta.leaf_job = leaf_job;
        meta.leaf_generation = leaf_generation;
        /* as admit: 16 bits are exact (slot < PASSING_SLOTS is checked apart, pool <= PASSING_SLOTS) */
        meta.base_plus_slot = (bit<16>)base + hdr.passing.slot;
        meta.slots_left = pool - hdr.passing.slot;
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
     * entry: no owner of the job. A flat job has no entries (its owner is checked against `full`) ---- */
    action owner_worker(bit<8> worker) {
        PASSING_ASSUME(PASSING_PIN_OWNER_WORKER)
        meta.owner_mapped = 1;
        meta.owner_ok = 1;
        meta.owner_worker = worker;
        meta.tree.owner_rid = (bit<16>)worker;
    }
    action owner_up() {
        PASSING_ASSUME(PASSING_PIN_OWNER_UP)
        meta.owner_up = 1;
        meta.owner_ok = meta.leaf;  /* up means something at a leaf only */
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

    /* ---- a leaf job's round: 0 until the root's answer comes down, then 1 (a RESULT) or 2 (an ACK: the
     * slot holds a partial); a new round resets it. The apply's parameter is `phase` (not `value`, which
     * names slot_overflow's in P4Testgen's traces: p4/testgen_p4testgen.py) ---- */
    Register<bit<8>, bit<32>>(PASSING_SLOT_SETS) slot_phase;
    RegisterAction<bit<8>, bit<32>, bit<8>>(slot_phase) phase_reset = {
        void apply(inout bit<8> phase) {
            PASSING_ASSUME(PASSING_PIN_PHASE(phase))
            phase = 0;
        }
    };
    RegisterAction<bit<8>, bit<32>, bit<8>>(slot_phase) phase_read = {
        void apply(inout bit<8> phase, out bit<8> now) {
            PASSING_TESTGEN_PHASE_READ(phase)
            now = phase;
        }
    };
    /* the root's answer to a round complete here: 1 if it answers it (phase 0 until now), else 0 (late) */
    RegisterAction<bit<8>, bit<32>, bit<8>>(slot_phase) phase_result = {
        void apply(inout bit<8> phase, out bit<8> first) {
            PASSING_TESTGEN_PHASE_READ(phase)
            if (phase == 0) {
                phase = 1;
                first = 1;
            }
        }
    };
    RegisterAction<bit<8>, bit<32>, bit<8>>(slot_phase) phase_ack = {
        void apply(inout bit<8> phase, out bit<8> first) {
            PASSING_TESTGEN_PHASE_READ(phase)
            if (phase == 0) {
                phase = 2;
                first = 1;
            }
        }
    };

    /* ---- the root's answer against the round its slot/set holds, read only: the allocation and psn
     * (slot_tag), every worker's bit (slot_bitmap) ---- */
    Hash<bit<32>>(HashAlgorithm_t.IDENTITY) answer_set_index;  /* slot_tag's entry, as slot_set_index */
    RegisterAction<round_t, bit<32>, bit<8>>(slot_tag) answer_check = {
        void apply(inout round_t value, out bit<8> same) {
            PASSING_TESTGEN_ROUND_READ(value)
            if (value.epoch == meta.epoch && value.tag == hdr.passing.psn) {
                same = 1;
            }
        }
    };
    RegisterAction<contributors_t, bit<32>, bit<32>>(slot_bitmap) bitmap_read = {
        void apply(inout contributors_t value, out bit<32> bitmap) {
            PASSING_TESTGEN_CONTRIBUTORS_READ(value)
            bitmap = value.bitmap;
        }
    };

    /* A leaf's partial (or a NACK for another rack) to its root: the level's fields from tree_role, out of
     * the uplink port, from this switch's aggregation address (the one the packet came to) to the root's;
     * flags from meta.up_flags (set whole: flags shares its container with op). */
    action go_up() {
        hdr.passing.job = meta.tree.up_job;
        hdr.passing.generation = meta.tree.up_generation;
        hdr.passing.worker = meta.tree.up_worker;
        hdr.passing.flags = meta.up_flags;
        ig_tm_md.ucast_egress_port = meta.up_port;
        hdr.ethernet.src_addr = hdr.ethernet.dst_addr;
        hdr.ethernet.dst_addr = meta.tree.up_mac;
        hdr.ipv4.src_addr = hdr.ipv4.dst_addr;
        hdr.ipv4.dst_addr = meta.tree.up_ip;
        hdr.udp.src_port = PASSING_UDP_PORT;
        hdr.udp.dst_port = PASSING_UDP_PORT;
        hdr.udp.checksum = 0;
    }

    /* The root's answer (or a GATHER or NACK from it) to the leaf job's servers: the leaf job's names */
    action to_leaf_job() {
        hdr.passing.job = meta.leaf_job;
        hdr.passing.generation = meta.leaf_generation;
    }
