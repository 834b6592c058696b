/* The native data path of PASSING: the host streaming engine and the software
 * aggregator's engine, as plain C functions over caller-owned buffers.
 *
 * passing/native.py loads this library with ctypes (docs/architecture.md says why); the
 * numpy implementations in passing/reduce_stream.py, passing/gather_stream.py and
 * passing/aggregator/engine.py are the executable specification this code is tested against,
 * byte for byte. No function
 * keeps global state: everything lives in the objects the caller creates and frees.
 * The wire format is defined once for C, in wire.c and the lane accessors below
 * (docs/protocol.md is the contract).
 */
#ifndef PASSING_NATIVE_H
#define PASSING_NATIVE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define PN_API __attribute__((visibility("default")))

/* ---- wire format (mirrors passing/wire.py) ---------------------------------------- */
#define PN_VERSION 3
#define PN_HEADER_SIZE 16
#define PN_DATA 1
#define PN_RESULT 2
#define PN_ACK 3      /* header only: an OWNER_ONLY round is complete, its sums went to the owner */
#define PN_GATHER 4   /* relayed unchanged to every other worker of the job */
#define PN_NACK 5     /* relayed to its owner */
#define PN_OP_SUM 0
#define PN_OP_MAX 1
#define PN_FLAG_OVERFLOW 0x01
#define PN_FLAG_RETRANSMIT 0x02
#define PN_FLAG_OWNER_ONLY 0x04
#define PN_MAX_WORKERS 32
#define PN_GENERATIONS 65536

/* The header in host byte order; on the wire every field is big-endian. */
typedef struct {
    uint8_t version, type, op, flags;
    uint16_t job, slot;
    uint8_t worker;
    uint8_t owner, set;  /* byte 9: owner in bits 7..1, set in bit 0 */
    uint16_t generation;
    uint32_t psn;
} pn_header;

PN_API void pn_header_read(const uint8_t *packet, pn_header *h);
PN_API void pn_header_write(uint8_t *packet, const pn_header *h);

/* What pn_header_read and pn_header_write do, inline for the per-packet loops (a call per packet, and the
 * header's bytes stored one at a time then read back as wider words, cost them a fifth of a packet's time):
 * the 16 bytes moved as words and byte-swapped. The wire format's one definition in C. */
static inline uint16_t pn_be16_at(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, sizeof v);
    return __builtin_bswap16(v);
}

static inline uint32_t pn_be32_at(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return __builtin_bswap32(v);
}

static inline void pn_header_decode(const uint8_t *p, pn_header *h) {
    h->version = p[0];
    h->type = p[1];
    h->op = p[2];
    h->flags = p[3];
    h->job = pn_be16_at(p + 4);
    h->slot = pn_be16_at(p + 6);
    h->worker = p[8];
    h->owner = (uint8_t)(p[9] >> 1);
    h->set = p[9] & 1;
    h->generation = pn_be16_at(p + 10);
    h->psn = pn_be32_at(p + 12);
}

static inline void pn_header_encode(uint8_t *p, const pn_header *h) {
    uint32_t w[4] = {
        __builtin_bswap32((uint32_t)h->version << 24 | (uint32_t)h->type << 16 | (uint32_t)h->op << 8 | h->flags),
        __builtin_bswap32((uint32_t)h->job << 16 | h->slot),
        __builtin_bswap32((uint32_t)h->worker << 24 | (uint32_t)(uint8_t)(h->owner << 1 | (h->set & 1)) << 16 |
                          h->generation),
        __builtin_bswap32(h->psn),
    };
    memcpy(p, w, sizeof w);
}
PN_API size_t pn_packet_size(uint32_t lanes);
/* The lane loops of the engine and the stream are written so that the compiler vectorizes
 * them; byte swaps need SSSE3, which x86-64's baseline lacks, so on x86-64 they are also
 * built for AVX2 and, with GCC 12 on, for AVX-512 (x86-64-v4: a 64-lane packet is four
 * vectors), and the loader picks the variant the CPU runs. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12 && defined(__linux__)
#define PN_LANE_LOOP __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#elif defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
#define PN_LANE_LOOP __attribute__((target_clones("avx2", "default")))
#else
#define PN_LANE_LOOP
#endif

/* Big-endian int32 lane i of a packet. Inline, so that the lane loops of the engine and
 * the stream vectorize (a call per lane would keep them scalar). */
static inline int32_t pn_lane_get(const uint8_t *packet, uint32_t i) {
    uint32_t be;
    memcpy(&be, packet + PN_HEADER_SIZE + 4 * (size_t)i, sizeof be);
    return (int32_t)__builtin_bswap32(be);
}

static inline void pn_lane_set(uint8_t *packet, uint32_t i, int32_t v) {
    uint32_t be = __builtin_bswap32((uint32_t)v);
    memcpy(packet + PN_HEADER_SIZE + 4 * (size_t)i, &be, sizeof be);
}

/* ---- errors ---------------------------------------------------------------------- */
#define PN_OK 0
#define PN_EINVAL (-1)      /* a bad argument (the message says which) */
#define PN_ENOMEM (-2)
#define PN_EEXIST (-3)      /* job already admitted */
#define PN_ENOENT (-4)      /* job not admitted */
#define PN_ERANGE (-5)      /* slot range outside the engine, or overlapping another job */
#define PN_EFULL (-6)       /* no room for another job */
#define PN_ESYS (-7)        /* a system call failed: errno in the report */
#define PN_ETIMEOUT (-8)    /* no RESULT within the timeout */
#define PN_ESILENT (-9)     /* the stream's on_silence callback gave the call up (failover) */

/* ---- the aggregation engine (mirrors passing/aggregator/engine.py) ----------------------- */

/* Counters, in the order of passing.aggregator.engine.COUNTERS. */
enum {
    PN_C_RECEIVED, PN_C_MALFORMED, PN_C_REJECTED, PN_C_AGGREGATED, PN_C_COMPLETED,
    PN_C_DUPLICATE, PN_C_DUPLICATE_ANSWERED, PN_C_STALE, PN_C_OVERFLOW, PN_C_RESULTS_SENT, PN_C_RELAYED,
    PN_C_SENT_UP, PN_C_ANSWERED, PN_C_LATE_ANSWER,
    PN_COUNTERS
};

/* A job's role in a two-level tree (docs/protocol.md, "Trees across racks"; mirrors
 * passing/aggregator/jobs.py). owners[o]: what owner value o names here: a worker, PN_OWNER_UP (a
 * leaf: a server of another rack) or PN_OWNER_NONE. A leaf's partials go up as DATA of job up_job,
 * generation up_generation, worker up_worker, to origin up_source, the only origin it takes answers from. */
#define PN_ROLE_FLAT 0
#define PN_ROLE_LEAF 1
#define PN_ROLE_ROOT 2
#define PN_OWNERS 128
#define PN_OWNER_NONE (-1)
#define PN_OWNER_UP (-2)
typedef struct {
    uint32_t role;
    int32_t owners[PN_OWNERS];
    uint32_t up_job, up_generation, up_worker;
    int64_t up_source;
} pn_tree;

typedef struct pn_engine pn_engine;

/* slots x 2 sets x lanes int32 accumulators shared by up to max_jobs jobs; lanes is the widest
 * packet a job may use. NULL on bad arguments or no memory. Thread-safe: every call takes the
 * engine's lock. */
PN_API pn_engine *pn_engine_new(uint32_t slots, uint32_t lanes, uint32_t max_jobs);
PN_API void pn_engine_free(pn_engine *e);
/* Admit a job: the caller (passing/aggregator/engine.py's checks) has validated ranges, but the
 * engine re-checks everything and returns a PN_E* code rather than trusting it.
 * sources[w] is worker w's admitted origin (packed ip << 16 | port, or any id >= 0); lanes
 * (1 .. the engine's) the int32 values of the job's packets, which use that many accumulators
 * of each of its slots. */
PN_API int pn_engine_add_job(pn_engine *e, uint32_t job, uint32_t generation, uint32_t base, uint32_t pool,
                             uint32_t workers, const int64_t *sources, uint32_t lanes);
/* pn_engine_add_job for a job with a role in a tree (tree NULL: a flat job, owners the identity). The
 * engine checks the role, the owner map and the uplink as passing/aggregator/jobs.py does. */
PN_API int pn_engine_add_tree_job(pn_engine *e, uint32_t job, uint32_t generation, uint32_t base, uint32_t pool,
                                  uint32_t workers, const int64_t *sources, uint32_t lanes, const pn_tree *tree);
PN_API int pn_engine_remove_job(pn_engine *e, uint32_t job);
/* job < 0: the totals. */
PN_API int pn_engine_counters(pn_engine *e, int64_t job, int64_t out[PN_COUNTERS]);

/* Apply datagrams (DATA, and GATHER and NACK to relay; at a leaf what comes down from its root) in arrival order: datagram i starts at in + i * in_stride, is lengths[i]
 * bytes long (only the first min(length, in_stride) bytes are read: a longer one is
 * malformed) and came from sources[i]. A datagram of 16 + 4 k bytes is a packet of k lanes,
 * admitted only for a job of k lanes. RESULTs go to out (one every pn_packet_size(the
 * engine's lanes) bytes, at most out_cap), with their length in out_length (their job's
 * packet size: the rest of the row is not part of them), their destination in out_dest and
 * whether they are a multicast replica (1) or a unicast answer (0) in out_multicast, in the
 * arrival order of the datagrams that caused them (a completion's replicas in worker order; an
 * ACK is PN_HEADER_SIZE long; relayed replicas are marked multicast). Stops
 * before a datagram whose RESULTs might not fit (at most PN_MAX_WORKERS each); returns how
 * many datagrams it consumed, *emitted how many RESULTs. */
PN_API size_t pn_engine_process(pn_engine *e, const uint8_t *in, size_t in_stride, const uint32_t *lengths,
                                const int64_t *sources, size_t n, uint8_t *out, int64_t *out_dest,
                                uint8_t *out_multicast, uint32_t *out_length, size_t out_cap, size_t *emitted);

/* ---- the AF_XDP I/O path (xsk.c; built where libxdp, libbpf and clang were at install) ---- */

typedef struct pn_xsk pn_xsk;

typedef struct {
    uint64_t rx_packets, tx_packets;   /* datagrams taken from / given to the XSK rings */
    uint64_t rx_foreign;               /* frames the XSK got that were not datagrams to its port (dropped) */
    uint64_t tx_spilled;               /* packets sent through the UDP socket: no MAC known for them yet */
    uint64_t kicks;                    /* sendto() calls that made the kernel transmit */
    uint64_t tx_waits;                 /* sends that found no free tx frame and waited for completions */
    uint64_t ring_rx_dropped, ring_rx_full, ring_fill_empty, ring_tx_invalid;  /* the kernel's XDP_STATISTICS */
    int32_t zerocopy;                  /* 1: the driver maps the frames (zero-copy); 0: copy mode */
    int32_t driver_mode;               /* 1: native (driver) XDP; 0: generic (SKB) XDP */
    uint32_t ifindex, queue;
} pn_xsk_stats;

/* 1 where this library was built with the AF_XDP path, else 0 (pn_xsk_open then always fails). */
PN_API int pn_xdp_built(void);
/* pn_xsk_open's flags */
#define PN_XSK_GENERIC 1        /* generic (SKB) XDP only, never the driver's */
#define PN_XSK_ZEROCOPY_ONLY 2  /* zero-copy or nothing (no copy mode): what io="auto" asks */

/* An XSK on queue `queue` of interface `ifindex`, beside the bound UDP socket `udp_fd` (local_ip:local_port,
 * host byte order), for packets of up to packet_size bytes: binds zero-copy where the driver supports it, else
 * copy mode (unless PN_XSK_ZEROCOPY_ONLY), and attaches the steering program (a BPF link: detached when the
 * process ends) in driver mode, else generic mode (PN_XSK_GENERIC: generic only). NULL with a one-line reason
 * in `error`. */
PN_API pn_xsk *pn_xsk_open(int udp_fd, uint32_t ifindex, uint32_t queue, uint32_t local_ip, uint32_t local_port,
                           uint32_t packet_size, int flags, char *error, uint32_t error_len);
PN_API void pn_xsk_close(pn_xsk *x);
PN_API void pn_xsk_get_stats(pn_xsk *x, pn_xsk_stats *out);
/* Tell it the MAC of a destination IP (host byte order) ahead of the first packet from it (it learns
 * the others from what it receives). PN_OK, or PN_EFULL. */
PN_API int pn_xsk_add_neighbor(pn_xsk *x, uint32_t ip, const uint8_t *mac);

/* ---- the software aggregator's data path: engine behind a UDP socket --------------- */

typedef struct pn_server pn_server;

typedef struct {
    uint64_t packets_sent, bytes_sent, packets_received, bytes_received;
    uint64_t ingress_dropped, ingress_duplicated, egress_dropped, egress_duplicated;
    uint64_t batches, send_errors;
    uint64_t gso_fallbacks;      /* GSO messages the kernel refused, resent as plain datagrams */
    int32_t last_errno;
} pn_server_stats;

/* fd: a bound, non-blocking UDP socket (GRO may be on); the server does not own it. */
PN_API pn_server *pn_server_new(pn_engine *e, int fd, uint32_t batch, int gso);
/* Serve through the XSK x (pn_xsk_open on the server's socket) beside the socket, before pn_server_run;
 * the server does not own it. PN_OK, PN_EINVAL or PN_ENOMEM. */
PN_API int pn_server_use_xsk(pn_server *s, pn_xsk *x);
PN_API void pn_server_free(pn_server *s);
/* Seeded drop / duplicate / reorder of received DATA (direction 0) or sent RESULTs (1),
 * for tests. */
PN_API int pn_server_impair(pn_server *s, int direction, double drop, double duplicate, int reorder,
                            uint64_t seed);
/* Blocks in poll() and serves until pn_server_stop(); returns PN_OK or PN_ESYS (errno in
 * the stats). Call it from one thread; the engine may be changed from others meanwhile. */
PN_API int pn_server_run(pn_server *s);
PN_API void pn_server_stop(pn_server *s);
PN_API void pn_server_get_stats(pn_server *s, pn_server_stats *out);

/* ---- the host streaming engine (mirrors passing/reduce_stream.py's ReduceStream) ---- */

#define PN_IN_F32 0
#define PN_IN_I32 1

typedef struct {
    /* the group */
    int fd;                      /* bound non-blocking UDP socket; GRO may be on */
    uint32_t lanes;
    uint32_t job, generation, worker;
    uint32_t op;                 /* PN_OP_SUM or PN_OP_MAX */
    uint32_t owner_packets;      /* 0: an allreduce. Else OWNER_ONLY rounds (reduce_scatter): packet i of
                                    the array belongs to owner i / owner_packets (a worker, or in a tree
                                    across racks a server's global number: < PN_OWNERS), whose RESULT it is
                                    (the others get an ACK); only the RESULTs' rows, this worker's, are written */
    /* the shards: packets [start[s], start[s] + count[s]) of the array go to aggregator s */
    uint32_t shards;
    const int64_t *aggregator;   /* packed ip << 16 | port */
    const uint32_t *pool;
    uint64_t *next_psn;          /* in: the shard's stream position p of its first packet, unwrapped;
                                    out: after this call. psn = p mod 2^32, slot = p mod pool,
                                    set = (p div pool) mod 2 (docs/protocol.md) */
    const uint64_t *start, *count;
    /* the data: elements values, padded with zeros to whole packets */
    int32_t kind;                /* PN_IN_F32 or PN_IN_I32 */
    const void *input;
    void *output;                /* same kind; may be input itself */
    uint64_t elements;
    const double *scale;         /* per shard, float input: x * scale rounded to int32 */
    /* loss recovery, in seconds; srtt/rttvar carry the round-trip estimate from call to call
     * (srtt < 0: none measured yet), last_loss when the group last saw evidence of loss
     * (CLOCK_MONOTONIC seconds; < 0: never). rto_min: the least a probe waits on a path with no
     * recent evidence of loss (and before the round trip is measured); max_rto: the most the
     * doublings of unanswered probes make the wait. */
    double rto_min, max_rto, timeout;
    double *srtt, *rttvar;
    double *last_loss;
    int32_t gso;                 /* in: try UDP GSO (a message the kernel refuses goes as plain
                                    datagrams, GSO stays on); out: as in */
    /* test impairment: drop this fraction each way, here */
    double drop;
    uint64_t *rng;               /* its generator's state */
    /* failover (docs/control.md): once no RESULT has come for `silence` seconds (0: never),
     * and every `silence_every` seconds after that, on_silence(silence_ctx) says whether to
     * keep waiting (0) or give the call up (nonzero: PN_ESILENT) */
    double silence, silence_every;
    int (*on_silence)(void *ctx);
    void *silence_ctx;
    /* GATHER packets of this group that arrive during the call (a faster peer's next all_gather,
     * docs/protocol.md): copied to `early` (rows of the packet size) with their sources, up to
     * early_cap; *early_count says how many (in: already there). early_cap 0: dropped. */
    uint8_t *early;
    int64_t *early_source;
    uint32_t early_cap;
    uint32_t *early_count;
    pn_xsk *xsk;                 /* the group's AF_XDP path beside fd (pn_xsk_open), or NULL: fd alone */
} pn_stream_call;

typedef struct {
    uint64_t packets_sent, bytes_sent, packets_received, bytes_received;
    uint64_t retransmissions, early_retransmissions, foreign_results;
    uint64_t gso_fallbacks;      /* GSO messages the kernel refused, resent as plain datagrams */
    uint8_t *overflow;           /* caller's array of `shards` bytes: 1 where a RESULT overflowed */
    /* on PN_ETIMEOUT: which packet; on PN_ESYS: errno and the call */
    uint32_t error_shard, error_psn, error_retries;
    int32_t error_errno;
    char error_call[16];
} pn_stream_report;

/* One allreduce pass of every shard's packets (a MAX round or a SUM), start to finish. */
PN_API int pn_stream_run(pn_stream_call *c, pn_stream_report *r);

/* ---- the all_gather stream (mirrors passing/gather_stream.py's GatherStream) -------- */

typedef struct {
    int fd;                      /* the group's socket, as pn_stream_call's */
    uint32_t lanes, job, generation, worker;  /* worker: this worker's bit at its aggregator (the header's) */
    uint32_t origins, number;    /* the pieces (the job's servers, at most PN_OWNERS) and this worker's, the
                                    `owner` of its GATHERs and of the NACKs it answers: its global number in a
                                    tree across racks, its worker index in a flat group */
    int64_t aggregator;          /* the first aggregator: GATHERs, NACKs and the completion round */
    uint32_t window;             /* this worker's packets sent ahead of what it holds from the slowest peer */
    uint64_t start;              /* the call's first gather position G (unwrapped) */
    const uint64_t *counts;      /* packets of each origin's piece */
    uint8_t *packets;            /* this worker's GATHER packets, counts[number] of the packet size, built */
    uint8_t *staged;             /* the pieces' lanes: origin o's packet i at row sum(counts[:o]) + i, 4 x lanes bytes */
    uint8_t *have;               /* per staged row: 1 when held (in: this worker's, and any kept from before) */
    uint8_t *completion;         /* the completion round's DATA packet, built; its psn is the round's */
    double rto_min, max_rto, timeout;
    double *srtt, *rttvar, *last_loss;  /* as pn_stream_call's */
    int32_t gso;
    double drop;                 /* test impairment, as pn_stream_call's */
    uint64_t *rng;
    uint8_t *early;              /* GATHERs of the next call, as pn_stream_call's */
    int64_t *early_source;
    uint32_t early_cap;
    uint32_t *early_count;
    int32_t completion_sum;      /* out: lane 0 of the completion round's RESULT (the workers, in step) */
    /* failover, as pn_stream_call's: once nothing has moved (no new packet of a piece, no
     * completion) for `silence` seconds (0: never), and every `silence_every` seconds after
     * that, on_silence(silence_ctx) says whether to keep waiting (0) or give the call up
     * (nonzero: PN_ESILENT) */
    double silence, silence_every;
    int (*on_silence)(void *ctx);
    void *silence_ctx;
    pn_xsk *xsk;                 /* as pn_stream_call's */
} pn_gather_call;

/* One all_gather: sends this worker's packets a window at a time, takes the others' into
 * `staged`, answers NACKs, sends its own after a silence, and ends at the completion round's
 * RESULT. PN_ETIMEOUT when nothing moved for `timeout` seconds; PN_ESILENT when on_silence
 * gave it up. */
PN_API int pn_gather_run(pn_gather_call *c, pn_stream_report *r);

/* max |x| of n float32 as its bit pattern, in one pass (passing/quantize.py's
 * max_abs_bits): any NaN gives the canonical NaN's 0x7FC00000, which sorts above
 * infinity's 0x7F800000. finite_only: over the finite values alone (0 when none). */
PN_API uint32_t pn_max_abs_bits(const float *x, size_t n, int finite_only);

/* ---- the in-host stage's bulk moves (passing/torch/in_host.py; torch's copy_ and add
 * are the specification, bit for bit) ------------------------------------------------ */

/* From PN_STREAM_BYTES of output on, the stores bypass the cache (non-temporal): an
 * in-host piece is far larger than the cache, so a normal store would first read the
 * line it overwrites, a third of the memory traffic of a copy. Below, normal stores. */
#define PN_STREAM_BYTES (256u * 1024u)

/* dst[i] = src[i] for i < n; the two do not overlap. */
PN_API void pn_copy_f32(float *dst, const float *src, size_t n);

/* dst[i] = ((srcs[0][i] + srcs[1][i]) + srcs[2][i]) + ... over k >= 1 sources, in that
 * order (so the same bits as adding them one by one); dst overlaps none of them. */
PN_API void pn_sum_f32(float *dst, const float *const *srcs, uint32_t k, size_t n);

#endif
