/* The host streaming engine: one allreduce pass of a group's array through its
 * aggregators (passing/reduce_stream.py's ReduceStream is the specification). What it shares
 * with the all_gather loop (gather.c) is stream_loop.c's: time, the send queue, failover's
 * silence rule and loss recovery's estimates and waits; quantizing is quantize.c's.
 *
 * Per shard a self-clocked window: packet offset o of the shard is at stream position
 * p = next_psn + o (64 bits, unwrapped: psn = p mod 2^32, slot = p mod pool, set =
 * (p div pool) mod 2, so any pool keeps o and o + pool on one slot across the psn's wrap),
 * and o + pool is sent only once the RESULT of o is in, so the window
 * holds exactly `pool` packets and its memory is shards x pool x packet size, whatever
 * the array's size. Packets are built straight from the caller's input (quantized with
 * the shard's scale) into the window, and RESULTs are written straight into the output.
 *
 * Loss recovery keeps the window moving under random loss, where one lost packet must
 * cost one retransmission of that packet and not stall the stream, and resends nothing
 * while the stream only waits: a RESULT comes when every worker has sent its packet, so a
 * late peer (one that starts its call later, or is descheduled) stops RESULTs as a loss
 * would, and a per-packet timer, or a probe after a round trip or two, resends for it.
 *  - Evidence (RACK, RFC 8985): a packet is resent once a packet transmitted after it has
 *    been answered and it has been out for longer than that packet's round trip plus a
 *    reordering allowance (time order, so retransmissions give evidence too and a stalled
 *    window still recovers). Rounds complete in transmission order on an in-order path,
 *    since every worker sends in psn order; a round stalled by a peer's loss costs each
 *    waiting worker about one resend per round trip, not one per RESULT.
 *  - Silence (a probe): a shard that has neither sent nor been answered for a while resends
 *    its latest-sent packet, whose answer lets RACK judge the ones before it, and the one
 *    out the longest, whose round holds every worker's window (if its resend by RACK was lost
 *    as well, nothing later can be answered); each unanswered probe doubles the next wait
 *    (up to max_rto). There is no per-packet timer: every unanswered packet is either older
 *    than an answered one (RACK) or among those a probe stands for.
 *  - The while depends on what the path has shown. Within LOSS_MEMORY_S of evidence of loss
 *    (a RACK resend, or a resend answered right away), two smoothed round trips (RFC 8985's
 *    PTO, 1 ms at least): silence is then likely a loss. Otherwise silence is all but surely
 *    a late peer, whose lateness has a long tail (skew of compute, scheduling, a busy switch),
 *    so rto_min at least (1 s by default, RFC 6298's initial timer): a loss-free run resends
 *    nothing, and the first loss after a quiet spell costs at most that, once. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "passing_native.h"
#include "quantize.h"
#include "stream_loop.h"
#include "udp.h"

typedef struct {
    uint64_t offset;   /* packet offset within the shard */
    double first_sent, last_sent;
    uint64_t xmit;     /* order of its latest transmission among the call's (ties of time broken) */
    uint32_t retries;  /* transmissions after the first */
    uint8_t inflight;
} window_slot;

typedef struct {
    uint32_t pool;
    uint64_t start, count;
    uint64_t sent, done;       /* packets sent for the first time / answered */
    uint64_t rack_xmit;        /* the latest-transmitted answered packet's xmit (0: none yet) */
    double last_activity;      /* the shard's latest transmission or answer */
    uint32_t probes;           /* probes since the last answer: each doubles the next wait */
    double rack_rtt;           /* that packet's round trip */
    uint64_t base;             /* stream position of the shard's first packet in this call */
    uint64_t base_round;       /* base / pool and base % pool: a packet's slot and set follow from its offset's */
    uint32_t base_slot;
    int64_t aggregator;
    uint8_t *packets;          /* pool packets */
    window_slot *slots;
    pn_scale scale;            /* float32 input: the shard's */
} shard_state;

typedef struct {
    const pn_stream_call *c;
    pn_stream_report *r;
    shard_state *shards;
    size_t packet_size;
    pn_udp udp;
    pn_recovery rec;              /* the group's estimates: read from the call, written back to it */
    uint64_t xmit;                /* transmissions so far */
    pn_send_queue sends;
} stream_state;

static int flush_sends(stream_state *st) {
    return pn_send_queue_flush(&st->sends, &st->udp, st->packet_size, st->c->drop, st->c->rng, st->r);
}

/* Rows of the caller's array (input or output: same element size) are read and written in order, a packet at a
 * time between system calls that evict them from the caches: ask for those PREFETCH_ROWS ahead of the one at
 * hand (the hardware's prefetcher loses the stream among the kernel's copies). */
#define PREFETCH_ROWS 4
static inline void prefetch_row(const void *array, uint64_t row, const pn_stream_call *c, int write) {
    uint64_t first = (row + PREFETCH_ROWS) * c->lanes;
    if (first >= c->elements) return;
    const uint8_t *p = (const uint8_t *)array + 4 * first;
    size_t bytes = 4 * (size_t)(first + c->lanes <= c->elements ? c->lanes : c->elements - first);
    for (size_t b = 0; b < bytes; b += 64) {
        if (write) __builtin_prefetch(p + b, 1, 3);
        else __builtin_prefetch(p + b, 0, 3);
    }
}

/* Build packet `offset` of shard s into its window slot `index` (offset % pool; offsets fit 32 bits: validate). The
 * stream position's slot and round come from the offset's and base's, with no 64-bit division per packet. */
static uint8_t *build_packet(stream_state *st, shard_state *s, uint32_t offset, uint32_t index) {
    const pn_stream_call *c = st->c;
    uint8_t *p = s->packets + (size_t)index * st->packet_size;
    uint64_t row = s->start + offset;
    uint64_t first = row * c->lanes;
    uint32_t full = first + c->lanes <= c->elements ? c->lanes : (uint32_t)(c->elements - first);
    int saturated = 0;
    prefetch_row(c->input, row, c, 0);
    if (c->kind != PN_IN_F32 || !s->scale.f32 ||
        !pn_quantize_f32_fast((const float *)c->input + first, full, s->scale.f, p)) {
        for (uint32_t i = 0; i < full; i++) {
            int32_t q;
            if (c->kind == PN_IN_F32) saturated |= pn_quantize(((const float *)c->input)[first + i], &s->scale, &q);
            else q = ((const int32_t *)c->input)[first + i];
            pn_lane_set(p, i, q);
        }
    }
    if (full < c->lanes) memset(p + PN_HEADER_SIZE + 4 * (size_t)full, 0, 4 * (size_t)(c->lanes - full)); /* padding */
    uint32_t slot = s->base_slot + index;  /* (base + offset) % pool and / pool */
    uint64_t round = s->base_round + offset / s->pool;
    if (slot >= s->pool) {
        slot -= s->pool;
        round++;
    }
    pn_header h = {
        .version = PN_VERSION, .type = PN_DATA, .op = (uint8_t)c->op,
        .flags = (uint8_t)((saturated ? PN_FLAG_OVERFLOW : 0) | (c->owner_packets ? PN_FLAG_OWNER_ONLY : 0)),
        .job = (uint16_t)c->job, .slot = (uint16_t)slot, .worker = (uint8_t)c->worker,
        .owner = (uint8_t)(c->owner_packets ? row / c->owner_packets : 0),
        .set = (uint8_t)(round % 2), .generation = (uint16_t)c->generation, .psn = (uint32_t)(s->base + offset),
    };
    pn_header_encode(p, &h);
    return p;
}

/* First transmission of packet `offset` of the shard (its window slot `index`, offset % pool, is free), if it
 * exists. */
static void send_first(stream_state *st, shard_state *s, uint64_t offset, uint32_t index, double now) {
    if (offset >= s->count) return;
    s->sent++;
    s->last_activity = now;
    window_slot *w = &s->slots[index];
    *w = (window_slot){.offset = offset, .xmit = ++st->xmit, .first_sent = now, .last_sent = now, .inflight = 1};
    pn_send_queue_add(&st->sends, build_packet(st, s, (uint32_t)offset, index), s->aggregator);
}

/* Resend a packet: early (RACK: a later packet was answered, evidence of loss) or as a probe (silence). */
static void retransmit(stream_state *st, shard_state *s, window_slot *w, double now, int early) {
    if (early) st->rec.last_loss = now;
    uint8_t *p = s->packets + (size_t)(w - s->slots) * st->packet_size;
    p[3] |= PN_FLAG_RETRANSMIT;
    w->retries++;
    w->last_sent = now;
    w->xmit = ++st->xmit;
    s->last_activity = now;
    st->r->retransmissions++;
    if (early) st->r->early_retransmissions++;
    pn_send_queue_add(&st->sends, p, s->aggregator);
}

/* A datagram from the socket: a RESULT of this call goes into the output, and the window
 * moves on; so does an ACK (an OWNER_ONLY round this worker does not own: the header alone),
 * without output. Returns 1 for an answer to a packet still in flight. */
static int process_datagram(stream_state *st, const pn_datagram *d, double now) {
    const pn_stream_call *c = st->c;
    if (d->length != st->packet_size && d->length != PN_HEADER_SIZE) return 0;
    pn_header h;
    pn_header_decode(d->data, &h);
    int ack = d->length == PN_HEADER_SIZE;
    if (h.version == PN_VERSION && h.type == PN_GATHER && !ack && h.job == c->job && h.generation == c->generation &&
        h.worker == c->worker) {  /* a faster peer's next all_gather: kept for it */
        if (*c->early_count < c->early_cap) {
            memcpy(c->early + (size_t)*c->early_count * st->packet_size, d->data, st->packet_size);
            c->early_source[*c->early_count] = d->source;
            (*c->early_count)++;
        }
        return 0;
    }
    if (h.version != PN_VERSION || h.type != (ack ? PN_ACK : PN_RESULT)) return 0;
    if (h.job != c->job || h.generation != c->generation) {
        st->r->foreign_results++; /* another allocation's: never ours */
        return 0;
    }
    if (h.worker != c->worker) return 0;
    for (uint32_t k = 0; k < c->shards; k++) {
        shard_state *s = &st->shards[k];
        if (s->aggregator != d->source || s->count == 0) continue;
        uint32_t offset = h.psn - (uint32_t)s->base;
        if (offset >= s->count) return 0; /* another call's, or from the future */
        uint32_t index = offset % s->pool;
        window_slot *w = &s->slots[index];
        if (!w->inflight || w->offset != offset) return 0; /* answered already */
        w->inflight = 0;
        /* answered right after a resend: the resend was (most likely) needed, evidence of loss */
        if (w->retries > 0 && now - w->last_sent <= pn_probe_timeout(&st->rec)) st->rec.last_loss = now;
        s->done++;
        s->last_activity = now;
        s->probes = 0;
        if (w->xmit > s->rack_xmit) { /* RACK: the latest-sent packet known delivered */
            s->rack_xmit = w->xmit;
            s->rack_rtt = now - w->last_sent;
        }
        if (w->retries == 0) pn_smooth(&st->rec, now - w->first_sent); /* Karn: unambiguous samples only */
        if (h.flags & PN_FLAG_OVERFLOW) st->r->overflow[k] = 1;
        if (!ack) {
            uint64_t first = (s->start + offset) * c->lanes;
            uint32_t n = first + c->lanes <= c->elements ? c->lanes : (uint32_t)(c->elements - first);
            /* A SUM lane at an int32 bound is a saturated sum: Tofino saturates without the flag
             * (docs/tofino.md), so every target's is read as overflow (padding lanes too). Not in
             * OWNER_ONLY rounds: only the owner sees the sums, and the workers must agree on an
             * overflow, so there the flag alone tells (as in passing/reduce_stream.py). */
            prefetch_row(c->output, s->start + offset, c, 1);
            void *out = c->kind == PN_IN_F32 ? (void *)((float *)c->output + first) : (void *)((int32_t *)c->output + first);
            int bound = pn_read_result(d->data, n, c->lanes, c->kind, &s->scale, out); /* one pass: values, bound */
            if (c->op == PN_OP_SUM && !c->owner_packets && bound) st->r->overflow[k] = 1;
        }
        send_first(st, s, (uint64_t)offset + s->pool, index, now); /* self-clocking: the answer releases offset + pool */
        return 1;
    }
    return 0;
}

/* RACK and probes; returns the earliest time one may be due, or PN_ETIMEOUT. */
static int check_timers(stream_state *st, double now, double *next_deadline) {
    const pn_stream_call *c = st->c;
    double next = now + MAX_WAIT_S;
    for (uint32_t k = 0; k < c->shards; k++) {
        shard_state *s = &st->shards[k];
        if (s->done == s->sent) continue; /* nothing in flight */
        double allowance = s->rack_rtt * REORDER_FRACTION;
        double overdue = s->rack_rtt + (allowance > REORDER_MIN_S ? allowance : REORDER_MIN_S);
        window_slot *latest = NULL; /* the in-flight packet transmitted last */
        window_slot *oldest = NULL; /* and the one out the longest (lowest offset) */
        for (uint32_t i = 0; i < s->pool; i++) {
            window_slot *w = &s->slots[i];
            if (!w->inflight) continue;
            if (now - w->first_sent > c->timeout) {
                st->r->error_shard = k;
                st->r->error_psn = (uint32_t)(s->base + w->offset);
                st->r->error_retries = w->retries;
                return PN_ETIMEOUT;
            }
            if (s->rack_xmit > w->xmit) { /* a later packet was answered: this one is overdue after a while */
                if (now >= w->last_sent + overdue) retransmit(st, s, w, now, 1);
                if (w->last_sent + overdue < next) next = w->last_sent + overdue;
            }
            if (!latest || w->xmit > latest->xmit) latest = w;
            if (!oldest || w->offset < oldest->offset) oldest = w;
        }
        /* Probe: nothing sent or answered for a while, and nothing later to tell a loss: resend
         * the packet out the longest, and the latest-sent one. The oldest round holds every
         * worker's window (self-clocking): when a resend of it was lost too, nothing later may
         * ever be answered (the peers cannot send past it), so only resending it unblocks them.
         * The latest one's answer lets RACK judge the ones before it. A peer that is only slow
         * makes a shard silent too: each unanswered probe doubles the wait. */
        double pto = pn_probe_wait(&st->rec, now, s->probes);
        double probe_at = s->last_activity + pto;
        if (latest && now >= probe_at) {
            if (oldest != latest) retransmit(st, s, oldest, now, 0);
            retransmit(st, s, latest, now, 0);
            s->probes++;
            probe_at = now + 2 * pto;
        }
        if (probe_at < next) next = probe_at;
    }
    *next_deadline = next;
    return PN_OK;
}

static void free_state(stream_state *st) {
    if (st->shards) {
        for (uint32_t k = 0; k < st->c->shards; k++) {
            free(st->shards[k].packets);
            free(st->shards[k].slots);
        }
    }
    free(st->shards);
    pn_send_queue_free(&st->sends);
    pn_udp_free(&st->udp);
}

static int validate(const pn_stream_call *c, const pn_stream_report *r) {
    if (!c || !r || !r->overflow || c->fd < 0 || c->lanes == 0 || c->lanes > 16000 || c->shards == 0 ||
        c->job > 0xFFFF || c->generation >= PN_GENERATIONS || c->worker >= PN_MAX_WORKERS ||
        (c->op != PN_OP_SUM && c->op != PN_OP_MAX) || (c->kind != PN_IN_F32 && c->kind != PN_IN_I32) ||
        !c->aggregator || !c->pool || !c->next_psn || !c->start || !c->count || !c->srtt || !c->rttvar ||
        !c->last_loss ||
        !c->rng || !(c->timeout > 0) || !(c->rto_min > 0) || !(c->max_rto >= c->rto_min) || c->drop < 0 ||
        c->drop >= 1 || !(c->silence >= 0) || (c->silence > 0 && (!c->on_silence || !(c->silence_every > 0))))
        return PN_EINVAL;
    if (c->elements && (!c->input || !c->output)) return PN_EINVAL;
    if (!c->early_count || (c->early_cap && (!c->early || !c->early_source)) || *c->early_count > c->early_cap)
        return PN_EINVAL;
    /* an OWNER_ONLY round's owner: 7 bits on the wire (a worker, or a server's number in a tree across racks) */
    if (c->owner_packets && c->elements &&
        ((c->elements + c->lanes - 1) / c->lanes - 1) / c->owner_packets >= PN_OWNERS)
        return PN_EINVAL;
    if (c->kind == PN_IN_F32 && !c->scale) return PN_EINVAL;
    for (uint32_t k = 0; k < c->shards; k++) {
        if (c->pool[k] == 0 || c->pool[k] > 65536) return PN_EINVAL;
        /* every packet of the shard lies inside the (padded) array */
        if (c->count[k] && (c->start[k] + c->count[k]) * c->lanes > c->elements + c->lanes - 1) return PN_EINVAL;
        if (c->count[k] > 0x7FFFFFFF) return PN_EINVAL; /* psns of one call stay in serial-number range */
    }
    return PN_OK;
}

int pn_stream_run(pn_stream_call *c, pn_stream_report *r) {
    int rc = validate(c, r);
    if (rc != PN_OK) return rc;
    stream_state st = {.c = c, .r = r, .packet_size = pn_packet_size(c->lanes),
                       .rec = {.srtt = *c->srtt, .rttvar = *c->rttvar, .last_loss = *c->last_loss,
                               .rto_min = c->rto_min, .max_rto = c->max_rto}};
    st.udp.fd = -1;
    uint64_t window = 0;
    st.shards = calloc(c->shards, sizeof *st.shards);
    if (!st.shards) return PN_ENOMEM;
    for (uint32_t k = 0; k < c->shards; k++) {
        shard_state *s = &st.shards[k];
        s->pool = c->pool[k];
        s->start = c->start[k];
        s->count = c->count[k];
        s->base = c->next_psn[k];
        s->aggregator = c->aggregator[k];
        s->base_round = s->base / s->pool;
        s->base_slot = (uint32_t)(s->base % s->pool);
        if (c->kind == PN_IN_F32) s->scale = pn_scale_of(c->scale[k]);
        if (s->count == 0) continue;
        s->packets = malloc((size_t)s->pool * st.packet_size);
        s->slots = calloc(s->pool, sizeof *s->slots);
        if (!s->packets || !s->slots) {
            free_state(&st);
            return PN_ENOMEM;
        }
        window += s->pool;
    }
    /* a slot is queued at most twice per loop iteration (its first transmission, then a resend) */
    int queued = pn_send_queue_init(&st.sends, (uint32_t)(2 * window + 2));
    int u = pn_udp_init(&st.udp, c->fd, (uint32_t)st.packet_size, RECV_BATCH, c->gso);
    if (u == 0) u = pn_udp_use_xsk(&st.udp, c->xsk);
    if (!queued || u < 0) {
        free_state(&st);
        return u == -ENOMEM || u == 0 ? PN_ENOMEM : PN_EINVAL;
    }

    double now = pn_now();
    uint64_t remaining = 0;
    for (uint32_t k = 0; k < c->shards; k++) {
        shard_state *s = &st.shards[k];
        remaining += s->count;
        for (uint32_t i = 0; i < s->pool; i++) send_first(&st, s, i, i, now);
    }
    rc = flush_sends(&st);
    uint32_t capacity = pn_udp_capacity(&st.udp);
    pn_datagram *got = malloc(capacity * sizeof *got);
    if (!got) rc = PN_ENOMEM;
    /* the first wake-up: the first probe's time (a call of one packet, such as the MAX round,
     * has nothing else to tell a loss) */
    double next_deadline = now;  /* the loop computes the first probe's time before it waits */
    double last_answer = now; /* the latest RESULT that answered a packet (or the call's start) */
    double silence_check = now + c->silence;
    while (rc == PN_OK && remaining) {
        int n = pn_wait_and_receive(&st.udp, next_deadline - pn_now(), got, capacity, r);
        if (n < 0) {
            rc = PN_ESYS;
            break;
        }
        now = pn_now();
        for (int i = 0; i < n; i++) {
            r->packets_received++;
            r->bytes_received += got[i].length;
            if (c->drop > 0 && pn_uniform(c->rng) < c->drop) continue; /* test impairment: lost on the way in */
            if (process_datagram(&st, &got[i], now)) {
                remaining--;
                last_answer = now;
            }
        }
        if (remaining == 0) break;
        rc = check_timers(&st, now, &next_deadline);
        if (rc != PN_OK) break;
        if (c->silence > 0) {
            if (pn_silence_gives_up(c->silence, c->silence_every, c->on_silence, c->silence_ctx, now, last_answer,
                                 &silence_check)) {
                rc = PN_ESILENT;
                break;
            }
            if (silence_check < next_deadline) next_deadline = silence_check;
        }
        rc = flush_sends(&st);
    }
    if (rc == PN_OK) {
        if (st.sends.count) rc = flush_sends(&st);
        for (uint32_t k = 0; k < c->shards; k++) c->next_psn[k] = st.shards[k].base + st.shards[k].count;
    }
    free(got);
    *c->last_loss = st.rec.last_loss;
    *c->srtt = st.rec.srtt;
    *c->rttvar = st.rec.rttvar;
    c->gso = st.udp.gso;
    r->gso_fallbacks += st.udp.gso_fallbacks;
    free_state(&st);
    return rc;
}
