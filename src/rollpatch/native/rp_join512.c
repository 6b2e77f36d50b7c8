/* rollpatch native core: phase B of the decoder, the join (rp_join.c), with AVX-512 (F, BW,
 * VL, VBMI, VBMI2, BITALG, VPOPCNTDQ) and GFNI. Same positions, old elements and context-order
 * indices as the scalar and AVX2 joins, from fewer instructions and branches:
 *
 * - A block's 256 contexts are made 64 at a time in zmm registers (a shift and one byte
 *   permute for 16-bit words) and kept there.
 * - The counts of the 16 contexts of the window in the block come from one-hot bytes, an 8x8
 *   bit transpose per 8 elements (GF2P8AFFINEQB), byte popcounts (VPOPCNTB), one byte
 *   transpose (VPERMB) and VPSADBW: ~40 vector instructions per block for all 16 contexts,
 *   against ~300 for the AVX2 join's compare-and-add per context.
 * - The hit test is one unsigned compare of 16 lanes. A hit slot's changes in the block are
 *   found all at once, with no loop per changed rank: its ranks are kept as a bitmap over the
 *   slot's elements, and one PDEP per 64 elements deposits the bitmap's bits from the slot's
 *   count on into the slot's compare mask. A slot with at most 64 elements in the block (the
 *   common case) reads its bitmap's window once and shifts it by each 64's popcount.
 * - The changes are emitted in position order by a byte compress of the block's positions
 *   and one loop per block; a change's context-order index is its context's running index.
 * Slot r of the window is context lo + r (no slot table): contexts that are not listed never
 * reach their target (UINT32_MAX). */
#include "rp_lane.h"

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

/* The count of each of the 16 window slots (rel = context - lo; >= 16: no slot) in the 256
 * elements of rel[0..3], as 16 u32 lanes. */
T512 static inline __m512i slot_counts(const __m512i rel[JB / 64]) {
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

/* Each window slot's changed ranks as a bitmap over the slot's elements (bit i: its i-th
 * element changed), two zero words after each: a block's changes of a slot are then one
 * PDEP of the bitmap's bits at the slot's count into the slot's mask of the block. */
typedef struct {
    const uint64_t *bm[WIN];
    uint32_t lim[WIN]; /* words of the slot's bitmap before its zero words */
} slotbm_t;

static uint64_t *slot_bitmaps(lane_t *l, int lo, slotbm_t *sb) {
    static const uint64_t zero[2] = {0, 0};
    size_t need = 1; /* never an empty allocation */
    for (int r = 0; r < WIN; r++) { sb->bm[r] = zero; sb->lim[r] = 0; }
    for (int i = 0; i < l->pp.g; i++)
        if (l->pp.cid[i] >= lo && l->pp.cid[i] < lo + WIN && l->abo[i] < 0)
            need += (l->pp.nc[i] + 63) / 64 + 2;
    if (need > l->jbmcap) { /* kept by the lane: no fresh pages per chunk */
        free(l->jbm);
        l->jbmcap = 0;
        l->jbm = malloc((need + need / 4) * 8);
        if (!l->jbm) return NULL;
        l->jbmcap = need + need / 4;
    }
    uint64_t *buf = l->jbm, *p = buf;
    memset(buf, 0, need * 8);
    for (int i = 0; i < l->pp.g; i++) {
        int c = l->pp.cid[i];
        if (c < lo || c >= lo + WIN) continue;
        const uint64_t nc = l->pp.nc[i], words = (nc + 63) / 64;
        if (l->abo[i] >= 0) { /* phase A's (rp_decode.c) */
            sb->bm[c - lo] = l->abm + l->abo[i];
            sb->lim[c - lo] = (uint32_t)words;
            continue;
        }
        const uint32_t *rk = l->ranks + l->ofs[i];
        for (uint64_t j = 0; j < l->pp.kc[i]; j++)
            if (rk[j] < nc) p[rk[j] >> 6] |= 1ULL << (rk[j] & 63); /* else: refused in phase C */
        sb->bm[c - lo] = p;
        sb->lim[c - lo] = (uint32_t)words;
        p += words + 2;
    }
    return buf;
}

/* The AVX-512 join; returns -1 (nothing done) when out of memory: the caller joins another way. */
RP_HIDDEN T512 int rp_join_lane_avx512(const rp_kind *kd, const uint8_t *base, lane_t *l,
                                       int64_t start, int64_t n) {
    uint8_t cbuf[JB] __attribute__((aligned(64)));
    uint8_t elist[JB + 64] __attribute__((aligned(64)));
    uint8_t listed[NCTX];
    uint32_t tgt[WIN] __attribute__((aligned(64))), cnt[WIN] __attribute__((aligned(64)));
    uint32_t endb[WIN] __attribute__((aligned(64))); /* each slot's count at the block's end */
    uint32_t ctr[NCTX]; /* each context's next context-order index, in position order */
    uint64_t cur[WIN], endr[WIN];
    slotbm_t sb;
    int outside = 0;
    const int lo = rp_join_window(l);
    uint64_t *bmbuf = slot_bitmaps(l, lo, &sb);
    if (!bmbuf) return -1;
    const int bits = kd->bits;
    const uint32_t *const ranks = l->ranks;
    const uint8_t *const magc = (const uint8_t *)l->magc;
    const uint64_t mw = (uint64_t)l->mw;
    memset(listed, 0, sizeof listed);
    memset(ctr, 0, sizeof ctr);
    for (int r = 0; r < WIN; r++) {
        cnt[r] = 0;
        tgt[r] = UINT32_MAX;
        cur[r] = endr[r] = 0;
    }
    for (int i = 0; i < l->pp.g; i++) {
        int c = l->pp.cid[i];
        listed[c] = 1;
        ctr[c] = (uint32_t)l->cur[c];
        if (c >= lo && c < lo + WIN) {
            int r = c - lo;
            cnt[r] = l->cnt[c]; tgt[r] = l->tgt[c];
            cur[r] = l->cur[c]; endr[r] = l->endr[c];
        } else {
            outside = 1;
        }
    }
    const uint8_t pad = (uint8_t)(lo + WIN < NCTX ? lo + WIN : lo - 1); /* in no window */
    const __m128i sh = _mm_cvtsi32_si128(kd->shift);
    const __m512i mk = _mm512_set1_epi8((char)((1 << kd->cbits) - 1));
    const __m512i lov = _mm512_set1_epi8((char)lo);
    const __m512i iota = _mm512_set_epi8(
        63, 62, 61, 60, 59, 58, 57, 56, 55, 54, 53, 52, 51, 50, 49, 48, 47, 46, 45, 44, 43, 42,
        41, 40, 39, 38, 37, 36, 35, 34, 33, 32, 31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20,
        19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512i cntv = _mm512_load_si512(cnt), tgtv = _mm512_load_si512(tgt);
    /* listed[] as four 64-byte tables, for the elements outside the window */
    const __m512i lt0 = _mm512_loadu_si512(listed), lt1 = _mm512_loadu_si512(listed + 64);
    const __m512i lt2 = _mm512_loadu_si512(listed + 128), lt3 = _mm512_loadu_si512(listed + 192);
    for (int64_t b0 = 0; b0 < n; b0 += JB) {
        int len = n - b0 < JB ? (int)(n - b0) : JB;
        uint64_t bb[JB / 64] = {0}; /* positions found in this block */
        __m512i rel[JB / 64];
        if (b0 + (RP_PF + 1) * JB <= n) { /* the base's lines RP_PF blocks ahead */
            const uint8_t *pf = base + ((start + b0 + RP_PF * JB) * bits >> 3);
            for (int q_ = 0; q_ < JB * bits / 8; q_ += 64) __builtin_prefetch(pf + q_);
        }
        if (len == JB && (bits != 4 || !((start + b0) & 1))) {
            for (int v = 0; v < JB / 64; v++) {
                __m512i c = ctx64(kd, base, start + b0 + 64 * v, sh, mk);
                _mm512_store_si512(cbuf + 64 * v, c);
                rel[v] = _mm512_sub_epi8(c, lov);
            }
        } else {
            block_ctx(kd, base, start + b0, len, cbuf);
            if (len < JB) memset(cbuf + len, pad, (size_t)(JB - len));
            for (int v = 0; v < JB / 64; v++)
                rel[v] = _mm512_sub_epi8(_mm512_load_si512(cbuf + 64 * v), lov);
        }
        __m512i endv = _mm512_add_epi32(cntv, slot_counts(rel));
        uint32_t hit = _mm512_cmpgt_epu32_mask(endv, tgtv);
        if (hit) {
            _mm512_store_si512(cnt, cntv);
            _mm512_store_si512(endb, endv);
        }
        while (hit) { /* each slot with a changed rank in this block: all its changes at once */
            const int r = __builtin_ctz(hit);
            hit &= hit - 1;
            const __m512i rv = _mm512_set1_epi8((char)r);
            const uint64_t *const bm = sb.bm[r];
            const uint32_t lim = sb.lim[r];
            uint32_t pre = cnt[r], nchg = 0;
            const uint32_t tot = endb[r] - pre; /* the slot's elements in the block */
            if (tot <= 64) { /* their bits are one 64-bit window of the bitmap, read once */
                uint32_t j = pre >> 6;
                j = j < lim ? j : lim;
                unsigned s = pre & 63;
                uint64_t w = (bm[j] >> s) | (bm[j + 1] << 1 << (63 - s));
                nchg = (uint32_t)__builtin_popcountll(tot < 64 ? w & ((1ULL << tot) - 1) : w);
                for (int v = 0; v < JB / 64; v++) { /* each 64 takes its next popcount(m) bits */
                    uint64_t m = _mm512_cmpeq_epi8_mask(rel[v], rv);
                    unsigned pc = (unsigned)__builtin_popcountll(m);
                    bb[v] |= _pdep_u64(w, m);
                    w = pc < 64 ? w >> pc : 0;
                }
            } else {
                for (int v = 0; v < JB / 64; v++) {
                    uint64_t m = _mm512_cmpeq_epi8_mask(rel[v], rv);
                    uint32_t j = pre >> 6;
                    j = j < lim ? j : lim;
                    unsigned s = pre & 63;
                    uint64_t bits_ = (bm[j] >> s) | (bm[j + 1] << 1 << (63 - s));
                    uint64_t hitb = _pdep_u64(bits_, m); /* the slot's changed elements */
                    bb[v] |= hitb;
                    nchg += (uint32_t)__builtin_popcountll(hitb);
                    pre += (uint32_t)__builtin_popcountll(m);
                }
            }
            uint64_t cu = cur[r] + nchg;
            cur[r] = cu;
            __builtin_prefetch(magc + (cu + 32) * mw);
            uint32_t g = cu < endr[r] ? ranks[cu] : UINT32_MAX;
            tgt[r] = g;
            tgtv = _mm512_mask_set1_epi32(tgtv, (__mmask16)(1u << r), (int)g);
        }
        cntv = endv;
        if (__builtin_expect(outside, 0)) { /* listed contexts outside the window */
            __mmask64 om[JB / 64], any = 0; /* their elements: a table lookup per 64 */
            for (int v = 0; v < JB / 64; v++) {
                const __m512i c = _mm512_load_si512(cbuf + 64 * v);
                const __m512i lt = _mm512_mask_blend_epi8(_mm512_movepi8_mask(c),
                                                          _mm512_permutex2var_epi8(lt0, c, lt1),
                                                          _mm512_permutex2var_epi8(lt2, c, lt3));
                om[v] = _mm512_mask_test_epi8_mask(
                    _mm512_cmpge_epu8_mask(rel[v], _mm512_set1_epi8(WIN)), lt, lt);
                any |= om[v];
            }
            for (int v = 0; any && v < JB / 64; v++) {
                uint64_t m = om[v];
                if (64 * v + 64 > len) m &= len > 64 * v ? ~0ULL >> (64 - (len - 64 * v)) : 0;
                while (m) {
                    int e = 64 * v + __builtin_ctzll(m);
                    m &= m - 1;
                    unsigned c = cbuf[e];
                    if (!listed[c]) continue;
                    if (l->cnt[c]++ == l->tgt[c]) {
                        bb[v] |= 1ULL << (e & 63);
                        uint64_t nx = ++l->cur[c];
                        l->tgt[c] = nx < l->endr[c] ? l->ranks[nx] : UINT32_MAX;
                    }
                }
            }
        }
        if (bb[0] | bb[1] | bb[2] | bb[3]) { /* in position order, old words still in L1;
           * fields in locals: the stores may alias them (-fno-strict-aliasing) */
            int ne = 0;
            for (int v = 0; v < JB / 64; v++) {
                __m512i at = _mm512_add_epi8(iota, _mm512_set1_epi8((char)(64 * v)));
                _mm512_storeu_si512(elist + ne, _mm512_maskz_compress_epi8(bb[v], at));
                ne += __builtin_popcountll(bb[v]);
            }
            int64_t em = l->emitted;
            const int64_t kmax = (int64_t)l->pp.k;
            if (ne > kmax - em) ne = (int)(kmax - em); /* refused in phase C */
            uint32_t *const rpos = l->rpos + em, *const rci = l->rci + em;
            uint64_t *const rold = l->rold + em;
            if (bits == 16) {
                const uint16_t *const bw = (const uint16_t *)base + start + b0;
                for (int i = 0; i < ne; i++) {
                    unsigned e = elist[i];
                    rpos[i] = (uint32_t)(b0 + e);
                    rold[i] = bw[e];
                    rci[i] = ctr[cbuf[e]]++;
                }
            } else if (bits == 8) {
                const uint8_t *const bw = base + start + b0;
                for (int i = 0; i < ne; i++) {
                    unsigned e = elist[i];
                    rpos[i] = (uint32_t)(b0 + e);
                    rold[i] = bw[e];
                    rci[i] = ctr[cbuf[e]]++;
                }
            } else {
                for (int i = 0; i < ne; i++) {
                    unsigned e = elist[i];
                    rpos[i] = (uint32_t)(b0 + e);
                    rold[i] = elem_get(base, bits, start + b0 + e);
                    rci[i] = ctr[cbuf[e]]++;
                }
            }
            l->emitted = em + ne;
        }
        if ((b0 & (16 * JB - 1)) == 15 * JB) rp_lane_group(kd, l, start, b0 + len, 0);
    }
    _mm512_store_si512(cnt, cntv);
    for (int r = 0; r < WIN; r++) {
        int c = lo + r;
        if (!listed[c]) continue;
        l->cnt[c] = cnt[r]; l->tgt[c] = tgt[r]; l->cur[c] = cur[r];
    }
    return 0;
}
#endif
