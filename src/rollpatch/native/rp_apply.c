/* rollpatch native core: gather and apply of sparse changes (diff: rp_diff.c, compose: rp_compose.c), and
 * the rp.sum128 digest (docs/patch-format.md §7). */
#include "rp_internal.h"

/* Prefetches APPLY_PF changes ahead: without them, apply's ~40 instructions per change left
 * the core's window room for ~8 cache misses in flight (26 ns per change at 1.3% of a 130 MB
 * tensor, against 2.5 for numpy's scatter; now 4.6), and gather's ~8 for more (5.2 -> 2.8 ns). */
#define APPLY_PF 64
/* Changes written between two read-backs (apply's `readback`): their lines still in L1. */
#define APPLY_RB 256
/* A prefetch of base + off: integer arithmetic (a hostile position makes any address, and a
 * prefetch never faults); rw 1 for a line about to be written. */
#define prefetch_at(base, off, rw)                                                             \
    __builtin_prefetch((const void *)((uintptr_t)(base) + (off)), (rw))

/* ------------------------------------------------------------------ gather / apply */

int rp_gather(const rp_kind *kd, const uint8_t *data, int64_t n_el, const int64_t *pos,
              int64_t count, void *out, int ow, const char **err) {
    /* 16 and 8 bits: one pass, each position checked as it is read (a position out of range
     * reads element 0 instead and fails the call; `out` is the caller's scratch) */
    uint64_t bad = 0, n = (uint64_t)n_el;
    if (kd->bits == 16 && ow == 2 && n) {
        const uint16_t *d = (const uint16_t *)data;
        uint16_t *o = out;
        /* sparse (under one per 16 elements): lines mostly apart, prefetched; denser, the
         * hardware's stream prefetch does better without them (30%: 11.5 ms against 9.8) */
        const int64_t pf = (uint64_t)count * 16 < n ? count - APPLY_PF : 0;
        int64_t i = 0;
        for (; i < pf; i++) {
            uint64_t p = (uint64_t)pos[i];
            prefetch_at(d, (uint64_t)pos[i + APPLY_PF] << 1, 0);
            bad |= (uint64_t)(p >= n);
            o[i] = d[p < n ? p : 0];
        }
        for (; i < count; i++) {
            uint64_t p = (uint64_t)pos[i];
            bad |= (uint64_t)(p >= n);
            o[i] = d[p < n ? p : 0];
        }
    } else if (kd->bits == 8 && ow == 1 && n) {
        uint8_t *o = out;
        for (int64_t i = 0; i < count; i++) {
            uint64_t p = (uint64_t)pos[i];
            bad |= (uint64_t)(p >= n);
            o[i] = data[p < n ? p : 0];
        }
    } else {
        for (int64_t i = 0; i < count; i++)
            if (pos[i] < 0 || pos[i] >= n_el) { *err = "position out of range"; return RP_EARG; }
        for (int64_t i = 0; i < count; i++) arr_put(out, ow, i, elem_get(data, kd->bits, pos[i]));
    }
    if (bad) { *err = "position out of range"; return RP_EARG; }
    return RP_OK;
}

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx2"))) static void sum_avx2(const uint8_t *d, uint64_t j0,
                                                      uint64_t nw, uint64_t acc[2]) {
    __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
    __m256i k0 = _mm256_set_epi64x((long long)(SUM_S[0] + (j0 + 3) * SUM_K[0]),
                                   (long long)(SUM_S[0] + (j0 + 2) * SUM_K[0]),
                                   (long long)(SUM_S[0] + (j0 + 1) * SUM_K[0]),
                                   (long long)(SUM_S[0] + j0 * SUM_K[0]));
    __m256i k1 = _mm256_set_epi64x((long long)(SUM_S[1] + (j0 + 3) * SUM_K[1]),
                                   (long long)(SUM_S[1] + (j0 + 2) * SUM_K[1]),
                                   (long long)(SUM_S[1] + (j0 + 1) * SUM_K[1]),
                                   (long long)(SUM_S[1] + j0 * SUM_K[1]));
    const __m256i s0 = _mm256_set1_epi64x((long long)(4 * SUM_K[0]));
    const __m256i s1 = _mm256_set1_epi64x((long long)(4 * SUM_K[1]));
    for (uint64_t i = 0; i < nw; i += 4) {
        __m256i w = _mm256_loadu_si256((const __m256i *)(d + 8 * i));
        __m256i x0 = _mm256_xor_si256(w, k0), x1 = _mm256_xor_si256(w, k1);
        __m256i p0 = _mm256_mul_epu32(x0, _mm256_srli_epi64(x0, 32));
        __m256i p1 = _mm256_mul_epu32(x1, _mm256_srli_epi64(x1, 32));
        __m256i r0 = _mm256_or_si256(_mm256_slli_epi64(w, 32), _mm256_srli_epi64(w, 32));
        __m256i r1 = _mm256_or_si256(_mm256_slli_epi64(w, 17), _mm256_srli_epi64(w, 47));
        a0 = _mm256_add_epi64(a0, _mm256_add_epi64(p0, r0));
        a1 = _mm256_add_epi64(a1, _mm256_add_epi64(p1, r1));
        k0 = _mm256_add_epi64(k0, s0);
        k1 = _mm256_add_epi64(k1, s1);
    }
    uint64_t t0[4], t1[4];
    _mm256_storeu_si256((__m256i *)t0, a0);
    _mm256_storeu_si256((__m256i *)t1, a1);
    acc[0] += t0[0] + t0[1] + t0[2] + t0[3];
    acc[1] += t1[0] + t1[1] + t1[2] + t1[3];
}

/* sum_avx2 with 512-bit vectors and VPROLQ for the rotations, 16 words per step into two
 * accumulator pairs (Zen 4 runs a zmm op as two halves: the gain is the rotations, one op
 * instead of three, and half the loop's overhead). nw: a multiple of 16. */
__attribute__((target("avx512f"))) static void sum_avx512(const uint8_t *d, uint64_t j0,
                                                          uint64_t nw, uint64_t acc[2]) {
    uint64_t t0[8], t1[8];
    for (int q = 0; q < 8; q++) {
        t0[q] = SUM_S[0] + (j0 + (uint64_t)q) * SUM_K[0];
        t1[q] = SUM_S[1] + (j0 + (uint64_t)q) * SUM_K[1];
    }
    __m512i k0 = _mm512_loadu_si512(t0), k1 = _mm512_loadu_si512(t1);
    const __m512i s0 = _mm512_set1_epi64((long long)(8 * SUM_K[0]));
    const __m512i s1 = _mm512_set1_epi64((long long)(8 * SUM_K[1]));
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, c0 = a0, c1 = a0;
    for (uint64_t i = 0; i < nw; i += 16) {
        __m512i w = _mm512_loadu_si512(d + 8 * i), v = _mm512_loadu_si512(d + 8 * i + 64);
        __m512i k0b = _mm512_add_epi64(k0, s0), k1b = _mm512_add_epi64(k1, s1);
        __m512i x0 = _mm512_xor_si512(w, k0), x1 = _mm512_xor_si512(w, k1);
        __m512i y0 = _mm512_xor_si512(v, k0b), y1 = _mm512_xor_si512(v, k1b);
        __m512i p0 = _mm512_mul_epu32(x0, _mm512_srli_epi64(x0, 32));
        __m512i p1 = _mm512_mul_epu32(x1, _mm512_srli_epi64(x1, 32));
        __m512i q0 = _mm512_mul_epu32(y0, _mm512_srli_epi64(y0, 32));
        __m512i q1 = _mm512_mul_epu32(y1, _mm512_srli_epi64(y1, 32));
        a0 = _mm512_add_epi64(a0, _mm512_add_epi64(p0, _mm512_rol_epi64(w, 32)));
        a1 = _mm512_add_epi64(a1, _mm512_add_epi64(p1, _mm512_rol_epi64(w, 17)));
        c0 = _mm512_add_epi64(c0, _mm512_add_epi64(q0, _mm512_rol_epi64(v, 32)));
        c1 = _mm512_add_epi64(c1, _mm512_add_epi64(q1, _mm512_rol_epi64(v, 17)));
        k0 = _mm512_add_epi64(k0b, s0);
        k1 = _mm512_add_epi64(k1b, s1);
    }
    acc[0] += (uint64_t)_mm512_reduce_add_epi64(_mm512_add_epi64(a0, c0));
    acc[1] += (uint64_t)_mm512_reduce_add_epi64(_mm512_add_epi64(a1, c1));
}

/* Whether the AVX-512 sum may run: the core's level (rp_isa.c: the CPU's best, or less by
 * ROLLPATCH_ISA / rp_isa_set). */
static int sum_avx512_ok(void) { return rp_isa() >= RP_ISA_AVX512; }
#endif

void rp_sum128(const uint8_t *d, size_t len, uint64_t w0, uint64_t nw, uint64_t out[2]) {
    uint64_t acc[2] = {0, 0}, j = w0, end = w0 + nw;
    uint64_t full = len / 8; /* words that lie wholly inside the data */
    uint64_t fast_end = end < full ? end : full;
#if defined(__x86_64__) && defined(__GNUC__)
    if (fast_end >= j + 16 && sum_avx512_ok()) {
        uint64_t cnt = (fast_end - j) & ~15ULL;
        sum_avx512(d + 8 * j, j, cnt, acc);
        j += cnt;
    }
    if (fast_end > j && rp_isa() >= RP_ISA_AVX2) {
        uint64_t cnt = (fast_end - j) & ~3ULL;
        if (cnt) {
            sum_avx2(d + 8 * j, j, cnt, acc);
            j += cnt;
        }
    }
#endif
    for (; j < end; j++) {
        uint64_t w = word_at(d, len, j);
        acc[0] += sum_term(0, w, j);
        acc[1] += sum_term(1, w, j);
    }
    out[0] = acc[0];
    out[1] = acc[1];
}

void rp_sum128_at(const uint8_t *d, uint64_t rows, uint64_t row_words, uint64_t j0,
                  uint64_t j_stride, uint64_t out[2]) {
    uint64_t acc[2] = {0, 0};
    for (uint64_t r = 0; r < rows; r++) {
        const uint8_t *p = d + 8 * r * row_words;
        uint64_t j = j0 + r * j_stride, i = 0;
#if defined(__x86_64__) && defined(__GNUC__)
        if (row_words >= 16 && sum_avx512_ok()) {
            uint64_t cnt = row_words & ~15ULL;
            sum_avx512(p, j, cnt, acc);
            i = cnt;
        }
        if (row_words - i >= 4 && rp_isa() >= RP_ISA_AVX2) {
            uint64_t cnt = (row_words - i) & ~3ULL;
            sum_avx2(p + 8 * i, j + i, cnt, acc);
            i += cnt;
        }
#endif
        for (; i < row_words; i++) {
            uint64_t w;
            memcpy(&w, p + 8 * i, 8);
            acc[0] += sum_term(0, w, j + i);
            acc[1] += sum_term(1, w, j + i);
        }
    }
    out[0] = acc[0];
    out[1] = acc[1];
}

/* Typed fast path: T elements, 8 / sizeof(T) per 64-bit word. Each word is read once; its
 * value after the writes is made in a register (lanes replaced), never read back from the
 * element stores (a 64-bit load of bytes just stored by narrower stores cannot be forwarded
 * and waits for them: that cost ~26 ns per change, 10x a plain scatter). A position is
 * checked (in range, increasing) and its old element compared before its store. `dry`: no
 * store at all (the checks and the sum change only: what the writes would change).
 * `readback`: every APPLY_RB changes, the elements just stored are read back and compared
 * while their lines are in L1 (element loads of element stores forward; a separate read-back
 * pass after a slice of 65,536 changes missed in L2 and cost ~45% of the apply). */
#define APPLY_TYPED(T, LOG)                                                                 \
    do {                                                                                    \
        T *d = (T *)data;                                                                   \
        const T *o = (const T *)old, *nw = (const T *)new_;                                 \
        const unsigned BITS_ = 8u * (unsigned)sizeof(T), PER = 8u / (unsigned)sizeof(T);    \
        const uint64_t MASK = BITS_ == 64 ? ~0ULL : (1ULL << (BITS_ & 63)) - 1;             \
        int64_t i = 0, bad = -1, prev = -1, rb = 0, wrote = 0;                              \
        while (i < count) {                                                                 \
            int64_t p = pos[i];                                                             \
            if (p <= prev || p >= n_el) { bad = i; break; }                                 \
            const uint64_t j = (uint64_t)p >> (3 - LOG);                                    \
            if (i + APPLY_PF < count)                                                       \
                prefetch_at(data, ((uint64_t)pos[i + APPLY_PF] >> (3 - LOG)) << 3, 1);      \
            uint64_t before;                                                                \
            if (j * 8 + 8 <= nbytes) memcpy(&before, data + j * 8, 8);                      \
            else before = word_at(data, nbytes, j);                                         \
            uint64_t after = before;                                                        \
            for (;;) {                                                                      \
                const unsigned sh = ((unsigned)p & (PER - 1)) * BITS_;                      \
                if ((T)(before >> (sh & 63)) != o[i]) { bad = i; break; }                   \
                after = (after & ~(MASK << (sh & 63))) | ((uint64_t)nw[i] << (sh & 63));    \
                if (!dry) d[p] = nw[i];                                                     \
                prev = p;                                                                   \
                if (++i == count) break;                                                    \
                p = pos[i];                                                                 \
                if ((uint64_t)p >> (3 - LOG) != j || p <= prev || p >= n_el) break;         \
            }                                                                               \
            const uint64_t jt = word_in_tensor(jm, j);                                      \
            d0 += sum_term(0, after, jt) - sum_term(0, before, jt);                         \
            d1 += sum_term(1, after, jt) - sum_term(1, before, jt);                         \
            if (bad >= 0) break;                                                            \
            if (readback && !dry && (i - rb >= APPLY_RB || i == count)) {                   \
                for (; rb < i; rb++)                                                        \
                    if (d[pos[rb]] != nw[rb]) break;                                        \
                if (rb < i) { wrote = i; bad = rb; break; }                                 \
            }                                                                               \
        }                                                                                   \
        if (wrote) { /* a read-back differs: put back every element written */              \
            for (int64_t q = 0; q < wrote; q++) d[pos[q]] = o[q];                           \
            *err = "read-back of a written element differs"; return RP_ECORRUPT;            \
        }                                                                                   \
        if (bad >= 0) { /* all or nothing: put back what this call wrote */                 \
            for (int64_t q = 0; !dry && q < bad; q++) d[pos[q]] = o[q];                     \
            if (pos[bad] < 0 || pos[bad] >= n_el || (bad && pos[bad] <= pos[bad - 1])) {    \
                *err = "positions out of range or not increasing"; return RP_EARG;          \
            }                                                                               \
            *err = "old elements differ from the patch's base"; return RP_EBASE;            \
        }                                                                                   \
    } while (0)

/* Word j of the data as a word of the tensor (rp_jmap, rpcore.h). */
static inline uint64_t word_in_tensor(const rp_jmap *jm, uint64_t j) {
    if (!jm) return j;
    return j + jm->j0 + (jm->row_words ? (j / jm->row_words) * jm->j_skip : 0);
}

int rp_apply(const rp_kind *kd, uint8_t *data, size_t nbytes, const int64_t *pos,
             const void *old, const void *new_, int64_t count, int iw, int dry, int readback,
             const rp_jmap *jm, uint64_t delta[2], const char **err) {
    int64_t n_el = kd->bits == 4 ? (int64_t)nbytes * 2 : (int64_t)(nbytes / (size_t)(kd->bits / 8));
    uint64_t d0 = 0, d1 = 0;
    if (kd->bits == 16 && iw == 2) APPLY_TYPED(uint16_t, 1);
    else if (kd->bits == 8 && iw == 1) APPLY_TYPED(uint8_t, 0);
    else if (kd->bits == 32 && iw == 4) APPLY_TYPED(uint32_t, 2);
    else if (kd->bits == 64 && iw == 8) APPLY_TYPED(uint64_t, 3);
    else {
        for (int64_t i = 0; i < count; i++) {
            if (pos[i] < 0 || pos[i] >= n_el || (i && pos[i] <= pos[i - 1])) {
                *err = "positions out of range or not increasing"; return RP_EARG;
            }
            if (elem_get(data, kd->bits, pos[i]) != arr_get(old, iw, i)) {
                *err = "old elements differ from the patch's base"; return RP_EBASE;
            }
        }
        int64_t i = 0;
        while (i < count) {
            uint64_t j = (uint64_t)pos[i] / 16; /* 16 nibbles per word */
            uint64_t before = word_at(data, nbytes, j), after;
            uint8_t lanes[8]; /* the word's bytes, written in a local (dry) or in place */
            memcpy(lanes, &before, 8);
            for (; i < count && (uint64_t)pos[i] / 16 == j; i++) {
                elem_put(lanes, kd->bits, pos[i] - (int64_t)(16 * j), arr_get(new_, iw, i));
                if (!dry) elem_put(data, kd->bits, pos[i], arr_get(new_, iw, i));
            }
            memcpy(&after, lanes, 8);
            const uint64_t jt = word_in_tensor(jm, j);
            d0 += sum_term(0, after, jt) - sum_term(0, before, jt);
            d1 += sum_term(1, after, jt) - sum_term(1, before, jt);
        }
        for (i = 0; readback && !dry && i < count; i++) /* nibbles: what elem_put stored */
            if (elem_get(data, kd->bits, pos[i]) != (arr_get(new_, iw, i) & 15)) {
                put_back(data, kd->bits, pos, old, iw, count);
                *err = "read-back of a written element differs"; return RP_ECORRUPT;
            }
    }
    delta[0] += d0;
    delta[1] += d1;
    return RP_OK;
}
