/* What the host's two stream loops share (stream.c: a reduce pass; gather.c: an all_gather): time, the one
 * blocking step, failover's silence rule, the sends of an iteration with their test impairment, and loss
 * recovery's estimates and waits. Internal to the library (not part of its ABI).
 *
 * Loss recovery's rules (RACK, probes, the RTT estimate, the silence rule) and constants: passing/recovery.py
 * mirrors them for the numpy streams, and a change to one is a change to the other. */
#ifndef PASSING_STREAM_LOOP_H
#define PASSING_STREAM_LOOP_H

#include <stddef.h>
#include <stdint.h>

#include "passing_native.h"
#include "udp.h"

#define REORDER_FRACTION 0.25 /* reordering allowance: a quarter of the round trip (RFC 8985) */
#define REORDER_MIN_S 200e-6 /* and at least this: RESULTs come in batches */
#define PROBE_MIN_S 1e-3     /* a probe waits at least this */
#define MAX_WAIT_S 0.05      /* the longest single wait: timers are checked at least this often */
#define RECV_BATCH 64        /* messages per recvmmsg */
#define SEND_TIMEOUT_MS 5000 /* a send buffer full this long is an error */
#define LOSS_MEMORY_S 10.0    /* evidence of loss this recent makes a probe wait what the estimates say */
#define MAX_PROBE_DOUBLINGS 6 /* unanswered probes double the wait, up to 64 x (and max_rto): a dead aggregator is told by `timeout` */

double pn_now(void);

/* Both loops' one blocking step: wait up to `wait` seconds (at most MAX_WAIT_S) for the socket, then take
 * what has arrived. Returns the datagrams received (0 when the wait ran out) or -1 with the failed call in
 * the report. */
int pn_wait_and_receive(pn_udp *udp, double wait, pn_datagram *got, uint32_t capacity, pn_stream_report *r);

/* Failover, the same rule for the reduce and the all_gather loops (docs/control.md): once nothing
 * has been heard for `silence` seconds since `last_heard`, ask on_silence(ctx), then every
 * `silence_every` seconds while it says wait. *check is when to ask next. Returns nonzero when
 * on_silence gave the call up. */
int pn_silence_gives_up(double silence, double silence_every, int (*on_silence)(void *), void *ctx, double now,
                        double last_heard, double *check);

/* splitmix64: the test impairment's generator; its state lives with the caller. Uniform in [0, 1). */
double pn_uniform(uint64_t *state);

/* The sends of one loop iteration: queued, then flushed as one sendmmsg. */
typedef struct {
    const uint8_t **packets;
    int64_t *dest;
    uint32_t count, cap;
} pn_send_queue;

int pn_send_queue_init(pn_send_queue *q, uint32_t cap); /* 1, or 0 when out of memory */
void pn_send_queue_free(pn_send_queue *q);
/* A queue is sized for every send of a loop iteration; were it ever full, the packet would be resent
 * as if it were lost. */
void pn_send_queue_add(pn_send_queue *q, const uint8_t *packet, int64_t dest);
/* Send what is queued (less what the test impairment `drop` loses on the way out, drawn from rng) and
 * empty the queue; the bytes and packets that left are counted in the report. PN_OK or PN_ESYS. */
int pn_send_queue_flush(pn_send_queue *q, pn_udp *udp, size_t packet_size, double drop, uint64_t *rng,
                        pn_stream_report *r);

/* A group's loss-recovery estimates (they outlive each call: the caller's pn_stream_call / pn_gather_call
 * hold them) and its settings. */
typedef struct {
    double srtt, rttvar;  /* smoothed round trip (< 0: none measured yet) and its variation */
    double last_loss;     /* when the group last saw evidence of loss (< 0: never) */
    double rto_min, max_rto;
} pn_recovery;

/* RFC 6298 smoothing of the round-trip estimate; the first sample (srtt < 0: none yet) sets it. Inline: the
 * streams take a sample per answered packet. */
static inline void pn_smooth(pn_recovery *rec, double sample) {
    if (rec->srtt < 0) {
        rec->srtt = sample;
        rec->rttvar = sample / 2;
        return;
    }
    double deviation = rec->srtt - sample;
    rec->rttvar = 0.75 * rec->rttvar + 0.25 * (deviation < 0 ? -deviation : deviation);
    rec->srtt = 0.875 * rec->srtt + 0.125 * sample;
}
/* Two smoothed round trips (RFC 8985's PTO; rto_min before one is measured), 1 ms at least. */
double pn_probe_timeout(const pn_recovery *rec);
/* How long a stream may stay silent before a probe, after `probes` unanswered ones: a probe's wait where the
 * path has lately shown loss, else rto_min at least (a late peer, not a loss); each unanswered probe doubles it,
 * up to max_rto (or that wait, if longer). */
double pn_probe_wait(const pn_recovery *rec, double now, uint32_t probes);

#endif
