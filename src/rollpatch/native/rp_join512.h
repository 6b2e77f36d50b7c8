/* rollpatch native core, internal: the AVX-512 join's per-block steps (rp_join512.c): a block's
 * contexts in registers, the window's 16 counts at once, a slot's changes in a block at once. */
#ifndef RP_JOIN512_H
#define RP_JOIN512_H
#include "rp_lane.h"
#include "rp_count512.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define T512                                                                                    \
    __attribute__((target("avx2,bmi,bmi2,popcnt,avx512f,avx512bw,avx512vl,avx512vbmi,avx512vbmi2,"       \
                          "avx512bitalg,avx512vpopcntdq,gfni")))

/* The contexts of 64 elements [s, s + 64) of the base (the block lies wholly inside it). */
T512 static inline __m512i ctx64(const rp_kind *kd, const uint8_t *base, int64_t s, __m128i sh,
                                 __m512i mk) {
    if (kd->bits == 16) {
        const __m512i even = _mm512_set_epi8(
            126, 124, 122, 120, 118, 116, 114, 112, 110, 108, 106, 104, 102, 100, 98, 96, 94, 92,
            90, 88, 86, 84, 82, 80, 78, 76, 74, 72, 70, 68, 66, 64, 62, 60, 58, 56, 54, 52, 50, 48,
            46, 44, 42, 40, 38, 36, 34, 32, 30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2,
            0);
        const uint16_t *p = (const uint16_t *)base + s;
        __m512i a = _mm512_srl_epi16(_mm512_loadu_si512(p), sh);
        __m512i b = _mm512_srl_epi16(_mm512_loadu_si512(p + 32), sh);
        return _mm512_and_si512(_mm512_permutex2var_epi8(a, even, b), mk);
    }
    if (kd->bits == 8) /* a word shift: bits from the next byte lie above the context's */
        return _mm512_and_si512(_mm512_srl_epi16(_mm512_loadu_si512(base + s), sh), mk);
    if (kd->bits == 4) { /* s is even: 32 bytes, low nibble first */
        __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(base + (s >> 1))));
        __m512i nib = _mm512_or_si512(_mm512_and_si512(w, _mm512_set1_epi16(0x0F)),
                                      _mm512_and_si512(_mm512_slli_epi16(w, 4),
                                                       _mm512_set1_epi16(0x0F00)));
        return _mm512_and_si512(_mm512_srl_epi16(nib, sh), mk);
    }
    if (kd->bits == 32) {
        const uint32_t *p = (const uint32_t *)base + s;
        __m128i q[4];
        for (int i = 0; i < 4; i++)
            q[i] = _mm512_cvtepi32_epi8(_mm512_srl_epi32(_mm512_loadu_si512(p + 16 * i), sh));
        __m512i x = _mm512_castsi128_si512(q[0]);
        x = _mm512_inserti32x4(x, q[1], 1);
        x = _mm512_inserti32x4(x, q[2], 2);
        x = _mm512_inserti32x4(x, q[3], 3);
        return _mm512_and_si512(x, mk);
    }
    const uint64_t *p = (const uint64_t *)base + s; /* 64-bit */
    __m128i q[4];
    for (int i = 0; i < 4; i++) {
        __m128i a = _mm512_cvtepi64_epi8(_mm512_srl_epi64(_mm512_loadu_si512(p + 16 * i), sh));
        __m128i b = _mm512_cvtepi64_epi8(_mm512_srl_epi64(_mm512_loadu_si512(p + 16 * i + 8), sh));
        q[i] = _mm_unpacklo_epi64(a, b);
    }
    __m512i x = _mm512_castsi128_si512(q[0]);
    x = _mm512_inserti32x4(x, q[1], 1);
    x = _mm512_inserti32x4(x, q[2], 2);
    x = _mm512_inserti32x4(x, q[3], 3);
    return _mm512_and_si512(x, mk);
}

/* A window slot's changed elements in one block (cb: its contexts; rv: the slot's context in
 * every byte; pre, tot: the slot's count before the block and in it), as bits into bb: one PDEP
 * per 64 of the bitmap's bits from pre on into the slot's compare mask. Returns how many. */
T512 static inline uint32_t slot_bits(const uint8_t *cb, __m512i rv, const uint64_t *bm,
                                      uint32_t lim, uint32_t pre, uint32_t tot,
                                      uint64_t bb[JB / 64]) {
    uint32_t nchg = 0;
    if (tot <= 64) { /* their bits are one 64-bit window of the bitmap, read once */
        uint32_t j = pre >> 6;
        j = j < lim ? j : lim;
        unsigned sft = pre & 63;
        uint64_t w = (bm[j] >> sft) | (bm[j + 1] << 1 << (63 - sft));
        nchg = (uint32_t)__builtin_popcountll(tot < 64 ? w & ((1ULL << tot) - 1) : w);
        for (int v = 0; v < JB / 64; v++) { /* each 64 takes its next popcount(m) bits */
            uint64_t m = _mm512_cmpeq_epi8_mask(_mm512_load_si512(cb + 64 * v), rv);
            unsigned pm = (unsigned)__builtin_popcountll(m);
            bb[v] |= _pdep_u64(w, m);
            w = pm < 64 ? w >> pm : 0;
        }
        return nchg;
    }
    for (int v = 0; v < JB / 64; v++) {
        uint64_t m = _mm512_cmpeq_epi8_mask(_mm512_load_si512(cb + 64 * v), rv);
        uint32_t j = pre >> 6;
        j = j < lim ? j : lim;
        unsigned sft = pre & 63;
        uint64_t w = _pdep_u64((bm[j] >> sft) | (bm[j + 1] << 1 << (63 - sft)), m);
        bb[v] |= w; /* the slot's changed elements */
        nchg += (uint32_t)__builtin_popcountll(w);
        pre += (uint32_t)__builtin_popcountll(m);
    }
    return nchg;
}
#endif
#endif /* RP_JOIN512_H */
