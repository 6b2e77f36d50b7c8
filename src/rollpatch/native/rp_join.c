/* rollpatch native core: phase B of the decoder, the join of the changed ranks with the
 * base's contexts (scalar, AVX2, AVX2 + PDEP), and the output of the changes it finds. */
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
        const uint8_t *outw = l->outw;                                                      \
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
            uint64_t sg = 0 - (uint64_t)!(outw[i] ^ (uint8_t)neg); /* 0: +a, ~0: -a */      \
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

void rp_finalize(const rp_kind *kd, lane_t *l, int64_t start) {
    uint64_t s = ksign(kd->bits), msk = kmask(kd->bits);
    if (kd->bits == 16 && l->ow == 2) {
        FIN_ORDERS(uint16_t, 1, uint16_t);
    } else if (kd->bits == 8 && l->ow == 1) {
        FIN_ORDERS(uint8_t, 0, uint16_t);
    } else {
        for (int64_t i = l->done; i < l->emitted; i++) {
            int64_t p = start + l->rpos[i];
            uint64_t x = l->rold[i];
            int neg = kd->order != RP_UNSIGNED && (x & s);
            uint64_t key = to_key(kd, x), a = arr_get(l->magc, l->mw, l->rci[i]);
            uint64_t sg = 0 - (uint64_t)!(l->outw[i] ^ (uint8_t)neg); /* 0: +a, ~0: -a */
            uint64_t y = from_key(kd, (key + ((a ^ sg) - sg)) & msk);
            l->pos_out[i] = p;
            arr_put(l->old_out, l->ow, i, x);
            arr_put(l->new_out, l->ow, i, y);
            if (l->wdata) {
                uint64_t j = (uint64_t)p * (uint64_t)kd->bits / 64;
                if (!l->notrack && j != l->cj) {
                    lane_flush(l);
                    l->cj = j;
                    l->before = word_at(l->wdata, l->wlen, j);
                }
                elem_put(l->wdata, kd->bits, p, y);
            }
        }
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
static void lane_group(const rp_kind *kd, lane_t *l, int64_t start, int64_t upto);
void rp_lane_group(const rp_kind *kd, lane_t *l, int64_t start, int64_t upto) {
    uint64_t t0 = PROF_T();
    lane_group(kd, l, start, upto);
    PROF_ADD(2, t0);
}

static void lane_group(const rp_kind *kd, lane_t *l, int64_t start, int64_t upto) {
    if (!l->hash || !l->wdata || upto <= l->hashed
        || (l->emitted - l->done) * 64 <= upto - l->hashed) {
        rp_lane_hash_to(kd, l, start, upto);
        rp_finalize(kd, l, start);
        return;
    }
    uint64_t before[2], after[2];
    lane_flush(l); /* the last tracked word lies in an earlier group */
    hash_range(kd, l, start, upto, before);
    l->notrack = 1;
    rp_finalize(kd, l, start);
    l->notrack = 0;
    hash_range(kd, l, start, upto, after);
    l->h0 += before[0];
    l->h1 += before[1];
    l->d0 += after[0] - before[0];
    l->d1 += after[1] - before[1];
    l->hashed = upto;
}

/* Phase B, the join: blocks of JB elements; each block's contexts are computed once into an
 * L1 buffer from the base; every listed context inside the densest window of W consecutive
 * contexts is counted per block with byte compares (no branch per element or per vector), and
 * only a block where a context reaches its next changed rank is scanned again for that
 * context to find the positions. Listed contexts outside the window (rare: a window of 16
 * holds every context of 8-bit and 4-bit kinds, and >99.9% of BF16 weights) go through a
 * table, element by element. Found positions are collected from a bitmap in order. WIN and
 * JB are in rp_internal.h (the encoder's pass shares them). */

int rp_join_window(const lane_t *l) {
    int lo = 0;
    int64_t best = -1;
    for (int w0 = 0; w0 + WIN <= NCTX; w0++) { /* the window never wraps */
        uint64_t sum = 0;
        for (int i = 0; i < l->pp.g; i++)
            if (l->pp.cid[i] >= w0 && l->pp.cid[i] < w0 + WIN) sum += l->pp.nc[i];
        if (best < 0 || sum > (uint64_t)best) { best = (int64_t)sum; lo = w0; }
    }
    return lo;
}

#define JOIN_BODY(COUNTS, EQ32, OUT32, OUTANY)                                                      \
    uint8_t cbuf[JB] __attribute__((aligned(32)));                                          \
    uint8_t listed[NCTX];                                                                   \
    int vc[WIN], nvc = 0, outside = 0;                                                      \
    uint32_t cnt[WIN], tgt[WIN], bcs[WIN];                                                  \
    uint8_t vcb[WIN];                                                                       \
    uint64_t cur[WIN], endr[WIN];                                                           \
    int lo = rp_join_window(l);                                                                \
    const int bits = kd->bits, bits16 = bits == 16;                                         \
    const uint32_t *const ranks = l->ranks;                                                 \
    const uint8_t *const magc = (const uint8_t *)l->magc;                                   \
    const uint64_t mw = (uint64_t)l->mw;                                                    \
    memset(listed, 0, sizeof listed);                                                       \
    for (int i = 0; i < l->pp.g; i++) {                                                     \
        int c = l->pp.cid[i];                                                               \
        listed[c] = 1;                                                                      \
        if (c >= lo && c < lo + WIN) {                                                      \
            cnt[nvc] = l->cnt[c]; tgt[nvc] = l->tgt[c];                                     \
            cur[nvc] = l->cur[c]; endr[nvc] = l->endr[c];                                   \
            vc[nvc++] = c;                                                                  \
        } else {                                                                            \
            outside = 1;                                                                    \
        }                                                                                   \
    }                                                                                       \
    uint8_t pad = (uint8_t)(lo + WIN < NCTX ? lo + WIN : lo - 1); /* in no window */       \
    for (int t = 0; t < WIN; t++) { /* slots past nvc never hit */                          \
        vcb[t] = t < nvc ? (uint8_t)vc[t] : pad;                                            \
        if (t >= nvc) { cnt[t] = 0; tgt[t] = UINT32_MAX; }                                  \
    }                                                                                       \
    for (int64_t b0 = 0; b0 < n; b0 += JB) {                                                \
        int len = n - b0 < JB ? (int)(n - b0) : JB;                                         \
        uint64_t bb[JB / 64] = {0}; /* positions found in this block */                     \
        uint32_t bci[JB]; /* their context-order indices */                                \
        if (b0 + (RP_PF + 1) * JB <= n) { /* the base's lines RP_PF blocks ahead */          \
            const uint8_t *pf = base + ((start + b0 + RP_PF * JB) * bits >> 3);              \
            for (int q_ = 0; q_ < JB * bits / 8; q_ += 64) __builtin_prefetch(pf + q_);      \
        }                                                                                   \
        BLOCKCTX(kd, base, start + b0, len, cbuf);                                          \
        if (len < JB) memset(cbuf + len, pad, (size_t)(JB - len));                          \
        uint32_t hit = COUNTS(cbuf, vcb, nvc, cnt, tgt, bcs); /* no branch per context */  \
        while (hit) { /* the contexts with a changed rank inside this block */             \
            int t = __builtin_ctz(hit);                                                     \
            hit &= hit - 1;                                                                 \
            int c = vc[t];                                                                  \
            uint32_t g = tgt[t], endc = cnt[t] + bcs[t], pre[JB / 64];                      \
            uint64_t cu = cur[t], w[JB / 64];                                               \
            uint32_t acc = cnt[t];                                                          \
            for (int v = 0; v < JB / 64; v++) { /* the context's masks, prefix counts */    \
                w[v] = (uint64_t)EQ32(cbuf + 64 * v, c)                                     \
                       | (uint64_t)EQ32(cbuf + 64 * v + 32, c) << 32;                       \
                pre[v] = acc;                                                               \
                acc += (uint32_t)__builtin_popcountll(w[v]);                                \
            }                                                                               \
            while (g < endc) { /* each changed rank: its word, then its bit */              \
                int v = (g >= pre[1]) + (g >= pre[2]) + (g >= pre[3]);                      \
                int e_ = SELECT64(w[v], g - pre[v]);                                        \
                bb[v] |= 1ULL << e_;                                                        \
                bci[64 * v + e_] = (uint32_t)cu;                                            \
                __builtin_prefetch(magc + (cu + 32) * mw);                                  \
                g = ++cu < endr[t] ? ranks[cu] : UINT32_MAX;                                \
            }                                                                               \
            tgt[t] = g;                                                                     \
            cur[t] = cu;                                                                    \
        }                                                                                   \
        for (int t = 0; t < nvc; t++) cnt[t] += bcs[t];                                     \
        if (__builtin_expect(outside, 0) && OUTANY(cbuf, lo)) { /* rare inside a block */  \
            for (int v = 0; v * 32 < len; v++) {                                            \
                uint32_t m = OUT32(cbuf + 32 * v, lo);                                      \
                if (len - 32 * v < 32) m &= (1u << (len - 32 * v)) - 1;                     \
                while (m) {                                                                 \
                    int e = 32 * v + __builtin_ctz(m);                                      \
                    m &= m - 1;                                                             \
                    unsigned c = cbuf[e];                                                   \
                    if (!listed[c]) continue;                                               \
                    if (l->cnt[c]++ == l->tgt[c]) {                                         \
                        bb[e >> 6] |= 1ULL << (e & 63);                                     \
                        bci[e] = (uint32_t)l->cur[c];                                       \
                        uint64_t nx = ++l->cur[c];                                          \
                        l->tgt[c] = nx < l->endr[c] ? l->ranks[nx] : UINT32_MAX;            \
                    }                                                                       \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
        { /* in position order, old words still in L1; fields in locals: the stores may    \
           * alias them (-fno-strict-aliasing) */                                           \
            int64_t em = l->emitted;                                                        \
            const int64_t kmax = (int64_t)l->pp.k;                                          \
            uint32_t *const rpos = l->rpos, *const rci = l->rci;                            \
            uint64_t *const rold = l->rold;                                                 \
            for (int w = 0; w < JB / 64; w++) {                                             \
                uint64_t x = bb[w];                                                         \
                while (x) {                                                                 \
                    int e = 64 * w + __builtin_ctzll(x);                                    \
                    x &= x - 1;                                                             \
                    if (em >= kmax) break; /* refused in phase C */                         \
                    rpos[em] = (uint32_t)(b0 + e);                                          \
                    rold[em] = bits16 ? ((const uint16_t *)base)[start + b0 + e]            \
                                      : elem_get(base, bits, start + b0 + e);               \
                    rci[em++] = bci[e];                                                     \
                }                                                                           \
            }                                                                               \
            l->emitted = em;                                                                \
        }                                                                                   \
        if ((b0 & (16 * JB - 1)) == 15 * JB) rp_lane_group(kd, l, start, b0 + len);         \
    }                                                                                       \
    for (int t = 0; t < nvc; t++) {                                                         \
        int c = vc[t];                                                                      \
        l->cnt[c] = cnt[t]; l->tgt[c] = tgt[t]; l->cur[c] = cur[t];                         \
    }

/* Position of the r-th (from 0) set bit of x; r < popcount(x). */
static inline int select64_loop(uint64_t x, uint32_t r) {
    while (r--) x &= x - 1;
    return __builtin_ctzll(x);
}

static inline uint32_t out32_scalar(const uint8_t *p, int lo) {
    uint32_t m = 0;
    for (int i = 0; i < 32; i++) m |= (uint32_t)((unsigned)(p[i] - lo) >= WIN) << i;
    return m;
}

/* Whether any byte of the block lies outside the window [lo, lo + WIN) (one test per block
 * instead of one per 32 elements; the pad of a short last block does: the loop that follows
 * masks it off). */
static inline int outany_scalar(const uint8_t *p, int lo) {
    int any = 0;
    for (int i = 0; i < JB; i++) any |= (unsigned)(p[i] - lo) >= WIN;
    return any;
}

/* Each slot's count in the block (bcs) and the slots whose next rank falls inside it. */
static inline uint32_t counts_scalar(const uint8_t *cb, const uint8_t *vcb, int nvc,
                                     const uint32_t *cnt, const uint32_t *tgt, uint32_t *bcs) {
    uint32_t hit = 0;
    for (int t = 0; t < nvc; t++) {
        bcs[t] = blkcnt_scalar(cb, vcb[t]);
        hit |= (uint32_t)(cnt[t] + bcs[t] > tgt[t]) << t;
    }
    return hit;
}

#define BLOCKCTX block_ctx
#define SELECT64 select64_loop
static void join_scalar(const rp_kind *kd, const uint8_t *base, lane_t *l, int64_t start,
                        int64_t n) {
    JOIN_BODY(counts_scalar, eq32_scalar, out32_scalar, outany_scalar)
}
#undef SELECT64
#undef BLOCKCTX

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx2"))) static inline uint32_t out32_avx2(const uint8_t *p, int lo) {
    __m256i v = _mm256_sub_epi8(_mm256_load_si256((const __m256i *)p), _mm256_set1_epi8((char)lo));
    __m256i top = _mm256_set1_epi8(WIN - 1);
    __m256i in = _mm256_cmpeq_epi8(_mm256_max_epu8(v, top), top);
    return ~(uint32_t)_mm256_movemask_epi8(in);
}

__attribute__((target("avx2"))) static inline int outany_avx2(const uint8_t *p, int lo) {
    const __m256i l = _mm256_set1_epi8((char)lo), top = _mm256_set1_epi8(WIN - 1);
    __m256i out = _mm256_setzero_si256();
    for (int v = 0; v < JB / 32; v++) { /* bytes above WIN - 1 after the shift: outside */
        __m256i x = _mm256_sub_epi8(_mm256_load_si256((const __m256i *)(p + 32 * v)), l);
        out = _mm256_or_si256(out, _mm256_xor_si256(_mm256_max_epu8(x, top), top));
    }
    return !_mm256_testz_si256(out, out);
}

/* counts_scalar for up to 16 slots, 8 at a time: byte compares per slot, then the 8 slots'
 * sums by horizontal adds into one vector, and the hit test (unsigned) for all 8 at once. */
__attribute__((target("avx2"))) static inline uint32_t counts_avx2(const uint8_t *cb,
                                                                    const uint8_t *vcb, int nvc,
                                                                    const uint32_t *cnt,
                                                                    const uint32_t *tgt,
                                                                    uint32_t *bcs) {
    __m256i x[JB / 32];
    for (int v = 0; v < JB / 32; v++) x[v] = _mm256_load_si256((const __m256i *)(cb + 32 * v));
    const __m256i z = _mm256_setzero_si256(), flip = _mm256_set1_epi32((int)0x80000000u);
    uint32_t hit = 0;
    for (int g = 0; g * 8 < nvc; g++) {
        __m256i sd[8];
        for (int t = 0; t < 8; t++) {
            __m256i c = _mm256_set1_epi8((char)vcb[8 * g + t]), acc = z;
            for (int v = 0; v < JB / 32; v++) acc = _mm256_sub_epi8(acc, _mm256_cmpeq_epi8(x[v], c));
            sd[t] = _mm256_sad_epu8(acc, z); /* 4 x u64, each <= 64 */
        }
        __m256i h01 = _mm256_hadd_epi32(sd[0], sd[1]), h23 = _mm256_hadd_epi32(sd[2], sd[3]);
        __m256i h45 = _mm256_hadd_epi32(sd[4], sd[5]), h67 = _mm256_hadd_epi32(sd[6], sd[7]);
        __m256i q0 = _mm256_hadd_epi32(h01, h23), q1 = _mm256_hadd_epi32(h45, h67);
        __m128i lo = _mm_add_epi32(_mm256_castsi256_si128(q0), _mm256_extracti128_si256(q0, 1));
        __m128i hi = _mm_add_epi32(_mm256_castsi256_si128(q1), _mm256_extracti128_si256(q1, 1));
        __m256i b = _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
        _mm256_storeu_si256((__m256i *)(bcs + 8 * g), b);
        __m256i sum = _mm256_add_epi32(_mm256_loadu_si256((const __m256i *)(cnt + 8 * g)), b);
        __m256i gt = _mm256_cmpgt_epi32(_mm256_xor_si256(sum, flip),
                                        _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(tgt + 8 * g)), flip));
        hit |= (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(gt)) << (8 * g);
    }
    return hit;
}

__attribute__((target("avx2"))) static void join_avx2(const rp_kind *kd, const uint8_t *base,
                                                       lane_t *l, int64_t start, int64_t n) {
#define BLOCKCTX BLOCKCTX16
#define SELECT64 select64_loop
    JOIN_BODY(counts_avx2, eq32_avx2, out32_avx2, outany_avx2)
#undef SELECT64
#undef BLOCKCTX
}

__attribute__((target("avx2,bmi2"))) static inline int select64_pdep(uint64_t x, uint32_t r) {
    return __builtin_ctzll(_pdep_u64(1ULL << r, x));
}

/* The same with PDEP for the bit select: only where PDEP is fast (not AMD before Zen 3). */
__attribute__((target("avx2,bmi2"))) static void join_avx2_pdep(const rp_kind *kd,
                                                                 const uint8_t *base,
                                                                 lane_t *l, int64_t start,
                                                                 int64_t n) {
#define BLOCKCTX BLOCKCTX16
#define SELECT64 select64_pdep
    JOIN_BODY(counts_avx2, eq32_avx2, out32_avx2, outany_avx2)
#undef SELECT64
#undef BLOCKCTX
}
#endif

void rp_join_lane(const rp_kind *kd, const uint8_t *base, lane_t *l, int64_t start,
                      int64_t n) {
#if defined(__x86_64__) && defined(__GNUC__)
    int isa = rp_isa();
    if (isa >= RP_ISA_AVX512 && rp_join_lane_avx512(kd, base, l, start, n) == 0) return;
    if (isa >= RP_ISA_AVX2) {
        if (__builtin_cpu_supports("bmi2") && !__builtin_cpu_is("znver1")
            && !__builtin_cpu_is("znver2"))
            join_avx2_pdep(kd, base, l, start, n);
        else
            join_avx2(kd, base, l, start, n);
        return;
    }
#endif
    join_scalar(kd, base, l, start, n);
}
