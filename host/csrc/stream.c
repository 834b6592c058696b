/* The host streaming engine: one allreduce pass of a group's array through its
 * aggregators (passing/reduce_stream.py's ReduceStream is the specification).
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
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "passing_native.h"
#include "udp.h"

/* Loss recovery's rules (RACK, probes, the RTT estimate, the silence rule) and constants: passing/recovery.py
 * mirrors them for the numpy streams, and a change to one is a change to the other. */
#define REORDER_FRACTION 0.25 /* reordering allowance: a quarter of the round trip (RFC 8985) */
#define REORDER_MIN_S 200e-6 /* and at least this: RESULTs come in batches */
#define PROBE_MIN_S 1e-3     /* a probe waits at least this */
#define MAX_WAIT_S 0.05      /* the longest single wait: timers are checked at least this often */
#define RECV_BATCH 64        /* messages per recvmmsg */
#define SEND_TIMEOUT_MS 5000 /* a send buffer full this long is an error */
#define LOSS_MEMORY_S 10.0    /* evidence of loss this recent makes a probe wait what the estimates say */
#define MAX_PROBE_DOUBLINGS 6 /* unanswered probes double the wait, up to 64 x (and max_rto): a dead aggregator is told by `timeout` */

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
    int64_t aggregator;
    uint8_t *packets;          /* pool packets */
    window_slot *slots;
    double scale;
    int scale_f32;             /* scale is a power of two that float32 applies exactly */
    float scale_f, inverse_f;
} shard_state;

/* The sends of one loop iteration, both loops': queued, then flushed as one sendmmsg. */
typedef struct {
    const uint8_t **packets;
    int64_t *dest;
    uint32_t count, cap;
} send_queue;

typedef struct {
    const pn_stream_call *c;
    pn_stream_report *r;
    shard_state *shards;
    size_t packet_size;
    pn_udp udp;
    double srtt, rttvar;
    double last_loss;             /* when the group last saw evidence of loss (< 0: never) */
    uint64_t xmit;                /* transmissions so far */
    send_queue sends;
} stream_state;

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* Both loops' one blocking step: wait up to `wait` seconds (at most MAX_WAIT_S) for the socket, then take
 * what has arrived. Returns the datagrams received (0 when the wait ran out) or -1 with the failed call in
 * the report. */
static int wait_and_receive(pn_udp *udp, double wait, pn_datagram *got, uint32_t capacity, pn_stream_report *r) {
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

/* Failover, the same rule for the reduce and the all_gather loops (docs/control.md): once nothing
 * has been heard for `silence` seconds since `last_heard`, ask on_silence(ctx), then every
 * `silence_every` seconds while it says wait. *check is when to ask next. Returns nonzero when
 * on_silence gave the call up. */
static int silence_gives_up(double silence, double silence_every, int (*on_silence)(void *), void *ctx, double now,
                            double last_heard, double *check) {
    if (now - last_heard < silence) {
        *check = last_heard + silence;
        return 0;
    }
    if (now < *check) return 0;
    if (on_silence(ctx)) return 1;
    *check = now_s() + silence_every;
    return 0;
}

/* splitmix64: the test impairment's generator; its state lives with the caller. */
static double uniform(uint64_t *state) {
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (double)(z >> 11) * 0x1.0p-53;
}

static int send_queue_init(send_queue *q, uint32_t cap) {
    q->cap = cap;
    q->packets = malloc(cap * sizeof *q->packets);
    q->dest = malloc(cap * sizeof *q->dest);
    return q->packets && q->dest;
}

static void send_queue_free(send_queue *q) {
    free(q->packets);
    free(q->dest);
}

/* A queue is sized for every send of a loop iteration; were it ever full, the packet would be resent
 * as if it were lost. */
static void send_queue_add(send_queue *q, const uint8_t *packet, int64_t dest) {
    if (q->count == q->cap) return;
    q->packets[q->count] = packet;
    q->dest[q->count] = dest;
    q->count++;
}

/* Send what is queued (less what the test impairment `drop` loses on the way out, drawn from rng) and
 * empty the queue; the bytes and packets that left are counted in the report. */
static int send_queue_flush(send_queue *q, pn_udp *udp, size_t packet_size, double drop, uint64_t *rng,
                            pn_stream_report *r) {
    uint32_t n = 0;
    for (uint32_t i = 0; i < q->count; i++) {
        if (drop > 0 && uniform(rng) < drop) continue;
        q->packets[n] = q->packets[i];
        q->dest[n] = q->dest[i];
        n++;
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

static int flush_sends(stream_state *st) {
    return send_queue_flush(&st->sends, &st->udp, st->packet_size, st->c->drop, st->c->rng, st->r);
}

static int scale_is_f32_exact(double scale) {
    int exponent;
    double mantissa = frexp(scale, &exponent);
    return mantissa == 0.5 && exponent > -120 && exponent < 120;
}

/* Round x * scale to int32, saturating (passing/quantize.py: the same arithmetic, bit for
 * bit). A NaN or an infinity becomes 0 and counts as saturated (the stream restores IEEE
 * semantics from a class round). Returns 1 when the value saturated. */
static int quantize(float x, const shard_state *s, int32_t *out) {
    if (!isfinite(x)) {
        *out = 0;
        return 1;
    }
    if (s->scale_f32) {
        float v = rintf(x * s->scale_f);
        if (v >= 2147483648.0f || v < -2147483648.0f || isnan(v)) {
            *out = isnan(v) ? 0 : (v > 0 ? INT32_MAX : INT32_MIN);
            return 1;
        }
        *out = (int32_t)v;
        return 0;
    }
    double v = rint((double)x * s->scale);
    if (v >= 2147483648.0 || v < -2147483648.0 || isnan(v)) {
        *out = isnan(v) ? 0 : (v > 0 ? INT32_MAX : INT32_MIN);
        return 1;
    }
    *out = (int32_t)v;
    return 0;
}

static uint32_t float_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* The common case: x * scale (exact in float32: scale is a power of two), rounded half to
 * even, to big-endian int32 lanes, without a branch or a libm call. Adding and taking away
 * 2^23 rounds |v| < 2^23 in the default rounding mode (IEEE: no compiler may fold it); from
 * 2^23 on every float32 is an integer. The selects are on bits, so the loop has no control
 * flow to keep it from vectorizing. Returns 0 when a value is not finite or falls outside
 * int32 (converted as 0 here, never out of range): the caller then redoes the packet with
 * quantize(), which saturates and flags. */
PN_LANE_LOOP static int quantize_f32_fast(const float *restrict x, uint32_t n, float scale, uint8_t *restrict packet) {
    uint32_t bad = 0;
    for (uint32_t i = 0; i < n; i++) {
        float v = x[i] * scale;
        float a = fabsf(v);
        float rounded = (a + 8388608.0f) - 8388608.0f;
        uint32_t small = -(uint32_t)(a < 8388608.0f);
        uint32_t fits = -(uint32_t)(a < 2147483648.0f); /* 0 for NaN too */
        uint32_t magnitude = (float_bits(rounded) & small) | (float_bits(a) & ~small);
        uint32_t bits = (magnitude | (float_bits(v) & 0x80000000u)) & fits;
        float r;
        memcpy(&r, &bits, sizeof r);
        bad |= ~fits;
        pn_lane_set(packet, i, (int32_t)r);
    }
    return bad == 0;
}

PN_LANE_LOOP uint32_t pn_max_abs_bits(const float *x, size_t n, int finite_only) {
    uint32_t most = 0;
    if (finite_only) {
        for (size_t i = 0; i < n; i++) {
            uint32_t b = float_bits(x[i]) & 0x7FFFFFFFu;
            b = b < 0x7F800000u ? b : 0;
            most = b > most ? b : most;
        }
    } else {
        for (size_t i = 0; i < n; i++) {
            uint32_t b = float_bits(x[i]) & 0x7FFFFFFFu;
            most = b > most ? b : most;
        }
    }
    return most > 0x7F800000u ? 0x7FC00000u : most;
}

PN_LANE_LOOP static int saturated_lanes(const uint8_t *packet, uint32_t n) {
    int saturated = 0;
    for (uint32_t i = 0; i < n; i++) {
        int32_t v = pn_lane_get(packet, i);
        saturated |= (v == INT32_MAX) | (v == INT32_MIN);
    }
    return saturated;
}

/* Lanes to floats: one rounding either way (passing/quantize.py's dequantize). */
PN_LANE_LOOP static void dequantize_lanes(const uint8_t *restrict packet, uint32_t n, const shard_state *s,
                                       float *restrict out) {
    if (s->scale_f32) {
        for (uint32_t i = 0; i < n; i++) out[i] = (float)pn_lane_get(packet, i) * s->inverse_f;
    } else {
        for (uint32_t i = 0; i < n; i++) out[i] = (float)((double)pn_lane_get(packet, i) / s->scale);
    }
}

PN_LANE_LOOP static void read_lanes(const uint8_t *restrict packet, uint32_t n, int32_t *restrict out) {
    for (uint32_t i = 0; i < n; i++) out[i] = pn_lane_get(packet, i);
}

/* Build packet `offset` of shard s into its window slot. */
static uint8_t *build_packet(stream_state *st, shard_state *s, uint64_t offset) {
    const pn_stream_call *c = st->c;
    uint8_t *p = s->packets + (size_t)(offset % s->pool) * st->packet_size;
    uint64_t row = s->start + offset;
    uint64_t first = row * c->lanes;
    uint32_t full = first + c->lanes <= c->elements ? c->lanes : (uint32_t)(c->elements - first);
    int saturated = 0;
    if (c->kind != PN_IN_F32 || !s->scale_f32 ||
        !quantize_f32_fast((const float *)c->input + first, full, s->scale_f, p)) {
        for (uint32_t i = 0; i < full; i++) {
            int32_t q;
            if (c->kind == PN_IN_F32) saturated |= quantize(((const float *)c->input)[first + i], s, &q);
            else q = ((const int32_t *)c->input)[first + i];
            pn_lane_set(p, i, q);
        }
    }
    memset(p + PN_HEADER_SIZE + 4 * (size_t)full, 0, 4 * (size_t)(c->lanes - full)); /* the last packet's padding */
    uint64_t position = s->base + offset;
    pn_header h = {
        .version = PN_VERSION, .type = PN_DATA, .op = (uint8_t)c->op,
        .flags = (uint8_t)((saturated ? PN_FLAG_OVERFLOW : 0) | (c->owner_packets ? PN_FLAG_OWNER_ONLY : 0)),
        .job = (uint16_t)c->job, .slot = (uint16_t)(position % s->pool), .worker = (uint8_t)c->worker,
        .owner = (uint8_t)(c->owner_packets ? row / c->owner_packets : 0),
        .set = (uint8_t)((position / s->pool) % 2), .generation = (uint16_t)c->generation, .psn = (uint32_t)position,
    };
    pn_header_write(p, &h);
    return p;
}

/* First transmission of packet `offset` of the shard (its window slot is free), if it exists. */
static void send_first(stream_state *st, shard_state *s, uint64_t offset, double now) {
    if (offset >= s->count) return;
    s->sent++;
    s->last_activity = now;
    window_slot *w = &s->slots[offset % s->pool];
    *w = (window_slot){.offset = offset, .xmit = ++st->xmit, .first_sent = now, .last_sent = now, .inflight = 1};
    send_queue_add(&st->sends, build_packet(st, s, offset), s->aggregator);
}

/* Resend a packet: early (RACK: a later packet was answered, evidence of loss) or as a probe (silence). */
static void retransmit(stream_state *st, shard_state *s, window_slot *w, double now, int early) {
    if (early) st->last_loss = now;
    uint8_t *p = s->packets + (size_t)(w->offset % s->pool) * st->packet_size;
    p[3] |= PN_FLAG_RETRANSMIT;
    w->retries++;
    w->last_sent = now;
    w->xmit = ++st->xmit;
    s->last_activity = now;
    st->r->retransmissions++;
    if (early) st->r->early_retransmissions++;
    send_queue_add(&st->sends, p, s->aggregator);
}

/* Two smoothed round trips (RFC 8985's PTO; rto_min before one is measured), 1 ms at least. */
static double probe_timeout(const stream_state *st) {
    double pto = st->srtt < 0 ? st->c->rto_min : 2.0 * st->srtt;
    return pto > PROBE_MIN_S ? pto : PROBE_MIN_S;
}

/* How long a shard may stay silent before a probe: a probe's wait where the path has lately
 * shown loss, else rto_min at least (a late peer, not a loss). */
static double silence_timeout(const stream_state *st, double now) {
    double wait = probe_timeout(st);
    int quiet = st->last_loss < 0 || now - st->last_loss > LOSS_MEMORY_S;
    return quiet && wait < st->c->rto_min ? st->c->rto_min : wait;
}

/* RFC 6298 smoothing of the round-trip estimate; the first sample (srtt < 0: none yet) sets it. */
static void smooth(double *srtt, double *rttvar, double sample) {
    if (*srtt < 0) {
        *srtt = sample;
        *rttvar = sample / 2;
        return;
    }
    *rttvar = 0.75 * *rttvar + 0.25 * fabs(*srtt - sample);
    *srtt = 0.875 * *srtt + 0.125 * sample;
}

/* A datagram from the socket: a RESULT of this call goes into the output, and the window
 * moves on; so does an ACK (an OWNER_ONLY round this worker does not own: the header alone),
 * without output. Returns 1 for an answer to a packet still in flight. */
static int process_datagram(stream_state *st, const pn_datagram *d, double now) {
    const pn_stream_call *c = st->c;
    if (d->length != st->packet_size && d->length != PN_HEADER_SIZE) return 0;
    pn_header h;
    pn_header_read(d->data, &h);
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
        uint64_t offset = (uint32_t)(h.psn - (uint32_t)s->base);
        if (offset >= s->count) return 0; /* another call's, or from the future */
        window_slot *w = &s->slots[offset % s->pool];
        if (!w->inflight || w->offset != offset) return 0; /* answered already */
        w->inflight = 0;
        /* answered right after a resend: the resend was (most likely) needed, evidence of loss */
        if (w->retries > 0 && now - w->last_sent <= probe_timeout(st)) st->last_loss = now;
        s->done++;
        s->last_activity = now;
        s->probes = 0;
        if (w->xmit > s->rack_xmit) { /* RACK: the latest-sent packet known delivered */
            s->rack_xmit = w->xmit;
            s->rack_rtt = now - w->last_sent;
        }
        if (w->retries == 0) smooth(&st->srtt, &st->rttvar, now - w->first_sent); /* Karn: unambiguous samples only */
        if (h.flags & PN_FLAG_OVERFLOW) st->r->overflow[k] = 1;
        if (!ack) {
            uint64_t first = (s->start + offset) * c->lanes;
            uint32_t n = first + c->lanes <= c->elements ? c->lanes : (uint32_t)(c->elements - first);
            /* A SUM lane at an int32 bound is a saturated sum: Tofino saturates without the flag
             * (docs/tofino.md), so every target's is read as overflow (padding lanes too). Not in
             * OWNER_ONLY rounds: only the owner sees the sums, and the workers must agree on an
             * overflow, so there the flag alone tells (as in passing/reduce_stream.py). */
            if (c->op == PN_OP_SUM && !c->owner_packets && saturated_lanes(d->data, c->lanes)) st->r->overflow[k] = 1;
            if (c->kind == PN_IN_F32) dequantize_lanes(d->data, n, s, (float *)c->output + first);
            else read_lanes(d->data, n, (int32_t *)c->output + first);
        }
        send_first(st, s, offset + s->pool, now); /* self-clocking: this answer releases offset + pool */
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
        double wait = silence_timeout(st, now);
        double pto = wait * (double)(1u << (s->probes < MAX_PROBE_DOUBLINGS ? s->probes : MAX_PROBE_DOUBLINGS));
        double most = wait > c->max_rto ? wait : c->max_rto; /* the doublings stop at max_rto */
        if (pto > most) pto = most;
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
    send_queue_free(&st->sends);
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
    /* an OWNER_ONLY round's owner is a worker: 7 bits on the wire, at most PN_MAX_WORKERS */
    if (c->owner_packets && c->elements &&
        ((c->elements + c->lanes - 1) / c->lanes - 1) / c->owner_packets >= PN_MAX_WORKERS)
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
    stream_state st = {.c = c, .r = r, .packet_size = pn_packet_size(c->lanes), .srtt = *c->srtt,
                       .rttvar = *c->rttvar, .last_loss = *c->last_loss};
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
        if (c->kind == PN_IN_F32) {
            s->scale = c->scale[k];
            s->scale_f32 = scale_is_f32_exact(s->scale);
            s->scale_f = (float)s->scale;
            s->inverse_f = (float)(1.0 / s->scale);
        }
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
    int queued = send_queue_init(&st.sends, (uint32_t)(2 * window + 2));
    int u = pn_udp_init(&st.udp, c->fd, (uint32_t)st.packet_size, RECV_BATCH, c->gso);
    if (!queued || u < 0) {
        free_state(&st);
        return u == -ENOMEM || u == 0 ? PN_ENOMEM : PN_EINVAL;
    }

    double now = now_s();
    uint64_t remaining = 0;
    for (uint32_t k = 0; k < c->shards; k++) {
        shard_state *s = &st.shards[k];
        remaining += s->count;
        for (uint32_t i = 0; i < s->pool; i++) send_first(&st, s, i, now);
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
        int n = wait_and_receive(&st.udp, next_deadline - now_s(), got, capacity, r);
        if (n < 0) {
            rc = PN_ESYS;
            break;
        }
        now = now_s();
        for (int i = 0; i < n; i++) {
            r->packets_received++;
            r->bytes_received += got[i].length;
            if (c->drop > 0 && uniform(c->rng) < c->drop) continue; /* test impairment: lost on the way in */
            if (process_datagram(&st, &got[i], now)) {
                remaining--;
                last_answer = now;
            }
        }
        if (remaining == 0) break;
        rc = check_timers(&st, now, &next_deadline);
        if (rc != PN_OK) break;
        if (c->silence > 0) {
            if (silence_gives_up(c->silence, c->silence_every, c->on_silence, c->silence_ctx, now, last_answer,
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
    *c->last_loss = st.last_loss;
    *c->srtt = st.srtt;
    *c->rttvar = st.rttvar;
    c->gso = st.udp.gso;
    r->gso_fallbacks += st.udp.gso_fallbacks;
    free_state(&st);
    return rc;
}

/* ---- the all_gather stream (docs/protocol.md, All-gather; passing/gather_stream.py) ---- */

typedef struct {
    pn_gather_call *c;
    pn_stream_report *r;
    size_t packet_size;
    pn_udp udp;
    uint64_t *base;               /* per origin: its first row in staged */
    uint64_t *prefix;             /* per origin: how many of its packets, from its first, are held */
    uint64_t mine, sent, lacking, largest;
    uint32_t completion_psn;
    double *resent_at;            /* per packet of mine: when last sent again for a NACK */
    uint8_t *nacks;               /* one NACK per origin */
    send_queue sends;             /* everything goes to the first aggregator */
} gather_state;

static void gather_queue(gather_state *g, const uint8_t *packet) {
    send_queue_add(&g->sends, packet, g->c->aggregator);
}

static int gather_flush(gather_state *g) {
    return send_queue_flush(&g->sends, &g->udp, g->packet_size, g->c->drop, g->c->rng, g->r);
}

/* Send this worker's packets up to a window ahead of the slowest peer's prefix. */
static void gather_send_ahead(gather_state *g) {
    const pn_gather_call *c = g->c;
    uint64_t slowest = UINT64_MAX;
    for (uint32_t o = 0; o < c->workers; o++) {
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
    for (uint32_t o = 0; o < c->workers; o++) {
        if (g->prefix[o] >= c->counts[o]) continue;
        uint64_t first = g->prefix[o], run = 0;
        while (first + run < c->counts[o] && run < c->window && run < 0xFFFF && !c->have[g->base[o] + first + run]) run++;
        uint8_t *p = g->nacks + (size_t)o * g->packet_size;
        memset(p, 0, g->packet_size);
        pn_header h = {.version = PN_VERSION, .type = PN_NACK, .job = (uint16_t)c->job, .slot = (uint16_t)run,
                       .worker = (uint8_t)c->worker, .owner = (uint8_t)o, .generation = (uint16_t)c->generation,
                       .psn = (uint32_t)(c->start + first)};
        pn_header_write(p, &h);
        gather_queue(g, p);
    }
}

/* A datagram during the call: a GATHER of this call (held), of the next (kept), a NACK to this
 * worker (its packets sent again), the completion round's RESULT (returns 1). */
static int gather_datagram(gather_state *g, const pn_datagram *d, double now, double pto, int *progress) {
    pn_gather_call *c = g->c;
    if (d->length != g->packet_size || d->source != c->aggregator) return 0;
    pn_header h;
    pn_header_read(d->data, &h);
    if (h.version != PN_VERSION || h.job != c->job || h.generation != c->generation || h.worker != c->worker)
        return 0;
    uint32_t offset = h.psn - (uint32_t)c->start;
    if (h.type == PN_GATHER) {
        if (h.owner < c->workers && h.owner != c->worker && offset < c->counts[h.owner]) {
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
    } else if (h.type == PN_NACK && h.owner == c->worker) {
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
    send_queue_free(&g->sends);
    pn_udp_free(&g->udp);
}

int pn_gather_run(pn_gather_call *c, pn_stream_report *r) {
    if (!c || !r || c->fd < 0 || c->lanes == 0 || c->lanes > 16000 || c->job > 0xFFFF ||
        c->generation >= PN_GENERATIONS || c->workers == 0 || c->workers > PN_MAX_WORKERS || c->worker >= c->workers ||
        c->window == 0 || !c->counts || !c->staged || !c->have || !c->completion || !c->srtt || !c->rttvar ||
        !c->last_loss || !c->rng || !(c->timeout > 0) || !(c->rto_min > 0) || !(c->max_rto >= c->rto_min) ||
        c->drop < 0 || c->drop >= 1 || !c->early_count || (c->early_cap && (!c->early || !c->early_source)) ||
        *c->early_count > c->early_cap || (c->counts[c->worker] && !c->packets) || !(c->silence >= 0) ||
        (c->silence > 0 && (!c->on_silence || !(c->silence_every > 0))))
        return PN_EINVAL;
    gather_state g = {.c = c, .r = r, .packet_size = pn_packet_size(c->lanes)};
    g.udp.fd = -1;
    g.base = calloc(c->workers, sizeof *g.base);
    g.prefix = calloc(c->workers, sizeof *g.prefix);
    uint64_t rows = 0;
    for (uint32_t o = 0; g.base && o < c->workers; o++) {
        if (c->counts[o] > 0x7FFFFFFF) {  /* positions of one call stay in serial-number range */
            gather_free(&g);
            return PN_EINVAL;
        }
        g.base[o] = rows;
        rows += c->counts[o];
        if (c->counts[o] > g.largest) g.largest = c->counts[o];
    }
    g.mine = c->counts[c->worker];
    for (uint64_t i = 0; i < rows; i++) g.lacking += !c->have[i];
    g.completion_psn = (uint32_t)c->completion[12] << 24 | (uint32_t)c->completion[13] << 16 |
                       (uint32_t)c->completion[14] << 8 | c->completion[15];
    g.resent_at = malloc((g.mine ? g.mine : 1) * sizeof *g.resent_at);
    g.nacks = malloc((size_t)c->workers * g.packet_size);
    int queued = send_queue_init(&g.sends, (uint32_t)(2 * g.mine + c->workers + 2));
    int u = g.base && g.prefix && g.resent_at && g.nacks && queued
                ? pn_udp_init(&g.udp, c->fd, (uint32_t)g.packet_size, RECV_BATCH, c->gso) : -ENOMEM;
    if (u < 0) {
        gather_free(&g);
        return u == -ENOMEM ? PN_ENOMEM : PN_EINVAL;
    }
    for (uint64_t i = 0; i < g.mine; i++) g.resent_at[i] = -INFINITY;
    stream_state timing = {.srtt = *c->srtt, .last_loss = *c->last_loss};  /* the probe rule's inputs */
    pn_stream_call rule = {.rto_min = c->rto_min, .max_rto = c->max_rto};
    timing.c = &rule;

    uint32_t capacity = pn_udp_capacity(&g.udp);
    pn_datagram *got = malloc(capacity * sizeof *got);
    int rc = got ? PN_OK : PN_ENOMEM;
    double now = now_s(), last_activity = now, last_progress = now;
    double silence_check = now + c->silence;
    uint32_t probes = 0;
    int completion_sent = 0, done = 0;
    gather_send_ahead(&g);
    if (rc == PN_OK) rc = gather_flush(&g);
    while (rc == PN_OK && !done) {
        double wait = silence_timeout(&timing, now);
        double pto = wait * (double)(1u << (probes < MAX_PROBE_DOUBLINGS ? probes : MAX_PROBE_DOUBLINGS));
        double most = wait > c->max_rto ? wait : c->max_rto;
        if (pto > most) pto = most;
        double due = last_activity + pto;
        if (c->silence > 0 && silence_check < due) due = silence_check;
        int n = wait_and_receive(&g.udp, due - now_s(), got, capacity, r);
        if (n < 0) {
            rc = PN_ESYS;
            break;
        }
        now = now_s();
        int progress = 0;
        /* every datagram of the batch, also those after the completion RESULT: a faster peer's GATHERs
         * of the next call come right behind it (the aggregator sends in order), and dropped here they
         * would wait for a NACK, a probe's wait later (a second, at rto, on loss-free links) */
        for (int i = 0; i < n; i++) {
            r->packets_received++;
            r->bytes_received += got[i].length;
            if (c->drop > 0 && uniform(c->rng) < c->drop) continue;  /* test impairment: lost on the way in */
            int completed = gather_datagram(&g, &got[i], now, probe_timeout(&timing), &progress);
            done = done || (completed && completion_sent);
        }
        if (done) break;
        if (progress) {
            last_activity = last_progress = now;
            probes = 0;
            gather_send_ahead(&g);
        }
        if (g.lacking == 0 && !completion_sent) {
            gather_queue(&g, c->completion);
            completion_sent = 1;
            last_activity = last_progress = now;
            probes = 0;
        }
        if (now - last_progress > c->timeout) {
            r->error_psn = (uint32_t)c->start;
            rc = PN_ETIMEOUT;
            break;
        }
        if (c->silence > 0 && silence_gives_up(c->silence, c->silence_every, c->on_silence, c->silence_ctx, now,
                                               last_progress, &silence_check)) {
            rc = PN_ESILENT;
            break;
        }
        if (now >= last_activity + pto) {
            if (completion_sent) {  /* its RESULT is lost, or a peer still lacks something */
                c->completion[3] |= PN_FLAG_RETRANSMIT;
                gather_queue(&g, c->completion);
                r->retransmissions++;
            } else {
                gather_send_ahead(&g);  /* brings the prefixes up to date */
                gather_nack(&g);
            }
            probes++;
            last_activity = now;
        }
        rc = gather_flush(&g);
    }
    free(got);
    c->gso = g.udp.gso;
    r->gso_fallbacks += g.udp.gso_fallbacks;
    gather_free(&g);
    return rc;
}
