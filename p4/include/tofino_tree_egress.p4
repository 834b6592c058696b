/* Inside PassingEgress of a Tofino program that takes the tree roles (p4/t2na), after tofino_egress.p4:
 * a leaf's GATHER on its uplink replica, and a replica's worker against a tree job's owner. Needs `meta`
 * with the bridged `tree` (tofino_tree_common.p4) and tree_to_owner (docs/tofino.md, "The tree roles"). */

    /* A leaf's GATHER, its uplink replica: to the root as the level's packet (the ingress go_up's rewrite). */
    action to_root() {
        hdr.passing.job = meta.tree.up_job;
        hdr.passing.generation = meta.tree.up_generation;
        hdr.passing.worker = meta.tree.up_worker;
        hdr.ethernet.src_addr = hdr.ethernet.dst_addr;
        hdr.ethernet.dst_addr = meta.tree.up_mac;
        hdr.ipv4.src_addr = hdr.ipv4.dst_addr;
        hdr.ipv4.dst_addr = meta.tree.up_ip;
        hdr.udp.src_port = PASSING_UDP_PORT;
        hdr.udp.dst_port = PASSING_UDP_PORT;
        hdr.udp.checksum = 0;
    }

    /* a tree job's replica: for the owner (as its owner map says), or another worker? */
    action compare_with_owner_rid() {
        meta.tree_to_owner = eg_intr_md.egress_rid ^ meta.tree.owner_rid;
    }
