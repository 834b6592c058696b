/* The host's all_gather stream (docs/protocol.md, All-gather; passing/gather_stream.py's GatherStream is the
 * specification of its loop): this worker's piece sent as GATHER packets through the first aggregator, at most
 * a window ahead of what it holds from the slowest peer; the peers' pieces held as they come; after a silence,
 * a NACK per origin for its first missing run; once every piece is held, a DATA round whose RESULT ends the call
 * for everyone. GATHERs of a next call that come early are kept for it. */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "passing_native.h"
#include "stream_loop.h"
#include "udp.h"

typedef struct {
    pn_gather_call *c;
    pn_stream_report *r;
    size_t packet_size;
    pn_udp udp;
    pn_recovery rec;              /* the group's estimates (read, not changed: no round trip is measured here) */
    uint64_t *base;               /* per origin: its first row in staged */
    uint64_t *prefix;             /* per origin: how many of its packets, from its first, are held */
    uint64_t mine, sent, lacking, largest;
    uint32_t completion_psn;
    double *resent_at;            /* per packet of mine: when last sent again for a NACK */
    uint8_t *nacks;               /* one NACK per origin */
    pn_send_queue sends;          /* everything goes to the first aggregator */
    /* the loop's clock: */
    double last_activity;         /* the latest progress, completion sent or probe */
    double last_progress;         /* the latest new packet of a piece, or the completion sent */
    double silence_check;         /* when failover's question is due next */
    uint32_t probes;              /* probes since the last progress: each doubles the next wait */
    int completion_sent;
} gather_state;

static void gather_queue(gather_state *g, const uint8_t *packet) {
    pn_send_queue_add(&g->sends, packet, g->c->aggregator);
}

static int gather_flush(gather_state *g) {
    return pn_send_queue_flush(&g->sends, &g->udp, g->packet_size, g->c->drop, g->c->rng, g->r);
}

/* Send this worker's packets up to a window ahead of the slowest peer's prefix. */
static void gather_send_ahead(gather_state *g) {
    const pn_gather_call *c = g->c;
    uint64_t slowest = UINT64_MAX;
    for (uint32_t o = 0; o < c->origins; o++) {
        while (g->prefix[o] < c->counts[o] && c->have[g->base[o] + g->prefix[o]]) g->prefix[o]++;
        if (g->prefix[o] < c->counts[o] && g->prefix[o] < slowest) slowest = g->prefix[o];
    }
    uint64_t limit = slowest == UINT64_MAX ? g->mine : slowest + c->window;
    if (limit > g->mine) limit = g->mine;
    for (; g->sent < limit; g->sent++) gather_queue(g, c->packets + g->sent * g->packet_size);
}

/* One NACK per origin this worker lacks packets of: its first missing run, up to a window. */
static void gather_nack(gather_state *g) {
    const pn_gather_call *c = g->c;
    for (uint32_t o = 0; o < c->origins; o++) {
        if (g->prefix[o] >= c->counts[o]) continue;
        uint64_t first = g->prefix[o], run = 0;
        while (first + run < c->counts[o] && run < c->window && run < 0xFFFF && !c->have[g->base[o] + first + run]) run++;
        uint8_t *p = g->nacks + (size_t)o * g->packet_size;
        memset(p, 0, g->packet_size);
        pn_header h = {.version = PN_VERSION, .type = PN_NACK, .job = (uint16_t)c->job, .slot = (uint16_t)run,
                       .worker = (uint8_t)c->worker, .owner = (uint8_t)o, .generation = (uint16_t)c->generation,
                       .psn = (uint32_t)(c->start + first)};
        pn_header_encode(p, &h);
        gather_queue(g, p);
    }
}

/* A datagram during the call: a GATHER of this call (held), of the next (kept), a NACK to this
 * worker (its packets sent again), the completion round's RESULT (returns 1). */
static int gather_datagram(gather_state *g, const pn_datagram *d, double now, double pto, int *progress) {
    pn_gather_call *c = g->c;
    if (d->length != g->packet_size || d->source != c->aggregator) return 0;
    pn_header h;
    pn_header_decode(d->data, &h);
    if (h.version != PN_VERSION || h.job != c->job || h.generation != c->generation || h.worker != c->worker)
        return 0;
    uint32_t offset = h.psn - (uint32_t)c->start;
    if (h.type == PN_GATHER) {
        if (h.owner < c->origins && h.owner != c->number && offset < c->counts[h.owner]) {
            uint64_t row = g->base[h.owner] + offset;
            if (!c->have[row]) {
                memcpy(c->staged + row * 4 * (size_t)c->lanes, d->data + PN_HEADER_SIZE, 4 * (size_t)c->lanes);
                c->have[row] = 1;
                g->lacking--;
                *progress = 1;
            }
        } else if ((uint32_t)(offset - (uint32_t)g->largest) < UINT32_C(1) << 31 && *c->early_count < c->early_cap) {
            memcpy(c->early + (size_t)*c->early_count * g->packet_size, d->data, g->packet_size);  /* the next call's */
            c->early_source[*c->early_count] = d->source;
            (*c->early_count)++;
        }
    } else if (h.type == PN_NACK && h.owner == c->number) {
        for (uint64_t i = offset; i < (uint64_t)offset + h.slot && i < g->sent; i++) {
            if (now - g->resent_at[i] <= pto / 2) continue;  /* several receivers may ask for one loss */
            uint8_t *p = c->packets + i * g->packet_size;
            p[3] |= PN_FLAG_RETRANSMIT;
            gather_queue(g, p);
            g->resent_at[i] = now;
            g->r->retransmissions++;
        }
    } else if (h.type == PN_RESULT && h.psn == g->completion_psn) {
        c->completion_sum = pn_lane_get(d->data, 0);
        return 1;
    }
    return 0;
}

static void gather_free(gather_state *g) {
    free(g->base);
    free(g->prefix);
    free(g->resent_at);
    free(g->nacks);
    pn_send_queue_free(&g->sends);
    pn_udp_free(&g->udp);
}

static int gather_validate(const pn_gather_call *c, const pn_stream_report *r) {
    if (!c || !r || c->fd < 0 || c->lanes == 0 || c->lanes > 16000 || c->job > 0xFFFF ||
        c->generation >= PN_GENERATIONS || c->origins == 0 || c->origins > PN_OWNERS || c->number >= c->origins ||
        c->worker >= PN_MAX_WORKERS ||
        c->window == 0 || !c->counts || !c->staged || !c->have || !c->completion || !c->srtt || !c->rttvar ||
        !c->last_loss || !c->rng || !(c->timeout > 0) || !(c->rto_min > 0) || !(c->max_rto >= c->rto_min) ||
        c->drop < 0 || c->drop >= 1 || !c->early_count || (c->early_cap && (!c->early || !c->early_source)) ||
        *c->early_count > c->early_cap || (c->counts[c->number] && !c->packets) || !(c->silence >= 0) ||
        (c->silence > 0 && (!c->on_silence || !(c->silence_every > 0))))
        return PN_EINVAL;
    for (uint32_t o = 0; o < c->origins; o++)
        if (c->counts[o] > 0x7FFFFFFF) return PN_EINVAL; /* positions of one call stay in serial-number range */
    return PN_OK;
}

/* The call's state: each origin's rows in staged, what is held already, the buffers and the socket. */
static int gather_init(gather_state *g, pn_gather_call *c, pn_stream_report *r) {
    *g = (gather_state){.c = c, .r = r, .packet_size = pn_packet_size(c->lanes),
                        .rec = {.srtt = *c->srtt, .rttvar = *c->rttvar, .last_loss = *c->last_loss,
                                .rto_min = c->rto_min, .max_rto = c->max_rto}};
    g->udp.fd = -1;
    g->base = calloc(c->origins, sizeof *g->base);
    g->prefix = calloc(c->origins, sizeof *g->prefix);
    uint64_t rows = 0;
    for (uint32_t o = 0; g->base && o < c->origins; o++) {
        g->base[o] = rows;
        rows += c->counts[o];
        if (c->counts[o] > g->largest) g->largest = c->counts[o];
    }
    g->mine = c->counts[c->number];
    for (uint64_t i = 0; i < rows; i++) g->lacking += !c->have[i];
    g->completion_psn = (uint32_t)c->completion[12] << 24 | (uint32_t)c->completion[13] << 16 |
                        (uint32_t)c->completion[14] << 8 | c->completion[15];
    g->resent_at = malloc((g->mine ? g->mine : 1) * sizeof *g->resent_at);
    g->nacks = malloc((size_t)c->origins * g->packet_size);
    int queued = pn_send_queue_init(&g->sends, (uint32_t)(2 * g->mine + c->origins + 2));
    int u = g->base && g->prefix && g->resent_at && g->nacks && queued
                ? pn_udp_init(&g->udp, c->fd, (uint32_t)g->packet_size, RECV_BATCH, c->gso) : -ENOMEM;
    if (u == 0) u = pn_udp_use_xsk(&g->udp, c->xsk);
    if (u < 0) {
        gather_free(g);
        return u == -ENOMEM ? PN_ENOMEM : PN_EINVAL;
    }
    for (uint64_t i = 0; i < g->mine; i++) g->resent_at[i] = -INFINITY;
    return PN_OK;
}

/* After progress, and once every piece is held (the completion round sent): the probe waits start again. */
static void gather_moved(gather_state *g, double now) {
    g->last_activity = g->last_progress = now;
    g->probes = 0;
}

/* Silence for a probe's wait: the completion round again (its RESULT is lost, or a peer still lacks something),
 * or, before it, one NACK per origin this worker lacks packets of. */
static void gather_probe(gather_state *g, double now) {
    if (g->completion_sent) {
        g->c->completion[3] |= PN_FLAG_RETRANSMIT;
        gather_queue(g, g->c->completion);
        g->r->retransmissions++;
    } else {
        gather_send_ahead(g); /* brings the prefixes up to date */
        gather_nack(g);
    }
    g->probes++;
    g->last_activity = now;
}

/* One iteration's datagrams, every one of the batch, also those after the completion RESULT: a faster peer's
 * GATHERs of the next call come right behind it (the aggregator sends in order), and dropped here they would
 * wait for a NACK, a probe's wait later (a second, at rto, on loss-free links). Returns 1 when the call is done
 * (its completion RESULT, after this worker sent its own contribution). */
static int gather_receive(gather_state *g, const pn_datagram *got, int n, double now, int *progress) {
    pn_gather_call *c = g->c;
    int done = 0;
    for (int i = 0; i < n; i++) {
        g->r->packets_received++;
        g->r->bytes_received += got[i].length;
        if (c->drop > 0 && pn_uniform(c->rng) < c->drop) continue; /* test impairment: lost on the way in */
        int completed = gather_datagram(g, &got[i], now, pn_probe_timeout(&g->rec), progress);
        done = done || (completed && g->completion_sent);
    }
    return done;
}

int pn_gather_run(pn_gather_call *c, pn_stream_report *r) {
    int rc = gather_validate(c, r);
    if (rc != PN_OK) return rc;
    gather_state g;
    rc = gather_init(&g, c, r);
    if (rc != PN_OK) return rc;
    uint32_t capacity = pn_udp_capacity(&g.udp);
    pn_datagram *got = malloc(capacity * sizeof *got);
    rc = got ? PN_OK : PN_ENOMEM;
    double now = pn_now();
    g.last_activity = g.last_progress = now;
    g.silence_check = now + c->silence;
    gather_send_ahead(&g);
    if (rc == PN_OK) rc = gather_flush(&g);
    while (rc == PN_OK) {
        double pto = pn_probe_wait(&g.rec, now, g.probes);
        double due = g.last_activity + pto;
        if (c->silence > 0 && g.silence_check < due) due = g.silence_check;
        int n = pn_wait_and_receive(&g.udp, due - pn_now(), got, capacity, r);
        if (n < 0) {
            rc = PN_ESYS;
            break;
        }
        now = pn_now();
        int progress = 0;
        if (gather_receive(&g, got, n, now, &progress)) break;
        if (progress) {
            gather_moved(&g, now);
            gather_send_ahead(&g);
        }
        if (g.lacking == 0 && !g.completion_sent) {
            gather_queue(&g, c->completion);
            g.completion_sent = 1;
            gather_moved(&g, now);
        }
        if (now - g.last_progress > c->timeout) {
            r->error_psn = (uint32_t)c->start;
            rc = PN_ETIMEOUT;
            break;
        }
        if (c->silence > 0 && pn_silence_gives_up(c->silence, c->silence_every, c->on_silence, c->silence_ctx, now,
                                                  g.last_progress, &g.silence_check)) {
            rc = PN_ESILENT;
            break;
        }
        if (now >= g.last_activity + pto) gather_probe(&g, now);
        rc = gather_flush(&g);
    }
    free(got);
    c->gso = g.udp.gso;
    r->gso_fallbacks += g.udp.gso_fallbacks;
    gather_free(&g);
    return rc;
}
