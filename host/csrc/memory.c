/* The in-host stage's bulk moves: copies and sums of float32 arrays of megabytes, written
 * with non-temporal stores where the output is larger than the cache is useful for
 * (passing_native.h says why). x86-64's baseline SSE2 has them; elsewhere the loops are
 * plain and the compiler's. */
#include "passing_native.h"

#if defined(__x86_64__)
#include <emmintrin.h>
#define PN_HAVE_STREAM 1
#else
#define PN_HAVE_STREAM 0
#endif

static int streamed(size_t n) {
    return PN_HAVE_STREAM && n * sizeof(float) >= PN_STREAM_BYTES;
}

/* Elements before dst + i is 16-byte aligned (what a 128-bit streaming store needs). */
static size_t head(const float *dst, size_t n) {
    size_t misaligned = ((uintptr_t)dst & 15u) / sizeof(float);
    size_t h = misaligned ? 4 - misaligned : 0;
    return h < n ? h : n;
}

static float sum_at(const float *const *srcs, uint32_t k, size_t i) {
    float acc = srcs[0][i];
    for (uint32_t j = 1; j < k; j++) acc += srcs[j][i];
    return acc;
}

void pn_copy_f32(float *restrict dst, const float *restrict src, size_t n) {
    if (n == 0) return;  /* an empty array's pointer may be NULL, which memcpy may not get */
    if (!streamed(n)) {
        memcpy(dst, src, n * sizeof(float));
        return;
    }
#if PN_HAVE_STREAM
    size_t i = head(dst, n);
    memcpy(dst, src, i * sizeof(float));
    for (; i + 4 <= n; i += 4) _mm_stream_ps(dst + i, _mm_loadu_ps(src + i));
    for (; i < n; i++) dst[i] = src[i];
    _mm_sfence();  /* the stores are visible before whatever this thread does next (a barrier) */
#endif
}

void pn_sum_f32(float *restrict dst, const float *const *srcs, uint32_t k, size_t n) {
    if (k == 0 || n == 0) return;
    if (!streamed(n)) {  /* source by source, in order: loops the compiler vectorizes */
        const float *restrict first = srcs[0];
        for (size_t i = 0; i < n; i++) dst[i] = first[i];
        for (uint32_t j = 1; j < k; j++) {
            const float *restrict s = srcs[j];
            for (size_t i = 0; i < n; i++) dst[i] += s[i];
        }
        return;
    }
#if PN_HAVE_STREAM
    size_t i = 0;
    for (size_t h = head(dst, n); i < h; i++) dst[i] = sum_at(srcs, k, i);
    for (; i + 4 <= n; i += 4) {
        __m128 acc = _mm_loadu_ps(srcs[0] + i);
        for (uint32_t j = 1; j < k; j++) acc = _mm_add_ps(acc, _mm_loadu_ps(srcs[j] + i));
        _mm_stream_ps(dst + i, acc);
    }
    for (; i < n; i++) dst[i] = sum_at(srcs, k, i);
    _mm_sfence();
#endif
}
