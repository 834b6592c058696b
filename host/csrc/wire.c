/* The PASSING wire format, defined once for C (passing/wire.py is the Python one;
 * docs/protocol.md the contract): a 16-byte big-endian header, then `lanes` big-endian
 * int32 values; the header's fields are read and written by passing_native.h's inline pn_header_decode and
 * pn_header_encode, which the per-packet loops call directly. */
#include "passing_native.h"

void pn_header_read(const uint8_t *p, pn_header *h) { pn_header_decode(p, h); }

void pn_header_write(uint8_t *p, const pn_header *h) { pn_header_encode(p, h); }

size_t pn_packet_size(uint32_t lanes) { return PN_HEADER_SIZE + 4 * (size_t)lanes; }
