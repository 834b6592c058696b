/* Batched UDP for the native data path: recvmmsg with GRO, sendmmsg with GSO; and, where the caller
 * gives it an XSK (xsk.h: the AF_XDP path), that XSK beside the socket: datagrams are taken from both,
 * and sent through the XSK to every destination whose MAC it knows (the others through the socket).
 * Internal to the library (not part of its ABI). IPv4, Linux. */
#ifndef PASSING_UDP_H
#define PASSING_UDP_H

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <netinet/in.h>

#define PN_UDP_MAX_SEGMENTS 128     /* the kernel's UDP_MAX_SEGMENTS since Linux 6.9: tried first */
#define PN_UDP_OLD_MAX_SEGMENTS 64  /* ... and before: where a kernel refuses more, the socket keeps to this */
#define PN_UDP_GSO_MAX_BYTES 65000  /* one GSO message is one UDP datagram before segmentation */
#define PN_UDP_SEND_CHUNK 1024      /* packets per sendmmsg call (UIO_MAXIOV iovecs) */

typedef struct pn_xsk pn_xsk;

typedef struct {
    int fd;
    pn_xsk *xsk;              /* NULL: the socket alone. Else the AF_XDP path beside it (not owned) */
    uint32_t xsk_turn;        /* receives since the socket was last read beside a busy XSK */
    const uint8_t **spill;    /* the packets of a send that go through the socket (no MAC known) */
    int64_t *spill_dest;
    uint32_t packet_size;     /* the largest datagram received (and sent) */
    int gso;                  /* 1: consecutive packets to one destination leave as one GSO message */
    uint32_t max_segments;    /* of one GSO message: PN_UDP_MAX_SEGMENTS, or the older kernels' 64 once refused */
    uint64_t gso_fallbacks;   /* GSO messages the kernel refused, resent as plain datagrams */
    /* receive side: `batch` message buffers of `msg_bytes` each */
    uint32_t batch;
    uint32_t msg_bytes;
    uint8_t *rx;
    struct mmsghdr *rx_msgs;
    struct iovec *rx_iov;
    struct sockaddr_in *rx_names;
    uint8_t *rx_control;      /* batch x PN_UDP_CMSG_BYTES */
    uint32_t rx_dirty;        /* headers the last recvmmsg filled: to restore before the next */
    int rx_drained;           /* the last recvmmsg found fewer messages than it had room for */
    uint32_t rx_next;         /* the first of those messages whose datagrams were not all handed out */
    uint32_t rx_at;           /* ... and the offset in it of the first datagram not handed out */
    /* send side */
    struct mmsghdr *tx_msgs;
    struct iovec *tx_iov;
    struct sockaddr_in *tx_names;
    uint8_t *tx_control;      /* one UDP_SEGMENT cmsg, shared by every message of a send */
} pn_udp;

/* A received datagram (one segment of a coalesced buffer counts as one). */
typedef struct {
    const uint8_t *data;
    uint32_t length;          /* a truncated datagram shows as longer than its buffer: read only
                                 datagrams whose length is the packet size */
    int64_t source;           /* ip << 16 | port */
} pn_datagram;

int pn_udp_init(pn_udp *u, int fd, uint32_t packet_size, uint32_t batch, int gso);
/* Use the XSK x (may be NULL) beside the socket from now on. 0, or -ENOMEM. */
int pn_udp_use_xsk(pn_udp *u, pn_xsk *x);
void pn_udp_free(pn_udp *u);
/* What is queued, without blocking, up to `max` datagrams (the buffers stay valid until
 * the next call). A coalesced buffer may hold more datagrams than `max` (GRO coalesces up
 * to 64 or 128 small ones, whatever the packet size): those left over are handed out by the
 * next calls, before anything new is read, so every datagram is returned once
 * (pn_udp_pending tells whether some are left). pn_udp_capacity: the packet-sized datagrams
 * one receive batch can hold. Returns the count, or -errno. */
uint32_t pn_udp_capacity(const pn_udp *u);
int pn_udp_recv(pn_udp *u, pn_datagram *out, uint32_t max);
int pn_udp_pending(const pn_udp *u);
/* Send packet[i] (size bytes each, at most packet_size) to dest[i]; consecutive packets to
 * one destination share a GSO message (a message the kernel refuses is resent as plain
 * datagrams, counted in gso_fallbacks; GSO stays on). Waits up to timeout_ms while the
 * socket buffer is full. Returns 0 or -errno (-ETIMEDOUT when the buffer stayed full,
 * -EINVAL for a bad size); bytes_sent counts the packets that left, and *handled (may be
 * NULL) the packets before the one that failed: sent, or refused by an ICMP error for an
 * earlier datagram (ECONNREFUSED: not sent, counted lost, not an error). */
int pn_udp_send(pn_udp *u, const uint8_t *const *packet, const int64_t *dest, uint32_t n, uint32_t size,
                int timeout_ms, uint64_t *bytes_sent, uint32_t *handled);
/* Block until the socket is readable or timeout_ms passed (or extra_fd, if >= 0, is
 * readable). Returns 1 readable (at once while received datagrams are pending), 0 timeout,
 * 2 extra_fd readable, -errno. */
int pn_udp_wait(pn_udp *u, int timeout_ms, int extra_fd);

#endif
