/* Preconditions for P4Testgen (docs/tofino.md, "Executed by P4Testgen"), compiled only when
 * p4/testgen_vectors.py defines PASSING_TESTGEN: a compiler for a target never sees them.
 *
 * They keep P4Testgen inside what the controller installs and what the protocol reaches; any
 * other input P4Testgen may still choose (the checker says which protocol rule decides it).
 *   admission: an admitted (job, worker) has the allocation the controller gives
 *     (controller/passing_controller/allocation.py): job id 1..1023, `full` = 2^n - 1 with the
 *     worker's bit in it, base .. base + pool - 1 a range of the slot table, epoch =
 *     job << 16 | generation, group = job + 1.
 *   PASSING_TESTGEN == 1: the first pass only (a packet from a port, not recirculated);
 *   PASSING_TESTGEN == 2: the second pass only, with the bridged header a first pass writes.
 *   PASSING_TESTGEN_DATA: the lanes the packet and the registers carry are shaped so that each
 *     vector has non-zero lanes of both signs, sums that saturate and sums that do not (below).
 *   PASSING_TESTGEN_PIN: one step of a sequence. p4/testgen_vectors.py writes passing_pin.p4
 *     (found through -I) with the exact input, admission entry and register values of the
 *     packet's slot/set, so that P4Testgen executes that packet on that state and nothing else. */
#ifndef PASSING_TESTGEN_P4
#define PASSING_TESTGEN_P4

#ifdef PASSING_TESTGEN
extern void testgen_assume(in bool assumption);  /* P4Testgen's own extern */
#define PASSING_ASSUME(condition) testgen_assume(condition);
#else
#define PASSING_ASSUME(condition)
#endif

#ifdef PASSING_TESTGEN_PIN
#include "passing_pin.p4"
#else
#define PASSING_PIN_INPUT true
#define PASSING_PIN_ADMIT(base, pool, full, epoch, group) true
#define PASSING_PIN_ROUND(value) true
#define PASSING_PIN_CONTRIBUTORS(value) true
#define PASSING_PIN_OVERFLOW(value) true
#define PASSING_PIN_PAIR(k, value) true
#endif

/* at the start of the ingress: the pinned input, and the shaped lanes (pair k of class k % 4:
 * 0: lane 2k small negative, 2k + 1 small positive; 1: both large positive; 2: both large negative;
 * 3: any) */
#ifdef PASSING_TESTGEN_DATA
#define PASSING_TESTGEN_LANES_SHAPE(k, a, b)                                                    \
    PASSING_ASSUME(!hdr.lanes.isValid()                                                      \
        || (k % 4 == 0 && (int<32>)hdr.lanes.value_##a < 0                                    \
                       && (int<32>)hdr.lanes.value_##a > -0x40000000                          \
                       && (int<32>)hdr.lanes.value_##b > 0                                    \
                       && (int<32>)hdr.lanes.value_##b < 0x40000000)                          \
        || (k % 4 == 1 && (int<32>)hdr.lanes.value_##a > 0x40000000                           \
                       && (int<32>)hdr.lanes.value_##b > 0x40000000)                          \
        || (k % 4 == 2 && (int<32>)hdr.lanes.value_##a < -0x40000000                          \
                       && (int<32>)hdr.lanes.value_##b < -0x40000000)                         \
        || k % 4 == 3)
/* a stored pair of the same class: with a packet's lanes, class 0 sums without saturating,
 * class 1 saturates at INT32_MAX, class 2 at INT32_MIN */
#define PASSING_TESTGEN_PAIR_SHAPE(k, value)                                                    \
    PASSING_ASSUME((k % 4 == 0 && (value).first < 0 && (value).first > -0x40000000             \
                           && (value).second > 0 && (value).second < 0x40000000)              \
        || (k % 4 == 1 && (value).first > 0x40000000 && (value).second > 0x40000000)           \
        || (k % 4 == 2 && (value).first < -0x40000000 && (value).second < -0x40000000)         \
        || k % 4 == 3)
#define PASSING_TESTGEN_INPUT_SHAPE FOR_EACH_PAIR(PASSING_TESTGEN_LANES_SHAPE)
#else
#define PASSING_TESTGEN_PAIR_SHAPE(k, value)
#define PASSING_TESTGEN_INPUT_SHAPE
#endif
#define PASSING_TESTGEN_INPUT                                                                   \
    PASSING_ASSUME(PASSING_PIN_INPUT)                                                          \
    PASSING_TESTGEN_INPUT_SHAPE

/* in the admission action: the allocation the controller writes */
#define PASSING_TESTGEN_ALLOCATION(base, pool, full)                                          \
    PASSING_ASSUME((full) != 0 && ((full) & ((full) + 1)) == 0)                                \
    PASSING_ASSUME((pool) != 0 && (base) <= PASSING_SLOTS                                      \
                   && (bit<32>)(pool) <= PASSING_SLOTS - (base))
#define PASSING_TESTGEN_ADMISSION(base, pool, full, epoch, group)                             \
    PASSING_TESTGEN_ALLOCATION(base, pool, full)                                               \
    PASSING_ASSUME(hdr.passing.job >= 1 && hdr.passing.job < PASSING_MAX_JOBS                  \
                   && (epoch) == ((bit<32>)hdr.passing.job << 16 | (bit<32>)hdr.passing.generation) \
                   && (group) == hdr.passing.job + 1)                                          \
    PASSING_ASSUME(PASSING_PIN_ADMIT(base, pool, full, epoch, group))
/* once the worker's bit is known: an admitted worker is one of the job's */
#define PASSING_TESTGEN_MEMBER(admitted, full, worker_bit) \
    PASSING_ASSUME((admitted) == 0 || ((full) & (worker_bit)) != 0)

/* The registers of a slot/set hold a state the protocol reaches: a round that is not new
 * (round_check said so) has a contributors' entry of the same round, with some of the job's
 * workers and no others, and an OVERFLOW flag of 0 or 1. round_check notes the round it
 * read for bitmap_join (P4Testgen runs both on one path). */
#ifdef PASSING_TESTGEN
#define PASSING_TESTGEN_METADATA bit<32> testgen_tag;
#define PASSING_TESTGEN_ROUND_READ(round) meta.testgen_tag = (round).tag; PASSING_ASSUME(PASSING_PIN_ROUND(round))
#else
#define PASSING_TESTGEN_METADATA
#define PASSING_TESTGEN_ROUND_READ(round)
#endif
#define PASSING_TESTGEN_CONTRIBUTORS_READ(contributors)                                         \
    PASSING_ASSUME((contributors).psn == meta.testgen_tag && (contributors).bitmap != 0        \
                   && ((contributors).bitmap & ~meta.full) == 0)                               \
    PASSING_ASSUME(PASSING_PIN_CONTRIBUTORS(contributors))
#define PASSING_TESTGEN_OVERFLOW_READ(flag) \
    PASSING_ASSUME((flag) <= 1)             \
    PASSING_ASSUME(PASSING_PIN_OVERFLOW(flag))
/* a lane pair read by add, max or harvest */
#define PASSING_TESTGEN_PAIR_READ(k, value) \
    PASSING_TESTGEN_PAIR_SHAPE(k, value)    \
    PASSING_ASSUME(PASSING_PIN_PAIR(k, value))

#endif
