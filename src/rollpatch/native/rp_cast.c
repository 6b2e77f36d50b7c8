/* rollpatch native core: the publisher's BF16 cast (rp_cast.h), in one pass over the masters.
 *
 * torch's cast on the host is a chunked copy_ plus a NaN check that reads the result again
 * (publisher/cast.py), and the publisher then compared the new words with the previous
 * snapshot's in other passes. Here each word is rounded in registers, its NaN test is a
 * compare on the same register, the word is stored once and, in rp_cast_bf16_diff, compared
 * with the previous snapshot's word while both are in registers. The rounding is integer
 * arithmetic on the float32 bits, never a float instruction: AVX-512's VCVTNEPS2BF16 treats
 * subnormal inputs as zero, and the served bits must be formats' (tests hold every level to
 * the numpy reference). Scalar, AVX2 and AVX-512 forms give the same words; rp_isa picks. */
#include <stddef.h>
#include <stdint.h>

#include "rp_cast.h"
#include "rpcore.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#define EXP_INF 0x7F800000u /* above this, once the sign is cleared: NaN */

static inline uint16_t bf16_one(uint32_t x, int64_t *nans) {
    if ((x & 0x7FFFFFFFu) > EXP_INF) {
        ++*nans;
        return 0xFFFF;
    }
    return (uint16_t)((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

/* Lists the differences one vector step found: bit b of m set means element i + b / step
 * differs (step 2: two mask bits per element). Returns the new count. */
static inline int64_t take(uint64_t m, int step, int64_t i, const uint16_t *prev,
                           const uint16_t *dst, int64_t k, int64_t *pos, uint16_t *oldv,
                           uint16_t *newv, int64_t cap) {
    while (m) {
        int64_t at = i + __builtin_ctzll(m) / step;
        m &= m - 1;
        if (k < cap) {
            pos[k] = at;
            oldv[k] = prev[at];
            newv[k] = dst[at];
        }
        k++;
    }
    return k;
}

/* Elements [i0, n); prev NULL: cast only. */
static int64_t pass_scalar(const uint32_t *src, const uint16_t *prev, uint16_t *dst, int64_t i0,
                           int64_t n, int64_t *pos, uint16_t *oldv, uint16_t *newv, int64_t cap,
                           int64_t k, int64_t *nans) {
    for (int64_t i = i0; i < n; i++) {
        dst[i] = bf16_one(src[i], nans);
        if (prev && dst[i] != prev[i]) k = take(1, 1, i, prev, dst, k, pos, oldv, newv, cap);
    }
    return k;
}

#if defined(__x86_64__) && defined(__GNUC__)
/* The 16 words of x0 (elements 0-7) and x1 (8-15), NaNs as 0xFFFF; the NaN count in *nans. */
__attribute__((target("avx2,popcnt"))) static inline __m256i words_avx2(__m256i x0, __m256i x1,
                                                                         int64_t *nans) {
    const __m256i bias = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1);
    const __m256i abs = _mm256_set1_epi32(0x7FFFFFFF), inf = _mm256_set1_epi32((int)EXP_INF);
    const __m256i nan = _mm256_set1_epi32(0xFFFF);
    /* a signed compare is exact: both sides are below 2^31 once the sign is cleared */
    __m256i n0 = _mm256_cmpgt_epi32(_mm256_and_si256(x0, abs), inf);
    __m256i n1 = _mm256_cmpgt_epi32(_mm256_and_si256(x1, abs), inf);
    __m256i r0 = _mm256_add_epi32(_mm256_add_epi32(x0, bias),
                                  _mm256_and_si256(_mm256_srli_epi32(x0, 16), one));
    __m256i r1 = _mm256_add_epi32(_mm256_add_epi32(x1, bias),
                                  _mm256_and_si256(_mm256_srli_epi32(x1, 16), one));
    r0 = _mm256_blendv_epi8(_mm256_srli_epi32(r0, 16), nan, n0);
    r1 = _mm256_blendv_epi8(_mm256_srli_epi32(r1, 16), nan, n1);
    *nans += __builtin_popcount((unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(n0)))
             + __builtin_popcount((unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(n1)));
    /* packus works per 128-bit lane: restore element order across the lanes */
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(r0, r1), 0xD8);
}

__attribute__((target("avx2,popcnt"))) static int64_t pass_avx2(
    const uint32_t *src, const uint16_t *prev, uint16_t *dst, int64_t n, int64_t *pos,
    uint16_t *oldv, uint16_t *newv, int64_t cap, int64_t *nans) {
    int64_t k = 0, i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256i p = words_avx2(_mm256_loadu_si256((const __m256i *)(src + i)),
                               _mm256_loadu_si256((const __m256i *)(src + i + 8)), nans);
        _mm256_storeu_si256((__m256i *)(dst + i), p);
        if (prev) { /* two mask bits per 16-bit element: keep the low one, step 2 */
            __m256i q = _mm256_loadu_si256((const __m256i *)(prev + i));
            uint32_t eq = (uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi16(p, q));
            uint32_t ne = ~eq & 0x55555555u;
            if (ne) k = take(ne, 2, i, prev, dst, k, pos, oldv, newv, cap);
        }
    }
    return pass_scalar(src, prev, dst, i, n, pos, oldv, newv, cap, k, nans);
}

/* 16 words of x, NaNs as 0xFFFF; the NaN mask in *isnan. */
__attribute__((target("avx512f,avx512bw,avx512vl"))) static inline __m256i words512(
    __m512i x, __mmask16 live, __mmask16 *isnan) {
    const __m512i bias = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1);
    const __m512i abs = _mm512_set1_epi32(0x7FFFFFFF), inf = _mm512_set1_epi32((int)EXP_INF);
    const __m512i nan = _mm512_set1_epi32(0xFFFF);
    *isnan = _mm512_mask_cmpgt_epu32_mask(live, _mm512_and_si512(x, abs), inf);
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(x, bias),
                                 _mm512_and_si512(_mm512_srli_epi32(x, 16), one));
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(_mm512_srli_epi32(r, 16), *isnan, nan));
}

__attribute__((target("avx512f,avx512bw,avx512vl,popcnt"))) static int64_t pass_avx512(
    const uint32_t *src, const uint16_t *prev, uint16_t *dst, int64_t n, int64_t *pos,
    uint16_t *oldv, uint16_t *newv, int64_t cap, int64_t *nans) {
    int64_t k = 0, i = 0;
    __mmask16 m0, m1;
    for (; i + 32 <= n; i += 32) { /* 32 words a step: one 512-bit store and compare */
        __m256i w0 = words512(_mm512_loadu_si512((const void *)(src + i)), 0xFFFF, &m0);
        __m256i w1 = words512(_mm512_loadu_si512((const void *)(src + i + 16)), 0xFFFF, &m1);
        __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(w0), w1, 1);
        _mm512_storeu_si512((void *)(dst + i), w);
        *nans += __builtin_popcount((unsigned)m0 | (unsigned)m1 << 16);
        if (prev) {
            __mmask32 ne = _mm512_cmpneq_epu16_mask(w, _mm512_loadu_si512((const void *)(prev + i)));
            if (ne) k = take(ne, 1, i, prev, dst, k, pos, oldv, newv, cap);
        }
    }
    for (; i < n; i += 16) { /* the tail under a mask: no scalar remainder */
        __mmask16 live = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        __m256i w = words512(_mm512_maskz_loadu_epi32(live, src + i), live, &m0);
        _mm256_mask_storeu_epi16(dst + i, live, w);
        *nans += __builtin_popcount((unsigned)m0);
        if (prev) {
            __mmask16 ne = _mm256_mask_cmpneq_epu16_mask(live, w, _mm256_maskz_loadu_epi16(live, prev + i));
            if (ne) k = take(ne, 1, i, prev, dst, k, pos, oldv, newv, cap);
        }
    }
    return k;
}
#endif

static int64_t pass(const uint32_t *src, const uint16_t *prev, uint16_t *dst, int64_t n,
                    int64_t *pos, uint16_t *oldv, uint16_t *newv, int64_t cap, int64_t *nans) {
    *nans = 0;
    if (n <= 0) return 0;
#if defined(__x86_64__) && defined(__GNUC__)
    int isa = rp_isa();
    if (isa >= RP_ISA_AVX512) return pass_avx512(src, prev, dst, n, pos, oldv, newv, cap, nans);
    if (isa >= RP_ISA_AVX2) return pass_avx2(src, prev, dst, n, pos, oldv, newv, cap, nans);
#endif
    return pass_scalar(src, prev, dst, 0, n, pos, oldv, newv, cap, 0, nans);
}

int64_t rp_cast_bf16(const uint32_t *src, uint16_t *dst, int64_t n) {
    int64_t nans;
    pass(src, NULL, dst, n, NULL, NULL, NULL, 0, &nans);
    return nans;
}

int64_t rp_cast_bf16_diff(const uint32_t *src, const uint16_t *prev, uint16_t *dst, int64_t n,
                          int64_t *pos, uint16_t *oldv, uint16_t *newv, int64_t cap,
                          int64_t *nans) {
    return pass(src, prev, dst, n, pos, oldv, newv, cap, nans);
}
