/* The aggregation state machine (docs/protocol.md), packet by packet in arrival order.
 * passing/aggregator/engine.py's AggregationEngine is the specification: the same admission,
 * the same slot/set state, the same counters and byte-identical RESULTs, in the same order:
 * the arrival order of the packets that caused them (a completion's replicas in worker order).
 * GATHER and NACK packets are relayed without state; an OWNER_ONLY round answers its
 * non-owners with ACKs (docs/protocol.md, Kinds).
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
#include "passing_native.h"

#define JOB_IDS 65536
#define NO_JOB 0              /* dense[job]: index + 1 of its entry, so that calloc means "none" */
#define NEVER_USED (-1)        /* the epoch of a slot/set no allocation has written */

typedef struct {
    int in_use;
    uint32_t job, generation, base, pool, workers;
    uint32_t lanes;            /* int32 values of its packets, at most the engine's */
    size_t packet_size;        /* its packets' (and RESULTs') bytes */
    uint32_t full;             /* bitmap with every worker's bit */
    int64_t epoch;             /* job << 16 | generation */
    int64_t sources[PN_MAX_WORKERS];
    int64_t counters[PN_COUNTERS];
} job_entry;

struct pn_engine {
    pthread_mutex_t lock;
    uint32_t slots, lanes, max_jobs; /* lanes: the widest packet, the width of a slot */
    size_t packet_size;              /* of the widest packet: the stride of RESULT rows */
    /* per slot/set, index slot * 2 + set */
    int64_t *epoch;
    uint32_t *tag, *bitmap;
    uint8_t *overflow;
    int32_t *acc;              /* lanes accumulators per slot/set */
    /* admission */
    uint32_t *dense;           /* job id -> 1 + index into jobs, or NO_JOB */
    job_entry *jobs;
    uint32_t *free_ids, free_count;
    int64_t totals[PN_COUNTERS];
};

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

static size_t checked_mul(size_t a, size_t b, int *overflowed) {
    if (a != 0 && b > SIZE_MAX / a) *overflowed = 1;
    return a * b;
}

/* ---- life cycle ------------------------------------------------------------------- */

pn_engine *pn_engine_new(uint32_t slots, uint32_t lanes, uint32_t max_jobs) {
    /* lengths are uint32: a packet must be a size they can state */
    if (slots == 0 || lanes == 0 || max_jobs == 0 || lanes > (UINT32_MAX - PN_HEADER_SIZE) / 4) return NULL;
    pn_engine *e = calloc(1, sizeof *e);
    if (!e) return NULL;
    if (pthread_mutex_init(&e->lock, NULL) != 0) {
        free(e);
        return NULL;
    }
    e->slots = slots;
    e->lanes = lanes;
    e->max_jobs = max_jobs;
    e->packet_size = pn_packet_size(lanes);
    size_t sets = (size_t)slots * 2;
    int overflowed = 0;
    size_t acc_bytes = checked_mul(checked_mul(sets, lanes, &overflowed), sizeof(int32_t), &overflowed);
    if (!overflowed) {
        e->epoch = malloc(sets * sizeof *e->epoch);
        e->tag = calloc(sets, sizeof *e->tag);
        e->bitmap = calloc(sets, sizeof *e->bitmap);
        e->overflow = calloc(sets, sizeof *e->overflow);
        e->acc = calloc(1, acc_bytes);
        e->dense = calloc(JOB_IDS, sizeof *e->dense);
        e->jobs = calloc(max_jobs, sizeof *e->jobs);
        e->free_ids = malloc((size_t)max_jobs * sizeof *e->free_ids);
    }
    if (overflowed || !e->epoch || !e->tag || !e->bitmap || !e->overflow || !e->acc || !e->dense || !e->jobs ||
        !e->free_ids) {
        pn_engine_free(e);
        return NULL;
    }
    for (size_t k = 0; k < sets; k++) e->epoch[k] = NEVER_USED;
    /* a stack of free entries, lowest on top (the numpy engine's order; not observable) */
    for (uint32_t d = 0; d < max_jobs; d++) e->free_ids[d] = max_jobs - 1 - d;
    e->free_count = max_jobs;
    return e;
}

void pn_engine_free(pn_engine *e) {
    if (!e) return;
    pthread_mutex_destroy(&e->lock);
    free(e->epoch);
    free(e->tag);
    free(e->bitmap);
    free(e->overflow);
    free(e->acc);
    free(e->dense);
    free(e->jobs);
    free(e->free_ids);
    free(e);
}

void pn_engine_lock(pn_engine *e) { pthread_mutex_lock(&e->lock); }
void pn_engine_unlock(pn_engine *e) { pthread_mutex_unlock(&e->lock); }
size_t pn_engine_packet_bytes(const pn_engine *e) { return e->packet_size; }

/* ---- admission ---------------------------------------------------------------------- */

static int add_job_locked(pn_engine *e, uint32_t job, uint32_t generation, uint32_t base, uint32_t pool,
                          uint32_t workers, const int64_t *sources, uint32_t lanes) {
    if (job >= JOB_IDS || generation >= PN_GENERATIONS || workers < 1 || workers > PN_MAX_WORKERS || !sources ||
        lanes < 1 || lanes > e->lanes)
        return PN_EINVAL;
    if (e->dense[job] != NO_JOB) return PN_EEXIST;
    for (uint32_t w = 0; w < workers; w++) {
        if (sources[w] < 0) return PN_EINVAL;
        for (uint32_t v = 0; v < w; v++)
            if (sources[v] == sources[w]) return PN_EINVAL;
    }
    if (pool < 1 || base >= e->slots || pool > e->slots - base) return PN_ERANGE;
    for (uint32_t d = 0; d < e->max_jobs; d++) {
        const job_entry *o = &e->jobs[d];
        if (o->in_use && base < o->base + o->pool && o->base < base + pool) return PN_ERANGE;
    }
    if (e->free_count == 0) return PN_EFULL;
    uint32_t d = e->free_ids[--e->free_count];
    job_entry *j = &e->jobs[d];
    memset(j, 0, sizeof *j);
    j->in_use = 1;
    j->job = job;
    j->generation = generation;
    j->base = base;
    j->pool = pool;
    j->workers = workers;
    j->lanes = lanes;
    j->packet_size = pn_packet_size(lanes);
    j->full = workers == 32 ? UINT32_MAX : (UINT32_C(1) << workers) - 1;
    j->epoch = (int64_t)job << 16 | generation;
    memcpy(j->sources, sources, workers * sizeof *sources);
    e->dense[job] = d + 1;
    return PN_OK;
}

int pn_engine_add_job(pn_engine *e, uint32_t job, uint32_t generation, uint32_t base, uint32_t pool,
                      uint32_t workers, const int64_t *sources, uint32_t lanes) {
    if (!e) return PN_EINVAL;
    pthread_mutex_lock(&e->lock);
    int rc = add_job_locked(e, job, generation, base, pool, workers, sources, lanes);
    pthread_mutex_unlock(&e->lock);
    return rc;
}

int pn_engine_remove_job(pn_engine *e, uint32_t job) {
    if (!e) return PN_EINVAL;
    if (job >= JOB_IDS) return PN_ENOENT;
    pthread_mutex_lock(&e->lock);
    int rc = PN_ENOENT;
    if (e->dense[job] != NO_JOB) {
        uint32_t d = e->dense[job] - 1;
        e->jobs[d].in_use = 0;
        e->dense[job] = NO_JOB;
        e->free_ids[e->free_count++] = d;
        rc = PN_OK;
    }
    pthread_mutex_unlock(&e->lock);
    return rc;
}

int pn_engine_counters(pn_engine *e, int64_t job, int64_t out[PN_COUNTERS]) {
    if (!e || !out) return PN_EINVAL;
    if (job >= JOB_IDS) return PN_ENOENT;
    pthread_mutex_lock(&e->lock);
    int rc = PN_OK;
    if (job < 0) {
        memcpy(out, e->totals, sizeof e->totals);
    } else if (e->dense[job] == NO_JOB) {
        rc = PN_ENOENT;
    } else {
        memcpy(out, e->jobs[e->dense[job] - 1].counters, sizeof e->totals);
    }
    pthread_mutex_unlock(&e->lock);
    return rc;
}

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
 * ACK (the header alone) when the round is OWNER_ONLY and w is not its owner. Its lanes are
 * those of `same` (a RESULT of the same round just emitted) when given. Returns its row. */
static const uint8_t *emit(pn_engine *e, batch_output *o, const job_entry *j, const pn_header *h, size_t k,
                           uint32_t w, int multicast, const uint8_t *same) {
    uint8_t *p = o->packets + o->count * e->packet_size;
    int ack = (h->flags & PN_FLAG_OWNER_ONLY) && w != h->owner;
    pn_header r = *h;  /* op, job, slot, owner, set, generation, psn: the causing packet's */
    r.version = PN_VERSION;
    r.type = ack ? PN_ACK : PN_RESULT;
    r.flags = e->overflow[k] ? PN_FLAG_OVERFLOW : 0;
    r.worker = (uint8_t)w;
    pn_header_write(p, &r);
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

/* An admitted GATHER or NACK: no state; a replica for each receiver (a GATHER's: every worker
 * but its sender, in worker order; a NACK's: its owner), the packet as sent but for `worker`,
 * the receiver's. */
static void relay(pn_engine *e, job_entry *j, const pn_header *h, const uint8_t *packet, batch_output *o) {
    uint32_t first = h->type == PN_GATHER ? 0 : h->owner;
    uint32_t last = h->type == PN_GATHER ? j->workers - 1 : h->owner;
    count(e, j, PN_C_RELAYED, 1);
    for (uint32_t w = first; w <= last; w++) {
        if (h->type == PN_GATHER && w == h->worker) continue;
        uint8_t *p = o->packets + o->count * e->packet_size;
        memcpy(p, packet, j->packet_size);
        p[8] = (uint8_t)w;  /* the header's worker byte (docs/protocol.md) */
        o->dest[o->count] = j->sources[w];
        o->multicast[o->count] = 1;
        o->length[o->count] = (uint32_t)j->packet_size;
        o->count++;
        count(e, j, PN_C_RESULTS_SENT, 1);
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
        count(e, j, PN_C_AGGREGATED, 1);
        if (flagged) count(e, j, PN_C_OVERFLOW, 1);
    } else if (ahead != 0) {
        count(e, j, PN_C_STALE, 1);
        return;
    } else if (e->bitmap[k] & wbit) {
        if (e->bitmap[k] == j->full) {
            count(e, j, PN_C_DUPLICATE_ANSWERED, 1);
            count(e, j, PN_C_RESULTS_SENT, 1);
            emit(e, o, j, h, k, h->worker, 0, NULL);
        } else {
            count(e, j, PN_C_DUPLICATE, 1);
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
    if (e->bitmap[k] == j->full) {  /* complete: one replica per worker, replication id = worker */
        count(e, j, PN_C_COMPLETED, 1);
        count(e, j, PN_C_RESULTS_SENT, j->workers);
        const uint8_t *with_lanes = NULL;  /* the first RESULT of the completion (ACKs have no lanes) */
        for (uint32_t w = 0; w < j->workers; w++) {
            const uint8_t *row = emit(e, o, j, h, k, w, 1, with_lanes);
            if (!with_lanes && row[1] == PN_RESULT) with_lanes = row;
        }
    }
}

static size_t run(pn_engine *e, const batch_input *in, size_t n, batch_output *o) {
    size_t i = 0;
    for (; i < n; i++) {
        const uint8_t *packet = in->packets ? in->packets[i] : in->base + i * in->stride;
        uint32_t length = in->lengths[i];
        size_t readable = in->packets ? length : (length < in->stride ? length : in->stride);
        pn_header h;
        job_entry *j = NULL;
        /* a whole packet of 1 .. the engine's lanes, all of it readable (a longer one was cut short) */
        int well_formed = length >= PN_HEADER_SIZE + 4 && (length - PN_HEADER_SIZE) % 4 == 0 &&
                          length <= e->packet_size && readable >= length;
        if (well_formed) {
            pn_header_read(packet, &h);
            well_formed = h.version == PN_VERSION && (h.type == PN_DATA || h.type == PN_GATHER || h.type == PN_NACK);
        }
        if (well_formed && e->dense[h.job] != NO_JOB) j = &e->jobs[e->dense[h.job] - 1];
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
        int admitted = h.generation == j->generation && h.worker < j->workers &&
                       j->sources[h.worker] == in->sources[i] && length == j->packet_size;
        if (h.type == PN_DATA)  /* a relayed kind's slot is no slot */
            admitted = admitted && h.slot < j->pool && (!(h.flags & PN_FLAG_OWNER_ONLY) || h.owner < j->workers);
        else if (h.type == PN_GATHER)  /* a piece of the sender's own */
            admitted = admitted && h.owner == h.worker;
        else  /* a NACK, to another worker of the job */
            admitted = admitted && h.owner < j->workers && h.owner != h.worker;
        if (!admitted) {
            count(e, j, PN_C_REJECTED, 1);
            continue;
        }
        if (h.type != PN_DATA) {
            relay(e, j, &h, packet, o);
            continue;
        }
        size_t k = ((size_t)j->base + h.slot) * 2 + (h.set & 1);
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
