/* The aggregation engine's entry points for the rest of the library (server.c), not
 * part of its ABI: the server holds the engine's lock from processing a chunk of
 * datagrams until their RESULTs are sent, so that counters read meanwhile (control
 * channel) only ever count packets whose RESULTs are on their way. */
#ifndef PASSING_ENGINE_H
#define PASSING_ENGINE_H

#include <stddef.h>
#include <stdint.h>

#include "passing_native.h"

void pn_engine_lock(pn_engine *e);
void pn_engine_unlock(pn_engine *e);
size_t pn_engine_packet_bytes(const pn_engine *e); /* of the widest packet: a RESULT row */

/* pn_engine_process for datagrams scattered in memory (datagram i: packets[i], lengths[i]
 * readable bytes), with the lock already held. */
size_t pn_engine_process_locked(pn_engine *e, const uint8_t *const *packets, const uint32_t *lengths,
                                const int64_t *sources, size_t n, uint8_t *out, int64_t *out_dest,
                                uint8_t *out_multicast, uint32_t *out_length, size_t out_cap, size_t *emitted);

/* Stable sort of the indices a[0..n) by key[a[i]] (bottom-up merge sort, b as scratch);
 * returns whichever of a and b holds the result. */
uint32_t *pn_stable_order(const int64_t *key, uint32_t *a, uint32_t *b, size_t n);

#endif
