/* The AF_XDP I/O path (xsk.c): an XSK socket on one queue of one interface, with the XDP program
 * (bpf/xdp_steer.bpf.c) that steers the UDP socket's port to it. Beside the UDP socket, never instead of
 * it: io.c reads both and sends through the XSK only to destinations whose MAC it has learned.
 * Internal to the library except the functions passing_native.h declares. */
#ifndef PASSING_XSK_H
#define PASSING_XSK_H

#include <stdint.h>

#include "passing_native.h"
#include "udp.h"

int pn_xsk_fd(const pn_xsk *x);
/* Whether received frames wait in the rx ring (no syscall). */
int pn_xsk_ready(pn_xsk *x);
/* Up to `max` datagrams from the rx ring; their buffers stay valid until the next call, which hands
 * their frames back to the kernel. Learns each sender's MAC. Returns the count, or -errno. */
int pn_xsk_recv(pn_xsk *x, pn_datagram *out, uint32_t max);
/* Sends packet[i] (size bytes) to dest[i] through the XSK where dest's MAC is known; the others are
 * listed in spill / spill_dest (*spilled of them, room for n) for the UDP socket. Waits up to
 * timeout_ms for tx frames. Returns 0 or -errno; bytes_sent counts what left. */
int pn_xsk_send(pn_xsk *x, const uint8_t *const *packet, const int64_t *dest, uint32_t n, uint32_t size,
                int timeout_ms, uint64_t *bytes_sent, const uint8_t **spill, int64_t *spill_dest,
                uint32_t *spilled);

#endif
