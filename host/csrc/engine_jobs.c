/* The aggregation engine's life cycle and admission (docs/protocol.md; passing/aggregator/jobs.py is the
 * specification of the checks): jobs with their slot ranges, lanes, origins and roles in a tree. The data
 * path is engine.c. */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "engine.h"
#include "engine_state.h"

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
        e->phase = calloc(sets, sizeof *e->phase);
        e->acc = calloc(1, acc_bytes);
        e->dense = calloc(JOB_IDS, sizeof *e->dense);
        e->up_dense = calloc(JOB_IDS, sizeof *e->up_dense);
        e->jobs = calloc(max_jobs, sizeof *e->jobs);
        e->free_ids = malloc((size_t)max_jobs * sizeof *e->free_ids);
    }
    if (overflowed || !e->epoch || !e->tag || !e->bitmap || !e->overflow || !e->phase || !e->acc || !e->dense ||
        !e->up_dense || !e->jobs || !e->free_ids) {
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
    free(e->phase);
    free(e->acc);
    free(e->dense);
    free(e->up_dense);
    free(e->jobs);
    free(e->free_ids);
    free(e);
}

void pn_engine_lock(pn_engine *e) { pthread_mutex_lock(&e->lock); }
void pn_engine_unlock(pn_engine *e) { pthread_mutex_unlock(&e->lock); }
size_t pn_engine_packet_bytes(const pn_engine *e) { return e->packet_size; }

/* ---- admission ---------------------------------------------------------------------- */

/* The tree's rules (passing/aggregator/jobs.py's _check_tree): a role, an uplink exactly for a leaf, an
 * owner map of workers (and PN_OWNER_UP at a leaf), a root origin that is none of the workers', one leaf
 * per uplink job id. */
static int check_tree(const pn_engine *e, const pn_tree *t, uint32_t workers, const int64_t *sources) {
    if (t->role > PN_ROLE_ROOT) return PN_EINVAL;
    for (uint32_t o = 0; o < PN_OWNERS; o++) {
        int32_t w = t->owners[o];
        if (!(w == PN_OWNER_NONE || (w >= 0 && (uint32_t)w < workers) || (w == PN_OWNER_UP && t->role == PN_ROLE_LEAF)))
            return PN_EINVAL;
    }
    if (t->role != PN_ROLE_LEAF) return PN_OK;
    if (t->up_job >= JOB_IDS || t->up_generation >= PN_GENERATIONS || t->up_worker >= PN_MAX_WORKERS ||
        t->up_source < 0)
        return PN_EINVAL;
    for (uint32_t w = 0; w < workers; w++)
        if (sources[w] == t->up_source) return PN_EINVAL;
    if (e->up_dense[t->up_job] != NO_JOB) return PN_EEXIST;
    return PN_OK;
}

static int add_job_locked(pn_engine *e, uint32_t job, uint32_t generation, uint32_t base, uint32_t pool,
                          uint32_t workers, const int64_t *sources, uint32_t lanes, const pn_tree *tree) {
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
    if (tree) {
        int rc = check_tree(e, tree, workers, sources);
        if (rc != PN_OK) return rc;
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
    for (uint32_t o = 0; o < PN_OWNERS; o++)
        j->owners[o] = (int8_t)(tree ? tree->owners[o] : o < workers ? (int32_t)o : PN_OWNER_NONE);
    j->role = tree ? tree->role : PN_ROLE_FLAT;
    j->up_source = -1;
    if (j->role == PN_ROLE_LEAF) {
        j->up_job = tree->up_job;
        j->up_generation = tree->up_generation;
        j->up_worker = tree->up_worker;
        j->up_source = tree->up_source;
        e->up_dense[tree->up_job] = d + 1;
    }
    e->dense[job] = d + 1;
    return PN_OK;
}

int pn_engine_add_tree_job(pn_engine *e, uint32_t job, uint32_t generation, uint32_t base, uint32_t pool,
                           uint32_t workers, const int64_t *sources, uint32_t lanes, const pn_tree *tree) {
    if (!e) return PN_EINVAL;
    pthread_mutex_lock(&e->lock);
    int rc = add_job_locked(e, job, generation, base, pool, workers, sources, lanes, tree);
    pthread_mutex_unlock(&e->lock);
    return rc;
}

int pn_engine_add_job(pn_engine *e, uint32_t job, uint32_t generation, uint32_t base, uint32_t pool,
                      uint32_t workers, const int64_t *sources, uint32_t lanes) {
    return pn_engine_add_tree_job(e, job, generation, base, pool, workers, sources, lanes, NULL);
}

int pn_engine_remove_job(pn_engine *e, uint32_t job) {
    if (!e) return PN_EINVAL;
    if (job >= JOB_IDS) return PN_ENOENT;
    pthread_mutex_lock(&e->lock);
    int rc = PN_ENOENT;
    if (e->dense[job] != NO_JOB) {
        uint32_t d = e->dense[job] - 1;
        e->jobs[d].in_use = 0;
        if (e->jobs[d].role == PN_ROLE_LEAF) e->up_dense[e->jobs[d].up_job] = NO_JOB;
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
