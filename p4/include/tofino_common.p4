/* What the Tofino 1 (p4/tna) and Tofino 2 (p4/t2na) programs share outside their controls:
 * the register entry of a slot/set, what a lane pair does, the verdicts, the registers' entry
 * types (docs/tofino.md). Included after headers.p4 and lanes.p4. */
#ifndef PASSING_TOFINO_COMMON_P4
#define PASSING_TOFINO_COMMON_P4

#define PASSING_SLOT_SETS (2 * PASSING_SLOTS)
#define PASSING_SLOT_BITS 10
#if (1 << PASSING_SLOT_BITS) != PASSING_SLOTS
#error "PASSING_SLOT_BITS must be log2(PASSING_SLOTS)"
#endif

/* what every lane pair does with this packet */
#define LANE_NONE 0
#define LANE_WRITE 1
#define LANE_ADD 2
#define LANE_MAX 3

/* what the first pass decided */
#define VERDICT_NONE 0
#define VERDICT_REJECTED 1
#define VERDICT_STALE 2
#define VERDICT_DUPLICATE 3
#define VERDICT_CONTRIBUTED 4
#define VERDICT_ANSWER 5
#define VERDICT_RELAY 6

struct round_t {
    bit<32> tag;    /* psn of the round the slot/set holds */
    bit<32> epoch;  /* allocation that wrote it */
}

struct contributors_t {
    bit<32> bitmap;
    bit<32> psn;    /* = round_t.tag */
}

struct lane_pair_t {
    int<32> first;   /* lane 2k */
    int<32> second;  /* lane 2k + 1 */
}

#endif
