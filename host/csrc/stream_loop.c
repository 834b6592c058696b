/* What the host's two stream loops share (stream_loop.h): time, the one blocking step, failover's silence
 * rule, the sends of an iteration, and loss recovery's estimates and waits (passing/recovery.py mirrors them). */
#define _GNU_SOURCE
#include "stream_loop.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

double pn_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

int pn_wait_and_receive(pn_udp *udp, double wait, pn_datagram *got, uint32_t capacity, pn_stream_report *r) {
    if (wait > 0) {
        int w = pn_udp_wait(udp, (int)ceil((wait < MAX_WAIT_S ? wait : MAX_WAIT_S) * 1000.0), -1);
        if (w < 0) {
            r->error_errno = -w;
            snprintf(r->error_call, sizeof r->error_call, "poll");
            return -1;
        }
    }
    int n = pn_udp_recv(udp, got, capacity);
    if (n < 0) {
        r->error_errno = -n;
        snprintf(r->error_call, sizeof r->error_call, "recvmmsg");
        return -1;
    }
    return n;
}

int pn_silence_gives_up(double silence, double silence_every, int (*on_silence)(void *), void *ctx, double now,
                        double last_heard, double *check) {
    if (now - last_heard < silence) {
        *check = last_heard + silence;
        return 0;
    }
    if (now < *check) return 0;
    if (on_silence(ctx)) return 1;
    *check = pn_now() + silence_every;
    return 0;
}

double pn_uniform(uint64_t *state) {
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (double)(z >> 11) * 0x1.0p-53;
}

/* ---- the sends of an iteration ---------------------------------------------------------------------------- */

int pn_send_queue_init(pn_send_queue *q, uint32_t cap) {
    q->cap = cap;
    q->packets = malloc(cap * sizeof *q->packets);
    q->dest = malloc(cap * sizeof *q->dest);
    return q->packets && q->dest;
}

void pn_send_queue_free(pn_send_queue *q) {
    free(q->packets);
    free(q->dest);
}

void pn_send_queue_add(pn_send_queue *q, const uint8_t *packet, int64_t dest) {
    if (q->count == q->cap) return;
    q->packets[q->count] = packet;
    q->dest[q->count] = dest;
    q->count++;
}

int pn_send_queue_flush(pn_send_queue *q, pn_udp *udp, size_t packet_size, double drop, uint64_t *rng,
                        pn_stream_report *r) {
    uint32_t n = q->count;
    if (drop > 0) { /* the test impairment: what it loses is left out */
        n = 0;
        for (uint32_t i = 0; i < q->count; i++) {
            if (pn_uniform(rng) < drop) continue;
            q->packets[n] = q->packets[i];
            q->dest[n] = q->dest[i];
            n++;
        }
    }
    q->count = 0;
    if (n == 0) return PN_OK;
    uint64_t bytes = 0;
    int rc = pn_udp_send(udp, q->packets, q->dest, n, (uint32_t)packet_size, SEND_TIMEOUT_MS, &bytes, NULL);
    r->bytes_sent += bytes;
    r->packets_sent += bytes / packet_size;
    if (rc < 0) {
        r->error_errno = -rc;
        snprintf(r->error_call, sizeof r->error_call, "sendmmsg");
        return PN_ESYS;
    }
    return PN_OK;
}

/* ---- loss recovery's estimates and waits ------------------------------------------------------------------ */

double pn_probe_timeout(const pn_recovery *rec) {
    double pto = rec->srtt < 0 ? rec->rto_min : 2.0 * rec->srtt;
    return pto > PROBE_MIN_S ? pto : PROBE_MIN_S;
}

double pn_probe_wait(const pn_recovery *rec, double now, uint32_t probes) {
    double wait = pn_probe_timeout(rec);
    int quiet = rec->last_loss < 0 || now - rec->last_loss > LOSS_MEMORY_S;
    if (quiet && wait < rec->rto_min) wait = rec->rto_min;
    double pto = wait * (double)(1u << (probes < MAX_PROBE_DOUBLINGS ? probes : MAX_PROBE_DOUBLINGS));
    double most = wait > rec->max_rto ? wait : rec->max_rto; /* the doublings stop at max_rto */
    return pto > most ? most : pto;
}
