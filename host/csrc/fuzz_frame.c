/* libFuzzer harness for the AF_XDP path's frame parser (frame.c; make fuzz).
 *
 * The input's first two bytes are the port to accept, the rest a frame, copied into a buffer of its exact
 * size so that AddressSanitizer sees any read past it. Checked (abort on violation):
 *  - an accepted frame's datagram lies inside the frame, after the headers, and comes from the source
 *    address and port the frame's IPv4 and UDP headers state;
 *  - headers built by pn_frame_headers for that datagram parse back to the same length and source, and
 *    a frame for another port is refused.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "frame.h"

#define CHECK(cond)                                                                         \
    do {                                                                                    \
        if (!(cond)) {                                                                      \
            fprintf(stderr, "fuzz_frame: invariant failed: %s (line %d)\n", #cond, __LINE__); \
            abort();                                                                        \
        }                                                                                   \
    } while (0)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 2 || size > 4096) return 0;
    uint16_t port = (uint16_t)(data[0] << 8 | data[1]);
    uint32_t len = (uint32_t)(size - 2);
    uint8_t *frame = malloc(len ? len : 1);
    if (!frame) abort();
    memcpy(frame, data + 2, len);
    pn_datagram d;
    uint8_t mac[6];
    if (pn_frame_parse(frame, len, port, &d, mac)) {
        CHECK(d.data >= frame + PN_FRAME_HEADERS && d.data + d.length <= frame + len);
        uint32_t ihl = (uint32_t)(frame[14] & 0x0F) * 4;
        const uint8_t *udp = frame + 14 + ihl;
        CHECK(d.data == udp + 8);
        CHECK(((uint32_t)udp[2] << 8 | udp[3]) == port);
        uint32_t ip = (uint32_t)frame[26] << 24 | (uint32_t)frame[27] << 16 | (uint32_t)frame[28] << 8 | frame[29];
        CHECK(d.source == ((int64_t)ip << 16 | (udp[0] << 8 | udp[1])));
        CHECK(memcmp(mac, frame + 6, 6) == 0);
        /* the same datagram framed by pn_frame_headers parses back the same */
        uint8_t *again = malloc(PN_FRAME_HEADERS + d.length + 1);
        if (!again) abort();
        pn_frame_headers(again, frame, mac, ip, (uint16_t)(d.source & 0xFFFF), 0x0A000001u, port, d.length, 1);
        memcpy(again + PN_FRAME_HEADERS, d.data, d.length);
        pn_datagram back;
        uint8_t mac2[6];
        CHECK(pn_frame_parse(again, PN_FRAME_HEADERS + d.length, port, &back, mac2));
        CHECK(back.length == d.length && back.source == d.source && memcmp(back.data, d.data, d.length) == 0);
        CHECK(!pn_frame_parse(again, PN_FRAME_HEADERS + d.length, (uint16_t)(port + 1), &back, mac2));
        free(again);
    }
    free(frame);
    return 0;
}
