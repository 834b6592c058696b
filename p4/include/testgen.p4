/* Preconditions for P4Testgen (docs/tofino.md, "Executed by P4Testgen"), compiled only when
 * p4/testgen_vectors.py defines PASSING_TESTGEN: a compiler for a target never sees them.
 *
 * They keep P4Testgen inside what the controller installs and what a first pass sends into
 * the second; any other input P4Testgen may still choose (the checker says which protocol
 * rule decides it).
 *   admission: an admitted (job, worker) has the allocation the controller gives
 *     (controller/passing_controller/allocation.py): `full` = 2^n - 1 with the worker's bit
 *     in it, and base .. base + pool - 1 a range of the slot table.
 *   PASSING_TESTGEN == 1: the first pass only (a packet from a port, not recirculated);
 *   PASSING_TESTGEN == 2: the second pass only, with the bridged header a first pass writes. */
#ifndef PASSING_TESTGEN_P4
#define PASSING_TESTGEN_P4

#ifdef PASSING_TESTGEN
extern void testgen_assume(in bool assumption);  /* P4Testgen's own extern */
#define PASSING_ASSUME(condition) testgen_assume(condition)
#else
#define PASSING_ASSUME(condition)/* the registers of a slot/set hold a state the protocol reaches: a round that is not new
 * (round_check said so) has a contributors' entry of the same round, with some of the job's
 * workers and no others, and an OVERFLOW flag of 0 or 1. round_check notes the round it
 * read for bitmap_join (P4Testgen runs both on one path). */
#ifdef PASSING_TESTGEN
#define PASSING_TESTGEN_METADATA bit<32> testgen_tag;
#define PASSING_TESTGEN_ROUND_READ(round) meta.testgen_tag = (round).tag;
#else
#define PASSING_TESTGEN_METADATA
#define PASSING_TESTGEN_ROUND_READ(round)
#endif
#define PASSING_TESTGEN_CONTRIBUTORS_READ(contributors)                                         \
    PASSING_ASSUME((contributors).psn == meta.testgen_tag && (contributors).bitmap != 0        \
                   && ((contributors).bitmap & ~meta.full) == 0);
#define PASSING_TESTGEN_OVERFLOW_READ(flag) PASSING_ASSUME((flag) <= 1);

#endif

/* in the admission action: the allocation's shape */
#define PASSING_TESTGEN_ALLOCATION(base, pool, full)                                          \
    PASSING_ASSUME((full) != 0 && ((full) & ((full) + 1)) == 0);                               \
    PASSING_ASSUME((pool) != 0 && (base) <= PASSING_SLOTS                                      \
                   && (bit<32>)(pool) <= PASSING_SLOTS - (base));
/* once the worker's bit is known: an admitted worker is one of the job's */
#define PASSING_TESTGEN_MEMBER(admitted, full, worker_bit) \
    PASSING_ASSUME((admitted) == 0 || ((full) & (worker_bit)) != 0);
/* the registers of a slot/set hold a state the protocol reaches: a round that is not new
 * (round_check said so) has a contributors' entry of the same round, with some of the job's
 * workers and no others, and an OVERFLOW flag of 0 or 1. round_check notes the round it
 * read for bitmap_join (P4Testgen runs both on one path). */
#ifdef PASSING_TESTGEN
#define PASSING_TESTGEN_METADATA bit<32> testgen_tag;
#define PASSING_TESTGEN_ROUND_READ(round) meta.testgen_tag = (round).tag;
#else
#define PASSING_TESTGEN_METADATA
#define PASSING_TESTGEN_ROUND_READ(round)
#endif
#define PASSING_TESTGEN_CONTRIBUTORS_READ(contributors)                                         \
    PASSING_ASSUME((contributors).psn == meta.testgen_tag && (contributors).bitmap != 0        \
                   && ((contributors).bitmap & ~meta.full) == 0);
#define PASSING_TESTGEN_OVERFLOW_READ(flag) PASSING_ASSUME((flag) <= 1);

#endif
