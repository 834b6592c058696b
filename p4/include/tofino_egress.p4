/* Inside PassingEgress of both Tofino programs (p4/tna, p4/t2na): results_sent, the
 * addressing of a replica (result_rewrite), of an answer (answer_to_sender), and the
 * comparison of a replica's worker with the packet's owner. Needs `eg_intr_md`,
 * `eg_dprsr_md`, and `meta` with to_owner (docs/tofino.md). */
    Counter<bit<32>, bit<32>>(PASSING_MAX_JOBS, CounterType_t.PACKETS) results_sent;

    /* Each replica of a completed round goes to one worker: replication id = worker. */
    action to_worker(bit<48> mac, bit<32> ip, bit<16> port) {
        hdr.ethernet.src_addr = hdr.ethernet.dst_addr;  /* the switch's aggregation address */
        hdr.ethernet.dst_addr = mac;
        hdr.ipv4.src_addr = hdr.ipv4.dst_addr;
        hdr.ipv4.dst_addr = ip;
        hdr.udp.src_port = PASSING_UDP_PORT;
        hdr.udp.dst_port = port;
        hdr.udp.checksum = 0;
        hdr.passing.worker = (bit<8>)eg_intr_md.egress_rid;
    }
    action drop() {
        eg_dprsr_md.drop_ctl = 1;
    }
    table result_rewrite {
        key = {
            hdr.passing.job: exact @name("job");
            eg_intr_md.egress_rid: exact @name("worker");  /* replication id = worker */
        }
        actions = { to_worker; @defaultonly drop; }
        const default_action = drop();
        size = 4096;
    }

    /* the unicast answer to a retransmission goes back where it came from */
    action answer_to_sender() {
        bit<48> mac = hdr.ethernet.dst_addr;
        hdr.ethernet.dst_addr = hdr.ethernet.src_addr;
        hdr.ethernet.src_addr = mac;
        bit<32> ip = hdr.ipv4.dst_addr;
        hdr.ipv4.dst_addr = hdr.ipv4.src_addr;
        hdr.ipv4.src_addr = ip;
        hdr.udp.dst_port = hdr.udp.src_port;
        hdr.udp.src_port = PASSING_UDP_PORT;
        hdr.udp.checksum = 0;
    }

    /* a relayed packet's replica: which worker is it for, the owner or another one? */
    action compare_with_owner() {
        /* in the hash unit: the owner (7 bits, at bit 1 of its byte) and the replication id do
         * not line up for an ALU */
        @in_hash { meta.to_owner = eg_intr_md.egress_rid ^ (bit<16>)hdr.passing.owner; }
    }
