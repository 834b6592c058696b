/* The parser every target shares: Ethernet / IPv4 / UDP / PASSING / lanes.
 * A PASSING packet is a UDP datagram to (or from) PASSING_UDP_PORT; only a datagram of
 * exactly header + PASSING_LANES values gets its lanes parsed (anything else is left for
 * the ingress to count as malformed). */
#ifndef PASSING_PARSER_P4
#define PASSING_PARSER_P4

#include <core.p4>
#include "headers.p4"
#include "lanes.p4"

#define PASSING_UDP_LENGTH (8 + 16 + 4 * PASSING_LANES)

/* with_lanes = false stops after the PASSING header, leaving the lanes as payload (a TNA
 * egress rewrites headers only and need not spend PHV on the lanes again).
 * PASSING_PARSE_HEADER_ONLY (a program with the tree roles defines it): a datagram of the header
 * alone (a root's ACK down to a leaf) gets its header parsed, lanes invalid. In the same select as
 * the DATA length, where it costs a Tofino parser no match register. */
parser PassingParser(packet_in pkt, inout headers_t hdr, in bool with_lanes) {
    state start {
        pkt.extract(hdr.ethernet);
        transition select(hdr.ethernet.ether_type) {
            ETHERTYPE_IPV4: parse_ipv4;
            default: accept;
        }
    }
    state parse_ipv4 {
        pkt.extract(hdr.ipv4);
        transition select(hdr.ipv4.ihl, hdr.ipv4.frag_offset, hdr.ipv4.protocol) {
            (5, 0, IP_PROTO_UDP): parse_udp;
            default: accept;
        }
    }
    state parse_udp {
        pkt.extract(hdr.udp);
        transition select(hdr.udp.dst_port) {
            PASSING_UDP_PORT: parse_passing;
            default: accept;
        }
    }
    state parse_passing {
        transition select(hdr.udp.length) {
            PASSING_UDP_LENGTH: parse_passing_header;
#ifdef PASSING_PARSE_HEADER_ONLY
            8 + 16: parse_header_only;
#endif
            default: accept;  /* wrong size: passing header stays invalid, ingress counts it */
        }
    }
#ifdef PASSING_PARSE_HEADER_ONLY
    state parse_header_only {
        pkt.extract(hdr.passing);  /* lanes invalid: the ingress takes it as a header-only kind or drops it */
        transition accept;
    }
#endif
    state parse_passing_header {
        pkt.extract(hdr.passing);
        transition select(with_lanes) {
            true: parse_lanes;
            false: accept;
        }
    }
    state parse_lanes {
        pkt.extract(hdr.lanes);
        transition accept;
    }
}

#endif
