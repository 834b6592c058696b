/* Batched UDP for the native data path: recvmmsg with GRO, sendmmsg with GSO.
 * Internal to the library (not part of its ABI). IPv4, Linux. */
#ifndef PASSING_UDP_H
#define PASSING_UDP_H

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <netinet/in.h>

#define PN_UDP_MAX_SEGMENTS 64      /* the kernel's UDP_MAX_SEGMENTS on older kernels */
#define PN_UDP_GSO_MAX_BYTES 65000  /* one GSO message is one UDP datagram before segmentation */
#define PN_UDP_SEND_CHUNK 1024      /* packets per sendmmsg call (UIO_MAXIOV iovecs) */

typedef struct {
    int fd;
    uint32_t packet_size;     /* the largest datagram received (and sent) */
    int gso;                  /* 1 while the kernel segments for us */
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
void pn_udp_free(pn_udp *u);
/* What is queued, without blocking, up to `max` datagrams (the buffers stay valid until
 * the next call). With max >= pn_udp_capacity(u) no packet-sized datagram is ever left
 * out; segments of a coalesced buffer of another size (malformed anyway) past `max` are.
 * Returns the count, or -errno. */
uint32_t pn_udp_capacity(const pn_udp *u);
int pn_udp_recv(pn_udp *u, pn_datagram *out, uint32_t max);
/* Send packet[i] (size bytes each, at most packet_size) to dest[i]; consecutive packets to
 * one destination share a GSO message. Waits up to timeout_ms while the socket buffer is
 * full. Returns 0 or -errno (-ETIMEDOUT when the buffer stayed full, -EINVAL for a bad size). */
int pn_udp_send(pn_udp *u, const uint8_t *const *packet, const int64_t *dest, uint32_t n, uint32_t size,
                int timeout_ms, uint64_t *bytes_sent);
/* Block until the socket is readable or timeout_ms passed (or extra_fd, if >= 0, is
 * readable). Returns 1 readable, 0 timeout, 2 extra_fd readable, -errno. */
int pn_udp_wait(pn_udp *u, int timeout_ms, int extra_fd);

#endif
