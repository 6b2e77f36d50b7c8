/* rollpatch native core: the encoder's pass over dense old/new tensors, scalar and AVX2 (the
 * AVX-512 one: rp_encpass512.c; the entry points that run them per chunk: rp_encrange.c). */
#include "rp_internal.h"

/* ------------------------------------------------------------------ encoder pass */

/* The encoder's pass, JB elements per block: change masks from word compares; the block's
 * contexts into an L1 buffer; the "hot" contexts (those of a window of WIN consecutive
 * contexts seen in a sample of the chunk's start) counted per block with byte compares; the
 * others ("cold") one by one through a table; the rank of a changed element is its
 * context's count before the block plus a popcount inside it. The rp.sum128 change of the
 * new words over the old ones is summed over the words that hold changes. */

static void changed_generic(const rp_kind *kd, const uint8_t *a, const uint8_t *b, int64_t s,
                            int len, uint64_t *dm) {
    memset(dm, 0, (JB / 64) * 8);
    if (kd->bits == 16) {
        const uint16_t *x = (const uint16_t *)a + s, *y = (const uint16_t *)b + s;
        for (int i = 0; i < len; i++) dm[i >> 6] |= (uint64_t)(x[i] != y[i]) << (i & 63);
    } else if (kd->bits == 8) {
        const uint8_t *x = a + s, *y = b + s;
        for (int i = 0; i < len; i++) dm[i >> 6] |= (uint64_t)(x[i] != y[i]) << (i & 63);
    } else {
        for (int i = 0; i < len; i++)
            dm[i >> 6] |= (uint64_t)(elem_get(a, kd->bits, s + i) != elem_get(b, kd->bits, s + i))
                          << (i & 63);
    }
}

static inline uint32_t cold32_scalar(const uint8_t *p, int lo, const uint8_t *hot) {
    uint32_t m = 0;
    for (int i = 0; i < 32; i++) {
        unsigned t = (unsigned)(p[i] - lo);
        m |= (uint32_t)!(t < WIN && hot[t]) << i;
    }
    return m;
}

/* The rp.sum128 change of a whole block's words at once (AVX2 only): every word's terms, new
 * less old (an unchanged word adds zero); 0 where not done (the caller sums per word). */
static inline int sumblk_none(const uint8_t *a, const uint8_t *b, uint64_t j0, int nw,
                              uint64_t *s0, uint64_t *s1) {
    (void)a; (void)b; (void)j0; (void)nw; (void)s0; (void)s1;
    return 0;
}

#define ENC_BODY(BLKCNT, EQ32, COLD32, BLOCKCTX, CHANGED, SUMBLK)                          \
    const rp_kind kdv_ = *kd_, *kd = &kdv_; /* locals: no reloads after every store */     \
    uint32_t *wrec = w->rec;                                                                \
    uint64_t *wtail = w->tail, sd0 = 0, sd1 = 0;                                            \
    int64_t wk = w->k, wnb = w->nb;                                                         \
    uint8_t cbuf[JB] __attribute__((aligned(32)));                                          \
    uint32_t rk[JB];                                                                        \
    uint64_t dm[JB / 64];                                                                   \
    uint8_t hot[WIN];                                                                       \
    uint32_t cnt[WIN], bcs[WIN], pre[WIN][JB / 64];                                         \
    uint64_t wm[WIN][JB / 64];                                                              \
    int vc[WIN], slot[NCTX], nvc = 0, lo = 0;                                               \
    int ncontexts = kd->cbits ? 1 << kd->cbits : 1;                                         \
    memset(hot, 0, sizeof hot);                                                             \
    for (int c = 0; c < NCTX; c++) slot[c] = -1;                                            \
    {                                                                                       \
        uint32_t sample[NCTX] = {0};                                                        \
        int64_t sn = n < 8192 ? n : 8192;                                                   \
        for (int64_t b0 = 0; b0 < sn; b0 += JB) {                                           \
            int len = sn - b0 < JB ? (int)(sn - b0) : JB;                                   \
            block_ctx(kd, old, start + b0, len, cbuf);                                      \
            for (int i = 0; i < len; i++) sample[cbuf[i]]++;                                \
        }                                                                                   \
        int w = ncontexts < WIN ? ncontexts : WIN;                                          \
        int64_t best = -1;                                                                  \
        for (int w0 = 0; w0 + w <= ncontexts; w0++) {                                       \
            int64_t sum = 0;                                                                \
            for (int c = w0; c < w0 + w; c++) sum += sample[c];                             \
            if (sum > best) { best = sum; lo = w0; }                                        \
        }                                                                                   \
        for (int c = lo; c < lo + w; c++) /* counted by byte compares when not rare */     \
            if (!kd->cbits || (int64_t)sample[c] * 512 >= sn) {                             \
                hot[c - lo] = 0xFF;                                                         \
                slot[c] = nvc;                                                              \
                cnt[nvc] = tab[c]; /* tab: the counts before start (a chunk's rest) */     \
                vc[nvc++] = c;                                                              \
            }                                                                               \
    }                                                                                       \
    uint8_t pad = (uint8_t)(lo + WIN < NCTX ? lo + WIN : lo - 1); /* in no window */       \
    int64_t cwl = -1; /* the last word whose sum change is counted (few-change blocks) */   \
    for (int64_t b0 = 0; b0 < n; b0 += JB) {                                                \
        int len = n - b0 < JB ? (int)(n - b0) : JB;                                         \
        BLOCKCTX(kd, old, start + b0, len, cbuf);                                           \
        if (len < JB) memset(cbuf + len, pad, (size_t)(JB - len));                          \
        CHANGED(kd, old, new_, start + b0, len, dm);                                        \
        uint64_t any = dm[0] | dm[1] | dm[2] | dm[3];                                      \
        int nch = __builtin_popcountll(dm[0]) + __builtin_popcountll(dm[1])                 \
                  + __builtin_popcountll(dm[2]) + __builtin_popcountll(dm[3]);              \
        int masks = nch >= nvc; /* few changes: each change's rank from its own compares */ \
        if (masks) { /* the hot contexts' element masks and prefix counts, per 64 elements */ \
            for (int t = 0; t < nvc; t++) {                                                 \
                uint32_t acc = 0;                                                           \
                for (int v = 0; v < JB / 64; v++) {                                         \
                    uint64_t e = (uint64_t)EQ32(cbuf + 64 * v, vc[t])                       \
                                 | (uint64_t)EQ32(cbuf + 64 * v + 32, vc[t]) << 32;         \
                    wm[t][v] = e;                                                           \
                    pre[t][v] = acc;                                                        \
                    acc += (uint32_t)__builtin_popcountll(e);                               \
                }                                                                           \
                bcs[t] = acc;                                                               \
            }                                                                               \
        } else {                                                                            \
            for (int t = 0; t < nvc; t++) bcs[t] = BLKCNT(cbuf, vc[t]);                     \
        }                                                                                   \
        int vsum = masks && len == JB                                                      \
                   && SUMBLK(old, new_, (uint64_t)(start + b0) * (uint64_t)kd->bits / 64,   \
                             JB * kd->bits / 64, &sd0, &sd1);                               \
        for (int v = 0; v * 32 < len; v++) { /* cold elements: ranks through the table */   \
            uint32_t m = COLD32(cbuf + 32 * v, lo, hot);                                    \
            if (len - 32 * v < 32) m &= (1u << (len - 32 * v)) - 1;                         \
            while (m) {                                                                     \
                int i = 32 * v + __builtin_ctz(m);                                          \
                m &= m - 1;                                                                 \
                rk[i] = tab[cbuf[i]]++;                                                     \
            }                                                                               \
        }                                                                                   \
        if (any && wk + JB >= w->cap) {                                                     \
            w->k = wk;                                                                      \
            w->nb = wnb;                                                                    \
            if (rp_ws_reserve(w, JB)) return -1;                                            \
            wrec = w->rec;                                                                  \
            wtail = w->tail;                                                                \
        }                                                                                   \
        if (any && r && r->k + JB > r->cap && rp_recs_grow(r)) return -1;                   \
        for (int v = 0; v < JB / 64; v++) {                                                 \
            uint64_t ch = dm[v];                                                            \
            while (ch) { /* no branch per change beyond the loop */                         \
                int i = 64 * v + __builtin_ctzll(ch);                                       \
                ch &= ch - 1;                                                               \
                unsigned c = cbuf[i];                                                       \
                int t = slot[c];                                                            \
                uint32_t rank;                                                              \
                uint64_t below = (1ULL << (i & 63)) - 1;                                    \
                if (t < 0) {                                                                \
                    rank = rk[i];                                                           \
                } else if (masks) {                                                         \
                    rank = cnt[t] + pre[t][v] + (uint32_t)__builtin_popcountll(wm[t][v] & below); \
                } else { /* few changes: the words up to the change, compared here */      \
                    rank = cnt[t];                                                          \
                    for (int u = 0; u <= v; u++) {                                          \
                        uint64_t e = (uint64_t)EQ32(cbuf + 64 * u, (int)c)                  \
                                     | (uint64_t)EQ32(cbuf + 64 * u + 32, (int)c) << 32;    \
                        if (u == v) e &= below;                                             \
                        rank += (uint32_t)__builtin_popcountll(e);                          \
                    }                                                                       \
                }                                                                           \
                if (!masks) { /* the sum change of this change's word, if not yet counted */ \
                    int64_t j = (int64_t)((uint64_t)(start + b0 + i) * (uint64_t)kd->bits / 64); \
                    if (j != cwl) {                                                         \
                        uint64_t wa = word_at(old, nbytes, (uint64_t)j);                    \
                        uint64_t wb = word_at(new_, nbytes, (uint64_t)j);                   \
                        sd0 += sum_term(0, wb, (uint64_t)j) - sum_term(0, wa, (uint64_t)j); \
                        sd1 += sum_term(1, wb, (uint64_t)j) - sum_term(1, wa, (uint64_t)j); \
                        cwl = j;                                                            \
                    }                                                                       \
                }                                                                           \
                uint64_t ov = elem_get(old, kd->bits, start + b0 + i);                      \
                uint64_t nv = elem_get(new_, kd->bits, start + b0 + i);                     \
                {                                                                           \
                    uint64_t mag;                                                           \
                    wrec[wk++] = rec_word(kd, rank, c, ov, nv, &mag);                       \
                    wtail[wnb] = mag - 2;                                                   \
                    wnb += mag > 1;                                                         \
                }                                                                           \
                if (r) { /* the keep path: the diff as well */                              \
                    r->pos[r->k] = (uint32_t)(b0 + i);                                      \
                    r->oldv[r->k] = ov;                                                     \
                    r->newv[r->k] = nv;                                                     \
                    r->k++;                                                                 \
                }                                                                           \
            }                                                                               \
            /* many changes: the rp.sum128 change once per word that holds one, apart */   \
            uint64_t cw = masks && !vsum ? dm[v] : 0;                                       \
            const int epw = 64 / kd->bits;                                                  \
            const uint64_t gm = epw >= 64 ? ~0ULL : (1ULL << epw) - 1;                      \
            while (cw) {                                                                    \
                int i = __builtin_ctzll(cw);                                                \
                int i0 = i & ~(epw - 1);                                                    \
                cw &= ~(gm << i0);                                                          \
                uint64_t j = (uint64_t)(start + b0 + 64 * v + i0) * (uint64_t)kd->bits / 64; \
                uint64_t wa = word_at(old, nbytes, j), wb = word_at(new_, nbytes, j);       \
                sd0 += sum_term(0, wb, j) - sum_term(0, wa, j);                             \
                sd1 += sum_term(1, wb, j) - sum_term(1, wa, j);                             \
            }                                                                               \
        }                                                                                   \
        for (int t = 0; t < nvc; t++) cnt[t] += bcs[t];                                     \
    }                                                                                       \
    for (int t = 0; t < nvc; t++) tab[vc[t]] = cnt[t];                                      \
    w->k = wk;                                                                              \
    w->nb = wnb;                                                                            \
    sd[0] += sd0;                                                                           \
    sd[1] += sd1;                                                                           \
    return 0;

#define BLOCKCTX_PLAIN block_ctx
RP_HIDDEN int rp_enc_pass_scalar(const rp_kind *kd_, const uint8_t *old, const uint8_t *new_,
                                 size_t nbytes, int64_t start, int64_t n, recs_t *r,
                                 rp_encws *w, uint32_t *tab, uint64_t sd[2]) {
    ENC_BODY(blkcnt_scalar, eq32_scalar, cold32_scalar, BLOCKCTX_PLAIN, changed_generic,
             sumblk_none)
}

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx2"))) static inline uint32_t cold32_avx2(const uint8_t *p, int lo,
                                                                    const uint8_t *hot) {
    __m256i idx = _mm256_sub_epi8(_mm256_load_si256((const __m256i *)p), _mm256_set1_epi8((char)lo));
    __m256i top = _mm256_set1_epi8(WIN - 1);
    __m256i in = _mm256_cmpeq_epi8(_mm256_max_epu8(idx, top), top);
    __m128i t = _mm_loadu_si128((const __m128i *)hot);
    __m256i tab = _mm256_broadcastsi128_si256(t);
    __m256i h = _mm256_and_si256(_mm256_shuffle_epi8(tab, _mm256_and_si256(idx, _mm256_set1_epi8(15))), in);
    return ~(uint32_t)_mm256_movemask_epi8(h);
}

/* sum_term(lane, w, j) for four words, lane 0 (rotation 32) or 1 (rotation 17). */
__attribute__((target("avx2"))) static inline __m256i sum_terms4(__m256i w, __m256i jk, int lane) {
    __m256i x = _mm256_xor_si256(w, jk);
    __m256i p = _mm256_mul_epu32(x, _mm256_srli_epi64(x, 32));
    __m256i r = lane ? _mm256_or_si256(_mm256_slli_epi64(w, 17), _mm256_srli_epi64(w, 47))
                     : _mm256_shuffle_epi32(w, 0xB1);
    return _mm256_add_epi64(p, r);
}

__attribute__((target("avx2"))) static inline int sumblk_avx2(const uint8_t *a, const uint8_t *b,
                                                               uint64_t j0, int nw, uint64_t *s0,
                                                               uint64_t *s1) {
    __m256i acc0 = _mm256_setzero_si256(), acc1 = _mm256_setzero_si256();
    __m256i jk0 = _mm256_set_epi64x((long long)(SUM_S[0] + (j0 + 3) * SUM_K[0]),
                                    (long long)(SUM_S[0] + (j0 + 2) * SUM_K[0]),
                                    (long long)(SUM_S[0] + (j0 + 1) * SUM_K[0]),
                                    (long long)(SUM_S[0] + j0 * SUM_K[0]));
    __m256i jk1 = _mm256_set_epi64x((long long)(SUM_S[1] + (j0 + 3) * SUM_K[1]),
                                    (long long)(SUM_S[1] + (j0 + 2) * SUM_K[1]),
                                    (long long)(SUM_S[1] + (j0 + 1) * SUM_K[1]),
                                    (long long)(SUM_S[1] + j0 * SUM_K[1]));
    const __m256i st0 = _mm256_set1_epi64x((long long)(4 * SUM_K[0]));
    const __m256i st1 = _mm256_set1_epi64x((long long)(4 * SUM_K[1]));
    for (int v = 0; v < nw; v += 4) {
        __m256i wa = _mm256_loadu_si256((const __m256i *)(a + 8 * (j0 + (uint64_t)v)));
        __m256i wb = _mm256_loadu_si256((const __m256i *)(b + 8 * (j0 + (uint64_t)v)));
        acc0 = _mm256_add_epi64(acc0, _mm256_sub_epi64(sum_terms4(wb, jk0, 0), sum_terms4(wa, jk0, 0)));
        acc1 = _mm256_add_epi64(acc1, _mm256_sub_epi64(sum_terms4(wb, jk1, 1), sum_terms4(wa, jk1, 1)));
        jk0 = _mm256_add_epi64(jk0, st0);
        jk1 = _mm256_add_epi64(jk1, st1);
    }
    uint64_t t0[4], t1[4];
    _mm256_storeu_si256((__m256i *)t0, acc0);
    _mm256_storeu_si256((__m256i *)t1, acc1);
    *s0 += t0[0] + t0[1] + t0[2] + t0[3];
    *s1 += t1[0] + t1[1] + t1[2] + t1[3];
    return 1;
}

/* Change masks of a whole block (JB elements); partial blocks take the generic path. */
__attribute__((target("avx2"))) static inline void changed_avx2(const rp_kind *kd,
                                                                 const uint8_t *a,
                                                                 const uint8_t *b, int64_t s,
                                                                 int len, uint64_t *dm) {
    if (len < JB || !(kd->bits == 16 || kd->bits == 8 || (kd->bits == 4 && !(s & 1)))) {
        changed_generic(kd, a, b, s, len, dm);
        return;
    }
    if (kd->bits == 16) {
        const uint16_t *x = (const uint16_t *)a + s, *y = (const uint16_t *)b + s;
        for (int v = 0; v < JB / 64; v++) {
            uint64_t m = 0;
            for (int h = 0; h < 2; h++) {
                const uint16_t *px = x + 64 * v + 32 * h, *py = y + 64 * v + 32 * h;
                __m256i e0 = _mm256_cmpeq_epi16(_mm256_loadu_si256((const __m256i *)px),
                                                _mm256_loadu_si256((const __m256i *)py));
                __m256i e1 = _mm256_cmpeq_epi16(_mm256_loadu_si256((const __m256i *)(px + 16)),
                                                _mm256_loadu_si256((const __m256i *)(py + 16)));
                __m256i e = _mm256_permute4x64_epi64(_mm256_packs_epi16(e0, e1), 0xD8);
                m |= (uint64_t)(uint32_t)~_mm256_movemask_epi8(e) << (32 * h);
            }
            dm[v] = m;
        }
    } else if (kd->bits == 8) {
        const uint8_t *x = a + s, *y = b + s;
        for (int v = 0; v < JB / 64; v++) {
            uint32_t lo0 = ~(uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(
                _mm256_loadu_si256((const __m256i *)(x + 64 * v)),
                _mm256_loadu_si256((const __m256i *)(y + 64 * v))));
            uint32_t hi0 = ~(uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(
                _mm256_loadu_si256((const __m256i *)(x + 64 * v + 32)),
                _mm256_loadu_si256((const __m256i *)(y + 64 * v + 32))));
            dm[v] = (uint64_t)hi0 << 32 | lo0;
        }
    } else { /* two codes per byte: changed bytes first, then their nibbles */
        const uint8_t *x = a + (s >> 1), *y = b + (s >> 1);
        for (int v = 0; v < JB / 64; v++) {
            uint32_t m = ~(uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(
                _mm256_loadu_si256((const __m256i *)(x + 32 * v)),
                _mm256_loadu_si256((const __m256i *)(y + 32 * v))));
            uint64_t d = 0;
            while (m) {
                int i = __builtin_ctz(m);
                m &= m - 1;
                unsigned z = (unsigned)(x[32 * v + i] ^ y[32 * v + i]);
                d |= (uint64_t)((z & 15u) != 0) << (2 * i) | (uint64_t)((z >> 4) != 0) << (2 * i + 1);
            }
            dm[v] = d;
        }
    }
}

RP_HIDDEN __attribute__((target("avx2"))) int rp_enc_pass_avx2(
    const rp_kind *kd_, const uint8_t *old, const uint8_t *new_, size_t nbytes, int64_t start,
    int64_t n, recs_t *r, rp_encws *w, uint32_t *tab, uint64_t sd[2]) {
#define BLOCKCTX BLOCKCTX16
    ENC_BODY(blkcnt_avx2, eq32_avx2, cold32_avx2, BLOCKCTX, changed_avx2, sumblk_avx2)
#undef BLOCKCTX
}
#endif
