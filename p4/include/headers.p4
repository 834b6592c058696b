/* Headers of the PASSING wire format (docs/protocol.md), shared by every target. */
#ifndef PASSING_HEADERS_P4
#define PASSING_HEADERS_P4

#include "constants.p4"
#include "lanes.p4"

header ethernet_h {
    bit<48> dst_addr;
    bit<48> src_addr;
    bit<16> ether_type;
}

header ipv4_h {
    bit<4> version;
    bit<4> ihl;
    bit<8> diffserv;
    bit<16> total_len;
    bit<16> identification;
    bit<3> flags;
    bit<13> frag_offset;
    bit<8> ttl;
    bit<8> protocol;
    bit<16> hdr_checksum;
    bit<32> src_addr;
    bit<32> dst_addr;
}

header udp_h {
    bit<16> src_port;
    bit<16> dst_port;
    bit<16> length;
    bit<16> checksum;
}

/* 16 bytes, field for field as passing.wire.HEADER_DTYPE. */
header passing_h {
    bit<8> version;
    bit<8> type;
    bit<8> op;
    bit<8> flags;
    bit<16> job;
    bit<16> slot;
    bit<8> worker;
    bit<7> owner;        /* whose data: an OWNER_ONLY round's owner, a GATHER's sender, a NACK's addressee */
    bit<1> set;
    bit<16> generation;  /* which allocation of this job id: part of the admission match */
    bit<32> psn;
}

/* The payload: PASSING_LANES int32 values (lanes) as one header, value_0 .. value_<n-1>.
 * One header, not a stack: Tofino keeps a stack's valid bits in one container (<= 32). */
#define PASSING_LANE_FIELD(i) bit<32> value_##i;
header lanes_h {
    FOR_EACH_LANE(PASSING_LANE_FIELD)
}

/* Ingress -> egress metadata on targets whose egress parses the packet again (TNA), and
 * the note a packet carries into its second pass (recirculation); never on the wire. */
header bridged_h {
    bit<7> pad0;
    bit<9> ingress_port;      /* the worker's port, kept across the second pass */
    bit<16> slot_set;         /* second pass: the register entry whose sums it collects */
    bit<16> group;            /* second pass: multicast group of the RESULT, 0 = unicast answer */
    bit<3> pad1;
    /* in this order: Tofino writes the bits an action sets only as one contiguous run */
    bit<1> relay;             /* a GATHER or NACK: the egress keeps the replicas it goes to */
    bit<1> flood;
    bit<1> result_multicast;  /* a completed round: the egress addresses each replica */
    bit<1> second_pass;       /* on its way to (or in) the second pass */
    bit<1> answer;            /* a RESULT answering a retransmission: back to its sender */
}

struct headers_t {
    bridged_h bridged;
    ethernet_h ethernet;
    ipv4_h ipv4;
    udp_h udp;
    passing_h passing;
    lanes_h lanes;
}

#endif
