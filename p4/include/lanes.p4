/* Unrolling over the payload's lanes: P4 has no loops in controls, and a header stack
 * index must be a compile-time constant. PASSING_LANES may be 4, 8, 16, 32 or 64.
 * FOR_EACH_LANE(M) calls M(i) with an expression for i; FOR_EACH_PAIR_ID(M) calls M(k) for
 * the lane pairs (2k, 2k + 1), for targets that keep two lanes per register (TNA). */
#ifndef PASSING_LANES_P4
#define PASSING_LANES_P4

#include "constants.p4"

#define PASSING_REPEAT_4(M, b) M(b + 0) M(b + 1) M(b + 2) M(b + 3)
#define PASSING_REPEAT_8(M, b) PASSING_REPEAT_4(M, b + 0) PASSING_REPEAT_4(M, b + 4)
#define PASSING_REPEAT_16(M, b) PASSING_REPEAT_8(M, b + 0) PASSING_REPEAT_8(M, b + 8)
#define PASSING_REPEAT_32(M, b) PASSING_REPEAT_16(M, b + 0) PASSING_REPEAT_16(M, b + 16)
#define PASSING_REPEAT_64(M, b) PASSING_REPEAT_32(M, b + 0) PASSING_REPEAT_32(M, b + 32)

#define PASSING_IDS_2(M) M(0) M(1)
#define PASSING_IDS_4(M) PASSING_IDS_2(M) M(2) M(3)
#define PASSING_IDS_8(M) PASSING_IDS_4(M) M(4) M(5) M(6) M(7)
#define PASSING_IDS_16(M) PASSING_IDS_8(M) M(8) M(9) M(10) M(11) M(12) M(13) M(14) M(15)
#define PASSING_IDS_32(M) PASSING_IDS_16(M) M(16) M(17) M(18) M(19) M(20) M(21) M(22) M(23) \
    M(24) M(25) M(26) M(27) M(28) M(29) M(30) M(31)

#if PASSING_LANES == 64
#define FOR_EACH_LANE(M) PASSING_REPEAT_64(M, 0)
#define FOR_EACH_PAIR_ID(M) PASSING_IDS_32(M)
#elif PASSING_LANES == 32
#define FOR_EACH_LANE(M) PASSING_REPEAT_32(M, 0)
#define FOR_EACH_PAIR_ID(M) PASSING_IDS_16(M)
#elif PASSING_LANES == 16
#define FOR_EACH_LANE(M) PASSING_REPEAT_16(M, 0)
#define FOR_EACH_PAIR_ID(M) PASSING_IDS_8(M)
#elif PASSING_LANES == 8
#define FOR_EACH_LANE(M) PASSING_REPEAT_8(M, 0)
#define FOR_EACH_PAIR_ID(M) PASSING_IDS_4(M)
#elif PASSING_LANES == 4
#define FOR_EACH_LANE(M) PASSING_REPEAT_4(M, 0)
#define FOR_EACH_PAIR_ID(M) PASSING_IDS_2(M)
#else
#error "PASSING_LANES must be 4, 8, 16, 32 or 64"
#endif

#endif
