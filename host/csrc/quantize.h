/* float32 <-> int32 lanes for the host's reduce stream (passing/quantize.py: the same arithmetic, bit for bit).
 * Internal to the library (not part of its ABI; pn_max_abs_bits, the MAX round's input, is). */
#ifndef PASSING_QUANTIZE_H
#define PASSING_QUANTIZE_H

#include <stdint.h>

/* The lane loops are target clones (PN_LANE_LOOP), which GCC exports whatever -fvisibility says: hidden here,
 * so that the library's ABI stays passing_native.h's. */
#define PN_INTERNAL __attribute__((visibility("hidden")))

/* A shard's scale, as double and as the float32 the fast path multiplies by. */
typedef struct {
    double scale;
    int f32;             /* scale is a power of two that float32 applies exactly */
    float f, inverse;    /* scale and 1 / scale as float32 */
} pn_scale;

pn_scale pn_scale_of(double scale);

/* Round x * scale to int32, saturating. A NaN or an infinity becomes 0 and counts as saturated (the stream
 * restores IEEE semantics from a class round). Returns 1 when the value saturated. */
int pn_quantize(float x, const pn_scale *s, int32_t *out);

/* The common case: n floats times a float32-exact scale, rounded half to even, to big-endian lanes of packet,
 * without a branch or a libm call. Returns 0 when a value is not finite or falls outside int32 (converted as 0
 * here, never out of range): the caller then redoes the packet with pn_quantize, which saturates and flags. */
PN_INTERNAL int pn_quantize_f32_fast(const float *restrict x, uint32_t n, float scale, uint8_t *restrict packet);

/* A RESULT's first n lanes to floats (one rounding either way: passing/quantize.py's dequantize) or, kind
 * PN_IN_I32, to int32 (host order); in the same pass, whether any of the packet's `lanes` lanes (the padding
 * too) is at an int32 bound, a saturated sum. */
PN_INTERNAL int pn_read_result(const uint8_t *restrict packet, uint32_t n, uint32_t lanes, int kind, const pn_scale *s,
                               void *restrict out);

#endif
