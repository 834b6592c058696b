/* Unrolling over the payload's lanes: P4 has no loops in controls. PASSING_LANES may be
 * 4, 8, 16, 32, 64, 72 or 128 (72, 128: for Tofino 2). FOR_EACH_LANE(M) calls M(i) for
 * every lane i (a literal, so M can paste it into a field name); FOR_EACH_PAIR(M) calls
 * M(k, a, b) for the lane pairs k = (a, b) = (2k, 2k + 1), for targets that keep two lanes
 * per register (TNA, T2NA). */
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
#define PASSING_IDS_72(M) PASSING_IDS_64(M) M(64) M(65) M(66) M(67) M(68) M(69) M(70) M(71)
#define PASSING_IDS_128(M) PASSING_IDS_72(M) M(72) M(73) \
    M(74) M(75) M(76) M(77) M(78) M(79) M(80) M(81) M(82) M(83) \
    M(84) M(85) M(86) M(87) M(88) M(89) M(90) M(91) M(92) M(93) \
    M(94) M(95) M(96) M(97) M(98) M(99) M(100) M(101) M(102) M(103) \
    M(104) M(105) M(106) M(107) M(108) M(109) M(110) M(111) M(112) M(113) \
    M(114) M(115) M(116) M(117) M(118) M(119) M(120) M(121) M(122) M(123) \
    M(124) M(125) M(126) M(127)

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
#define PASSING_PAIRS_36(M) PASSING_PAIRS_32(M) M(32, 64, 65) M(33, 66, 67) M(34, 68, 69) \
    M(35, 70, 71)
#define PASSING_PAIRS_64(M) PASSING_PAIRS_36(M) \
    M(36, 72, 73) M(37, 74, 75) M(38, 76, 77) M(39, 78, 79) \
    M(40, 80, 81) M(41, 82, 83) M(42, 84, 85) M(43, 86, 87) \
    M(44, 88, 89) M(45, 90, 91) M(46, 92, 93) M(47, 94, 95) \
    M(48, 96, 97) M(49, 98, 99) M(50, 100, 101) M(51, 102, 103) \
    M(52, 104, 105) M(53, 106, 107) M(54, 108, 109) M(55, 110, 111) \
    M(56, 112, 113) M(57, 114, 115) M(58, 116, 117) M(59, 118, 119) \
    M(60, 120, 121) M(61, 122, 123) M(62, 124, 125) M(63, 126, 127)

#if PASSING_LANES == 128
#define FOR_EACH_LANE(M) PASSING_IDS_128(M)
#define FOR_EACH_PAIR(M) PASSING_PAIRS_64(M)
#elif PASSING_LANES == 72
#define FOR_EACH_LANE(M) PASSING_IDS_72(M)
#define FOR_EACH_PAIR(M) PASSING_PAIRS_36(M)
#elif PASSING_LANES == 64
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
#error "PASSING_LANES must be 4, 8, 16, 32, 64, 72 or 128"
#endif

#endif
