/* The tree roles on Tofino (docs/protocol.md, "Trees across racks"; docs/tofino.md, "The tree roles"):
 * what a Tofino program that takes them needs outside its controls. Included after
 * tofino_common.p4; p4/include/tofino_tree.p4 (ingress) and tofino_tree_egress.p4 (egress) use it. */
#ifndef PASSING_TOFINO_TREE_COMMON_P4
#define PASSING_TOFINO_TREE_COMMON_P4

/* A leaf's multicast group holds, besides its servers, one replica out of its uplink port with this
 * replication id: a server's GATHER's copy up (controller tree_roles.UP_RID, PASSING_UP_RID of
 * p4/v1model/passing.p4); every other packet drops it in egress. */
#define PASSING_UP_RID 255
#define PASSING_NO_RID 0xFFFF  /* an owner that is no replica of the job's group */

/* what the tree adds to the verdicts of tofino_common.p4 */
#define VERDICT_UP 7          /* a leaf's NACK for a server of another rack: up, as sent */
#define VERDICT_ANSWERED 8    /* the root's RESULT or ACK answered the leaf's round */
#define VERDICT_LATE 9        /* the root's RESULT or ACK that no round waited for */

/* Ingress -> egress, behind the bridged header: what a tree job's replicas need. Always valid on
 * the way to the egress (zero for a flat job's packet). */
header tree_bridged_h {
    bit<16> owner_rid;      /* a tree job's owner as a replication id (its worker here), PASSING_NO_RID for none */
    bit<16> up_job;         /* a leaf's uplink (tree_role): a GATHER's copy up is the root's job's packet */
    bit<16> up_generation;
    bit<8> up_worker;
    bit<48> up_mac;
    bit<32> up_ip;
    bit<3> pad;
    bit<1> resend;          /* a leaf's partial sent up again: the egress flags it RETRANSMIT */
    bit<1> tree;            /* a tree job's packet (leaf, root, or what comes down to a leaf) */
    bit<1> relay_up;        /* a leaf server's GATHER: the group's uplink replica goes up */
    bit<1> owner_only;      /* the root's OWNER_ONLY RESULT at a leaf: the replicas but the owner's are ACKs */
    bit<1> ack;             /* a tree job's unicast answer that is an ACK (decided in ingress) */
}

/* P4Testgen (p4/include/testgen.p4): the uplink entry a controller writes (controller tree_roles.leaf_entries:
 * the leaf job's allocation, as admission's), and a round's phase of 0, 1 or 2. Each tree action assumes its
 * pin, which a pinned run's passing_pin.p4 defines as the controller's entries (p4/testgen_tofino_tree.py:
 * conditions on the key and the action's parameters, in scope where the pin is expanded); by default every
 * pin is PASSING_PIN_TREE, which the runs of flat jobs and the flat sequences define false (no entry of
 * uplink, tree_role or owner_map: p4/testgen_programs.py's FLAT_ONLY). */
#ifndef PASSING_PIN_TREE
#define PASSING_PIN_TREE true
#endif
#ifndef PASSING_PIN_LEAF
#define PASSING_PIN_LEAF PASSING_PIN_TREE
#endif
#ifndef PASSING_PIN_ROOT
#define PASSING_PIN_ROOT PASSING_PIN_TREE
#endif
#ifndef PASSING_PIN_UPLINK
#define PASSING_PIN_UPLINK PASSING_PIN_TREE
#endif
#ifndef PASSING_PIN_OWNER_WORKER
#define PASSING_PIN_OWNER_WORKER PASSING_PIN_TREE
#endif
#ifndef PASSING_PIN_OWNER_UP
#define PASSING_PIN_OWNER_UP PASSING_PIN_TREE
#endif
#ifndef PASSING_PIN_PHASE
#define PASSING_PIN_PHASE(phase) true
#endif
#define PASSING_TESTGEN_UPLINK(leaf_job, leaf_generation, base, pool, full, epoch, group)          \
    PASSING_TESTGEN_ALLOCATION(base, pool, full)                                                  \
    PASSING_ASSUME((leaf_job) >= 1 && (leaf_job) < PASSING_MAX_JOBS                               \
                   && (epoch) == ((bit<32>)(leaf_job) << 16 | (bit<32>)(leaf_generation))         \
                   && (group) == (leaf_job) + 1)                                                  \
    PASSING_ASSUME(PASSING_PIN_UPLINK)
#define PASSING_TESTGEN_PHASE_READ(phase) \
    PASSING_ASSUME((phase) <= 2)          \
    PASSING_ASSUME(PASSING_PIN_PHASE(phase))

#endif
