/* The AF_XDP I/O path (xsk.h, docs/architecture.md "I/O paths"). One UMEM per XSK: its first half are
 * receive frames (all in the fill ring but the ones the caller holds), its second half transmit frames (a
 * free stack, refilled from the completion ring). Rings are batched: a receive takes what the rx ring holds
 * with no syscall; a send fills the tx ring and kicks the kernel once (copy mode transmits in sendto, 32
 * frames a call: it kicks until the ring is empty). Compiled to "not built" where PN_HAVE_XDP is not
 * defined (host/setup.py defines it where libxdp, libbpf and clang are). */
#define _GNU_SOURCE
#include "xsk.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

#ifdef PN_HAVE_XDP

#include <bpf/bpf.h>
#include <bpf/libbpf.h>
#include <linux/if_link.h>
#include <linux/if_xdp.h>
#include <net/if.h>
#include <poll.h>
#include <pthread.h>
#include <stdlib.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>
#include <xdp/xsk.h>

#include "frame.h"

extern const unsigned char pn_xdp_object[];  /* bpf/xdp_steer.bpf.c, compiled at install (host/setup.py) */
extern const unsigned int pn_xdp_object_len;

#define FRAME_SIZE 2048u
#define RX_FRAMES 2048u
#define TX_FRAMES 2048u
#define RING 2048u
#define RX_BATCH 256u
#define NEIGHBORS 256u

struct pn_xsk {
    struct xsk_umem *umem;
    struct xsk_socket *xsk;
    struct xsk_ring_prod fill, tx;
    struct xsk_ring_cons comp, rx;
    uint8_t *area;
    uint64_t held[RX_BATCH]; /* frames handed to the caller by the last receive */
    uint32_t held_count;
    uint64_t free_tx[TX_FRAMES];
    uint32_t free_count;
    struct bpf_object *obj;
    int link_fd;
    uint32_t ifindex, queue, local_ip, packet_size;
    uint16_t local_port, ip_id;
    uint8_t mac[6];
    uint32_t neighbor_ip[NEIGHBORS];
    uint8_t neighbor_mac[NEIGHBORS][6];
    uint32_t neighbors, last_hit;
    pthread_mutex_t lock; /* the stats: read from other threads */
    pn_xsk_stats stats;
};

int pn_xdp_built(void) { return 1; }

static void fail(char *error, uint32_t len, const char *what, int err) {
    if (error && len) snprintf(error, len, "%s: %s", what, strerror(err));
}

static int local_mac(uint32_t ifindex, uint8_t mac[6]) {
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    if (!if_indextoname(ifindex, ifr.ifr_name)) return -errno;
    int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -errno;
    int r = ioctl(fd, SIOCGIFHWADDR, &ifr);
    int err = errno;
    close(fd);
    if (r < 0) return -err;
    memcpy(mac, ifr.ifr_hwaddr.sa_data, 6);
    return 0;
}

/* The steering program, loaded and linked to the interface (driver mode, else generic unless generic_only: generic alone). */
static int attach_program(pn_xsk *x, int generic_only, char *error, uint32_t len) {
    x->obj = bpf_object__open_mem(pn_xdp_object, pn_xdp_object_len, NULL);
    if (!x->obj) {
        fail(error, len, "bpf_object__open_mem", errno);
        return -1;
    }
    int err = bpf_object__load(x->obj);
    if (err) {
        fail(error, len, "loading the XDP program (needs CAP_BPF and CAP_NET_ADMIN)", -err);
        return -1;
    }
    struct bpf_program *prog = bpf_object__find_program_by_name(x->obj, "passing_steer");
    int ports = bpf_object__find_map_fd_by_name(x->obj, "passing_port");
    int xsks = bpf_object__find_map_fd_by_name(x->obj, "passing_xsks");
    if (!prog || ports < 0 || xsks < 0) {
        fail(error, len, "the embedded XDP program", ENOENT);
        return -1;
    }
    uint32_t key = 0, port = x->local_port;
    int fd = xsk_socket__fd(x->xsk);
    if (bpf_map_update_elem(ports, &key, &port, BPF_ANY) || bpf_map_update_elem(xsks, &x->queue, &fd, BPF_ANY)) {
        fail(error, len, "filling the XDP program's maps", errno);
        return -1;
    }
    for (int generic = generic_only ? 1 : 0; generic < 2; generic++) {
        LIBBPF_OPTS(bpf_link_create_opts, opts, .flags = generic ? XDP_FLAGS_SKB_MODE : XDP_FLAGS_DRV_MODE);
        x->link_fd = bpf_link_create(bpf_program__fd(prog), (int)x->ifindex, BPF_XDP, &opts);
        if (x->link_fd >= 0) {
            x->stats.driver_mode = !generic;
            return 0;
        }
        err = errno;
        if (err == EBUSY || err == EEXIST) break;  /* someone's XDP program is there already */
    }
    fail(error, len, err == EBUSY || err == EEXIST ? "the interface has an XDP program already" : "attaching XDP",
         err);
    return -1;
}

pn_xsk *pn_xsk_open(int udp_fd, uint32_t ifindex, uint32_t queue, uint32_t local_ip, uint32_t local_port,
                    uint32_t packet_size, int flags, char *error, uint32_t error_len) {
    if (udp_fd < 0 || ifindex == 0 || queue >= 64 || local_port == 0 || local_port > 0xFFFF || packet_size == 0 ||
        packet_size + PN_FRAME_HEADERS > FRAME_SIZE - XDP_PACKET_HEADROOM) {
        fail(error, error_len, "pn_xsk_open (a packet must fit a 2 KiB frame)", EINVAL);
        return NULL;
    }
    pn_xsk *x = calloc(1, sizeof *x);
    if (!x) {
        fail(error, error_len, "calloc", ENOMEM);
        return NULL;
    }
    x->link_fd = -1;
    x->ifindex = ifindex;
    x->queue = queue;
    x->local_ip = local_ip;
    x->local_port = (uint16_t)local_port;
    x->packet_size = packet_size;
    x->stats.ifindex = ifindex;
    x->stats.queue = queue;
    if (pthread_mutex_init(&x->lock, NULL) != 0) {
        free(x);
        fail(error, error_len, "pthread_mutex_init", EAGAIN);
        return NULL;
    }
    int err = local_mac(ifindex, x->mac);
    if (err) {
        fail(error, error_len, "the interface's MAC", -err);
        goto out;
    }
    size_t bytes = (size_t)(RX_FRAMES + TX_FRAMES) * FRAME_SIZE;
    x->area = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (x->area == MAP_FAILED) {
        x->area = NULL;
        fail(error, error_len, "mmap", errno);
        goto out;
    }
    struct xsk_umem_config ucfg = {.fill_size = RING, .comp_size = RING, .frame_size = FRAME_SIZE,
                                   .frame_headroom = 0, .flags = 0};
    err = xsk_umem__create(&x->umem, x->area, bytes, &x->fill, &x->comp, &ucfg);
    if (err) {
        x->umem = NULL;
        fail(error, error_len, "xsk_umem__create (needs CAP_NET_RAW and locked memory)", -err);
        goto out;
    }
    char name[IF_NAMESIZE];
    if (!if_indextoname(ifindex, name)) {
        fail(error, error_len, "if_indextoname", errno);
        goto out;
    }
    /* zero-copy where the driver has it, else copy mode (veth, generic XDP) unless only zero-copy will do */
    for (int copy = 0; copy < ((flags & PN_XSK_ZEROCOPY_ONLY) ? 1 : 2); copy++) {
        struct xsk_socket_config cfg = {
            .rx_size = RING, .tx_size = RING, .libxdp_flags = XSK_LIBXDP_FLAGS__INHIBIT_PROG_LOAD,
            .xdp_flags = 0, .bind_flags = (uint16_t)(XDP_USE_NEED_WAKEUP | (copy ? XDP_COPY : XDP_ZEROCOPY))};
        err = xsk_socket__create(&x->xsk, name, queue, x->umem, &x->rx, &x->tx, &cfg);
        if (!err) {
            x->stats.zerocopy = !copy;
            break;
        }
        x->xsk = NULL;
        if (err == -EBUSY) break;  /* the queue has an XSK already */
    }
    if (!x->xsk) {
        fail(error, error_len, err == -EBUSY ? "the interface's queue has an XSK socket already" :
             (flags & PN_XSK_ZEROCOPY_ONLY) ? "no zero-copy AF_XDP in the interface's driver (copy mode would be "
             "slower than the UDP sockets with GSO/GRO; io='xdp' forces it)" : "xsk_socket__create", -err);
        goto out;
    }
    uint32_t idx;
    if (xsk_ring_prod__reserve(&x->fill, RX_FRAMES, &idx) != RX_FRAMES) {
        fail(error, error_len, "filling the fill ring", ENOSPC);
        goto out;
    }
    for (uint32_t i = 0; i < RX_FRAMES; i++) *xsk_ring_prod__fill_addr(&x->fill, idx + i) = (uint64_t)i * FRAME_SIZE;
    xsk_ring_prod__submit(&x->fill, RX_FRAMES);
    for (uint32_t i = 0; i < TX_FRAMES; i++) x->free_tx[i] = (uint64_t)(RX_FRAMES + i) * FRAME_SIZE;
    x->free_count = TX_FRAMES;
    if (attach_program(x, flags & PN_XSK_GENERIC, error, error_len) != 0) goto out;
    (void)udp_fd;  /* the UDP socket stays the caller's: io.c reads it beside the XSK */
    return x;
out:
    pn_xsk_close(x);
    return NULL;
}

void pn_xsk_close(pn_xsk *x) {
    if (!x) return;
    if (x->link_fd >= 0) close(x->link_fd);  /* detaches the program */
    if (x->xsk) xsk_socket__delete(x->xsk);
    if (x->umem) xsk_umem__delete(x->umem);
    if (x->obj) bpf_object__close(x->obj);
    if (x->area) munmap(x->area, (size_t)(RX_FRAMES + TX_FRAMES) * FRAME_SIZE);
    pthread_mutex_destroy(&x->lock);
    free(x);
}

void pn_xsk_get_stats(pn_xsk *x, pn_xsk_stats *out) {
    if (!x || !out) return;
    struct xdp_statistics ks;
    socklen_t len = sizeof ks;
    int have = getsockopt(xsk_socket__fd(x->xsk), SOL_XDP, XDP_STATISTICS, &ks, &len) == 0;
    pthread_mutex_lock(&x->lock);
    if (have) {
        x->stats.ring_rx_dropped = ks.rx_dropped;
        x->stats.ring_rx_full = ks.rx_ring_full;
        x->stats.ring_fill_empty = ks.rx_fill_ring_empty_descs;
        x->stats.ring_tx_invalid = ks.tx_invalid_descs;
    }
    *out = x->stats;
    pthread_mutex_unlock(&x->lock);
}

static int find_neighbor(pn_xsk *x, uint32_t ip) {
    if (x->last_hit < x->neighbors && x->neighbor_ip[x->last_hit] == ip) return (int)x->last_hit;
    for (uint32_t i = 0; i < x->neighbors; i++)
        if (x->neighbor_ip[i] == ip) return (int)(x->last_hit = i);
    return -1;
}

int pn_xsk_add_neighbor(pn_xsk *x, uint32_t ip, const uint8_t *mac) {
    if (!x || !mac) return PN_EINVAL;
    int i = find_neighbor(x, ip);
    if (i < 0) {
        if (x->neighbors == NEIGHBORS) return PN_EFULL;
        i = (int)x->neighbors++;
        x->neighbor_ip[i] = ip;
    }
    memcpy(x->neighbor_mac[i], mac, 6);
    return PN_OK;
}

int pn_xsk_fd(const pn_xsk *x) { return xsk_socket__fd(x->xsk); }

int pn_xsk_ready(pn_xsk *x) { return xsk_cons_nb_avail(&x->rx, 1) > 0; }

/* The frames the caller held since the last receive go back to the fill ring. */
static void refill(pn_xsk *x) {
    if (!x->held_count) return;
    uint32_t idx;
    uint32_t got = xsk_ring_prod__reserve(&x->fill, x->held_count, &idx);
    /* the fill ring has room for every receive frame: it cannot be short */
    for (uint32_t i = 0; i < got; i++) *xsk_ring_prod__fill_addr(&x->fill, idx + i) = x->held[i];
    xsk_ring_prod__submit(&x->fill, got);
    x->held_count = 0;
}

int pn_xsk_recv(pn_xsk *x, pn_datagram *out, uint32_t max) {
    refill(x);
    if (xsk_ring_prod__needs_wakeup(&x->fill)) {
        if (recvfrom(xsk_socket__fd(x->xsk), NULL, 0, MSG_DONTWAIT, NULL, NULL) < 0 && errno != EAGAIN &&
            errno != EWOULDBLOCK && errno != EBUSY && errno != ENOBUFS && errno != EINTR)
            return -errno;
    }
    uint32_t idx, count = 0, foreign = 0;
    uint32_t n = xsk_ring_cons__peek(&x->rx, max < RX_BATCH ? max : RX_BATCH, &idx);
    for (uint32_t i = 0; i < n; i++) {
        const struct xdp_desc *d = xsk_ring_cons__rx_desc(&x->rx, idx + i);
        uint8_t *frame = xsk_umem__get_data(x->area, d->addr);
        x->held[x->held_count++] = xsk_umem__extract_addr(d->addr);
        uint8_t mac[6];
        /* to this socket: its port (the parser) and its address (another of the host's, on the same port, is not) */
        if (!pn_frame_parse(frame, d->len, x->local_port, &out[count], mac) ||
            ((uint32_t)frame[30] << 24 | (uint32_t)frame[31] << 16 | (uint32_t)frame[32] << 8 | frame[33]) !=
                x->local_ip) {
            foreign++;
            continue;
        }
        uint32_t ip = (uint32_t)(out[count].source >> 16);
        int k = find_neighbor(x, ip);
        if (k < 0 || memcmp(x->neighbor_mac[k], mac, 6) != 0) pn_xsk_add_neighbor(x, ip, mac);
        count++;
    }
    if (n) {
        xsk_ring_cons__release(&x->rx, n);
        pthread_mutex_lock(&x->lock);
        x->stats.rx_packets += count;
        x->stats.rx_foreign += foreign;
        pthread_mutex_unlock(&x->lock);
    }
    return (int)count;
}

/* Transmit frames the kernel is done with go back on the free stack. */
static void reclaim(pn_xsk *x) {
    uint32_t idx;
    uint32_t n = xsk_ring_cons__peek(&x->comp, RING, &idx);
    for (uint32_t i = 0; i < n; i++) x->free_tx[x->free_count++] = *xsk_ring_cons__comp_addr(&x->comp, idx + i);
    if (n) xsk_ring_cons__release(&x->comp, n);
}

/* Make the kernel transmit what the tx ring holds (copy mode: 32 frames a sendto, so until it is empty). */
static int kick(pn_xsk *x, uint64_t *kicks) {
    for (int tries = 0; tries < 4 * (int)(RING / 32); tries++) {
        if (xsk_prod_nb_free(&x->tx, RING) >= RING) return 0;  /* the kernel took every descriptor */
        /* zero-copy: the driver takes them on its own once woken; copy mode transmits only in sendto */
        if (x->stats.zerocopy && !xsk_ring_prod__needs_wakeup(&x->tx) && tries > 0) return 0;
        (*kicks)++;
        if (sendto(xsk_socket__fd(x->xsk), NULL, 0, MSG_DONTWAIT, NULL, 0) >= 0) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) continue;
        if (errno == EBUSY || errno == ENOBUFS || errno == ENETDOWN) {
            struct pollfd p = {.fd = xsk_socket__fd(x->xsk), .events = POLLOUT};
            if (poll(&p, 1, 1) < 0 && errno != EINTR) return -errno;
            continue;
        }
        return -errno;
    }
    return 0;
}

int pn_xsk_send(pn_xsk *x, const uint8_t *const *packet, const int64_t *dest, uint32_t n, uint32_t size,
                int timeout_ms, uint64_t *bytes_sent, const uint8_t **spill, int64_t *spill_dest,
                uint32_t *spilled) {
    *spilled = 0;
    if (size == 0) return -EINVAL;
    if (size > x->packet_size) {  /* longer than a frame holds (an aggregator's widest jobs): the socket's */
        for (uint32_t i = 0; i < n; i++) {
            spill[i] = packet[i];
            spill_dest[i] = dest[i];
        }
        *spilled = n;
        return 0;
    }
    uint64_t kicks = 0, waits = 0, sent = 0;
    int rc = 0;
    uint32_t i = 0;
    while (i < n) {
        reclaim(x);
        uint32_t room = x->free_count, idx;
        if (room == 0) {  /* every tx frame is in flight: kick, and wait for completions */
            waits++;
            rc = kick(x, &kicks);
            if (rc) break;
            struct pollfd p = {.fd = xsk_socket__fd(x->xsk), .events = POLLOUT};
            int w = poll(&p, 1, timeout_ms);
            if (w < 0 && errno != EINTR) {
                rc = -errno;
                break;
            }
            reclaim(x);
            if (x->free_count == 0 && w == 0) {
                rc = -ETIMEDOUT;
                break;
            }
            continue;
        }
        uint32_t want = n - i < room ? n - i : room;
        uint32_t got = xsk_ring_prod__reserve(&x->tx, want, &idx);
        if (got == 0) {
            rc = kick(x, &kicks);
            if (rc) break;
            continue;
        }
        uint32_t used = 0;
        for (; i < n && used < got; i++) {
            uint32_t ip = (uint32_t)(dest[i] >> 16);
            int k = find_neighbor(x, ip);
            if (k < 0) {  /* no MAC known for it yet: the kernel's UDP path resolves it */
                spill[*spilled] = packet[i];
                spill_dest[*spilled] = dest[i];
                (*spilled)++;
                continue;
            }
            uint64_t addr = x->free_tx[--x->free_count];
            uint8_t *frame = xsk_umem__get_data(x->area, addr);
            pn_frame_headers(frame, x->neighbor_mac[k], x->mac, x->local_ip, x->local_port, ip,
                             (uint16_t)(dest[i] & 0xFFFF), size, x->ip_id++);
            memcpy(frame + PN_FRAME_HEADERS, packet[i], size);
            struct xdp_desc *d = xsk_ring_prod__tx_desc(&x->tx, idx + used);
            d->addr = addr;
            d->len = PN_FRAME_HEADERS + size;
            d->options = 0;
            used++;
        }
        if (used < got) x->tx.cached_prod -= got - used;  /* give back the descriptors not written */
        xsk_ring_prod__submit(&x->tx, used);
        sent += used;
    }
    if (!rc && sent) rc = kick(x, &kicks);
    *bytes_sent += sent * size;
    pthread_mutex_lock(&x->lock);
    x->stats.tx_packets += sent;
    x->stats.tx_spilled += *spilled;
    x->stats.kicks += kicks;
    x->stats.tx_waits += waits;
    pthread_mutex_unlock(&x->lock);
    return rc;
}

#else /* built without AF_XDP: pn_xsk_open always fails, so no pn_xsk exists and the rest is never called */

struct pn_xsk {
    int unused;
};

int pn_xdp_built(void) { return 0; }

pn_xsk *pn_xsk_open(int udp_fd, uint32_t ifindex, uint32_t queue, uint32_t local_ip, uint32_t local_port,
                    uint32_t packet_size, int flags, char *error, uint32_t error_len) {
    (void)udp_fd, (void)ifindex, (void)queue, (void)local_ip, (void)local_port, (void)packet_size, (void)flags;
    if (error && error_len)
        snprintf(error, error_len, "built without AF_XDP (libxdp-dev, libbpf-dev or clang absent at install)");
    return NULL;
}

void pn_xsk_close(pn_xsk *x) { (void)x; }

void pn_xsk_get_stats(pn_xsk *x, pn_xsk_stats *out) {
    (void)x;
    if (out) memset(out, 0, sizeof *out);
}

int pn_xsk_add_neighbor(pn_xsk *x, uint32_t ip, const uint8_t *mac) {
    (void)x, (void)ip, (void)mac;
    return PN_EINVAL;
}

int pn_xsk_fd(const pn_xsk *x) {
    (void)x;
    return -1;
}

int pn_xsk_ready(pn_xsk *x) {
    (void)x;
    return 0;
}

int pn_xsk_recv(pn_xsk *x, pn_datagram *out, uint32_t max) {
    (void)x, (void)out, (void)max;
    return -ENOTSUP;
}

int pn_xsk_send(pn_xsk *x, const uint8_t *const *packet, const int64_t *dest, uint32_t n, uint32_t size,
                int timeout_ms, uint64_t *bytes_sent, const uint8_t **spill, int64_t *spill_dest,
                uint32_t *spilled) {
    (void)x, (void)packet, (void)dest, (void)n, (void)size, (void)timeout_ms, (void)bytes_sent, (void)spill;
    (void)spill_dest;
    *spilled = 0;
    return -ENOTSUP;
}

#endif
