/* Inside PassingIngress of both Tofino programs (p4/tna, p4/t2na): the per-job counters and
 * the registers that decide a round (slot_tag, slot_bitmap, slot_overflow) with their
 * RegisterActions. Needs `hdr`, and `meta` with epoch, worker_bit, full and flagged
 * (docs/tofino.md, "How the state machine maps onto Tofino"). */
    /* ---- outcomes, per job (index = job id mod PASSING_MAX_JOBS) ---- */
    Counter<bit<32>, bit<32>>(1, CounterType_t.PACKETS) malformed;
    Counter<bit<32>, bit<32>>(PASSING_MAX_JOBS, CounterType_t.PACKETS) received;
    Counter<bit<32>, bit<32>>(PASSING_MAX_JOBS, CounterType_t.PACKETS) rejected;
    Counter<bit<32>, bit<32>>(PASSING_MAX_JOBS, CounterType_t.PACKETS) aggregated;
    Counter<bit<32>, bit<32>>(PASSING_MAX_JOBS, CounterType_t.PACKETS) completed;
    Counter<bit<32>, bit<32>>(PASSING_MAX_JOBS, CounterType_t.PACKETS) duplicate;
    Counter<bit<32>, bit<32>>(PASSING_MAX_JOBS, CounterType_t.PACKETS) duplicate_answered;
    Counter<bit<32>, bit<32>>(PASSING_MAX_JOBS, CounterType_t.PACKETS) stale;
    Counter<bit<32>, bit<32>>(PASSING_MAX_JOBS, CounterType_t.PACKETS) overflow;
    Counter<bit<32>, bit<32>>(PASSING_MAX_JOBS, CounterType_t.PACKETS) relayed;

    /* ---- state per slot and set: entry set * PASSING_SLOTS + base + slot ---- */
    Hash<bit<32>>(HashAlgorithm_t.IDENTITY) slot_set_index;
    /* Which round the slot/set holds, for which allocation: a packet ahead of the tag,
     * or of another allocation (epoch), starts a new round. */
    Register<round_t, bit<32>>(PASSING_SLOT_SETS) slot_tag;
    RegisterAction<round_t, bit<32>, bit<8>>(slot_tag) round_check = {
        void apply(inout round_t value, out bit<8> fresh) {
            PASSING_TESTGEN_ROUND_READ(value)
            if (value.epoch != meta.epoch || (int<32>)(hdr.passing.psn - value.tag) > 0) {
                value.tag = hdr.passing.psn;
                value.epoch = meta.epoch;
                fresh = 1;
            }
        }
    };

    /* Who contributed to the round, and the round's psn again (one register, one access:
     * slot_tag cannot also say "same round or stale"). */
    Register<contributors_t, bit<32>>(PASSING_SLOT_SETS) slot_bitmap;
    RegisterAction<contributors_t, bit<32>, bit<32>>(slot_bitmap) bitmap_start = {
        void apply(inout contributors_t value) {
            PASSING_ASSUME(PASSING_PIN_CONTRIBUTORS(value))  /* a sequence's state, though not read */
            value.bitmap = meta.worker_bit;
            value.psn = hdr.passing.psn;
        }
    };
    /* the bitmap before this worker's bit, or 0 for a packet behind the round (stale):
     * a round in progress always has at least one bit */
    RegisterAction<contributors_t, bit<32>, bit<32>>(slot_bitmap) bitmap_join = {
        void apply(inout contributors_t value, out bit<32> before) {
            PASSING_TESTGEN_CONTRIBUTORS_READ(value)
            if (value.psn == hdr.passing.psn) {
                before = value.bitmap;
                value.bitmap = value.bitmap | meta.worker_bit;
            }
        }
    };

    /* OR of the contributions' flags; a duplicate ORs the flag it already brought */
    Register<bit<8>, bit<32>>(PASSING_SLOT_SETS) slot_overflow;
    RegisterAction<bit<8>, bit<32>, bit<8>>(slot_overflow) overflow_start = {
        void apply(inout bit<8> value, out bit<8> now) {
            PASSING_ASSUME(PASSING_PIN_OVERFLOW(value))
            value = meta.flagged;
            now = value;
        }
    };
    RegisterAction<bit<8>, bit<32>, bit<8>>(slot_overflow) overflow_join = {
        void apply(inout bit<8> value, out bit<8> now) {
            PASSING_TESTGEN_OVERFLOW_READ(value)
            value = value | meta.flagged;
            now = value;
        }
    };
