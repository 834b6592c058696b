/* The aggregation state machine (docs/protocol.md), packet by packet in arrival order.
 * passing/aggregator/engine.py's AggregationEngine is the specification: the same admission,
 * the same slot/set state, the same counters and byte-identical RESULTs, in the same order:
 * the arrival order of the packets that caused them (a completion's replicas in worker order).
 * GATHER and NACK packets are relayed without state; an OWNER_ONLY round answers its
 * non-owners with ACKs (docs/protocol.md, Kinds). A job may be a leaf or the root of a two-level
 * tree (docs/protocol.md, "Trees across racks"): a leaf sends a complete round's partial up and
 * delivers its root's answer; a root's workers are leaves. Owners go through each job's owner map.
 *
 * Every job has a lane count of its own (at most the engine's, the width of a slot): its
 * packets are that long, and it uses that many accumulators of each of its slots.
 *
 * Datagrams are untrusted: every length is checked before a byte is read, and anything
 * that does not parse is a counted drop.
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "engine.h"
#include "engine_state.h"

/* Where a call's datagrams are: at a fixed stride, or scattered (the server's). */
typedef struct {
    const uint8_t *base;
    size_t stride;
    const uint8_t *const *packets;
    const uint32_t *lengths;
    const int64_t *sources;
} batch_input;

typedef struct {
    uint8_t *packets;          /* rows of the engine's packet_size */
    int64_t *dest;
    uint8_t *multicast;
    uint32_t *length;          /* each RESULT's bytes: its job's packet size */
    size_t cap, count;
} batch_output;

/* ---- data path ---------------------------------------------------------------------- */

static void count(pn_engine *e, job_entry *j, int counter, int64_t n) {
    j->counters[counter] += n;
    e->totals[counter] += n;
}

/* The lane loops (vectorized: PN_LANE_LOOP). A slot's accumulators are in host order. */

/* The first packet of a round: its lanes become the accumulators. */
PN_LANE_LOOP static void lanes_load(int32_t *restrict acc, const uint8_t *restrict packet, uint32_t n) {
    for (uint32_t i = 0; i < n; i++) acc[i] = pn_lane_get(packet, i);
}

/* acc += lanes, saturating at the int32 limits; returns whether any lane saturated. The
 * overflow test and the select are on bits (two's complement wrap-around in unsigned), so
 * the loop has no branch to keep it from vectorizing. */
PN_LANE_LOOP static int lanes_add(int32_t *restrict acc, const uint8_t *restrict packet, uint32_t n) {
    uint32_t saturated = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t a = (uint32_t)acc[i], b = (uint32_t)pn_lane_get(packet, i), sum = a + b;
        uint32_t over = -(((a ^ sum) & (b ^ sum)) >> 31);  /* all ones when the sign flipped */
        uint32_t limit = (uint32_t)INT32_MAX + (a >> 31);   /* INT32_MIN's bits for negative a */
        acc[i] = (int32_t)((sum & ~over) | (limit & over));
        saturated |= over;
    }
    return saturated != 0;
}

PN_LANE_LOOP static void lanes_max(int32_t *restrict acc, const uint8_t *restrict packet, uint32_t n) {
    for (uint32_t i = 0; i < n; i++) {
        int32_t v = pn_lane_get(packet, i);
        acc[i] = v > acc[i] ? v : acc[i];
    }
}

PN_LANE_LOOP static void lanes_store(uint8_t *restrict packet, const int32_t *restrict acc, uint32_t n) {
    for (uint32_t i = 0; i < n; i++) pn_lane_set(packet, i, acc[i]);
}

/* One RESULT of the round in slot/set k, caused by the packet with header h, for worker w: an
 * ACK (the header alone) when the round is OWNER_ONLY and w is not its owner (the job's owner map),
 * or when the slot holds a leaf's partial that its root answered with an ACK. Its lanes are those of
 * `same` (a RESULT of the same round just emitted) when given. Returns its row. */
static const uint8_t *emit(pn_engine *e, batch_output *o, const job_entry *j, const pn_header *h, size_t k,
                           uint32_t w, int multicast, const uint8_t *same) {
    uint8_t *p = o->packets + o->count * e->packet_size;
    int owner_only = (h->flags & PN_FLAG_OWNER_ONLY) != 0;
    int ack = (owner_only && (int)w != j->owners[h->owner]) || e->phase[k] == 2;
    pn_header r = *h;  /* op, slot, owner, set, psn: the causing packet's */
    r.version = PN_VERSION;
    r.type = ack ? PN_ACK : PN_RESULT;
    r.job = (uint16_t)j->job;  /* a leaf's answer from its root goes out with the leaf's own */
    r.generation = (uint16_t)j->generation;
    r.flags = (uint8_t)((e->overflow[k] ? PN_FLAG_OVERFLOW : 0) |
                        (j->role == PN_ROLE_ROOT && owner_only ? PN_FLAG_OWNER_ONLY : 0));  /* down to a leaf: kept */
    r.worker = (uint8_t)w;
    pn_header_encode(p, &r);
    if (ack)
        ;  /* the header alone */
    else if (same)
        memcpy(p + PN_HEADER_SIZE, same + PN_HEADER_SIZE, 4 * (size_t)j->lanes);
    else
        lanes_store(p, e->acc + k * e->lanes, j->lanes);
    o->dest[o->count] = j->sources[w];
    o->multicast[o->count] = (uint8_t)multicast;
    o->length[o->count] = ack ? PN_HEADER_SIZE : (uint32_t)j->packet_size;
    o->count++;
    return p;
}

/* Every worker's answer of the round in slot/set k (replication id = worker). */
static void multicast(pn_engine *e, batch_output *o, job_entry *j, const pn_header *h, size_t k) {
    count(e, j, PN_C_RESULTS_SENT, j->workers);
    const uint8_t *with_lanes = NULL;  /* the first RESULT of the completion (ACKs have no lanes) */
    for (uint32_t w = 0; w < j->workers; w++) {
        const uint8_t *row = emit(e, o, j, h, k, w, 1, with_lanes);
        if (!with_lanes && row[1] == PN_RESULT) with_lanes = row;
    }
}

/* A leaf's partial of the round in slot/set k up to its root, as one DATA (docs/protocol.md, "Trees across
 * racks"): the round's op, slot, owner, set and psn; the uplink's job, generation and worker; OVERFLOW of the
 * partial, the OWNER_ONLY of the packet that sent it, RETRANSMIT on a re-send. */
static void send_up(pn_engine *e, batch_output *o, job_entry *j, const pn_header *h, size_t k, int resent) {
    uint8_t *p = o->packets + o->count * e->packet_size;
    pn_header r = *h;
    r.version = PN_VERSION;
    r.type = PN_DATA;
    r.job = (uint16_t)j->up_job;
    r.generation = (uint16_t)j->up_generation;
    r.worker = (uint8_t)j->up_worker;
    r.flags = (uint8_t)((e->overflow[k] ? PN_FLAG_OVERFLOW : 0) | (h->flags & PN_FLAG_OWNER_ONLY) |
                        (resent ? PN_FLAG_RETRANSMIT : 0));
    pn_header_encode(p, &r);
    lanes_store(p, e->acc + k * e->lanes, j->lanes);
    o->dest[o->count] = j->up_source;
    o->multicast[o->count] = 0;
    o->length[o->count] = (uint32_t)j->packet_size;
    o->count++;
    count(e, j, PN_C_SENT_UP, 1);
}

/* A copy of a relayed packet with the job, generation and worker of the hop it takes. */
static void relay_copy(pn_engine *e, batch_output *o, const job_entry *j, const uint8_t *packet, uint32_t job,
                       uint32_t generation, uint32_t w, int64_t dest, int multicast) {
    uint8_t *p = o->packets + o->count * e->packet_size;
    memcpy(p, packet, j->packet_size);
    p[4] = (uint8_t)(job >> 8);  /* the header's job, worker and generation bytes (docs/protocol.md) */
    p[5] = (uint8_t)job;
    p[8] = (uint8_t)w;
    p[10] = (uint8_t)(generation >> 8);
    p[11] = (uint8_t)generation;
    o->dest[o->count] = dest;
    o->multicast[o->count] = (uint8_t)multicast;
    o->length[o->count] = (uint32_t)j->packet_size;
    o->count++;
}

/* An admitted GATHER or NACK: no state; a replica for each receiver (a GATHER's: every worker
 * but its sender, in worker order; a NACK's: its owner's worker), the packet as sent but for `worker`,
 * the receiver's, and the job's own job id and generation. At a leaf a host's GATHER, and a NACK to
 * another rack, also go up (after the replicas); what came down (`down`) goes to every server here. */
static void relay(pn_engine *e, job_entry *j, const pn_header *h, const uint8_t *packet, batch_output *o,
                  int down) {
    int owner = j->owners[h->owner];
    count(e, j, PN_C_RELAYED, 1);
    if (h->type == PN_GATHER) {
        for (uint32_t w = 0; w < j->workers; w++) {
            if (!down && w == h->worker) continue;
            relay_copy(e, o, j, packet, j->job, j->generation, w, j->sources[w], 1);
            count(e, j, PN_C_RESULTS_SENT, 1);
        }
    } else if (owner >= 0) {
        relay_copy(e, o, j, packet, j->job, j->generation, (uint32_t)owner, j->sources[owner], 1);
        count(e, j, PN_C_RESULTS_SENT, 1);
    }
    if (!down && j->role == PN_ROLE_LEAF && (h->type == PN_GATHER || owner == PN_OWNER_UP)) {
        relay_copy(e, o, j, packet, j->up_job, j->up_generation, j->up_worker, j->up_source, 0);
        count(e, j, PN_C_SENT_UP, 1);
    }
}

/* The state machine for one admitted DATA packet in slot/set k. */
static void apply(pn_engine *e, job_entry *j, const pn_header *h, const uint8_t *packet, size_t k,
                  batch_output *o) {
    uint32_t wbit = UINT32_C(1) << h->worker;
    int same_epoch = e->epoch[k] == j->epoch;
    uint32_t ahead = h->psn - e->tag[k];  /* serial-number distance to the slot's round */
    int flagged = (h->flags & PN_FLAG_OVERFLOW) != 0;
    int32_t *acc = e->acc + k * e->lanes;

    if (!same_epoch || (ahead != 0 && ahead < UINT32_C(1) << 31)) {
        /* a new round: the first write resets the slot/set, no separate clearing pass */
        lanes_load(acc, packet, j->lanes);
        e->tag[k] = h->psn;
        e->epoch[k] = j->epoch;
        e->bitmap[k] = wbit;
        e->overflow[k] = (uint8_t)flagged;
        e->phase[k] = 0;
        count(e, j, PN_C_AGGREGATED, 1);
        if (flagged) count(e, j, PN_C_OVERFLOW, 1);
    } else if (ahead != 0) {
        count(e, j, PN_C_STALE, 1);
        return;
    } else if (e->bitmap[k] & wbit) {
        if (e->bitmap[k] != j->full) {
            count(e, j, PN_C_DUPLICATE, 1);
        } else if (j->role == PN_ROLE_LEAF && e->phase[k] == 0) {  /* no answer from the root yet: up again */
            count(e, j, PN_C_DUPLICATE, 1);
            send_up(e, o, j, h, k, 1);
        } else {
            count(e, j, PN_C_DUPLICATE_ANSWERED, 1);
            count(e, j, PN_C_RESULTS_SENT, 1);
            emit(e, o, j, h, k, h->worker, 0, NULL);
        }
        return;
    } else {
        int saturated = 0;
        if (h->op == PN_OP_MAX)
            lanes_max(acc, packet, j->lanes);
        else  /* any other op sums, as in the numpy engine */
            saturated = lanes_add(acc, packet, j->lanes);
        e->bitmap[k] |= wbit;
        e->overflow[k] |= (uint8_t)(flagged | saturated);
        count(e, j, PN_C_AGGREGATED, 1);
        if (flagged || saturated) count(e, j, PN_C_OVERFLOW, 1);
    }
    if (e->bitmap[k] == j->full) {  /* complete: every worker's answer, or a leaf's partial up */
        count(e, j, PN_C_COMPLETED, 1);
        if (j->role == PN_ROLE_LEAF) {
            send_up(e, o, j, h, k, 0);
        } else {
            e->phase[k] = 1;
            multicast(e, o, j, h, k);
        }
    }
}

/* A leaf's RESULT or ACK from its root, for slot/set k: the answer of a round complete here and waiting for
 * it (a RESULT's sums replace the partial, either answer's flag the partial's: the whole round's), multicast
 * to the leaf's servers; anything else is late. */
static void answer(pn_engine *e, job_entry *j, const pn_header *h, const uint8_t *packet, size_t k,
                   batch_output *o) {
    if (e->epoch[k] != j->epoch || e->tag[k] != h->psn || e->bitmap[k] != j->full || e->phase[k] != 0) {
        count(e, j, PN_C_LATE_ANSWER, 1);
        return;
    }
    count(e, j, PN_C_ANSWERED, 1);
    e->overflow[k] = (h->flags & PN_FLAG_OVERFLOW) != 0;
    if (h->type == PN_RESULT) {
        lanes_load(e->acc + k * e->lanes, packet, j->lanes);
        e->phase[k] = 1;
    } else {
        e->phase[k] = 2;
    }
    multicast(e, o, j, h, k);
}

/* Admission of a packet that came down to leaf j from its root (docs/protocol.md, "Trees across racks"). */
static int down_admitted(const job_entry *j, const pn_header *h, uint32_t length, int64_t source) {
    int owner = j->owners[h->owner];
    int ok = h->generation == j->up_generation && h->worker == j->up_worker && source == j->up_source &&
             (h->type == PN_ACK || length == j->packet_size);
    if (h->type == PN_RESULT || h->type == PN_ACK) ok = ok && h->slot < j->pool;
    if (h->type == PN_GATHER) ok = ok && owner == PN_OWNER_UP;
    if (h->type == PN_NACK || (h->type == PN_RESULT && (h->flags & PN_FLAG_OWNER_ONLY))) ok = ok && owner >= 0;
    return ok;
}

/* Admission of a packet of job j from a host (or, at a root, from a leaf). */
static int admitted_up(const job_entry *j, const pn_header *h, uint32_t length, int64_t source) {
    int owner = j->owners[h->owner];
    int ok = h->generation == j->generation && h->worker < j->workers && j->sources[h->worker] == source &&
             length == j->packet_size;
    if (h->type == PN_DATA)  /* a relayed kind's slot is no slot */
        return ok && h->slot < j->pool &&
               (!(h->flags & PN_FLAG_OWNER_ONLY) || owner >= 0 || owner == PN_OWNER_UP);
    if (h->type == PN_GATHER)  /* a piece of the sender's own */
        return ok && owner == (int)h->worker;
    /* a NACK, to another worker of the job (or up, at a leaf) */
    return ok && owner != (int)h->worker && (owner >= 0 || owner == PN_OWNER_UP);
}

static size_t run(pn_engine *e, const batch_input *in, size_t n, batch_output *o) {
    size_t i = 0;
    for (; i < n; i++) {
        const uint8_t *packet = in->packets ? in->packets[i] : in->base + i * in->stride;
        uint32_t length = in->lengths[i];
        size_t readable = in->packets ? length : (length < in->stride ? length : in->stride);
        pn_header h;
        job_entry *j = NULL;
        int down = 0, well_formed = 0;
        /* a header, all of the datagram readable (a longer one was cut short), no longer than the widest packet */
        if (length >= PN_HEADER_SIZE && length <= e->packet_size && readable >= length) {
            /* a whole packet of 1 .. the engine's lanes */
            int whole = length >= PN_HEADER_SIZE + 4 && (length - PN_HEADER_SIZE) % 4 == 0;
            pn_header_decode(packet, &h);
            uint32_t up = e->up_dense[h.job];
            job_entry *leaf = up != NO_JOB ? &e->jobs[up - 1] : NULL;
            int relayed = h.type == PN_GATHER || h.type == PN_NACK;
            /* what comes down from a root: a RESULT or ACK comes from nowhere else */
            down = h.type == PN_RESULT || h.type == PN_ACK || (relayed && leaf && leaf->up_source == in->sources[i]);
            if (down)
                well_formed = leaf && (h.type == PN_ACK ? length == PN_HEADER_SIZE : whole);
            else
                well_formed = whole && (h.type == PN_DATA || relayed);
            well_formed = well_formed && h.version == PN_VERSION;
            if (well_formed) j = down ? leaf : e->dense[h.job] != NO_JOB ? &e->jobs[e->dense[h.job] - 1] : NULL;
        }
        /* stop before a packet whose RESULTs might not fit */
        if (j && o->cap - o->count < j->workers) break;
        if (!well_formed) {  /* not a PASSING packet: not `received` (a switch counts it so too) */
            e->totals[PN_C_MALFORMED]++;
            continue;
        }
        e->totals[PN_C_RECEIVED]++;
        if (!j) {
            e->totals[PN_C_REJECTED]++;  /* no job to charge it to */
            continue;
        }
        if (!(down ? down_admitted(j, &h, length, in->sources[i]) : admitted_up(j, &h, length, in->sources[i]))) {
            count(e, j, PN_C_REJECTED, 1);
            continue;
        }
        if (h.type == PN_GATHER || h.type == PN_NACK) {
            relay(e, j, &h, packet, o, down);
            continue;
        }
        size_t k = ((size_t)j->base + h.slot) * 2 + (h.set & 1);
        if (down)
            answer(e, j, &h, packet, k, o);
        else
            apply(e, j, &h, packet, k, o);
    }
    return i;
}

uint32_t *pn_stable_order(const int64_t *key, uint32_t *a, uint32_t *b, size_t n) {
    for (size_t width = 1; width < n; width *= 2) {
        for (size_t lo = 0; lo < n; lo += 2 * width) {
            size_t mid = lo + width < n ? lo + width : n;
            size_t hi = lo + 2 * width < n ? lo + 2 * width : n;
            size_t l = lo, r = mid, t = lo;
            while (l < mid && r < hi) b[t++] = key[a[r]] < key[a[l]] ? a[r++] : a[l++];
            while (l < mid) b[t++] = a[l++];
            while (r < hi) b[t++] = a[r++];
        }
        uint32_t *swap = a;
        a = b;
        b = swap;
    }
    return a;
}

size_t pn_engine_process(pn_engine *e, const uint8_t *in, size_t in_stride, const uint32_t *lengths,
                         const int64_t *sources, size_t n, uint8_t *out, int64_t *out_dest, uint8_t *out_multicast,
                         uint32_t *out_length, size_t out_cap, size_t *emitted) {
    if (emitted) *emitted = 0;
    if (!e || !emitted || n == 0 || !in || !lengths || !sources) return 0;
    if (out_cap > 0 && (!out || !out_dest || !out_multicast || !out_length)) return 0;
    pthread_mutex_lock(&e->lock);
    batch_input input = {.base = in, .stride = in_stride, .lengths = lengths, .sources = sources};
    batch_output o = {.packets = out, .dest = out_dest, .multicast = out_multicast, .length = out_length,
                      .cap = out_cap};
    size_t consumed = run(e, &input, n, &o);
    pthread_mutex_unlock(&e->lock);
    *emitted = o.count;
    return consumed;
}

size_t pn_engine_process_locked(pn_engine *e, const uint8_t *const *packets, const uint32_t *lengths,
                                const int64_t *sources, size_t n, uint8_t *out, int64_t *out_dest,
                                uint8_t *out_multicast, uint32_t *out_length, size_t out_cap, size_t *emitted) {
    batch_input input = {.packets = packets, .lengths = lengths, .sources = sources};
    batch_output o = {.packets = out, .dest = out_dest, .multicast = out_multicast, .length = out_length,
                      .cap = out_cap};
    size_t consumed = run(e, &input, n, &o);
    *emitted = o.count;
    return consumed;
}
