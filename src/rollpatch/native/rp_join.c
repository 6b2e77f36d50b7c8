/* rollpatch native core: phase B of the decoder, the join of the changed ranks with the
 * base's contexts (scalar, AVX2, AVX2 + PDEP); what it finds is written group by group by
 * rp_lane_group (rp_group.c). */
#include "rp_lane.h"

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
        if ((b0 & (16 * JB - 1)) == 15 * JB) rp_lane_group(kd, l, start, b0 + len, 0);         \
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
