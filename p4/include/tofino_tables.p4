/* Inside PassingIngress of both Tofino programs (p4/tna, p4/t2na), after their lane pairs:
 * drop, admission, aggregator_address, l2_forward, worker_bit, the relay of GATHER and NACK,
 * and contribution (docs/tofino.md). Needs `ig_dprsr_md`, `ig_intr_md`, `ig_tm_md`. */
    action drop() {
        ig_dprsr_md.drop_ctl = 1;
    }

    /* ---- admission: (job, generation, worker, ingress port) -> the job's allocation ---- */
    action admit(bit<32> base, bit<16> pool, bit<32> full, bit<32> epoch, bit<16> group) {
        PASSING_TESTGEN_ADMISSION(base, pool, full, epoch, group)
        /* 16 bits are exact here: slot < PASSING_SLOTS (checked apart) and pool <= PASSING_SLOTS;
         * Tofino subtracts action data only as the first operand */
        meta.base_plus_slot = (bit<16>)base + hdr.passing.slot;
        meta.slots_left = pool - hdr.passing.slot;
        meta.full = full;
        meta.epoch = epoch;
        meta.group = group;
        meta.admitted = 1;
    }
    action reject() {
        meta.slots_left = 0;  /* no slot is in the pool of an unknown (job, worker, port) */
        meta.admitted = 0;
    }
    table admission {
        key = {
            hdr.passing.job: exact @name("job");
            hdr.passing.generation: exact @name("generation");  /* a late packet of an earlier allocation: rejected */
            hdr.passing.worker: exact @name("worker");
            ig_intr_md.ingress_port: exact @name("ingress_port");
        }
        actions = { admit; @defaultonly reject; }
        const default_action = reject();
        size = 4096;
    }

    /* ---- which IPv4 address is the switch's aggregator ---- */
    table aggregator_address {
        key = { hdr.ipv4.dst_addr: exact @name("ip"); }
        actions = { NoAction; }
        const default_action = NoAction();
        size = 16;
    }

    /* ---- plain L2 forwarding for everything that is not PASSING DATA ---- */
    action forward(PortId_t port) {
        ig_tm_md.ucast_egress_port = port;
    }
    action flood() {
        ig_tm_md.mcast_grp_a = PASSING_FLOOD_GROUP;
        hdr.bridged.flood = 1;
    }
    table l2_forward {
        key = { hdr.ethernet.dst_addr: exact @name("dst_addr"); }
        actions = { forward; flood; drop; }
        const default_action = drop();
        size = 1024;
    }

    /* 1 << worker: Tofino shifts by constants only, so a constant table does it */
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

    /* ---- GATHER and NACK: whose piece, and for whom ---- */
    /* A GATHER must carry its sender as owner; a NACK another worker of the job (its bit in
     * `full`). Equality of two PHV fields and the AND with `full` are ternary entries here,
     * as in `contribution`; the first entry that matches wins. */
    action relay_allowed() {
        meta.relay_ok = 1;
    }
    action relay_refused() {
        meta.relay_ok = 0;
    }
    #define GATHER_OWN_ENTRY(i) (_, i, i, PASSING_TYPE_GATHER): relay_allowed();
    #define NACK_SELF_ENTRY(i) (_, i, i, PASSING_TYPE_NACK): relay_refused();
    #define NACK_PEER_ENTRY(i) (32w1 << i &&& 32w1 << i, i, _, PASSING_TYPE_NACK): relay_allowed();
    table relay_check {
        key = {
            meta.full: ternary;
            hdr.passing.owner: ternary;
            hdr.passing.worker: ternary;
            hdr.passing.type: exact;
        }
        actions = { relay_allowed; relay_refused; }
        const entries = {
            PASSING_IDS_32(GATHER_OWN_ENTRY)
            PASSING_IDS_32(NACK_SELF_ENTRY)
            PASSING_IDS_32(NACK_PEER_ENTRY)
        }
        const default_action = relay_refused();
        size = 96;
    }
    /* through the job's multicast group; the egress prunes by replication id */
    action relay() {
        ig_tm_md.mcast_grp_a = meta.group;
        hdr.bridged.relay = 1;
    }

    /* ---- a packet of the round under way: new contribution or duplicate? ---- */
    /* old & (1 << worker) needs an AND of two PHV fields, which a gateway cannot do and an
     * action would need a stage for; a ternary match on the worker's bit does it in one. */
    action contribute_add() {
        meta.bitmap = meta.old_bitmap | meta.worker_bit;
        meta.lane_op = LANE_ADD;
        meta.verdict = VERDICT_CONTRIBUTED;
    }
    action contribute_max() {
        meta.bitmap = meta.old_bitmap | meta.worker_bit;
        meta.lane_op = LANE_MAX;
        meta.verdict = VERDICT_CONTRIBUTED;
    }
    action already_counted() {
        meta.verdict = VERDICT_DUPLICATE;
    }
    action behind_the_round() {
        meta.verdict = VERDICT_STALE;  /* bitmap_join returned 0: another psn holds the slot */
    }
    #define SEEN_ENTRY(i) (32w1 << i &&& 32w1 << i, i, _): already_counted();
    table contribution {
        key = {
            meta.old_bitmap: ternary;
            hdr.passing.worker: ternary;
            hdr.passing.op: ternary;
        }
        actions = { contribute_add; contribute_max; already_counted; behind_the_round; }
        const entries = {
            (0, _, _): behind_the_round();
            PASSING_IDS_32(SEEN_ENTRY)
            (_, _, PASSING_OP_MAX): contribute_max();
        }
        const default_action = contribute_add();
        size = 64;
    }
