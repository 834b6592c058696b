/* The aggregation engine's state, shared by its two halves (engine_jobs.c: life cycle and admission;
 * engine.c: the data path). Private to them: the rest of the library uses engine.h. */
#ifndef PASSING_ENGINE_STATE_H
#define PASSING_ENGINE_STATE_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

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
    int8_t owners[PN_OWNERS];  /* owner value -> worker, PN_OWNER_UP or PN_OWNER_NONE */
    uint32_t role;
    uint32_t up_job, up_generation, up_worker;
    int64_t up_source;
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
    uint8_t *phase;            /* answered: 0 not yet (a leaf's until its root answers), 1 with the sums, 2 by an ACK */
    int32_t *acc;              /* lanes accumulators per slot/set */
    /* admission */
    uint32_t *dense;           /* job id -> 1 + index into jobs, or NO_JOB */
    uint32_t *up_dense;        /* a leaf's uplink job id -> 1 + index into jobs, or NO_JOB */
    job_entry *jobs;
    uint32_t *free_ids, free_count;
    int64_t totals[PN_COUNTERS];
};

#endif
