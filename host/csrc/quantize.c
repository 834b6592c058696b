/* float32 <-> int32 lanes for the host's reduce stream (quantize.h; passing/quantize.py: the same arithmetic, bit
 * for bit), and the MAX round's input (pn_max_abs_bits). */
#include "quantize.h"

#include <math.h>
#include <string.h>

#include "passing_native.h"

static int scale_is_f32_exact(double scale) {
    int exponent;
    double mantissa = frexp(scale, &exponent);
    return mantissa == 0.5 && exponent > -120 && exponent < 120;
}

pn_scale pn_scale_of(double scale) {
    return (pn_scale){.scale = scale, .f32 = scale_is_f32_exact(scale), .f = (float)scale,
                      .inverse = (float)(1.0 / scale)};
}

int pn_quantize(float x, const pn_scale *s, int32_t *out) {
    if (!isfinite(x)) {
        *out = 0;
        return 1;
    }
    if (s->f32) {
        float v = rintf(x * s->f);
        if (v >= 2147483648.0f || v < -2147483648.0f || isnan(v)) {
            *out = isnan(v) ? 0 : (v > 0 ? INT32_MAX : INT32_MIN);
            return 1;
        }
        *out = (int32_t)v;
        return 0;
    }
    double v = rint((double)x * s->scale);
    if (v >= 2147483648.0 || v < -2147483648.0 || isnan(v)) {
        *out = isnan(v) ? 0 : (v > 0 ? INT32_MAX : INT32_MIN);
        return 1;
    }
    *out = (int32_t)v;
    return 0;
}

static uint32_t float_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* rintf rounds half to even in the default rounding mode (numpy's rint, bit for bit), and compiles to one
 * vector instruction where SSE4.1 is there (the AVX2 and AVX-512 clones; the baseline gets the same rounding
 * inline, scalar). A lane that does not fit int32 (or is NaN) is converted as 0, never out of range, and makes
 * the call return 0. The select is on bits, so the loop has no control flow to keep it from vectorizing. */
PN_LANE_LOOP int pn_quantize_f32_fast(const float *restrict x, uint32_t n, float scale, uint8_t *restrict packet) {
    uint32_t bad = 0;
    for (uint32_t i = 0; i < n; i++) {
        float v = x[i] * scale;
        uint32_t fits = -(uint32_t)(fabsf(v) < 2147483648.0f); /* 0 for NaN too */
        uint32_t bits = float_bits(rintf(v)) & fits;
        float r;
        memcpy(&r, &bits, sizeof r);
        bad |= ~fits;
        pn_lane_set(packet, i, (int32_t)r);
    }
    return bad == 0;
}

PN_LANE_LOOP uint32_t pn_max_abs_bits(const float *x, size_t n, int finite_only) {
    uint32_t most = 0;
    if (finite_only) {
        for (size_t i = 0; i < n; i++) {
            uint32_t b = float_bits(x[i]) & 0x7FFFFFFFu;
            b = b < 0x7F800000u ? b : 0;
            most = b > most ? b : most;
        }
    } else {
        for (size_t i = 0; i < n; i++) {
            uint32_t b = float_bits(x[i]) & 0x7FFFFFFFu;
            most = b > most ? b : most;
        }
    }
    return most > 0x7F800000u ? 0x7FC00000u : most;
}

/* The bound is told from the lanes' least and greatest values (two vector instructions a vector, where testing
 * each lane for either bound takes four). */
PN_LANE_LOOP int pn_read_result(const uint8_t *restrict packet, uint32_t n, uint32_t lanes, int kind,
                                const pn_scale *s, void *restrict out) {
    int32_t least = 0, most = 0;
    if (kind == PN_IN_I32) {
        int32_t *o = out;
        for (uint32_t i = 0; i < n; i++) {
            int32_t v = pn_lane_get(packet, i);
            least = v < least ? v : least;
            most = v > most ? v : most;
            o[i] = v;
        }
    } else if (s->f32) {
        float *o = out;
        for (uint32_t i = 0; i < n; i++) {
            int32_t v = pn_lane_get(packet, i);
            least = v < least ? v : least;
            most = v > most ? v : most;
            o[i] = (float)v * s->inverse;
        }
    } else {
        float *o = out;
        for (uint32_t i = 0; i < n; i++) {
            int32_t v = pn_lane_get(packet, i);
            least = v < least ? v : least;
            most = v > most ? v : most;
            o[i] = (float)((double)v / s->scale);
        }
    }
    for (uint32_t i = n; i < lanes; i++) { /* the last packet's padding: read for the bound alone */
        int32_t v = pn_lane_get(packet, i);
        least = v < least ? v : least;
        most = v > most ? v : most;
    }
    return least == INT32_MIN || most == INT32_MAX;
}
