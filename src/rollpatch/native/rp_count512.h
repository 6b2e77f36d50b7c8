/* rollpatch native core, internal: the 16 counts of a window of contexts in a block of JB
 * elements at once (AVX-512 BW, BITALG, VBMI and GFNI, all of the core's avx512 level): the
 * decoder's join (rp_join512.h) and the encoder's pass (rp_encpass512.c). */
#ifndef RP_COUNT512_H
#define RP_COUNT512_H
#include "rp_internal.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define RP_T512_COUNT                                                                         \
    __attribute__((target("avx2,bmi,bmi2,popcnt,avx512f,avx512bw,avx512vl,avx512vbmi,"          \
                          "avx512bitalg,gfni")))

/* The count of each of the 16 window slots (rel = context - lo; >= 16: no slot) in the 256
 * elements of rel[0..3], as 16 u32 lanes. */
RP_T512_COUNT static inline __m512i slot_counts(const __m512i rel[JB / 64]) {
    const __m512i tlo = _mm512_broadcast_i32x4(_mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 0, 0,
                                                             0, 0, 0, 0, 0, 0));
    const __m512i thi = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 4, 8,
                                                             16, 32, 64, -128));
    /* x.byte[i] = 1 << i: byte i of the result holds bit i of each of the 8 bytes */
    const __m512i diag = _mm512_set1_epi64((long long)0x8040201008040201ULL);
    const __m512i sixteen = _mm512_set1_epi8(16);
    __m512i alo = _mm512_setzero_si512(), ahi = _mm512_setzero_si512();
    for (int v = 0; v < JB / 64; v++) { /* per byte: <= 8 per 64 elements, <= 32 per block */
        __mmask64 in = _mm512_cmplt_epu8_mask(rel[v], sixteen);
        __m512i lo = _mm512_maskz_shuffle_epi8(in, tlo, rel[v]);
        __m512i hi = _mm512_maskz_shuffle_epi8(in, thi, rel[v]);
        alo = _mm512_add_epi8(alo, _mm512_popcnt_epi8(_mm512_gf2p8affine_epi64_epi8(diag, lo, 0)));
        ahi = _mm512_add_epi8(ahi, _mm512_popcnt_epi8(_mm512_gf2p8affine_epi64_epi8(diag, hi, 0)));
    }
    /* alo.qword[j].byte[t]: slot t's count in elements 8j..8j+7 (of each sub-block): transpose
     * the 8x8 bytes, then sum each qword */
    const __m512i tr = _mm512_set_epi8(63, 55, 47, 39, 31, 23, 15, 7, 62, 54, 46, 38, 30, 22, 14,
                                       6, 61, 53, 45, 37, 29, 21, 13, 5, 60, 52, 44, 36, 28, 20,
                                       12, 4, 59, 51, 43, 35, 27, 19, 11, 3, 58, 50, 42, 34, 26,
                                       18, 10, 2, 57, 49, 41, 33, 25, 17, 9, 1, 56, 48, 40, 32,
                                       24, 16, 8, 0);
    const __m512i z = _mm512_setzero_si512();
    __m512i slo = _mm512_sad_epu8(_mm512_permutexvar_epi8(tr, alo), z);
    __m512i shi = _mm512_sad_epu8(_mm512_permutexvar_epi8(tr, ahi), z);
    const __m512i pick = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28,
                                           30);
    return _mm512_permutex2var_epi32(slo, pick, shi);
}
#endif
#endif
