/* Batched UDP: one recvmmsg or sendmmsg moves a whole batch; GRO and GSO, where the
 * kernel offers them, cut the per-packet cost further (docs/architecture.md). */
#define _GNU_SOURCE
#include "udp.h"
#include "xsk.h"

#include <errno.h>
#include <netinet/udp.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>

#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103
#endif
#ifndef UDP_GRO
#define UDP_GRO 104
#endif
#ifndef SOL_UDP
#define SOL_UDP 17
#endif

#define PN_UDP_CMSG_BYTES CMSG_SPACE(sizeof(int))

static void reset_rx_header(pn_udp *u, uint32_t i) {
    struct msghdr *h = &u->rx_msgs[i].msg_hdr;
    h->msg_namelen = sizeof(struct sockaddr_in);
    h->msg_control = u->rx_control + (size_t)i * PN_UDP_CMSG_BYTES;
    h->msg_controllen = PN_UDP_CMSG_BYTES;
    h->msg_flags = 0;
}

int pn_udp_init(pn_udp *u, int fd, uint32_t packet_size, uint32_t batch, int gso) {
    memset(u, 0, sizeof *u);
    if (fd < 0 || packet_size == 0 || packet_size > 65507 || batch == 0 || batch > 1024) return -EINVAL;
    u->fd = fd;
    u->packet_size = packet_size;
    u->gso = gso ? 1 : 0;
    u->max_segments = PN_UDP_MAX_SEGMENTS;
    u->batch = batch;
    /* A buffer holds a whole GRO-coalesced datagram (up to 64 KiB) as packet rows. */
    u->msg_bytes = (65536 / packet_size + 2) * packet_size;
    u->rx = malloc((size_t)batch * u->msg_bytes);
    u->rx_msgs = calloc(batch, sizeof *u->rx_msgs);
    u->rx_iov = calloc(batch, sizeof *u->rx_iov);
    u->rx_names = calloc(batch, sizeof *u->rx_names);
    u->rx_control = calloc(batch, PN_UDP_CMSG_BYTES);
    u->tx_msgs = calloc(PN_UDP_SEND_CHUNK, sizeof *u->tx_msgs);
    u->tx_iov = calloc(PN_UDP_SEND_CHUNK, sizeof *u->tx_iov);
    u->tx_names = calloc(PN_UDP_SEND_CHUNK, sizeof *u->tx_names);
    u->tx_control = calloc(1, CMSG_SPACE(sizeof(uint16_t)));
    if (!u->rx || !u->rx_msgs || !u->rx_iov || !u->rx_names || !u->rx_control || !u->tx_msgs || !u->tx_iov ||
        !u->tx_names || !u->tx_control) {
        pn_udp_free(u);
        return -ENOMEM;
    }
    for (uint32_t i = 0; i < batch; i++) {
        u->rx_iov[i].iov_base = u->rx + (size_t)i * u->msg_bytes;
        u->rx_iov[i].iov_len = u->msg_bytes;
        u->rx_msgs[i].msg_hdr.msg_iov = &u->rx_iov[i];
        u->rx_msgs[i].msg_hdr.msg_iovlen = 1;
        u->rx_msgs[i].msg_hdr.msg_name = &u->rx_names[i];
        reset_rx_header(u, i);
    }
    struct cmsghdr *c = (struct cmsghdr *)u->tx_control;
    c->cmsg_level = SOL_UDP;
    c->cmsg_type = UDP_SEGMENT;
    c->cmsg_len = CMSG_LEN(sizeof(uint16_t));  /* its segment size: written by each pn_udp_send */
    return 0;
}

int pn_udp_use_xsk(pn_udp *u, pn_xsk *x) {
    if (x && !u->spill) {
        u->spill = calloc(PN_UDP_SEND_CHUNK, sizeof *u->spill);
        u->spill_dest = calloc(PN_UDP_SEND_CHUNK, sizeof *u->spill_dest);
        if (!u->spill || !u->spill_dest) return -ENOMEM;
    }
    u->xsk = x;
    return 0;
}

void pn_udp_free(pn_udp *u) {
    free(u->spill);
    free(u->spill_dest);
    free(u->rx);
    free(u->rx_msgs);
    free(u->rx_iov);
    free(u->rx_names);
    free(u->rx_control);
    free(u->tx_msgs);
    free(u->tx_iov);
    free(u->tx_names);
    free(u->tx_control);
    memset(u, 0, sizeof *u);
    u->fd = -1;
}

uint32_t pn_udp_capacity(const pn_udp *u) { return u->batch * (u->msg_bytes / u->packet_size); }

static int64_t packed(const struct sockaddr_in *a) {
    return ((int64_t)ntohl(a->sin_addr.s_addr) << 16) | ntohs(a->sin_port);
}

/* The segment size of a received message: its UDP_GRO cmsg's, else its length (one datagram). */
static uint32_t segment_of(struct msghdr *h, uint32_t length) {
    uint32_t segment = length;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(h); c; c = CMSG_NXTHDR(h, c)) {
        if (c->cmsg_level == SOL_UDP && c->cmsg_type == UDP_GRO && c->cmsg_len >= CMSG_LEN(sizeof(int))) {
            int gro;
            memcpy(&gro, CMSG_DATA(c), sizeof gro);
            if (gro > 0) segment = (uint32_t)gro;
        }
    }
    return segment;
}

/* Hand out up to `max` datagrams of the messages the last recvmmsg filled, from where the
 * previous call stopped (rx_next, rx_at), and remember where this one stops. */
static uint32_t split_messages(pn_udp *u, pn_datagram *out, uint32_t max) {
    uint32_t count = 0;
    while (u->rx_next < u->rx_dirty && count < max) {
        uint32_t i = u->rx_next;
        struct msghdr *h = &u->rx_msgs[i].msg_hdr;
        uint32_t length = u->rx_msgs[i].msg_len;
        uint32_t segment = segment_of(h, length);
        const uint8_t *base = u->rx_iov[i].iov_base;
        int64_t source = packed(&u->rx_names[i]);
        if (length == 0 || segment == 0 || segment >= length || (h->msg_flags & MSG_TRUNC)) {
            /* one datagram (a truncated one shows a length past the buffer: malformed) */
            out[count++] = (pn_datagram){base, (h->msg_flags & MSG_TRUNC) ? u->msg_bytes + 1 : length, source};
            u->rx_next++;
            continue;
        }
        for (; u->rx_at < length && count < max; u->rx_at += segment) {
            uint32_t len = length - u->rx_at < segment ? length - u->rx_at : segment;
            out[count++] = (pn_datagram){base + u->rx_at, len, source};
        }
        if (u->rx_at >= length) {
            u->rx_next++;
            u->rx_at = 0;
        }
    }
    return count;
}

int pn_udp_pending(const pn_udp *u) { return u->rx_next < u->rx_dirty; }

static int recv_socket(pn_udp *u, pn_datagram *out, uint32_t max) {
    if (max == 0) return 0;
    if (pn_udp_pending(u)) return (int)split_messages(u, out, max);  /* the rest of the last batch first */
    uint32_t want = max < u->batch ? max : u->batch;
    /* the kernel rewrites these only in the headers of the messages it filled last time */
    for (uint32_t i = 0; i < u->rx_dirty; i++) reset_rx_header(u, i);
    int n = recvmmsg(u->fd, u->rx_msgs, want, MSG_DONTWAIT, NULL);
    u->rx_dirty = n > 0 ? (uint32_t)n : 0;
    u->rx_next = 0;
    u->rx_at = 0;
    u->rx_drained = n < (int)want;
    if (n < 0) {
        /* ECONNREFUSED: an ICMP error for an earlier datagram of ours, not news for this call */
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR || errno == ECONNREFUSED) return 0;
        return -errno;
    }
    return (int)split_messages(u, out, max);
}

/* With an XSK: what its rx ring holds first (no syscall), and the socket when the ring is empty or every
 * XSK_TURN receives (a datagram the XDP program passed on, or that came another way, is not starved). */
#define XSK_TURN 16

int pn_udp_recv(pn_udp *u, pn_datagram *out, uint32_t max) {
    if (!u->xsk) return recv_socket(u, out, max);
    if (max == 0) return 0;
    if (pn_udp_pending(u)) return (int)split_messages(u, out, max);
    int n = pn_xsk_recv(u->xsk, out, max);
    if (n < 0) return n;
    int socket_drained = 1;
    if ((uint32_t)n < max && (n == 0 || ++u->xsk_turn >= XSK_TURN)) {
        u->xsk_turn = 0;
        int m = recv_socket(u, out + n, max - (uint32_t)n);
        if (m < 0) return m;
        n += m;
        socket_drained = u->rx_drained;
    }
    u->rx_drained = socket_drained && !pn_xsk_ready(u->xsk);
    return n;
}

int pn_udp_wait(pn_udp *u, int timeout_ms, int extra_fd) {
    if (pn_udp_pending(u) || (u->xsk && pn_xsk_ready(u->xsk))) return 1;
    struct pollfd p[3] = {{.fd = u->fd, .events = POLLIN}, {.fd = extra_fd, .events = POLLIN},
                          {.fd = u->xsk ? pn_xsk_fd(u->xsk) : -1, .events = POLLIN}};
    int r = poll(p, u->xsk ? 3 : extra_fd >= 0 ? 2 : 1, timeout_ms < 0 ? 0 : timeout_ms);
    if (r < 0) return errno == EINTR ? 0 : -errno;
    if (r == 0) return 0;
    if (extra_fd >= 0 && (p[1].revents & (POLLIN | POLLHUP | POLLERR))) return 2;
    return 1;
}

/* Messages for packets [from, from + n) of `size` bytes: runs of one destination, at most
 * max_segments packets each (one packet each without GSO). Packets that lie back to back in memory (a
 * window's consecutive slots) share one iovec: the kernel copies a GSO message iovec by iovec, and one of
 * 128 packets costs it less than 128 of one. Returns the number of messages. */
static uint32_t build_messages(pn_udp *u, const uint8_t *const *packet, const int64_t *dest, uint32_t n,
                               uint32_t size, uint32_t *packets_in) {
    uint32_t max_segments = u->gso ? PN_UDP_GSO_MAX_BYTES / size : 1;
    if (max_segments > u->max_segments) max_segments = u->max_segments;
    if (max_segments == 0) max_segments = 1;
    uint32_t m = 0, v = 0;  /* messages, iovecs */
    for (uint32_t i = 0; i < n;) {
        uint32_t run = 1;
        while (i + run < n && run < max_segments && dest[i + run] == dest[i]) run++;
        uint32_t first = v;
        for (uint32_t k = 0; k < run; k++) {
            struct iovec *last = v > first ? &u->tx_iov[v - 1] : NULL;
            if (last && (const uint8_t *)last->iov_base + last->iov_len == packet[i + k]) {
                last->iov_len += size;
                continue;
            }
            u->tx_iov[v].iov_base = (void *)packet[i + k];
            u->tx_iov[v].iov_len = size;
            v++;
        }
        struct sockaddr_in *a = &u->tx_names[m];
        memset(a, 0, sizeof *a);
        a->sin_family = AF_INET;
        a->sin_addr.s_addr = htonl((uint32_t)(dest[i] >> 16));
        a->sin_port = htons((uint16_t)(dest[i] & 0xFFFF));
        struct msghdr *h = &u->tx_msgs[m].msg_hdr;
        memset(h, 0, sizeof *h);
        h->msg_name = a;
        h->msg_namelen = sizeof *a;
        h->msg_iov = &u->tx_iov[first];
        h->msg_iovlen = v - first;
        if (u->gso && run > 1) {
            h->msg_control = u->tx_control;
            h->msg_controllen = CMSG_SPACE(sizeof(uint16_t));
        }
        packets_in[m++] = run;
        i += run;
    }
    return m;
}

/* The socket buffer is full: wait until it has room. 0, or -errno (-ETIMEDOUT: still full). */
static int wait_writable(int fd, int timeout_ms) {
    struct pollfd p = {.fd = fd, .events = POLLOUT};
    int w = poll(&p, 1, timeout_ms);
    if (w < 0) return errno == EINTR ? 0 : -errno;
    return w == 0 ? -ETIMEDOUT : 0;
}

/* The `count` packets of one GSO message the kernel refused, one plain datagram each. Returns 0 or
 * -errno of the first that failed; *handled: the packets before it (sent, or refused by an
 * ICMP error; bytes_sent counts the sent ones). */
static int send_plain(pn_udp *u, const struct msghdr *refused, const uint8_t *const *packet, uint32_t count,
                      uint32_t size, int timeout_ms, uint64_t *bytes_sent, uint32_t *handled) {
    struct mmsghdr plain[PN_UDP_MAX_SEGMENTS];
    struct iovec iov[PN_UDP_MAX_SEGMENTS];
    memset(plain, 0, count * sizeof *plain);
    for (uint32_t k = 0; k < count; k++) {
        iov[k].iov_base = (void *)packet[k];
        iov[k].iov_len = size;
        plain[k].msg_hdr.msg_name = refused->msg_name;
        plain[k].msg_hdr.msg_namelen = refused->msg_namelen;
        plain[k].msg_hdr.msg_iov = &iov[k];
        plain[k].msg_hdr.msg_iovlen = 1;
    }
    uint32_t done = 0;
    *handled = 0;
    while (done < count) {
        *handled = done;
        int r = sendmmsg(u->fd, plain + done, count - done, 0);
        if (r > 0) {
            done += (uint32_t)r;
            if (bytes_sent) *bytes_sent += (uint64_t)r * size;
            continue;
        }
        int err = r < 0 ? errno : EAGAIN;
        if (err == EAGAIN || err == EWOULDBLOCK || err == ENOBUFS) {
            int w = wait_writable(u->fd, timeout_ms);
            if (w < 0) return w;
        } else if (err == ECONNREFUSED) {
            done++;  /* an ICMP error for an earlier datagram: this one was not sent; count it lost */
        } else if (err != EINTR) {
            return -err;
        }
    }
    *handled = count;
    return 0;
}

static int send_socket(pn_udp *u, const uint8_t *const *packet, const int64_t *dest, uint32_t n, uint32_t size,
                       int timeout_ms, uint64_t *bytes_sent, uint32_t *handled);

/* Through the XSK where it knows the destination's MAC, the rest through the socket; a chunk at a time.
 * *handled: the packets of the chunks before one that failed. */
int pn_udp_send(pn_udp *u, const uint8_t *const *packet, const int64_t *dest, uint32_t n, uint32_t size,
                int timeout_ms, uint64_t *bytes_sent, uint32_t *handled) {
    if (!u->xsk) return send_socket(u, packet, dest, n, size, timeout_ms, bytes_sent, handled);
    uint32_t ignored;
    if (!handled) handled = &ignored;
    *handled = 0;
    uint64_t unused = 0;
    if (!bytes_sent) bytes_sent = &unused;
    for (uint32_t done = 0; done < n;) {
        uint32_t chunk = n - done < PN_UDP_SEND_CHUNK ? n - done : PN_UDP_SEND_CHUNK, spilled = 0;
        int r = pn_xsk_send(u->xsk, packet + done, dest + done, chunk, size, timeout_ms, bytes_sent, u->spill,
                            u->spill_dest, &spilled);
        if (r == 0 && spilled)
            r = send_socket(u, (const uint8_t *const *)u->spill, u->spill_dest, spilled, size, timeout_ms, bytes_sent,
                            NULL);
        if (r < 0) return r;
        done += chunk;
        *handled = done;
    }
    return 0;
}

static int send_socket(pn_udp *u, const uint8_t *const *packet, const int64_t *dest, uint32_t n, uint32_t size,
                       int timeout_ms, uint64_t *bytes_sent, uint32_t *handled) {
    uint32_t ignored;
    if (!handled) handled = &ignored;
    *handled = 0;
    if (size == 0 || size > u->packet_size) return -EINVAL;
    uint16_t segment = (uint16_t)size;  /* GSO cuts each message into datagrams of this size */
    memcpy(CMSG_DATA((struct cmsghdr *)u->tx_control), &segment, sizeof segment);
    uint32_t packets_in[PN_UDP_SEND_CHUNK];
    uint32_t done = 0;
    while (done < n) {
        uint32_t chunk = n - done < PN_UDP_SEND_CHUNK ? n - done : PN_UDP_SEND_CHUNK;
        uint32_t m = build_messages(u, packet + done, dest + done, chunk, size, packets_in);
        uint32_t sent_msgs = 0;
        while (sent_msgs < m) {
            *handled = done;
            int r = sendmmsg(u->fd, u->tx_msgs + sent_msgs, m - sent_msgs, 0);
            if (r > 0) {
                for (int k = 0; k < r; k++) {
                    done += packets_in[sent_msgs + k];
                    if (bytes_sent) *bytes_sent += (uint64_t)packets_in[sent_msgs + k] * size;
                }
                sent_msgs += (uint32_t)r;
                continue;
            }
            int err = r < 0 ? errno : EAGAIN;
            const struct msghdr *h = &u->tx_msgs[sent_msgs].msg_hdr;
            if (err == EAGAIN || err == EWOULDBLOCK || err == ENOBUFS) {
                int w = wait_writable(u->fd, timeout_ms);
                if (w < 0) return w;
            } else if (err == EINVAL && h->msg_controllen > 0 && packets_in[sent_msgs] > PN_UDP_OLD_MAX_SEGMENTS &&
                       u->max_segments > PN_UDP_OLD_MAX_SEGMENTS) {
                /* a kernel older than 6.9 takes at most 64 segments a message: the rest of the send, and every
                 * later one, is cut into messages of 64 (nothing of this message left) */
                u->max_segments = PN_UDP_OLD_MAX_SEGMENTS;
                break;
            } else if ((err == EIO || err == EINVAL || err == EMSGSIZE) && h->msg_controllen > 0) {
                /* the kernel refused this one GSO message: a path that cannot segment (EIO), an
                 * MTU below the segment size (EMSGSIZE), a destination it refuses anyway, such as
                 * port 0 (EINVAL). Its packets go as plain datagrams; GSO stays on for the others. */
                u->gso_fallbacks++;
                uint32_t plain = 0;
                int p = send_plain(u, h, packet + done, packets_in[sent_msgs], size, timeout_ms, bytes_sent, &plain);
                if (p < 0) {
                    *handled = done + plain;
                    return p;
                }
                done += packets_in[sent_msgs];
                sent_msgs++;
            } else if (err == ECONNREFUSED) {
                /* an ICMP error for an earlier datagram: the message was not sent; count it lost */
                done += packets_in[sent_msgs];
                sent_msgs++;
            } else if (err != EINTR) {
                return -err;
            }
        }
    }
    *handled = n;
    return 0;
}
