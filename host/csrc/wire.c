/* The PASSING wire format, defined once for C (passing/wire.py is the Python one;
 * docs/protocol.md the contract): a 16-byte big-endian header, then `lanes` big-endian
 * int32 values. */
#include <string.h>

#include "passing_native.h"

static uint16_t get16(const uint8_t *p) { return (uint16_t)(p[0] << 8 | p[1]); }
static uint32_t get32(const uint8_t *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}
static void put16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)(v >> 8);
    p[1] = (uint8_t)v;
}
static void put32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)(v >> 24);
    p[1] = (uint8_t)(v >> 16);
    p[2] = (uint8_t)(v >> 8);
    p[3] = (uint8_t)v;
}

void pn_header_read(const uint8_t *p, pn_header *h) {
    h->version = p[0];
    h->type = p[1];
    h->op = p[2];
    h->flags = p[3];
    h->job = get16(p + 4);
    h->slot = get16(p + 6);
    h->worker = p[8];
    h->owner = (uint8_t)(p[9] >> 1);
    h->set = p[9] & 1;
    h->generation = get16(p + 10);
    h->psn = get32(p + 12);
}

void pn_header_write(uint8_t *p, const pn_header *h) {
    p[0] = h->version;
    p[1] = h->type;
    p[2] = h->op;
    p[3] = h->flags;
    put16(p + 4, h->job);
    put16(p + 6, h->slot);
    p[8] = h->worker;
    p[9] = (uint8_t)(h->owner << 1 | (h->set & 1));
    put16(p + 10, h->generation);
    put32(p + 12, h->psn);
}

size_t pn_packet_size(uint32_t lanes) { return PN_HEADER_SIZE + 4 * (size_t)lanes; }
