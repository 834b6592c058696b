/* Unrolling over the payload's lanes: P4 has no loops in controls, and a header stack
 * index must be a compile-time constant. PASSING_LANES may be 4, 16 or 64. */
#ifndef PASSING_LANES_P4
#define PASSING_LANES_P4

#include "constants.p4"

#define PASSING_REPEAT_4(M, b) M(b + 0) M(b + 1) M(b + 2) M(b + 3)
#define PASSING_REPEAT_16(M, b) \
    PASSING_REPEAT_4(M, b + 0) PASSING_REPEAT_4(M, b + 4) PASSING_REPEAT_4(M, b + 8) PASSING_REPEAT_4(M, b + 12)
#define PASSING_REPEAT_64(M, b) \
    PASSING_REPEAT_16(M, b + 0) PASSING_REPEAT_16(M, b + 16) PASSING_REPEAT_16(M, b + 32) PASSING_REPEAT_16(M, b + 48)

#if PASSING_LANES == 64
#define FOR_EACH_LANE(M) PASSING_REPEAT_64(M, 0)
#elif PASSING_LANES == 16
#define FOR_EACH_LANE(M) PASSING_REPEAT_16(M, 0)
#elif PASSING_LANES == 4
#define FOR_EACH_LANE(M) PASSING_REPEAT_4(M, 0)
#else
#error "PASSING_LANES must be 4, 16 or 64"
#endif

#endif
