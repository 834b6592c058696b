/* PASSING constants shared by every target. They mirror host/passing/wire.py:
 * change one, change both (docs/protocol.md is the contract). */
#ifndef PASSING_CONSTANTS_P4
#define PASSING_CONSTANTS_P4

#define PASSING_UDP_PORT 9877
#define PASSING_VERSION 3  /* 3: owner in byte 9, OWNER_ONLY, ACK/GATHER/NACK; 2: the generation */

#define PASSING_TYPE_DATA 1
#define PASSING_TYPE_RESULT 2
#define PASSING_TYPE_ACK 3      /* header only: an OWNER_ONLY round is complete, the sums went to its owner */
#define PASSING_TYPE_GATHER 4   /* relayed to every other worker of the job, unchanged */
#define PASSING_TYPE_NACK 5     /* relayed to its owner alone */

#define PASSING_OP_SUM 0
#define PASSING_OP_MAX 1

#define PASSING_FLAG_OVERFLOW 0x01
#define PASSING_FLAG_RETRANSMIT 0x02
#define PASSING_FLAG_OWNER_ONLY 0x04

/* int32 values per packet: a compile-time constant (-DPASSING_LANES=N to change). */
#ifndef PASSING_LANES
#define PASSING_LANES 64
#endif

/* Slots of aggregation state (each has two sets); jobs get ranges of them. */
#ifndef PASSING_SLOTS
#define PASSING_SLOTS 1024
#endif

/* Per-job counters are indexed by job id modulo this. */
#ifndef PASSING_MAX_JOBS
#define PASSING_MAX_JOBS 1024
#endif

/* Multicast group that floods broadcast frames (ARP) to every host port. Job groups are
 * job id + 1 (the controller hands out job ids 1..1023; P4Runtime on BMv2 reserves groups
 * from 32768 on). */
#define PASSING_FLOOD_GROUP 1

const bit<16> ETHERTYPE_IPV4 = 0x0800;
const bit<8> IP_PROTO_UDP = 17;

#endif
