/* libFuzzer harness for the aggregation engine (make fuzz).
 *
 * The input is a little program: each step, chosen by one byte, admits or removes a job,
 * adds a datagram to the pending batch (raw bytes, or a header built from a few bytes so
 * that the fuzzer reaches admitted rounds, completions and duplicates quickly), or
 * processes the batch with an output buffer of a size the input picks. Buffers are
 * allocated to their exact sizes, so AddressSanitizer sees any read or write past them.
 *
 * Jobs may be leaves or roots of a two-level tree (docs/protocol.md, "Trees across racks"): a leaf's
 * datagrams from its root (RESULT, ACK, GATHER, NACK of its uplink's job id) are built too.
 *
 * Checked after every batch (abort on violation):
 *  - every datagram consumed is counted once: malformed, or received and then exactly one of
 *    rejected, aggregated, duplicate, duplicate_answered, stale, relayed, answered, late_answer
 *    (deltas of the totals);
 *  - results_sent and sent_up grew by the packets emitted; the unicast ones are the
 *    duplicate_answered answers and the packets up;
 *  - each packet emitted is of this version: a RESULT (as long as its job's packets) or an
 *    ACK (the header alone), flagged at most OVERFLOW (a root's: OWNER_ONLY too), or a relayed
 *    GATHER or NACK (a multicast replica as long as its job's packets), and goes to an admitted
 *    worker's origin; or it goes up: a DATA, GATHER or NACK with a leaf's uplink job, generation
 *    and worker, to its root's origin;
 *  - the engine never takes more than it was given nor emits more than it had room for.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "passing_native.h"

#define LANES 4             /* the engine's width; jobs take 1..LANES lanes */
#define SLOTS 16
#define MAX_JOBS 3
#define MAX_BATCH 64
#define PACKET (PN_HEADER_SIZE + 4 * LANES)

static const uint32_t JOB_IDS[4] = {0, 1, 2, 65535};

typedef struct {
    int admitted;
    uint32_t generation, pool, workers, lanes;
    int64_t sources[PN_MAX_WORKERS];
    pn_tree tree;
} shadow_job;

typedef struct {
    const uint8_t *data;
    size_t size, at;
} reader;

static uint8_t byte(reader *r) { return r->at < r->size ? r->data[r->at++] : 0; }
static uint16_t u16(reader *r) { return (uint16_t)(byte(r) << 8 | byte(r)); }

#define CHECK(cond)                                                                  \
    do {                                                                             \
        if (!(cond)) {                                                               \
            fprintf(stderr, "fuzz_engine: invariant failed: %s (line %d)\n", #cond, __LINE__); \
            abort();                                                                 \
        }                                                                            \
    } while (0)

typedef struct {
    pn_engine *e;
    shadow_job jobs[4];       /* by index into JOB_IDS */
    uint8_t rows[MAX_BATCH][PACKET + 8];
    uint32_t lengths[MAX_BATCH];
    int64_t sources[MAX_BATCH];
    size_t n;
} state;

static void admin(state *s, reader *r) {
    uint8_t what = byte(r);
    uint32_t j = what >> 1 & 3;
    uint32_t id = JOB_IDS[j];
    if (!(what & 1)) {
        int rc = pn_engine_remove_job(s->e, id);
        CHECK(rc == (s->jobs[j].admitted ? PN_OK : PN_ENOENT));
        s->jobs[j].admitted = 0;
        return;
    }
    uint32_t base = byte(r) % (SLOTS + 4), pool = byte(r) % 10, workers = byte(r) % 34;
    uint32_t generation = byte(r) & 0x80 ? u16(r) : 0x10000u + byte(r);  /* sometimes out of range */
    uint8_t spread = byte(r);
    uint32_t lanes = byte(r) % (LANES + 2);  /* 0 and LANES + 1 are refused */
    int64_t sources[PN_MAX_WORKERS + 2];
    for (uint32_t w = 0; w < PN_MAX_WORKERS + 2; w++)
        sources[w] = spread & 0x40 ? (int64_t)(w % 3) : (int64_t)(spread & 0x3F) * 64 + w;  /* duplicates or not */
    if (spread & 0x80) sources[0] = -1;
    /* a role in a tree now and then: owners a pattern (sometimes refused), a leaf's uplink to another id */
    uint8_t shape = byte(r);
    pn_tree tree = {.role = shape % 4 == 3 ? PN_ROLE_ROOT : shape % 4 == 2 ? PN_ROLE_LEAF : PN_ROLE_FLAT,
                    .up_job = JOB_IDS[(j + 1 + (shape >> 2 & 1)) & 3], .up_generation = byte(r),
                    .up_worker = shape >> 3 & 31, .up_source = shape & 0x80 ? 10 : 200 + (shape >> 3 & 7)};
    for (uint32_t o = 0; o < PN_OWNERS; o++)
        tree.owners[o] = o >= 3 * workers ? PN_OWNER_NONE : o < workers ? (int32_t)(o % (workers ? workers : 1))
                         : shape & 0x40 ? PN_OWNER_UP : (int32_t)(o % 4) - 2;
    int rc = pn_engine_add_tree_job(s->e, id, generation, base, pool, workers, sources, lanes,
                                    tree.role == PN_ROLE_FLAT && shape & 0x80 ? NULL : &tree);
    CHECK(rc == PN_OK || rc == PN_EINVAL || rc == PN_EEXIST || rc == PN_ERANGE || rc == PN_EFULL);
    if (rc == PN_OK) {
        CHECK(!s->jobs[j].admitted && workers >= 1 && workers <= PN_MAX_WORKERS && generation < PN_GENERATIONS);
        CHECK(lanes >= 1 && lanes <= LANES);
        CHECK(pool >= 1 && base + pool <= SLOTS);
        shadow_job *sj = &s->jobs[j];
        sj->admitted = 1;
        sj->generation = generation;
        sj->pool = pool;
        sj->workers = workers;
        sj->lanes = lanes;
        sj->tree = tree;
        memcpy(sj->sources, sources, sizeof sj->sources);
        int64_t c[PN_COUNTERS];
        CHECK(pn_engine_counters(s->e, id, c) == PN_OK);
        for (int i = 0; i < PN_COUNTERS; i++) CHECK(c[i] == 0);
    } else if (rc == PN_EEXIST) {  /* the job id, or a leaf's uplink job id another leaf goes up to */
        int taken = s->jobs[j].admitted;
        for (int o = 0; o < 4; o++)
            taken |= tree.role == PN_ROLE_LEAF && s->jobs[o].admitted && s->jobs[o].tree.role == PN_ROLE_LEAF &&
                     s->jobs[o].tree.up_job == tree.up_job;
        CHECK(taken);
    }
}

/* A datagram from raw input bytes. */
static void raw_datagram(state *s, reader *r) {
    if (s->n == MAX_BATCH) return;
    uint8_t *row = s->rows[s->n];
    uint8_t lenbyte = byte(r);
    uint32_t length = lenbyte == 255 ? 70000 : lenbyte % (PACKET + 9);  /* up to the row, or claimed huge */
    uint32_t copy = length < sizeof s->rows[0] ? length : sizeof s->rows[0];
    for (uint32_t i = 0; i < copy; i++) row[i] = byte(r);
    s->lengths[s->n] = length;
    s->sources[s->n] = (int64_t)byte(r) - 8;
    s->n++;
}

/* A well-formed packet from a few bytes: usually a DATA of an admitted job, from its origin;
 * now and then OWNER_ONLY, a GATHER or a NACK. */
static void built_datagram(state *s, reader *r) {
    if (s->n == MAX_BATCH) return;
    uint8_t pick = byte(r), where = byte(r), fields = byte(r), kind = byte(r);
    uint32_t j = pick & 3;
    const shadow_job *sj = &s->jobs[j];
    pn_header h = {
        .version = PN_VERSION, .type = PN_DATA, .op = (uint8_t)(fields & 3), .flags = (uint8_t)(fields >> 2 & 3),
        .job = (uint16_t)JOB_IDS[j], .worker = (uint8_t)(pick >> 2 & 31),
        .generation = (uint16_t)(fields & 0x10 ? sj->generation + 1 : sj->generation),
        .psn = (uint32_t)(byte(r) & 0x1F) + (fields & 0x20 ? UINT32_C(0xFFFFFFF0) : 0),  /* wraps around */
    };
    if (kind % 16 == 5 && sj->tree.role == PN_ROLE_LEAF) {  /* from its root: what a leaf takes down */
        static const uint8_t down[4] = {PN_RESULT, PN_ACK, PN_GATHER, PN_NACK};
        h.type = down[where & 3];
        h.job = (uint16_t)sj->tree.up_job;
        h.generation = (uint16_t)(fields & 0x10 ? sj->tree.up_generation + 1 : sj->tree.up_generation);
        h.worker = (uint8_t)(pick & 0x80 ? pick >> 2 & 31 : sj->tree.up_worker);
    }
    uint32_t pool = sj->pool ? sj->pool : 1;
    h.slot = (uint16_t)(fields & 0x40 ? where : h.psn % pool);
    h.set = (uint8_t)(fields & 0x80 ? where & 1 : (h.psn / pool) % 2);
    if (h.type == PN_DATA) h.type = (uint8_t)(kind % 8 == 6 ? PN_GATHER : kind % 8 == 7 ? PN_NACK : PN_DATA);
    if (kind & 0x08) h.flags |= PN_FLAG_OWNER_ONLY;
    /* the owner: a GATHER's sender, a NACK's other worker, a round's owner; or any */
    uint32_t workers = sj->workers ? sj->workers : 1;
    h.owner = (uint8_t)(kind & 0x80 ? kind >> 4 & 7 : h.type == PN_GATHER ? h.worker : (h.worker + 1u) % workers);
    uint8_t *row = s->rows[s->n];
    pn_header_write(row, &h);
    uint8_t size = byte(r);  /* now and then a lane count other than the job's */
    uint32_t lanes = sj->lanes && size < 0xE0 ? sj->lanes : 1u + (uint32_t)size % LANES;
    for (uint32_t i = 0; i < lanes; i++) {
        uint8_t v = byte(r);
        int32_t value = v == 0xFF ? INT32_MAX : v == 0xFE ? INT32_MIN : (int32_t)v - 100;
        pn_lane_set(row, i, value);
    }
    s->lengths[s->n] = h.type == PN_ACK && !(size & 1) ? PN_HEADER_SIZE : PN_HEADER_SIZE + 4 * lanes;
    s->sources[s->n] = sj->admitted && h.worker < sj->workers && !(pick & 0x80) ? sj->sources[h.worker] : pick;
    if (h.job == sj->tree.up_job && sj->tree.role == PN_ROLE_LEAF && !(pick & 0x40)) s->sources[s->n] = sj->tree.up_source;
    s->n++;
}

static void totals(pn_engine *e, int64_t out[PN_COUNTERS]) { CHECK(pn_engine_counters(e, -1, out) == PN_OK); }

static void process(state *s, reader *r) {
    uint8_t how = byte(r);
    /* the stride: whole rows, or rows that claim more than is readable (must be malformed) */
    size_t stride = how & 1 ? PACKET + 8 : how & 2 ? PACKET : 10;
    size_t out_cap = byte(r) % 80;
    uint8_t *in = malloc(s->n * stride + 1);
    uint8_t *out = malloc(out_cap * PACKET + 1);
    int64_t *dest = malloc(out_cap * sizeof *dest + 1);
    uint8_t *multicast = malloc(out_cap + 1);
    uint32_t *length = malloc(out_cap * sizeof *length + 1);
    if (!in || !out || !dest || !multicast || !length) abort();
    for (size_t i = 0; i < s->n; i++) memcpy(in + i * stride, s->rows[i], stride < PACKET + 8 ? stride : PACKET + 8);
    size_t done = 0;
    while (done < s->n) {
        int64_t before[PN_COUNTERS], after[PN_COUNTERS];
        totals(s->e, before);
        size_t emitted = 12345;
        size_t consumed = pn_engine_process(s->e, in + done * stride, stride, s->lengths + done, s->sources + done,
                                            s->n - done, out, dest, multicast, length, out_cap, &emitted);
        totals(s->e, after);
        CHECK(consumed <= s->n - done && emitted <= out_cap);
        int64_t d[PN_COUNTERS];
        for (int i = 0; i < PN_COUNTERS; i++) d[i] = after[i] - before[i];
        CHECK(d[PN_C_RECEIVED] + d[PN_C_MALFORMED] == (int64_t)consumed);
        CHECK(d[PN_C_RECEIVED] == d[PN_C_REJECTED] + d[PN_C_AGGREGATED] + d[PN_C_DUPLICATE] +
                                      d[PN_C_DUPLICATE_ANSWERED] + d[PN_C_STALE] + d[PN_C_RELAYED] +
                                      d[PN_C_ANSWERED] + d[PN_C_LATE_ANSWER]);
        CHECK(d[PN_C_RESULTS_SENT] + d[PN_C_SENT_UP] == (int64_t)emitted);
        CHECK(d[PN_C_COMPLETED] <= d[PN_C_AGGREGATED] && d[PN_C_OVERFLOW] <= d[PN_C_AGGREGATED]);
        int64_t unicast = 0;
        for (size_t i = 0; i < emitted; i++) {
            pn_header h;
            pn_header_read(out + i * PACKET, &h);
            int relayed = h.type == PN_GATHER || h.type == PN_NACK;
            CHECK(h.version == PN_VERSION);
            CHECK(multicast[i] <= 1);
            unicast += multicast[i] == 0;
            int known = 0;
            for (int j = 0; j < 4; j++) {
                const shadow_job *sj = &s->jobs[j];
                if (!sj->admitted) continue;
                if (multicast[i] == 0 && h.type != PN_RESULT && h.type != PN_ACK) {  /* up: DATA or a relay's copy */
                    known |= sj->tree.role == PN_ROLE_LEAF && sj->tree.up_job == h.job &&
                             sj->tree.up_worker == h.worker && sj->tree.up_generation == h.generation &&
                             sj->tree.up_source == dest[i] && length[i] == PN_HEADER_SIZE + 4 * sj->lanes;
                } else if (JOB_IDS[j] == h.job && h.worker < sj->workers) {
                    uint8_t allowed = PN_FLAG_OVERFLOW | (sj->tree.role == PN_ROLE_ROOT ? PN_FLAG_OWNER_ONLY : 0);
                    known = sj->sources[h.worker] == dest[i] && sj->generation == h.generation &&
                            length[i] == (h.type == PN_ACK ? PN_HEADER_SIZE  /* the header alone */
                                                           : PN_HEADER_SIZE + 4 * sj->lanes) &&
                            (relayed ? multicast[i] == 1
                                     : (h.type == PN_RESULT || h.type == PN_ACK) && (h.flags & ~allowed) == 0);
                }
            }
            CHECK(known);
        }
        CHECK(unicast == d[PN_C_DUPLICATE_ANSWERED] + d[PN_C_SENT_UP]);
        if (consumed == 0) {
            CHECK(out_cap < PN_MAX_WORKERS);  /* only a buffer too small for one job's RESULTs stops it */
            break;
        }
        done += consumed;
    }
    free(in);
    free(out);
    free(dest);
    free(multicast);
    free(length);
    s->n = 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    state *s = calloc(1, sizeof *s);
    if (!s) abort();
    s->e = pn_engine_new(SLOTS, LANES, MAX_JOBS);
    if (!s->e) abort();
    /* a starting point: two jobs admitted */
    int64_t sources[PN_MAX_WORKERS];
    for (int w = 0; w < PN_MAX_WORKERS; w++) sources[w] = 10 + w;
    CHECK(pn_engine_add_job(s->e, 1, 7, 0, 4, 3, sources, LANES) == PN_OK);
    s->jobs[1] = (shadow_job){.admitted = 1, .generation = 7, .pool = 4, .workers = 3, .lanes = LANES};
    memcpy(s->jobs[1].sources, sources, sizeof sources);
    CHECK(pn_engine_add_job(s->e, 2, 0, 4, 2, 1, sources + 5, 2) == PN_OK);
    s->jobs[2] = (shadow_job){.admitted = 1, .generation = 0, .pool = 2, .workers = 1, .lanes = 2};
    memcpy(s->jobs[2].sources, sources + 5, sizeof sources - 5 * sizeof *sources);
    reader r = {data, size, 0};
    while (r.at < r.size) {
        uint8_t step = byte(&r);
        switch (step % 8) {
        case 0:
            admin(s, &r);
            break;
        case 1:
        case 2:
            raw_datagram(s, &r);
            break;
        case 7:
            process(s, &r);
            break;
        default:
            built_datagram(s, &r);
        }
    }
    process(s, &r);
    /* some counter queries with odd ids */
    int64_t c[PN_COUNTERS];
    CHECK(pn_engine_counters(s->e, 65536, c) == PN_ENOENT && pn_engine_counters(s->e, 3, c) == PN_ENOENT);
    pn_engine_free(s->e);
    free(s);
    return 0;
}
