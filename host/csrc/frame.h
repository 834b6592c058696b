/* Ethernet / IPv4 / UDP framing for the AF_XDP path (xsk.c), which sees whole frames where the UDP
 * sockets see datagrams. Internal to the library; no libxdp needed (the fuzz harness builds it alone). */
#ifndef PASSING_FRAME_H
#define PASSING_FRAME_H

#include <stdint.h>

#include "udp.h"

#define PN_FRAME_HEADERS 42u /* Ethernet 14 + IPv4 20 (no options) + UDP 8 */

/* The datagram in `frame` (len bytes) if it is an unfragmented IPv4 UDP datagram to `port` whose
 * lengths agree with the frame (IP options allowed; trailing padding past the IP length ignored):
 * *out gets the payload, its length and its source (ip << 16 | port), src_mac the sender's MAC.
 * Returns 1, or 0 for anything else (out untouched). */
int pn_frame_parse(const uint8_t *frame, uint32_t len, uint16_t port, pn_datagram *out, uint8_t src_mac[6]);

/* The 42 header bytes of a frame carrying `payload` bytes from src_ip:src_port to dst_ip:dst_port
 * (host byte order), IPv4 header checksum computed, UDP checksum 0 (none: IPv4 allows it). */
void pn_frame_headers(uint8_t *frame, const uint8_t dst_mac[6], const uint8_t src_mac[6], uint32_t src_ip,
                      uint16_t src_port, uint32_t dst_ip, uint16_t dst_port, uint32_t payload, uint16_t ip_id);

#endif
