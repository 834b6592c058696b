/* Ethernet / IPv4 / UDP framing for the AF_XDP path (frame.h). */
#include "frame.h"

#include <string.h>

static uint16_t be16(const uint8_t *p) { return (uint16_t)(p[0] << 8 | p[1]); }

static uint32_t be32(const uint8_t *p) { return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3]; }

static void put16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)(v >> 8);
    p[1] = (uint8_t)v;
}

static void put32(uint8_t *p, uint32_t v) {
    put16(p, (uint16_t)(v >> 16));
    put16(p + 2, (uint16_t)v);
}

int pn_frame_parse(const uint8_t *frame, uint32_t len, uint16_t port, pn_datagram *out, uint8_t src_mac[6]) {
    if (!frame || len < PN_FRAME_HEADERS || be16(frame + 12) != 0x0800) return 0;
    const uint8_t *ip = frame + 14;
    uint32_t ihl = (uint32_t)(ip[0] & 0x0F) * 4;
    if ((ip[0] >> 4) != 4 || ihl < 20 || ip[9] != 17) return 0;
    if (be16(ip + 6) & 0x3FFF) return 0; /* a fragment */
    uint32_t ip_len = be16(ip + 2);
    if (ip_len < ihl + 8 || 14 + ip_len > len) return 0;
    const uint8_t *udp = ip + ihl;
    uint32_t udp_len = be16(udp + 4);
    if (be16(udp + 2) != port || udp_len < 8 || udp_len > ip_len - ihl) return 0;
    out->data = udp + 8;
    out->length = udp_len - 8;
    out->source = (int64_t)be32(ip + 12) << 16 | be16(udp);
    memcpy(src_mac, frame + 6, 6);
    return 1;
}

void pn_frame_headers(uint8_t *f, const uint8_t dst_mac[6], const uint8_t src_mac[6], uint32_t src_ip,
                      uint16_t src_port, uint32_t dst_ip, uint16_t dst_port, uint32_t payload, uint16_t ip_id) {
    memcpy(f, dst_mac, 6);
    memcpy(f + 6, src_mac, 6);
    put16(f + 12, 0x0800);
    uint8_t *ip = f + 14;
    ip[0] = 0x45;
    ip[1] = 0;
    put16(ip + 2, (uint16_t)(20 + 8 + payload));
    put16(ip + 4, ip_id);
    put16(ip + 6, 0x4000); /* DF: PASSING never fragments */
    ip[8] = 64;
    ip[9] = 17;
    put16(ip + 10, 0);
    put32(ip + 12, src_ip);
    put32(ip + 16, dst_ip);
    uint32_t sum = 0;
    for (int i = 0; i < 20; i += 2) sum += be16(ip + i);
    while (sum >> 16) sum = (sum & 0xFFFF) + (sum >> 16);
    put16(ip + 10, (uint16_t)~sum);
    uint8_t *udp = ip + 20;
    put16(udp, src_port);
    put16(udp + 2, dst_port);
    put16(udp + 4, (uint16_t)(8 + payload));
    put16(udp + 6, 0);
}
