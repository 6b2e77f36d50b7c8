/* rollpatch native core: diff, the positions where two same-layout tensors differ.
 *
 * Why a vector loop: the catch-up of a chain takes its composed change by comparing each
 * touched tensor's copy with the live words (rollpatch.engines.catchup), and the publisher's
 * folded and skip patches start from `diff` (rollpatch.patch.diff). At 1-10% of the elements
 * changed the scalar loop (a 32-byte equality skip, then a memcmp per element) cost ~2 ns per
 * element, more than numpy's compare and its boolean mask (BF16 100M, 6%: 437 ms with the
 * binding's second pass when its first guess of the output was short; numpy 125; this 46). Here 64 bytes are compared per
 * step into a lane mask (AVX-512 BW: 64, 32, 16 or 8 lanes; 4-bit codes: the low and high
 * nibbles' masks interleaved by PDEP), and the set lanes' positions are written eight lanes at a
 * time by a compress (no branch per changed lane). Same positions at every level.
 * rp_diff_words also writes the differing elements' words of both tensors, compressed out of
 * the registers the compare loaded (a chain's catch-up took them by two gathers after the
 * diff, each a second pass over a tensor at a few % changed). */
#include "rp_internal.h"

/* The scalar loop: positions in [start, start + n) where a and b differ, from f on, and where
 * ow (olds and news: NULL, or room for cap elements of bits >= 8 each) is given, their words
 * in a and in b; writes only below cap (counts on past it). Returns the new f. */
#define PUT(e)                                                                                     \
    do {                                                                                           \
        if (f < cap) {                                                                             \
            pos[f] = (int64_t)((e) / w);                                                           \
            if (olds) {                                                                            \
                memcpy(olds + (size_t)f * w, a + (e), w);                                          \
                memcpy(news + (size_t)f * w, b + (e), w);                                          \
            }                                                                                      \
        }                                                                                          \
        f++;                                                                                       \
    } while (0)
static int64_t diff_scalar(int bits, const uint8_t *a, const uint8_t *b, int64_t start,
                           int64_t n, int64_t *pos, uint8_t *olds, uint8_t *news, int64_t cap,
                           int64_t f) {
    if (bits == 4) { /* no words out (rp_diff_words refuses 4-bit kinds) */
        for (int64_t i = start; i < start + n; i++)
            if (elem_get(a, 4, i) != elem_get(b, 4, i)) { if (f < cap) pos[f] = i; f++; }
        return f;
    }
    size_t w = (size_t)bits / 8, lo = (size_t)start * w, hi = (size_t)(start + n) * w;
    size_t o = lo;
    for (; o + 32 <= hi; o += 32) { /* skip equal 32-byte blocks fast */
        uint64_t x[4], y[4];
        memcpy(x, a + o, 32);
        memcpy(y, b + o, 32);
        if (((x[0] ^ y[0]) | (x[1] ^ y[1]) | (x[2] ^ y[2]) | (x[3] ^ y[3])) == 0) continue;
        for (size_t e = o; e < o + 32; e += w)
            if (memcmp(a + e, b + e, w)) PUT(e);
    }
    for (size_t e = o; e < hi; e += w)
        if (memcmp(a + e, b + e, w)) PUT(e);
    return f;
}
#undef PUT

#if defined(__x86_64__) && defined(__GNUC__)
#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi2,bmi,bmi2,popcnt")))

/* Each set bit i of m's first nl: position base + i, from f on: eight lanes' positions per
 * compress, stored whole (the output has room for 8 past the last), no branch per bit.
 * (Compressing all the lanes' indices as bytes at once (VPCOMPRESSB), then widening eight at
 * a time, measured the same.) */
T512 static inline int64_t emit(uint64_t m, int nl, int64_t base, int64_t *pos, int64_t f) {
    __m512i idx = _mm512_add_epi64(_mm512_set1_epi64(base), _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7));
    const __m512i eight = _mm512_set1_epi64(8);
    for (int g = 0; g < nl; g += 8) {
        __mmask8 mg = (__mmask8)(m >> g);
        _mm512_storeu_si512((void *)(pos + f), _mm512_maskz_compress_epi64(mg, idx));
        f += __builtin_popcount(mg);
        idx = _mm512_add_epi64(idx, eight);
    }
    return f;
}

/* The lanes that differ in 64 bytes (elements of `bits`); 4-bit: the first 64 of the 128
 * codes in *m, the last 64 in *m2. */
T512 static inline uint64_t lanes(int bits, const uint8_t *a, const uint8_t *b, uint64_t *m2) {
    __m512i x = _mm512_loadu_si512((const void *)a), y = _mm512_loadu_si512((const void *)b);
    switch (bits) {
    case 8: return _mm512_cmpneq_epu8_mask(x, y);
    case 16: return _mm512_cmpneq_epu16_mask(x, y);
    case 32: return _mm512_cmpneq_epu32_mask(x, y);
    case 64: return _mm512_cmpneq_epu64_mask(x, y);
    default: { /* 4: code 2i is byte i's low nibble, code 2i + 1 its high one */
        __m512i d = _mm512_xor_si512(x, y);
        uint64_t lo = _mm512_test_epi8_mask(d, _mm512_set1_epi8(0x0F));
        uint64_t hi = _mm512_test_epi8_mask(d, _mm512_set1_epi8((char)0xF0));
        const uint64_t ev = 0x5555555555555555ULL, od = 0xAAAAAAAAAAAAAAAAULL;
        *m2 = _pdep_u64(lo >> 32, ev) | _pdep_u64(hi >> 32, od);
        return _pdep_u64(lo & 0xFFFFFFFFULL, ev) | _pdep_u64(hi & 0xFFFFFFFFULL, od);
    }
    }
}

/* The lanes of x set in m, packed to the front and stored whole (64 bytes) at out
 * (VBMI2's word and byte compresses: the differing words taken from the registers the compare
 * loaded, instead of two gathers re-reading both tensors afterwards). */
T512 static inline void emit_words(int bits, uint64_t m, __m512i x, uint8_t *out) {
    switch (bits) {
    case 8: x = _mm512_maskz_compress_epi8(m, x); break;
    case 16: x = _mm512_maskz_compress_epi16((__mmask32)m, x); break;
    case 32: x = _mm512_maskz_compress_epi32((__mmask16)m, x); break;
    default: x = _mm512_maskz_compress_epi64((__mmask8)m, x); break;
    }
    _mm512_storeu_si512((void *)out, x);
}

/* The vector loop over whole 64-byte steps while the output has room for a step's positions
 * (and words: a step's 64 bytes); returns where it stopped (*pf: the count so far). */
T512 static int64_t diff_avx512(int bits, const uint8_t *a, const uint8_t *b, int64_t start,
                                int64_t n, int64_t *pos, uint8_t *olds, uint8_t *news,
                                int64_t cap, int64_t *pf) {
    const int64_t per = 512 / bits; /* elements per step */
    int64_t i = start, f = *pf;
    if (bits == 4 && (i & 1) && i < start + n) { /* a step starts on a byte */
        f = diff_scalar(4, a, b, i, 1, pos, NULL, NULL, cap, f);
        i++;
    }
    /* no test for a step with no change: at 1-2% changed, half the steps have one, and the
     * branch cost more than it saved (BF16 100M, 2%: 30 -> 16 ms; 0.2%: 12 -> 18 ms); the
     * words' test (olds: bits >= 8, words wanted) goes the same way at every step */
    for (; i + per <= start + n && f + per + 8 <= cap; i += per) {
        const uint8_t *pa = a + (i * bits >> 3), *pb = b + (i * bits >> 3);
        uint64_t m2 = 0, m = lanes(bits, pa, pb, &m2);
        if (olds) { /* the step's 64 bytes are in L1: loaded again, compressed out */
            emit_words(bits, m, _mm512_loadu_si512((const void *)pa), olds + f * (bits >> 3));
            emit_words(bits, m, _mm512_loadu_si512((const void *)pb), news + f * (bits >> 3));
        }
        f = emit(m, per < 64 ? (int)per : 64, i, pos, f);
        if (bits == 4) f = emit(m2, 64, i + 64, pos, f);
    }
    *pf = f;
    return i;
}

#endif

int rp_diff_words(const rp_kind *kd, const uint8_t *a, const uint8_t *b, int64_t start,
                  int64_t n, int64_t *pos, uint8_t *olds, uint8_t *news, int64_t cap,
                  int64_t *found) {
    int64_t f = 0, i = start;
    if (olds && kd->bits < 8) return RP_EARG;
#if defined(__x86_64__) && defined(__GNUC__)
    if (rp_isa() >= RP_ISA_AVX512)
        i = diff_avx512(kd->bits, a, b, start, n, pos, olds, news, cap, &f);
#endif
    *found = diff_scalar(kd->bits, a, b, i, start + n - i, pos, olds, news, cap, f);
    return RP_OK;
}

int rp_diff(const rp_kind *kd, const uint8_t *a, const uint8_t *b, int64_t start, int64_t n,
            int64_t *pos, int64_t cap, int64_t *found) {
    return rp_diff_words(kd, a, b, start, n, pos, NULL, NULL, cap, found);
}
