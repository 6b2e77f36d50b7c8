/* rollpatch native core: phase B of the decoder, the join (rp_join.c), with AVX-512 (F, BW,
 * VL, VBMI, VBMI2, BITALG, VPOPCNTDQ) and GFNI. Same positions, old elements and context-order
 * indices as the scalar and AVX2 joins, from fewer instructions and branches. Per step of 16
 * blocks (rp_lane_group's):
 *
 * 1. Every block's 256 contexts, made 64 at a time in zmm registers (a shift and one byte
 *    permute for 16-bit words) into an L1 buffer, and the counts of the window's 16 contexts
 *    (rp_join512.h: one-hot bytes, an 8x8 bit transpose per 8 elements by GF2P8AFFINEQB,
 *    byte popcounts, one byte transpose and VPSADBW: ~40 vector instructions per block for
 *    all 16), each block's kept: no branch on the data, and the counts are off the chain of
 *    2 (a block's test waits on the last hit's next rank, not on its own counts).
 * 2. Block by block, the hit test: one unsigned compare of 16 lanes. A hit slot's changes in
 *    the block are found all at once, with no loop per changed rank: its ranks are kept as a
 *    bitmap over the slot's elements, and one PDEP per 64 elements deposits the bitmap's bits
 *    from the slot's count on into the slot's compare mask (a slot with at most 64 elements
 *    in the block reads its bitmap's window once and shifts it by each 64's popcount).
 * 3. The step's changes in position order: each block with a change by a byte compress of its
 *    positions, then one loop over them all; a change's context-order index is its context's
 *    running index, four changes at a time (their counters loaded before any is stored, each
 *    raised by the earlier ones of its context among the four: one store-to-load wait per
 *    four changes where a context repeats, not one per change).
 * Slot r of the window is context lo + r (no slot table): contexts that are not listed never
 * reach their target (UINT32_MAX). */
#include "rp_join512.h"

#if defined(__x86_64__) && defined(__GNUC__)
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
        /* phase A decodes the ranks increasing (a rank past nc is refused in phase C): each
         * 64-bit word built in a register and stored, never re-read (no load waiting on the
         * last store); every store stays inside the slot's words whatever the ranks */
        const uint32_t *rk = l->ranks + l->ofs[i];
        uint64_t acc = 0, wprev = 0;
        for (uint64_t j = 0; j < l->pp.kc[i]; j++) {
            const uint64_t v = rk[j], wv = v >> 6;
            if (v >= nc) continue;
            acc = (wv == wprev ? acc : 0) | 1ULL << (v & 63);
            wprev = wv;
            p[wv] = acc;
        }
        sb->bm[c - lo] = p;
        sb->lim[c - lo] = (uint32_t)words;
        p += words + 2;
    }
    return buf;
}

/* The listed contexts outside the window in one block (rare; only a block phase 1 found an
 * element outside the window in): their elements found by a table lookup per 64 (lt: listed[]
 * as four 64-byte tables), then counted one by one; a change's position bit into bb. */
T512 static void join_outside(lane_t *l, const uint8_t *cb, __m512i lov, const uint8_t *listed,
                              const __m512i lt[4], uint64_t bb[JB / 64], int len) {
    __mmask64 om[JB / 64], any = 0;
    for (int v = 0; v < JB / 64; v++) {
        const __m512i c = _mm512_load_si512(cb + 64 * v);
        const __m512i t = _mm512_mask_blend_epi8(_mm512_movepi8_mask(c),
                                                 _mm512_permutex2var_epi8(lt[0], c, lt[1]),
                                                 _mm512_permutex2var_epi8(lt[2], c, lt[3]));
        om[v] = _mm512_mask_test_epi8_mask(
            _mm512_cmpge_epu8_mask(_mm512_sub_epi8(c, lov), _mm512_set1_epi8(WIN)), t, t);
        any |= om[v];
    }
    for (int v = 0; any && v < JB / 64; v++) {
        uint64_t m = om[v];
        if (64 * v + 64 > len) m &= len > 64 * v ? ~0ULL >> (64 - (len - 64 * v)) : 0;
        while (m) {
            int e = 64 * v + __builtin_ctzll(m);
            m &= m - 1;
            unsigned c = cb[e];
            if (!listed[c]) continue;
            if (l->cnt[c]++ == l->tgt[c]) {
                bb[v] |= 1ULL << (e & 63);
                uint64_t nx = ++l->cur[c];
                l->tgt[c] = nx < l->endr[c] ? l->ranks[nx] : UINT32_MAX;
            }
        }
    }
}

/* Blocks per step (rp_lane_group's 16). */
#define SB 16

/* The AVX-512 join; returns -1 (nothing done) when out of memory: the caller joins another way. */
RP_HIDDEN T512 int rp_join_lane_avx512(const rp_kind *kd, const uint8_t *base, lane_t *l,
                                       int64_t start, int64_t n) {
    uint8_t cbuf[SB][JB] __attribute__((aligned(64)));
    uint32_t pc[SB + 1][WIN] __attribute__((aligned(64))); /* each slot's count before block i */
    uint8_t elist[SB * JB + 64], eblk[SB * JB + 64]; /* found positions: in block, block */
    uint8_t listed[NCTX];
    uint32_t tgt[WIN] __attribute__((aligned(64)));
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
        pc[0][r] = 0;
        tgt[r] = UINT32_MAX;
        cur[r] = endr[r] = 0;
    }
    for (int i = 0; i < l->pp.g; i++) {
        int c = l->pp.cid[i];
        listed[c] = 1;
        ctr[c] = (uint32_t)l->cur[c];
        if (c >= lo && c < lo + WIN) {
            int r = c - lo;
            pc[0][r] = l->cnt[c]; tgt[r] = l->tgt[c];
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
    __m512i cntv = _mm512_load_si512(pc[0]), tgtv = _mm512_load_si512(tgt);
    /* listed[] as four 64-byte tables, for the elements outside the window */
    __m512i lt[4];
    for (int t = 0; t < 4; t++) lt[t] = _mm512_loadu_si512(listed + 64 * t);
    for (int64_t s0 = 0; s0 < n; s0 += SB * JB) {
        const int nb = n - s0 >= SB * JB ? SB : (int)((n - s0 + JB - 1) / JB);
        _mm512_store_si512(pc[0], cntv);
        uint32_t ob = 0; /* blocks with an element outside the window */
        /* 1: every block's contexts and slot counts, no branch on the data */
        for (int i = 0; i < nb; i++) {
            const int64_t b0 = s0 + (int64_t)i * JB;
            const int len = n - b0 < JB ? (int)(n - b0) : JB;
            __m512i rel[JB / 64];
            if (b0 + (RP_PF + 1) * JB <= n) { /* the base's lines RP_PF blocks ahead */
                const uint8_t *pf = base + ((start + b0 + RP_PF * JB) * bits >> 3);
                for (int q_ = 0; q_ < JB * bits / 8; q_ += 64) __builtin_prefetch(pf + q_);
            }
            if (len == JB && (bits != 4 || !((start + b0) & 1))) {
                for (int v = 0; v < JB / 64; v++) {
                    __m512i c = ctx64(kd, base, start + b0 + 64 * v, sh, mk);
                    _mm512_store_si512(cbuf[i] + 64 * v, c);
                    rel[v] = _mm512_sub_epi8(c, lov);
                }
            } else {
                block_ctx(kd, base, start + b0, len, cbuf[i]);
                if (len < JB) memset(cbuf[i] + len, pad, (size_t)(JB - len));
                for (int v = 0; v < JB / 64; v++)
                    rel[v] = _mm512_sub_epi8(_mm512_load_si512(cbuf[i] + 64 * v), lov);
            }
            cntv = _mm512_add_epi32(cntv, slot_counts(rel));
            _mm512_store_si512(pc[i + 1], cntv);
            if (outside) { /* only such a block is looked at again for the listed ones */
                const __m512i w = _mm512_set1_epi8(WIN);
                const __mmask64 o =
                    _mm512_cmpge_epu8_mask(rel[0], w) | _mm512_cmpge_epu8_mask(rel[1], w)
                    | _mm512_cmpge_epu8_mask(rel[2], w) | _mm512_cmpge_epu8_mask(rel[3], w);
                ob |= (uint32_t)(o != 0) << i;
            }
        }
        uint64_t bb[SB][JB / 64] __attribute__((aligned(64))); /* positions found (all set in 2) */
        uint32_t nz = 0; /* blocks with a change (maybe) */
        /* 2: block by block, the slots whose next changed rank lies in the block (one 16-lane
         * compare of the counts of 1), each one's changes at once, then its next rank */
        for (int i = 0; i < nb; i++) {
            uint32_t hit = _mm512_cmpgt_epu32_mask(_mm512_load_si512(pc[i + 1]), tgtv);
            uint64_t bi[JB / 64] = {0};
            while (hit) {
                const int r = __builtin_ctz(hit);
                hit &= hit - 1;
                const uint32_t pre = pc[i][r];
                const __m512i rv = _mm512_set1_epi8((char)(lo + r));
                const uint64_t cu = cur[r] + slot_bits(cbuf[i], rv, sb.bm[r], sb.lim[r], pre,
                                                       pc[i + 1][r] - pre, bi);
                cur[r] = cu;
                __builtin_prefetch(magc + (cu + 32) * mw);
                const uint32_t g = cu < endr[r] ? ranks[cu] : UINT32_MAX;
                tgt[r] = g;
                tgtv = _mm512_mask_set1_epi32(tgtv, (__mmask16)(1u << r), (int)g);
            }
            for (int v = 0; v < JB / 64; v++) bb[i][v] = bi[v];
            nz |= (uint32_t)((bi[0] | bi[1] | bi[2] | bi[3]) != 0) << i;
        }
        if (__builtin_expect(outside, 0)) /* listed contexts outside the window */
            for (; ob; ob &= ob - 1) { /* the blocks with an element outside the window */
                const int i = __builtin_ctz(ob);
                join_outside(l, cbuf[i], lov, listed, lt, bb[i],
                             n - s0 - i * JB < JB ? (int)(n - s0 - i * JB) : JB);
                nz |= (uint32_t)((bb[i][0] | bb[i][1] | bb[i][2] | bb[i][3]) != 0) << i;
            }
        /* the blocks' positions in order (each block's by a byte compress, with its number),
         * then one loop over them all, old words still in L1; fields in locals: the stores
         * may alias them (-fno-strict-aliasing) */
        int ne = 0;
        for (; nz; nz &= nz - 1) /* the blocks with a change */
            for (int v = 0, i = __builtin_ctz(nz); v < JB / 64; v++) {
                __m512i at = _mm512_add_epi8(iota, _mm512_set1_epi8((char)(64 * v)));
                _mm512_storeu_si512(elist + ne, _mm512_maskz_compress_epi8(bb[i][v], at));
                _mm512_storeu_si512(eblk + ne, _mm512_set1_epi8((char)i));
                ne += __builtin_popcountll(bb[i][v]);
            }
        {
            int64_t em = l->emitted;
            const int64_t kmax = (int64_t)l->pp.k;
            if (ne > kmax - em) ne = (int)(kmax - em); /* refused in phase C */
            uint32_t *const rpos = l->rpos + em, *const rci = l->rci + em;
            uint64_t *const rold = l->rold + em;
            const uint8_t *const cf = cbuf[0];
            /* four changes at a time: their four counters loaded before any is stored, and a
             * change's index raised by the earlier ones of its context among the four, so the
             * counters' chain through memory (store, then load) is one per four changes */
#define RP_EMIT4(OLD)                                                                           \
    do {                                                                                        \
        int q = 0;                                                                              \
        for (; q + 4 <= ne; q += 4) {                                                           \
            unsigned e0 = (unsigned)eblk[q] << 8 | elist[q];                                    \
            unsigned e1 = (unsigned)eblk[q + 1] << 8 | elist[q + 1];                            \
            unsigned e2 = (unsigned)eblk[q + 2] << 8 | elist[q + 2];                            \
            unsigned e3 = (unsigned)eblk[q + 3] << 8 | elist[q + 3];                            \
            const unsigned c0 = cf[e0], c1 = cf[e1], c2 = cf[e2], c3 = cf[e3];                  \
            uint32_t x0 = ctr[c0], x1 = ctr[c1], x2 = ctr[c2], x3 = ctr[c3];                    \
            x1 += c1 == c0;                                                                     \
            x2 += (uint32_t)(c2 == c0) + (c2 == c1);                                            \
            x3 += (uint32_t)(c3 == c0) + (c3 == c1) + (c3 == c2);                               \
            ctr[c0] = x0 + 1; ctr[c1] = x1 + 1; ctr[c2] = x2 + 1; ctr[c3] = x3 + 1;             \
            rci[q] = x0; rci[q + 1] = x1; rci[q + 2] = x2; rci[q + 3] = x3;                     \
            rpos[q] = (uint32_t)(s0 + e0); rpos[q + 1] = (uint32_t)(s0 + e1);                   \
            rpos[q + 2] = (uint32_t)(s0 + e2); rpos[q + 3] = (uint32_t)(s0 + e3);               \
            rold[q] = OLD(e0); rold[q + 1] = OLD(e1); rold[q + 2] = OLD(e2); rold[q + 3] = OLD(e3); \
        }                                                                                       \
        for (; q < ne; q++) {                                                                   \
            unsigned e = (unsigned)eblk[q] << 8 | elist[q];                                     \
            rpos[q] = (uint32_t)(s0 + e);                                                       \
            rold[q] = OLD(e);                                                                   \
            rci[q] = ctr[cf[e]]++;                                                              \
        }                                                                                       \
    } while (0)
            if (bits == 16) {
                const uint16_t *const bw = (const uint16_t *)base + start + s0;
#define RP_OLD(e) bw[e]
                RP_EMIT4(RP_OLD);
#undef RP_OLD
            } else if (bits == 8) {
                const uint8_t *const bw = base + start + s0;
#define RP_OLD(e) bw[e]
                RP_EMIT4(RP_OLD);
#undef RP_OLD
            } else {
#define RP_OLD(e) elem_get(base, bits, start + s0 + (e))
                RP_EMIT4(RP_OLD);
#undef RP_OLD
            }
#undef RP_EMIT4
            l->emitted = em + ne;
        }
        if (nb == SB) rp_lane_group(kd, l, start, n - s0 < SB * JB ? n : s0 + SB * JB, 0);
    }
    _mm512_store_si512(pc[0], cntv);
    for (int r = 0; r < WIN; r++) {
        int c = lo + r;
        if (!listed[c]) continue;
        l->cnt[c] = pc[0][r]; l->tgt[c] = tgt[r]; l->cur[c] = cur[r];
    }
    return 0;
}
#endif
