/* The aggregation state machine (docs/protocol.md), packet by packet in arrival order.
 * passing/aggregation.py's AggregationEngine is the specification: the same admission,
 * the same slot/set state, the same counters and byte-identical RESULTs.
 *
 * Every job has a lane count of its own (at most the engine's, the width of a slot): its
 * packets are that long, and it uses that many accumulators of each of its slots.
 *
 * The numpy engine processes a batch by lane count (ascending), each in waves (the k-th
 * packet of every slot/set goes to wave k), and emits wave by wave: in a wave, the
 * completions' replicas first, then the unicast answers. Processing in arrival order reaches
 * the same state, because packets of different slot/sets are independent (and jobs of
 * different lane counts share no slot), but emits in another order; pn_engine_process
 * therefore tags each RESULT with its job's lane count, its packet's rank (its index among
 * the batch's packets for that slot/set) and its kind, and sorts them stably by that.
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
#define FIRST_ORDER_CAP 1024   /* RESULTs the ordering scratch holds before it grows */

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
    /* ordering RESULTs like the numpy engine (pn_engine_process only) */
    uint32_t *rank_stamp, *rank_count; /* per slot/set: which call last counted it, and how often */
    uint32_t call_serial;
    int64_t *order_key;
    uint32_t *order, *order_tmp;
    size_t order_cap;
    uint8_t *packet_tmp;
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
    int64_t *key;              /* NULL: no ordering wanted */
} batch_output;

static size_t checked_mul(size_t a, size_t b, int *overflowed) {
    if (a != 0 && b > SIZE_MAX / a) *overflowed = 1;
    return a * b;
}

/* ---- life cycle ------------------------------------------------------------------- */

static int grow_order(pn_engine *e, size_t cap) {
    if (cap <= e->order_cap) return 0;
    int overflowed = 0;
    size_t key_bytes = checked_mul(cap, sizeof(int64_t), &overflowed);
    size_t order_bytes = checked_mul(cap, 2 * sizeof(uint32_t), &overflowed);
    if (overflowed) return -1;
    int64_t *key = malloc(key_bytes);
    uint32_t *block = malloc(order_bytes);
    if (!key || !block) {
        free(key);
        free(block);
        return -1;
    }
    free(e->order_key);
    free(e->order);  /* order and order_tmp share one block, order first */
    e->order_key = key;
    e->order = block;
    e->order_tmp = block + cap;
    e->order_cap = cap;
    return 0;
}

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
        e->rank_stamp = calloc(sets, sizeof *e->rank_stamp);
        e->rank_count = calloc(sets, sizeof *e->rank_count);
        e->dense = calloc(JOB_IDS, sizeof *e->dense);
        e->jobs = calloc(max_jobs, sizeof *e->jobs);
        e->free_ids = malloc((size_t)max_jobs * sizeof *e->free_ids);
        e->packet_tmp = malloc(e->packet_size);
    }
    if (overflowed || !e->epoch || !e->tag || !e->bitmap || !e->overflow || !e->acc || !e->rank_stamp ||
        !e->rank_count || !e->dense || !e->jobs || !e->free_ids || !e->packet_tmp ||
        grow_order(e, FIRST_ORDER_CAP) != 0) {
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
    free(e->rank_stamp);
    free(e->rank_count);
    free(e->dense);
    free(e->jobs);
    free(e->free_ids);
    free(e->order_key);
    free(e->order);
    free(e->packet_tmp);
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

static int32_t saturating_add(int32_t a, int32_t b, int *saturated) {
    int64_t sum = (int64_t)a + b;
    if (sum > INT32_MAX) {
        *saturated = 1;
        return INT32_MAX;
    }
    if (sum < INT32_MIN) {
        *saturated = 1;
        return INT32_MIN;
    }
    return (int32_t)sum;
}

/* One RESULT of the round in slot/set k, caused by the packet with header h, for worker w. */
static void emit(pn_engine *e, batch_output *o, const job_entry *j, const pn_header *h, size_t k, uint32_t w,
                 int multicast, int64_t key) {
    uint8_t *p = o->packets + o->count * e->packet_size;
    pn_header r = *h;  /* op, job, slot, set, generation, psn: the causing packet's */
    r.version = PN_VERSION;
    r.type = PN_RESULT;
    r.flags = e->overflow[k] ? PN_FLAG_OVERFLOW : 0;
    r.worker = (uint8_t)w;
    pn_header_write(p, &r);
    const int32_t *acc = e->acc + k * e->lanes;
    for (uint32_t i = 0; i < j->lanes; i++) pn_lane_set(p, i, acc[i]);
    o->dest[o->count] = j->sources[w];
    o->multicast[o->count] = (uint8_t)multicast;
    o->length[o->count] = (uint32_t)j->packet_size;
    if (o->key) o->key[o->count] = key;
    o->count++;
}

/* Where a RESULT goes in the numpy engine's order: by its job's lane count, then the rank of the
 * packet that caused it, replicas (kind 0) before unicast answers (kind 1). */
static int64_t order_key(const job_entry *j, uint32_t rank, int kind) {
    return (int64_t)j->lanes << 33 | (int64_t)rank << 1 | kind;
}

/* The state machine for one admitted DATA packet in slot/set k. */
static void apply(pn_engine *e, job_entry *j, const pn_header *h, const uint8_t *packet, size_t k,
                  batch_output *o, uint32_t rank) {
    uint32_t wbit = UINT32_C(1) << h->worker;
    int same_epoch = e->epoch[k] == j->epoch;
    uint32_t ahead = h->psn - e->tag[k];  /* serial-number distance to the slot's round */
    int flagged = (h->flags & PN_FLAG_OVERFLOW) != 0;
    int32_t *acc = e->acc + k * e->lanes;

    if (!same_epoch || (ahead != 0 && ahead < UINT32_C(1) << 31)) {
        /* a new round: the first write resets the slot/set, no separate clearing pass */
        for (uint32_t i = 0; i < j->lanes; i++) acc[i] = pn_lane_get(packet, i);
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
            emit(e, o, j, h, k, h->worker, 0, order_key(j, rank, 1));
        } else {
            count(e, j, PN_C_DUPLICATE, 1);
        }
        return;
    } else {
        int saturated = 0;
        if (h->op == PN_OP_MAX) {
            for (uint32_t i = 0; i < j->lanes; i++) {
                int32_t v = pn_lane_get(packet, i);
                if (v > acc[i]) acc[i] = v;
            }
        } else {  /* any other op sums, as in the numpy engine */
            for (uint32_t i = 0; i < j->lanes; i++) acc[i] = saturating_add(acc[i], pn_lane_get(packet, i), &saturated);
        }
        e->bitmap[k] |= wbit;
        e->overflow[k] |= (uint8_t)(flagged | saturated);
        count(e, j, PN_C_AGGREGATED, 1);
        if (flagged || saturated) count(e, j, PN_C_OVERFLOW, 1);
    }
    if (e->bitmap[k] == j->full) {  /* complete: one replica per worker, replication id = worker */
        count(e, j, PN_C_COMPLETED, 1);
        count(e, j, PN_C_RESULTS_SENT, j->workers);
        for (uint32_t w = 0; w < j->workers; w++) emit(e, o, j, h, k, w, 1, order_key(j, rank, 0));
    }
}

/* Rank of a packet among this call's packets for slot/set k (0 for the first). */
static uint32_t next_rank(pn_engine *e, size_t k) {
    if (e->rank_stamp[k] != e->call_serial) {
        e->rank_stamp[k] = e->call_serial;
        e->rank_count[k] = 0;
    }
    return e->rank_count[k]++;
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
            well_formed = h.version == PN_VERSION && h.type == PN_DATA;
        }
        if (well_formed && e->dense[h.job] != NO_JOB) j = &e->jobs[e->dense[h.job] - 1];
        /* stop before a packet whose RESULTs might not fit */
        if (j && o->cap - o->count < j->workers) break;
        e->totals[PN_C_RECEIVED]++;
        if (!well_formed) {
            e->totals[PN_C_MALFORMED]++;
            continue;
        }
        if (!j) {
            e->totals[PN_C_REJECTED]++;  /* no job to charge it to */
            continue;
        }
        if (h.generation != j->generation || h.worker >= j->workers || j->sources[h.worker] != in->sources[i] ||
            h.slot >= j->pool || length != j->packet_size) {
            count(e, j, PN_C_REJECTED, 1);
            continue;
        }
        size_t k = ((size_t)j->base + h.slot) * 2 + (h.set & 1);
        uint32_t rank = o->key ? next_rank(e, k) : 0;
        apply(e, j, &h, packet, k, o, rank);
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

/* Put the RESULTs in the numpy engine's order: by (rank, kind), arrival order within. */
static void order_results(pn_engine *e, batch_output *o) {
    size_t n = o->count;
    size_t sorted = 1;
    while (sorted < n && o->key[sorted - 1] <= o->key[sorted]) sorted++;
    if (sorted >= n) return;  /* the usual case: nothing to move */
    for (size_t i = 0; i < n; i++) e->order[i] = (uint32_t)i;
    uint32_t *order = pn_stable_order(o->key, e->order, e->order_tmp, n);
    uint8_t *done = (uint8_t *)(order == e->order ? e->order_tmp : e->order);  /* the spare array */
    memset(done, 0, n);
    size_t ps = e->packet_size;
    /* apply the permutation in place, cycle by cycle: position j gets the RESULT at order[j] */
    for (size_t start = 0; start < n; start++) {
        if (done[start]) continue;
        uint32_t length = o->length[start];
        memcpy(e->packet_tmp, o->packets + start * ps, length);
        int64_t dest = o->dest[start];
        uint8_t multicast = o->multicast[start];
        size_t j = start;
        for (;;) {
            size_t from = order[j];
            done[j] = 1;
            if (from == start) {
                memcpy(o->packets + j * ps, e->packet_tmp, length);
                o->dest[j] = dest;
                o->multicast[j] = multicast;
                o->length[j] = length;
                break;
            }
            memcpy(o->packets + j * ps, o->packets + from * ps, o->length[from]);
            o->dest[j] = o->dest[from];
            o->multicast[j] = o->multicast[from];
            o->length[j] = o->length[from];
            j = from;
        }
    }
}

size_t pn_engine_process(pn_engine *e, const uint8_t *in, size_t in_stride, const uint32_t *lengths,
                         const int64_t *sources, size_t n, uint8_t *out, int64_t *out_dest, uint8_t *out_multicast,
                         uint32_t *out_length, size_t out_cap, size_t *emitted) {
    if (emitted) *emitted = 0;
    if (!e || !emitted || n == 0 || !in || !lengths || !sources) return 0;
    if (out_cap > 0 && (!out || !out_dest || !out_multicast || !out_length)) return 0;
    pthread_mutex_lock(&e->lock);
    /* the ordering scratch bounds how many RESULTs one call can order; grow it when asked
     * for more, and if memory is short process fewer datagrams instead */
    size_t wanted = n > SIZE_MAX / PN_MAX_WORKERS ? out_cap : n * PN_MAX_WORKERS;
    if (wanted > out_cap) wanted = out_cap;
    if (wanted > UINT32_MAX) wanted = UINT32_MAX;  /* the order is uint32 indices */
    if (wanted > e->order_cap) grow_order(e, wanted);
    batch_input input = {.base = in, .stride = in_stride, .lengths = lengths, .sources = sources};
    batch_output o = {.packets = out, .dest = out_dest, .multicast = out_multicast, .length = out_length,
                      .cap = out_cap < e->order_cap ? out_cap : e->order_cap, .key = e->order_key};
    if (++e->call_serial == 0) {  /* wrapped: stamps of long ago would look current */
        memset(e->rank_stamp, 0, (size_t)e->slots * 2 * sizeof *e->rank_stamp);
        e->call_serial = 1;
    }
    size_t consumed = run(e, &input, n, &o);
    order_results(e, &o);
    pthread_mutex_unlock(&e->lock);
    *emitted = o.count;
    return consumed;
}

size_t pn_engine_process_locked(pn_engine *e, const uint8_t *const *packets, const uint32_t *lengths,
                                const int64_t *sources, size_t n, uint8_t *out, int64_t *out_dest,
                                uint8_t *out_multicast, uint32_t *out_length, size_t out_cap, size_t *emitted) {
    batch_input input = {.packets = packets, .lengths = lengths, .sources = sources};
    batch_output o = {.packets = out, .dest = out_dest, .multicast = out_multicast, .length = out_length,
                      .cap = out_cap, .key = NULL};
    size_t consumed = run(e, &input, n, &o);
    *emitted = o.count;
    return consumed;
}
