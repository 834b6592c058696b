/* Unrolling over the payload's lanes: P4 has no loops in controls. PASSING_LANES may be
 * 4, 8, 16, 32 or 64. FOR_EACH_LANE(M) calls M(i) for every lane i (a literal, so M can
 * paste it into a field name); FOR_EACH_PAIR(M) calls M(k, a, b) for the lane pairs
 * k = (a, b) = (2k, 2k + 1), for targets that keep two lanes per register (TNA). */
#ifndef PASSING_LANES_P4
#define PASSING_LANES_P4

#include "constants.p4"

#define PASSING_IDS_4(M) M(0) M(1) M(2) M(3)
#define PASSING_IDS_8(M) PASSING_IDS_4(M) M(4) M(5) M(6) M(7)
#define PASSING_IDS_16(M) PASSING_IDS_8(M) M(8) M(9) M(10) M(11) M(12) M(13) M(14) M(15)
#define PASSING_IDS_32(M) PASSING_IDS_16(M) M(16) M(17) M(18) M(19) M(20) M(21) M(22) M(23) \
    M(24) M(25) M(26) M(27) M(28) M(29) M(30) M(31)
#define PASSING_IDS_64(M) PASSING_IDS_32(M) M(32) M(33) M(34) M(35) M(36) M(37) M(38) M(39) \
    M(40) M(41) M(42) M(43) M(44) M(45) M(46) M(47) M(48) M(49) M(50) M(51) M(52) M(53) \
    M(54) M(55) M(56) M(57) M(58) M(59) M(60) M(61) M(62) M(63)

#define PASSING_PAIRS_2(M) M(0, 0, 1) M(1, 2, 3)
#define PASSING_PAIRS_4(M) PASSING_PAIRS_2(M) M(2, 4, 5) M(3, 6, 7)
#define PASSING_PAIRS_8(M) PASSING_PAIRS_4(M) M(4, 8, 9) M(5, 10, 11) M(6, 12, 13) \
    M(7, 14, 15)
#define PASSING_PAIRS_16(M) PASSING_PAIRS_8(M) M(8, 16, 17) M(9, 18, 19) M(10, 20, 21) \
    M(11, 22, 23) M(12, 24, 25) M(13, 26, 27) M(14, 28, 29) M(15, 30, 31)
#define PASSING_PAIRS_32(M) PASSING_PAIRS_16(M) M(16, 32, 33) M(17, 34, 35) M(18, 36, 37) \
    M(19, 38, 39) M(20, 40, 41) M(21, 42, 43) M(22, 44, 45) M(23, 46, 47) M(24, 48, 49) \
    M(25, 50, 51) M(26, 52, 53) M(27, 54, 55) M(28, 56, 57) M(29, 58, 59) M(30, 60, 61) \
    M(31, 62, 63)

#if PASSING_LANES == 64
#define FOR_EACH_LANE(M) PASSING_IDS_64(M)
#define FOR_EACH_PAIR(M) PASSING_PAIRS_32(M)
#elif PASSING_LANES == 32
#define FOR_EACH_LANE(M) PASSING_IDS_32(M)
#define FOR_EACH_PAIR(M) PASSING_PAIRS_16(M)
#elif PASSING_LANES == 16
#define FOR_EACH_LANE(M) PASSING_IDS_16(M)
#define FOR_EACH_PAIR(M) PASSING_PAIRS_8(M)
#elif PASSING_LANES == 8
#define FOR_EACH_LANE(M) PASSING_IDS_8(M)
#define FOR_EACH_PAIR(M) PASSING_PAIRS_4(M)
#elif PASSING_LANES == 4
#define FOR_EACH_LANE(M) PASSING_IDS_4(M)
#define FOR_EACH_PAIR(M) PASSING_PAIRS_2(M)
#else
#error "PASSING_LANES must be 4, 8, 16, 32 or 64"
#endif

#endif
