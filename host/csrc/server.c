/* The software aggregator's data path: the engine behind a UDP socket, in one thread.
 *
 * The loop sleeps in poll() on the socket and an eventfd that pn_server_stop() writes,
 * so an idle or trickling service costs next to no CPU. On readiness it drains the socket
 * with recvmmsg (GRO-coalesced buffers split into datagrams), applies the test
 * impairment, runs the engine and sends the RESULTs, sorted by destination so that each
 * worker's run leaves as one GSO message. passing/aggregator/server.py's SoftwareAggregator
 * (engine numpy) is the specification of the service; this is its fast path.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "engine.h"
#include "passing_native.h"
#include "udp.h"
#include "xsk.h"

#define OUT_CAP 4096          /* RESULTs per engine call: bounds memory whatever a GRO batch holds */
#define SEND_TIMEOUT_MS 1000  /* a send buffer full this long: the rest of the batch is lost (counted) */

/* Seeded drop / duplicate / reorder, as passing.aggregator.server.Impairment does it: one for the
 * datagrams received, one for the RESULTs sent (pn_server_impair's directions). */
enum { INGRESS = 0, EGRESS = 1 };

typedef struct {
    double drop, duplicate;
    int reorder;
    uint64_t rng[4];          /* xoshiro256** */
} impairment;

struct pn_server {
    pn_engine *engine;
    pn_udp udp;
    int wake_fd;              /* eventfd: pn_server_stop() makes it readable */
    size_t packet_size;
    /* received datagrams, then the ones the ingress impairment lets through (twice as
     * many room: each may be duplicated) */
    uint32_t rx_cap;
    pn_datagram *rx;
    uint32_t *in_keep;
    const uint8_t **in_packet;
    uint32_t *in_length;
    int64_t *in_source;
    /* one engine call's RESULTs (rows of the widest packet, each as long as its job's
     * packets), then the list to send (again room for duplicates) */
    uint8_t *out;
    int64_t *out_dest;
    uint8_t *out_multicast;
    uint32_t *out_length;
    uint32_t *tx_keep, *tx_sort_a, *tx_sort_b;
    const uint8_t **tx_packet;
    int64_t *tx_dest;
    uint32_t *tx_size;
    pthread_mutex_t lock;     /* stats and impairments: read and set from other threads */
    impairment impair[2];
    pn_server_stats stats;
    atomic_int stop;
};

/* ---- the impairment's generator: splitmix64 seeds xoshiro256** ------------------- */

static uint64_t splitmix64(uint64_t *state) {
    uint64_t z = (*state += UINT64_C(0x9E3779B97F4A7C15));
    z = (z ^ (z >> 30)) * UINT64_C(0xBF58476D1CE4E5B9);
    z = (z ^ (z >> 27)) * UINT64_C(0x94D049BB133111EB);
    return z ^ (z >> 31);
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static uint64_t next_random(uint64_t s[4]) {
    uint64_t result = rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

static double uniform(uint64_t s[4]) { return (double)(next_random(s) >> 11) * 0x1.0p-53; }

/* Uniform in 0..n-1 without modulo bias. */
static uint64_t below(uint64_t s[4], uint64_t n) {
    uint64_t limit = UINT64_MAX - UINT64_MAX % n;
    uint64_t x;
    do x = next_random(s);
    while (x >= limit);
    return x % n;
}

/* Indices of the `count` items that go on, in the order they go on, into keep (room for
 * 2 * count): the survivors, then the duplicates of some of them, all shuffled if asked (an
 * impairment that does nothing keeps them all, in order, and draws no number). */
static uint32_t impairment_apply(impairment *im, uint32_t count, uint32_t *keep, uint64_t *dropped,
                                 uint64_t *duplicated) {
    uint32_t kept = 0;
    for (uint32_t i = 0; i < count; i++)
        if (!(im->drop > 0 && uniform(im->rng) < im->drop)) keep[kept++] = i;
    *dropped += count - kept;
    uint32_t total = kept;
    if (im->duplicate > 0)
        for (uint32_t i = 0; i < kept; i++)
            if (uniform(im->rng) < im->duplicate) keep[total++] = keep[i];
    *duplicated += total - kept;
    if (im->reorder)
        for (uint32_t i = total; i > 1; i--) {
            uint32_t j = (uint32_t)below(im->rng, i);
            uint32_t t = keep[i - 1];
            keep[i - 1] = keep[j];
            keep[j] = t;
        }
    return total;
}

/* ---- life cycle ------------------------------------------------------------------- */

pn_server *pn_server_new(pn_engine *e, int fd, uint32_t batch, int gso) {
    if (!e || fd < 0) return NULL;
    pn_server *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->wake_fd = -1;
    if (pthread_mutex_init(&s->lock, NULL) != 0) {
        free(s);
        return NULL;
    }
    s->engine = e;
    s->packet_size = pn_engine_packet_bytes(e);
    if (s->packet_size > 65507 || pn_udp_init(&s->udp, fd, (uint32_t)s->packet_size, batch, gso) != 0) {
        pthread_mutex_destroy(&s->lock);
        free(s);
        return NULL;
    }
    s->rx_cap = pn_udp_capacity(&s->udp);
    s->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    size_t in_cap = (size_t)s->rx_cap * 2, tx_cap = (size_t)OUT_CAP * 2;
    s->rx = calloc(s->rx_cap, sizeof *s->rx);
    s->in_keep = calloc(in_cap, sizeof *s->in_keep);
    s->in_packet = calloc(in_cap, sizeof *s->in_packet);
    s->in_length = calloc(in_cap, sizeof *s->in_length);
    s->in_source = calloc(in_cap, sizeof *s->in_source);
    s->out = calloc(OUT_CAP, s->packet_size);
    s->out_dest = calloc(OUT_CAP, sizeof *s->out_dest);
    s->out_multicast = calloc(OUT_CAP, sizeof *s->out_multicast);
    s->out_length = calloc(OUT_CAP, sizeof *s->out_length);
    s->tx_keep = calloc(tx_cap, sizeof *s->tx_keep);
    s->tx_sort_a = calloc(tx_cap, sizeof *s->tx_sort_a);
    s->tx_sort_b = calloc(tx_cap, sizeof *s->tx_sort_b);
    s->tx_packet = calloc(tx_cap, sizeof *s->tx_packet);
    s->tx_dest = calloc(tx_cap, sizeof *s->tx_dest);
    s->tx_size = calloc(tx_cap, sizeof *s->tx_size);
    if (s->wake_fd < 0 || !s->rx || !s->in_keep || !s->in_packet || !s->in_length || !s->in_source || !s->out ||
        !s->out_dest || !s->out_multicast || !s->out_length || !s->tx_keep || !s->tx_sort_a || !s->tx_sort_b ||
        !s->tx_packet || !s->tx_dest || !s->tx_size) {
        pn_server_free(s);
        return NULL;
    }
    atomic_init(&s->stop, 0);
    return s;
}

int pn_server_use_xsk(pn_server *s, pn_xsk *x) {
    if (!s) return PN_EINVAL;
    return pn_udp_use_xsk(&s->udp, x) == 0 ? PN_OK : PN_ENOMEM;
}

void pn_server_free(pn_server *s) {
    if (!s) return;
    if (s->wake_fd >= 0) close(s->wake_fd);
    pn_udp_free(&s->udp);
    pthread_mutex_destroy(&s->lock);
    free(s->rx);
    free(s->in_keep);
    free(s->in_packet);
    free(s->in_length);
    free(s->in_source);
    free(s->out);
    free(s->out_dest);
    free(s->out_multicast);
    free(s->out_length);
    free(s->tx_keep);
    free(s->tx_sort_a);
    free(s->tx_sort_b);
    free(s->tx_packet);
    free(s->tx_dest);
    free(s->tx_size);
    free(s);
}

int pn_server_impair(pn_server *s, int direction, double drop, double duplicate, int reorder, uint64_t seed) {
    /* written so that NaN fails too */
    if (!s || (direction != INGRESS && direction != EGRESS) || !(drop >= 0 && drop < 1) || !(duplicate >= 0 && duplicate < 1))
        return PN_EINVAL;
    impairment im = {.drop = drop, .duplicate = duplicate, .reorder = reorder != 0};
    for (int i = 0; i < 4; i++) im.rng[i] = splitmix64(&seed);
    pthread_mutex_lock(&s->lock);
    s->impair[direction] = im;
    pthread_mutex_unlock(&s->lock);
    return PN_OK;
}

void pn_server_stop(pn_server *s) {
    if (!s) return;
    atomic_store(&s->stop, 1);
    uint64_t one = 1;
    /* async-signal-safe; a failure (EAGAIN) means it is readable already */
    if (write(s->wake_fd, &one, sizeof one) < 0) return;
}

void pn_server_get_stats(pn_server *s, pn_server_stats *out) {
    if (!s || !out) return;
    pthread_mutex_lock(&s->lock);
    *out = s->stats;
    pthread_mutex_unlock(&s->lock);
}

/* ---- serving ------------------------------------------------------------------------ */

/* Which of `count` items (datagrams in, RESULTs out) go on through the direction's impairment, into
 * keep; what it drops and duplicates is counted in the direction's stats. */
static uint32_t impair(pn_server *s, int direction, uint32_t count, uint32_t *keep) {
    pthread_mutex_lock(&s->lock);
    uint64_t *dropped = direction == INGRESS ? &s->stats.ingress_dropped : &s->stats.egress_dropped;
    uint64_t *duplicated = direction == INGRESS ? &s->stats.ingress_duplicated : &s->stats.egress_duplicated;
    uint32_t n = impairment_apply(&s->impair[direction], count, keep, dropped, duplicated);
    pthread_mutex_unlock(&s->lock);
    return n;
}

/* Send the engine call's `emitted` RESULTs through the egress impairment. */
static void send_results(pn_server *s, uint32_t emitted) {
    uint32_t n = impair(s, EGRESS, emitted, s->tx_keep);
    /* by destination: one run per worker, which leaves as one GSO message */
    memcpy(s->tx_sort_a, s->tx_keep, n * sizeof *s->tx_keep);
    const uint32_t *rows = pn_stable_order(s->out_dest, s->tx_sort_a, s->tx_sort_b, n);
    for (uint32_t i = 0; i < n; i++) {
        s->tx_packet[i] = s->out + (size_t)rows[i] * s->packet_size;
        s->tx_dest[i] = s->out_dest[rows[i]];
        s->tx_size[i] = s->out_length[rows[i]];
    }
    uint64_t bytes = 0, packets = 0;
    int errors = 0, last_errno = 0;
    uint32_t at = 0;
    while (at < n) {
        uint32_t size = s->tx_size[at], end = at + 1;  /* a run of one packet size (one job's, as a rule) */
        while (end < n && s->tx_size[end] == size) end++;
        uint64_t before = bytes;
        uint32_t handled = 0;
        int r = pn_udp_send(&s->udp, s->tx_packet + at, s->tx_dest + at, end - at, size, SEND_TIMEOUT_MS, &bytes,
                            &handled);
        packets += (bytes - before) / size;
        if (r == 0) {
            at = end;
            continue;
        }
        /* never fatal for the shared service: count it, skip the destination that failed
         * (its workers retransmit) and go on with the others; a buffer that stayed full
         * loses the rest of the batch */
        errors++;
        last_errno = -r;
        if (r == -ETIMEDOUT) break;
        uint32_t failed = at + handled;  /* not the bytes: a refused packet was handled, never sent */
        if (failed >= end) {
            at = end;
            continue;
        }
        at = failed + 1;
        while (at < n && s->tx_dest[at] == s->tx_dest[failed]) at++;
    }
    pthread_mutex_lock(&s->lock);
    s->stats.packets_sent += packets;
    s->stats.bytes_sent += bytes;
    s->stats.send_errors += (uint64_t)errors;
    s->stats.gso_fallbacks = s->udp.gso_fallbacks;
    if (errors) s->stats.last_errno = last_errno;
    pthread_mutex_unlock(&s->lock);
}

/* One received batch: impairment, engine, RESULTs out. */
static void serve_batch(pn_server *s, uint32_t received) {
    uint64_t bytes = 0;
    for (uint32_t i = 0; i < received; i++) bytes += s->rx[i].length;
    uint32_t n = impair(s, INGRESS, received, s->in_keep);
    for (uint32_t i = 0; i < n; i++) {
        const pn_datagram *d = &s->rx[s->in_keep[i]];
        s->in_packet[i] = d->data;
        s->in_length[i] = d->length;
        s->in_source[i] = d->source;
    }
    size_t done = 0;
    while (done < n) {
        size_t emitted = 0;
        /* the lock spans processing and sending: counters read meanwhile never count a
         * packet whose RESULTs are not sent yet */
        pn_engine_lock(s->engine);
        size_t consumed = pn_engine_process_locked(s->engine, s->in_packet + done, s->in_length + done,
                                                   s->in_source + done, n - done, s->out, s->out_dest,
                                                   s->out_multicast, s->out_length, OUT_CAP, &emitted);
        if (emitted) send_results(s, (uint32_t)emitted);
        pn_engine_unlock(s->engine);
        if (consumed == 0) break;  /* cannot happen: OUT_CAP holds any packet's RESULTs */
        done += consumed;
    }
    /* counted once the engine has: whoever reads these stats, then the engine's counters
     * (passing/aggregator/server.py), finds every datagram counted here under its outcome there */
    pthread_mutex_lock(&s->lock);
    s->stats.batches++;
    s->stats.packets_received += received;
    s->stats.bytes_received += bytes;
    pthread_mutex_unlock(&s->lock);
}

static int record_errno(pn_server *s, int err) {
    pthread_mutex_lock(&s->lock);
    s->stats.last_errno = err;
    pthread_mutex_unlock(&s->lock);
    return PN_ESYS;
}

int pn_server_run(pn_server *s) {
    if (!s) return PN_EINVAL;
    while (!atomic_load(&s->stop)) {
        /* the socket, the stop, and the XSK where there is one (-1: poll skips it) */
        struct pollfd p[3] = {{.fd = s->udp.fd, .events = POLLIN}, {.fd = s->wake_fd, .events = POLLIN},
                              {.fd = s->udp.xsk ? pn_xsk_fd(s->udp.xsk) : -1, .events = POLLIN}};
        if (!(s->udp.xsk && pn_xsk_ready(s->udp.xsk)) && poll(p, 3, -1) < 0) {
            if (errno == EINTR) continue;
            return record_errno(s, errno);
        }
        if (p[1].revents) break;  /* stopped */
        if ((p[0].revents | p[2].revents) & POLLNVAL) return record_errno(s, EBADF);
        if (!((p[0].revents | p[2].revents) & (POLLIN | POLLERR)) && !(s->udp.xsk && pn_xsk_ready(s->udp.xsk)))
            continue;
        /* drain what is queued; between batches, look whether we were stopped */
        while (!atomic_load(&s->stop)) {
            int received = pn_udp_recv(&s->udp, s->rx, s->rx_cap);
            if (received < 0) {
                if (received != -ENOMEM && received != -ENOBUFS) return record_errno(s, -received);
                record_errno(s, -received);  /* transient: noted, and poll again */
                break;
            }
            if (received == 0) break;
            serve_batch(s, (uint32_t)received);
            /* the socket held less than a batch (and all of it is served): back to poll without
             * an empty recvmmsg, one syscall fewer per wakeup at a trickle */
            if (s->udp.rx_drained && !pn_udp_pending(&s->udp)) break;
        }
    }
    return PN_OK;
}
