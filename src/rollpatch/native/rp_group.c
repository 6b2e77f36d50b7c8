/* rollpatch native core: the decoder's output, group by group (rp_lane_group): the changes
 * the join found (rp_join.c) become new elements, written into the outputs and in place, with
 * the in-pass rp.sum128 of the words as read and the change of those written. */
#include "rp_lane.h"

/* Phase B's output, the changes found since the last call, [done, emitted), in position
 * order: new elements from the outward flags and the magnitudes (by context-order index) into
 * the outputs and, when writing, into the base: the join calls this every few blocks, while
 * those words are still in cache. Typed loops for the common kinds. */
#define FIN_TYPED(T, LOG, MT, ORDER)                                                        \
    do {                                                                                    \
        enum { BITS_ = 8 << LOG };                                                          \
        const uint64_t s = 1ULL << (BITS_ - 1), msk = (T)~(T)0;                             \
        T *d = (T *)l->wdata, *po = (T *)l->old_out, *pn = (T *)l->new_out;                 \
        const MT *mg = (const MT *)l->magc;                                                 \
        const uint32_t *rpos = l->rpos, *rci = l->rci;                                      \
        const uint64_t *rold = l->rold;                                                     \
        const uint64_t *outw = l->outw;                                                     \
        int64_t *pout = l->pos_out;                                                         \
        const int64_t e_ = l->emitted;                                                      \
        uint64_t cj = l->cj, before = l->before, d0 = l->d0, d1 = l->d1;                    \
        const uint64_t nfull = l->wlen / 8;                                                 \
        const int notrack = l->notrack;                                                     \
        uint8_t *const wdata = l->wdata;                                                    \
        const size_t wlen = l->wlen;                                                        \
        /* the word being written is kept in a register (`after`): no reload of a word     \
         * just stored into (a store-forwarding stall). Every field is read into a local   \
         * first: the stores below may alias anything (-fno-strict-aliasing). */           \
        uint64_t after = before;                                                            \
        if (d && cj != UINT64_MAX) {                                                        \
            if (cj < nfull) memcpy(&after, wdata + 8 * cj, 8);                              \
            else after = word_at(wdata, wlen, cj);                                          \
        }                                                                                   \
        for (int64_t i = l->done; i < e_; i++) {                                            \
            __builtin_prefetch(mg + rci[i + 16 < e_ ? i + 16 : i]);                         \
            int64_t p = start + rpos[i];                                                    \
            uint64_t x = rold[i];                                                           \
            uint64_t neg = ORDER != RP_UNSIGNED ? (x >> (BITS_ - 1)) & 1 : 0;               \
            uint64_t key = ORDER == RP_SIGNMAG ? x ^ (s | (msk & (0 - neg)))                \
                           : ORDER == RP_TWOS ? x ^ s : x;                                  \
            uint64_t a = mg[rci[i]];                                                        \
            uint64_t ow_ = (outw[i >> 6] >> (i & 63)) & 1;                                  \
            uint64_t sg = (ow_ ^ neg) - 1; /* 0: +a, ~0: -a */                              \
            uint64_t yk = (key + ((a ^ sg) - sg)) & msk;                                    \
            T y = (T)(ORDER == RP_SIGNMAG ? yk ^ (s | (msk & (0 - ((yk >> (BITS_ - 1)) ^ 1)))) \
                      : ORDER == RP_TWOS ? yk ^ s : yk);                                    \
            pout[i] = p;                                                                    \
            po[i] = (T)x;                                                                   \
            pn[i] = y;                                                                      \
            if (d) {                                                                        \
                uint64_t j = (uint64_t)p >> (3 - LOG);                                      \
                if (notrack) {                                                              \
                } else if (j != cj) {                                                       \
                    if (cj != UINT64_MAX) {                                                 \
                        d0 += sum_term(0, after, cj) - sum_term(0, before, cj);             \
                        d1 += sum_term(1, after, cj) - sum_term(1, before, cj);             \
                    }                                                                       \
                    cj = j;                                                                 \
                    if (j < nfull) memcpy(&before, wdata + 8 * j, 8);                       \
                    else before = word_at(wdata, wlen, j);                                  \
                    after = before;                                                         \
                }                                                                           \
                unsigned sh_ = (unsigned)(p & ((8 >> LOG) - 1)) << (LOG + 3);               \
                after = (after & ~((uint64_t)(T)~(T)0 << sh_)) | ((uint64_t)y << sh_);      \
                d[p] = y;                                                                   \
            }                                                                               \
        }                                                                                   \
        l->cj = cj; l->before = before; l->d0 = d0; l->d1 = d1;                             \
    } while (0)

#define FIN_ORDERS(T, LOG, MT)                                                              \
    do {                                                                                    \
        if (kd->order == RP_SIGNMAG) FIN_TYPED(T, LOG, MT, RP_SIGNMAG);                     \
        else if (kd->order == RP_TWOS) FIN_TYPED(T, LOG, MT, RP_TWOS);                      \
        else FIN_TYPED(T, LOG, MT, RP_UNSIGNED);                                            \
    } while (0)

/* Every other kind (4-, 32- and 64-bit), one function per width so that the element
 * access is inlined; the fields in locals (the stores may alias them). */
static inline __attribute__((always_inline)) void fin_generic(const rp_kind *kd, lane_t *l,
                                                              int64_t start, const int BITS) {
    const rp_kind k = {BITS, kd->order, kd->shift, kd->cbits};
    const uint64_t s = ksign(BITS), msk = kmask(BITS);
    const uint32_t *const rpos = l->rpos, *const rci = l->rci;
    const uint64_t *const rold = l->rold, *const outw = l->outw;
    const void *const magc = l->magc;
    void *const old_out = l->old_out, *const new_out = l->new_out;
    int64_t *const pout = l->pos_out;
    uint8_t *const wdata = l->wdata;
    const int mw = l->mw, ow = l->ow, track = !l->notrack;
    const int64_t e = l->emitted;
    for (int64_t i = l->done; i < e; i++) {
        int64_t p = start + rpos[i];
        uint64_t x = rold[i];
        uint64_t neg = k.order != RP_UNSIGNED && (x & s);
        uint64_t key = to_key(&k, x), a = arr_get(magc, mw, rci[i]);
        uint64_t sg = (((outw[i >> 6] >> (i & 63)) & 1) ^ neg) - 1; /* 0: +a, ~0: -a */
        uint64_t y = from_key(&k, (key + ((a ^ sg) - sg)) & msk);
        pout[i] = p;
        arr_put(old_out, ow, i, x);
        arr_put(new_out, ow, i, y);
        if (wdata) {
            uint64_t j = (uint64_t)p * (uint64_t)BITS / 64;
            if (track && j != l->cj) {
                lane_flush(l);
                l->cj = j;
                l->before = word_at(wdata, l->wlen, j);
            }
            elem_put(wdata, BITS, p, y);
        }
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
#define FIN512                                                                                  \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"), always_inline)) static inline

/* rp.sum128's term (rp_internal.h, sum_term) of 8 words w at word indices j; jk = S + j * K. */
FIN512 __m512i sum_term8(__m512i w, __m512i jk, const int LANE) {
    __m512i x = _mm512_xor_si512(w, jk);
    __m512i prod = _mm512_mul_epu32(x, _mm512_srli_epi64(x, 32));
    /* an immediate each (clang wants a constant even where LANE is inlined as one) */
    return _mm512_add_epi64(prod, LANE ? _mm512_rol_epi64(w, 17) : _mm512_rol_epi64(w, 32));
}

/* The rp.sum128 change of writing 8 new elements y (64-bit lanes, in position order) at
 * element positions p of d: each word's value before (one gather) and after (its lanes'
 * elements put in, OR-ed along the run of lanes in the same word: positions increase, so a
 * word's lanes are consecutive); one term pair per run's last lane. Lane 7 always closes its
 * run: a word shared with the next 8 is read again by their gather, after this half's
 * stores, so its terms telescope. Adds the change into acc[0], acc[1] (mod 2^64). */
FIN512 void track8(const uint8_t *d, __m512i p, __m512i y, const int BITS, __m512i acc[2]) {
    const int LOGW = BITS == 16 ? 2 : 3; /* elements per 64-bit word: 1 << LOGW */
    const __m512i none = _mm512_set1_epi64(-1), zero = _mm512_setzero_si512();
    const __m512i j = _mm512_srli_epi64(p, LOGW);
    const __m512i sh = _mm512_slli_epi64(_mm512_and_si512(p, _mm512_set1_epi64((1 << LOGW) - 1)),
                                         BITS == 16 ? 4 : 3);
    __m512i m = _mm512_sllv_epi64(_mm512_set1_epi64((1 << BITS) - 1), sh);
    __m512i v = _mm512_sllv_epi64(y, sh);
    const __m512i w0 = _mm512_i64gather_epi64(j, (const void *)d, 8);
#define RP_SEG_OR(S)                                                                            \
    do {                                                                                        \
        __mmask8 eq = _mm512_cmpeq_epi64_mask(j, _mm512_alignr_epi64(j, none, 8 - (S)));        \
        m = _mm512_mask_or_epi64(m, eq, m, _mm512_alignr_epi64(m, zero, 8 - (S)));              \
        v = _mm512_mask_or_epi64(v, eq, v, _mm512_alignr_epi64(v, zero, 8 - (S)));              \
    } while (0)
    RP_SEG_OR(1);
    RP_SEG_OR(2);
    RP_SEG_OR(4);
#undef RP_SEG_OR
    const __m512i w1 = _mm512_or_si512(_mm512_andnot_si512(m, w0), v);
    const __mmask8 last = _mm512_cmpneq_epi64_mask(j, _mm512_alignr_epi64(none, j, 1));
    for (int ln = 0; ln < 2; ln++) {
        const __m512i jk = _mm512_add_epi64(_mm512_set1_epi64((long long)SUM_S[ln]),
                                            _mm512_mullo_epi64(j, _mm512_set1_epi64((long long)SUM_K[ln])));
        __m512i t = ln ? _mm512_sub_epi64(sum_term8(w1, jk, 1), sum_term8(w0, jk, 1))
                       : _mm512_sub_epi64(sum_term8(w1, jk, 0), sum_term8(w0, jk, 0));
        acc[ln] = _mm512_mask_add_epi64(acc[ln], last, acc[ln], t);
    }
}

/* The 16 outward flags of changes i .. i + 15. */
static inline uint32_t outw16(const uint64_t *outw, int64_t i) {
    uint64_t w = (uint64_t)i >> 6, sh = (uint64_t)i & 63, v = outw[w] >> sh;
    if (sh > 48) v |= outw[w + 1] << (64 - sh);
    return (uint32_t)v & 0xFFFFu;
}

/* rp_finalize's loop for 16- and 8-bit kinds, 16 changes per step in 32-bit lanes, where no
 * written word is tracked (no write, or a group summed whole): the magnitudes gathered, the
 * keys, signs and new elements under masks, the outputs stored whole; only the in-place
 * writes go one by one. Returns where it stopped (fewer than 16 left). */
FIN512 int64_t fin_avx512_(lane_t *l, int64_t start, const int BITS, const int ORDER,
                           const int TRACK) {
    const __m512i vs = _mm512_set1_epi32(1 << (BITS - 1));
    const __m512i vm = _mm512_set1_epi32((1 << BITS) - 1);
    const __m512i lo16 = _mm512_set1_epi32(0xFFFF), st = _mm512_set1_epi64(start);
    const uint32_t *const rpos = l->rpos, *const rci = l->rci;
    const uint64_t *const rold = l->rold, *const outw = l->outw;
    const uint16_t *const mg = (const uint16_t *)l->magc; /* mw == 2 for kinds up to 16 bits */
    uint8_t *const po = (uint8_t *)l->old_out, *const pn = (uint8_t *)l->new_out;
    int64_t *const pout = l->pos_out;
    uint8_t *const d = l->wdata;
    const int64_t e = l->emitted;
    int64_t i = l->done;
    /* TRACK: the written words' rp.sum128 change, as FIN_TYPED's tracking sums it */
    const uint64_t nfull = l->wlen / 8;
    __m512i acc[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
    if (TRACK) lane_flush(l); /* the scalar loop's pending word */
    for (; i + 16 <= e; i += 16) {
        /* every word written lies wholly inside the data (the gathers read 8 bytes) */
        if (TRACK && (uint64_t)(start + rpos[i + 15]) >> (BITS == 16 ? 2 : 3) >= nfull) break;
        __m512i rp = _mm512_loadu_si512(rpos + i);
        __m512i p0 = _mm512_cvtepu32_epi64(_mm512_castsi512_si256(rp));
        __m512i p1 = _mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64(rp, 1));
        _mm512_storeu_si512(pout + i, _mm512_add_epi64(p0, st));
        _mm512_storeu_si512(pout + i + 8, _mm512_add_epi64(p1, st));
        __m256i xl = _mm512_cvtepi64_epi32(_mm512_loadu_si512(rold + i));
        __m256i xh = _mm512_cvtepi64_epi32(_mm512_loadu_si512(rold + i + 8));
        __m512i x = _mm512_inserti64x4(_mm512_castsi256_si512(xl), xh, 1);
        /* 4 bytes at each magnitude, the last ones inside magc's 8 spare bytes */
        __m512i a = _mm512_i32gather_epi32(_mm512_loadu_si512(rci + i), mg, 2);
        a = _mm512_and_si512(a, lo16);
        __mmask16 ko = (__mmask16)outw16(outw, i);
        __mmask16 kn = ORDER != RP_UNSIGNED ? _mm512_test_epi32_mask(x, vs) : 0;
        __m512i key = ORDER == RP_SIGNMAG ? _mm512_mask_xor_epi32(_mm512_or_si512(x, vs), kn, x, vm)
                      : ORDER == RP_TWOS  ? _mm512_xor_si512(x, vs)
                                          : x;
        __mmask16 ksub = _knot_mask16(_kxor_mask16(ko, kn)); /* outward == negative: key - a */
        __m512i yk = _mm512_mask_sub_epi32(_mm512_add_epi32(key, a), ksub, key, a);
        yk = _mm512_and_si512(yk, vm);
        __mmask16 kp = _mm512_test_epi32_mask(yk, vs); /* signmag: a positive key */
        __m512i y = ORDER == RP_SIGNMAG ? _mm512_mask_xor_epi32(_mm512_xor_si512(yk, vm), kp, yk, vs)
                    : ORDER == RP_TWOS  ? _mm512_xor_si512(yk, vs)
                                        : yk;
        if (BITS == 16) {
            _mm256_storeu_si256((__m256i *)(po + 2 * i), _mm512_cvtepi32_epi16(x));
            _mm256_storeu_si256((__m256i *)(pn + 2 * i), _mm512_cvtepi32_epi16(y));
        } else {
            _mm_storeu_si128((__m128i *)(po + i), _mm512_cvtepi32_epi8(x));
            _mm_storeu_si128((__m128i *)(pn + i), _mm512_cvtepi32_epi8(y));
        }
        if (TRACK) { /* each half's words read before its own stores, after the last's */
            for (int h = 0; h < 2; h++) {
                track8(d, _mm512_add_epi64(h ? p1 : p0, st),
                       _mm512_cvtepu32_epi64(h ? _mm512_extracti64x4_epi64(y, 1)
                                               : _mm512_castsi512_si256(y)),
                       BITS, acc);
                for (int q = 8 * h; q < 8 * h + 8; q++) {
                    if (BITS == 16) memcpy(d + 2 * (start + rpos[i + q]), pn + 2 * (i + q), 2);
                    else d[start + rpos[i + q]] = pn[i + q];
                }
            }
        } else if (d) {
            for (int q = 0; q < 16; q++) {
                if (BITS == 16) memcpy(d + 2 * (start + rpos[i + q]), pn + 2 * (i + q), 2);
                else d[start + rpos[i + q]] = pn[i + q];
            }
        }
    }
    if (TRACK) {
        l->d0 += (uint64_t)_mm512_reduce_add_epi64(acc[0]);
        l->d1 += (uint64_t)_mm512_reduce_add_epi64(acc[1]);
    }
    return i;
}

#define FIN_DISPATCH(TRACK)                                                                     \
    do {                                                                                        \
        if (kd->bits == 16) {                                                                   \
            if (kd->order == RP_SIGNMAG) return fin_avx512_(l, start, 16, RP_SIGNMAG, TRACK);   \
            if (kd->order == RP_TWOS) return fin_avx512_(l, start, 16, RP_TWOS, TRACK);         \
            return fin_avx512_(l, start, 16, RP_UNSIGNED, TRACK);                               \
        }                                                                                       \
        if (kd->order == RP_SIGNMAG) return fin_avx512_(l, start, 8, RP_SIGNMAG, TRACK);        \
        if (kd->order == RP_TWOS) return fin_avx512_(l, start, 8, RP_TWOS, TRACK);              \
        return fin_avx512_(l, start, 8, RP_UNSIGNED, TRACK);                                    \
    } while (0)

/* track: written in place with each written word's rp.sum128 change summed */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) static int64_t
fin_avx512(const rp_kind *kd, lane_t *l, int64_t start, int track) {
    if (track) FIN_DISPATCH(1);
    FIN_DISPATCH(0);
}
#undef FIN_DISPATCH
#endif

/* Whether the decoder's AVX-512 loops may run (rp_lane.h). */
int rp_avx512(int what) {
#if defined(__x86_64__) && defined(__GNUC__)
    /* the core's level (rp_isa.c; its AVX-512 level also has VBMI, VBMI2 and BMI2, which
     * phase A's Golomb loops need) */
    (void)what;
    return rp_isa() >= RP_ISA_AVX512;
#else
    (void)what;
    return 0;
#endif
}

void rp_finalize(const rp_kind *kd, lane_t *l, int64_t start, int partial) {
    if ((kd->bits == 16 || kd->bits == 8) && l->ow == kd->bits / 8) {
#if defined(__x86_64__) && defined(__GNUC__)
        if (rp_avx512(RP_V512_FIN)) {
            if (l->emitted - l->done >= 16)
                l->done = fin_avx512(kd, l, start, l->wdata && !l->notrack);
            if (partial) return; /* the rest (fewer than 16, mostly) with the next group's */
        }
#endif
        if (kd->bits == 16) FIN_ORDERS(uint16_t, 1, uint16_t);
        else FIN_ORDERS(uint8_t, 0, uint16_t);
    } else if (kd->bits == 4) {
        fin_generic(kd, l, start, 4);
    } else if (kd->bits == 32) {
        fin_generic(kd, l, start, 32);
    } else {
        fin_generic(kd, l, start, 64);
    }
    l->done = l->emitted;
}
#undef FIN_ORDERS
#undef FIN_TYPED

/* rp.sum128 of the chunk's elements [l->hashed, upto), read before this lane writes them
 * (the in-pass hash): group boundaries are multiples of 4,096 elements, so word-aligned.
 * With `after`, the same words are summed again once written, into after[2]. */
static void hash_range(const rp_kind *kd, lane_t *l, int64_t start, int64_t upto,
                       uint64_t out[2]) {
    uint64_t b = (uint64_t)kd->bits, e0 = (uint64_t)(start + l->hashed), e1 = (uint64_t)(start + upto);
    uint64_t w0 = e0 * b / 64, w1 = (e1 * b + 63) / 64;
    rp_sum128(l->wdata, l->wlen, w0, w1 - w0, out);
}

void rp_lane_hash_to(const rp_kind *kd, lane_t *l, int64_t start, int64_t upto) {
    if (!l->hash || upto <= l->hashed) return;
    uint64_t out[2];
    hash_range(kd, l, start, upto, out);
    l->h0 += out[0];
    l->h1 += out[1];
    l->hashed = upto;
}

/* The group of elements up to `upto`: hashed as read (with the in-pass hash), then its
 * changes written. Where a group holds many changes (more than one per 64 elements), its
 * rp.sum128 change is the sum of its words after the write less the sum before (the words
 * are still in cache: cheaper than a change per written word, and exactly equal to it);
 * else each written word's change is summed as it is written. */
static void lane_group(const rp_kind *kd, lane_t *l, int64_t start, int64_t upto, int last);
void rp_lane_group(const rp_kind *kd, lane_t *l, int64_t start, int64_t upto, int last) {
    uint64_t t0 = PROF_T();
    lane_group(kd, l, start, upto, last);
    PROF_ADD(2, t0);
}

/* Without the in-pass hash, a group that is not the chunk's last may leave its last few
 * changes (fewer than a vector step) to the next group: nothing sums words by range then. */
static void lane_group(const rp_kind *kd, lane_t *l, int64_t start, int64_t upto, int last) {
    if (!l->hash || !l->wdata || upto <= l->hashed
        || (l->emitted - l->done) * 64 <= upto - l->hashed) {
        rp_lane_hash_to(kd, l, start, upto);
        rp_finalize(kd, l, start, !last && !l->hash);
        return;
    }
    uint64_t before[2], after[2];
    lane_flush(l); /* the last tracked word lies in an earlier group */
    hash_range(kd, l, start, upto, before);
    l->notrack = 1;
    rp_finalize(kd, l, start, 0);
    l->notrack = 0;
    hash_range(kd, l, start, upto, after);
    l->h0 += before[0];
    l->h1 += before[1];
    l->d0 += after[0] - before[0];
    l->d1 += after[1] - before[1];
    l->hashed = upto;
}
