/* rollpatch native core: the encoder's pass with AVX-512 (F, BW, VL, VBMI, VBMI2, VPOPCNTDQ)
 * for the 16-, 8- and 4-bit signmag kinds (bf16, f16, e4m3, e5m2, e2m1x2), whole blocks of
 * JB elements; the rest of a chunk (its last, short block) goes through the AVX2 pass, which
 * continues the counts.
 *
 * Why: at lr 1e-5 about 8% of BF16 elements change, and the per-change loop of the AVX2 pass
 * (a branch, table loads and a popcount chain per change) was most of the encoder's time.
 * Here a 64-element word's changes are built as one vector: their lane indices compressed
 * (vpcompressb), their old and new elements and contexts gathered by permutes, the key delta,
 * magnitude and flags computed lane-wise, and each change's rank as its context's count up
 * to the word (a permute of 16 per-context counts) plus a popcount of the context's element
 * mask below it (a permute of 16 per-context masks, vpopcntq); the records are stored 16 at
 * a time. The hot contexts' masks come from byte compares into k-masks, and the rp.sum128
 * change of a block with many changes from vprolq / vpmuludq over its words. Blocks with
 * few changes take each change on its own, as the AVX2 pass does. The records, and so the
 * bytes, are those of the other passes (tests and the fuzz harness compare them). */
#include "rp_internal.h"
#include "rp_count512.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define T512                                                                                 \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi,avx512vbmi2,avx512bitalg,"   \
                          "avx512vpopcntdq,gfni,avx2,bmi,bmi2,popcnt"))) /* rp_isa's avx512 level */

/* The rp.sum128 change of nw words from j0 (a multiple of 8), new less old. */
T512 static inline void sumblk512(const uint8_t *a, const uint8_t *b, uint64_t j0, int nw,
                                  uint64_t *s0, uint64_t *s1) {
    uint64_t k0[8] __attribute__((aligned(64))), k1[8] __attribute__((aligned(64)));
    for (int l = 0; l < 8; l++) {
        k0[l] = SUM_S[0] + (j0 + (uint64_t)l) * SUM_K[0];
        k1[l] = SUM_S[1] + (j0 + (uint64_t)l) * SUM_K[1];
    }
    __m512i jk0 = _mm512_load_si512((const void *)k0), jk1 = _mm512_load_si512((const void *)k1);
    const __m512i st0 = _mm512_set1_epi64((long long)(8 * SUM_K[0]));
    const __m512i st1 = _mm512_set1_epi64((long long)(8 * SUM_K[1]));
    __m512i acc0 = _mm512_setzero_si512(), acc1 = _mm512_setzero_si512();
    for (int v = 0; v < nw; v += 8) {
        __m512i wa = _mm512_loadu_si512((const void *)(a + 8 * (j0 + (uint64_t)v)));
        __m512i wb = _mm512_loadu_si512((const void *)(b + 8 * (j0 + (uint64_t)v)));
        __m512i xa0 = _mm512_xor_si512(wa, jk0), xb0 = _mm512_xor_si512(wb, jk0);
        __m512i xa1 = _mm512_xor_si512(wa, jk1), xb1 = _mm512_xor_si512(wb, jk1);
        __m512i t0 = _mm512_sub_epi64(
            _mm512_add_epi64(_mm512_mul_epu32(xb0, _mm512_srli_epi64(xb0, 32)), _mm512_rol_epi64(wb, 32)),
            _mm512_add_epi64(_mm512_mul_epu32(xa0, _mm512_srli_epi64(xa0, 32)), _mm512_rol_epi64(wa, 32)));
        __m512i t1 = _mm512_sub_epi64(
            _mm512_add_epi64(_mm512_mul_epu32(xb1, _mm512_srli_epi64(xb1, 32)), _mm512_rol_epi64(wb, 17)),
            _mm512_add_epi64(_mm512_mul_epu32(xa1, _mm512_srli_epi64(xa1, 32)), _mm512_rol_epi64(wa, 17)));
        acc0 = _mm512_add_epi64(acc0, t0);
        acc1 = _mm512_add_epi64(acc1, t1);
        jk0 = _mm512_add_epi64(jk0, st0);
        jk1 = _mm512_add_epi64(jk1, st1);
    }
    *s0 += (uint64_t)_mm512_reduce_add_epi64(acc0);
    *s1 += (uint64_t)_mm512_reduce_add_epi64(acc1);
}

/* The records of a word's changes from what the width-specific part found (rp_pass512):
 * their lane indices idx, contexts cw and hot slots tb (bytes, up to 64), outward and big
 * flags (bit l: the l-th change). cp: the hot slots' counts up to the word (16 dwords); wm0,
 * wm1: their element masks in the word (16 qwords); a cold change's rank is rk[idx]. */
T512 static inline void word_recs(const uint8_t *idx, const uint8_t *cw, const uint8_t *tb,
                                  uint64_t outw, uint64_t big, int cnt, __m512i cp, __m512i wm0,
                                  __m512i wm1, const uint32_t *rk, uint32_t *rec) {
    const __m512i one64 = _mm512_set1_epi64(1);
    for (int hh = 0; hh < cnt; hh += 16) {
        __m512i t = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(tb + hh)));
        __m512i ix = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(idx + hh)));
        __m512i c32 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(cw + hh)));
        __m512i rank = _mm512_permutexvar_epi32(t, cp);
        __m512i tlo = _mm512_cvtepu32_epi64(_mm512_castsi512_si256(t));
        __m512i thi = _mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64(t, 1));
        __m512i ilo = _mm512_cvtepu32_epi64(_mm512_castsi512_si256(ix));
        __m512i ihi = _mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64(ix, 1));
        __m512i plo = _mm512_popcnt_epi64(_mm512_and_si512(
            _mm512_permutex2var_epi64(wm0, tlo, wm1), _mm512_sub_epi64(_mm512_sllv_epi64(one64, ilo), one64)));
        __m512i phi = _mm512_popcnt_epi64(_mm512_and_si512(
            _mm512_permutex2var_epi64(wm0, thi, wm1), _mm512_sub_epi64(_mm512_sllv_epi64(one64, ihi), one64)));
        rank = _mm512_add_epi32(rank, _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi64_epi32(plo)),
                                                         _mm512_cvtepi64_epi32(phi), 1));
        int nl = cnt - hh < 16 ? cnt - hh : 16;
        __mmask16 vl = (__mmask16)(nl == 16 ? 0xFFFF : (1u << nl) - 1);
        __mmask16 cold = _mm512_mask_cmpge_epu32_mask(vl, t, _mm512_set1_epi32(16));
        if (__builtin_expect(cold != 0, 0)) /* contexts outside the hot slots */
            rank = _mm512_mask_i32gather_epi32(rank, cold, ix, (const void *)rk, 4);
        __m512i r = _mm512_or_si512(rank, _mm512_slli_epi32(c32, 20));
        r = _mm512_mask_or_epi32(r, (__mmask16)(outw >> hh), r, _mm512_set1_epi32(1 << 28));
        r = _mm512_mask_or_epi32(r, (__mmask16)(big >> hh), r, _mm512_set1_epi32(1 << 29));
        _mm512_storeu_si512((void *)(rec + hh), r);
    }
}

/* 64 packed 4-bit codes (32 bytes) as bytes, code 2i (the low nibble of byte i) first. */
T512 static inline __m512i spread4(const uint8_t *p) {
    __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_or_si512(_mm512_and_si512(w, _mm512_set1_epi16(0x000F)),
                           _mm512_and_si512(_mm512_slli_epi16(w, 4), _mm512_set1_epi16(0x0F00)));
}

/* One 64-element word's changes (mask m, cnt of them) of a 16-, 8- or 4-bit signmag kind at
 * old/new elements po/pn with contexts cb: records to rec, big steps' tails to tail (their
 * number returned). Lane-wise: key = x ^ 0x80..0 (x ^ 0xFF..F when negative), the step
 * d = key_new - key_old, |d| (the most negative d stays S), outward = (d > 0) ^ neg(old). */
T512 static inline __attribute__((always_inline)) int
word512(const int bits, const uint8_t *po, const uint8_t *pn, const uint8_t *cb, uint64_t m,
        int cnt, __m512i cp, __m512i wm0, __m512i wm1, __m512i slotw, __m512i lob,
        const uint32_t *rk, uint32_t *rec, uint64_t *tail) {
    const __m512i iota = _mm512_set_epi8(63, 62, 61, 60, 59, 58, 57, 56, 55, 54, 53, 52, 51,
                                         50, 49, 48, 47, 46, 45, 44, 43, 42, 41, 40, 39, 38, 37,
                                         36, 35, 34, 33, 32, 31, 30, 29, 28, 27, 26, 25, 24, 23,
                                         22, 21, 20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9,
                                         8, 7, 6, 5, 4, 3, 2, 1, 0);
    uint8_t idx[64] __attribute__((aligned(64))), cw[64] __attribute__((aligned(64)));
    uint8_t tb[64] __attribute__((aligned(64)));
    uint64_t outw = 0, big = 0;
    int nbig = 0;
    __m512i idxall = _mm512_maskz_compress_epi8(m, iota);
    __m512i cwv = _mm512_permutexvar_epi8(idxall, _mm512_loadu_si512((const void *)cb));
    _mm512_store_si512((void *)idx, idxall);
    _mm512_store_si512((void *)cw, cwv);
    _mm512_store_si512((void *)tb, _mm512_permutexvar_epi8(
        _mm512_min_epu8(_mm512_sub_epi8(cwv, lob), _mm512_set1_epi8(16)), slotw));
    if (bits == 16) {
        const __m512i h = _mm512_set1_epi16((short)0x8000);
        __m512i o0 = _mm512_loadu_si512((const void *)po), o1 = _mm512_loadu_si512((const void *)(po + 64));
        __m512i n0 = _mm512_loadu_si512((const void *)pn), n1 = _mm512_loadu_si512((const void *)(pn + 64));
        for (int b = 0; b < cnt; b += 32) {
            __m512i iw = _mm512_cvtepu8_epi16(_mm256_load_si256((const __m256i *)(idx + b)));
            __m512i ow = _mm512_permutex2var_epi16(o0, iw, o1);
            __m512i nw = _mm512_permutex2var_epi16(n0, iw, n1);
            __m512i ko = _mm512_xor_si512(ow, _mm512_or_si512(_mm512_srai_epi16(ow, 15), h));
            __m512i kn = _mm512_xor_si512(nw, _mm512_or_si512(_mm512_srai_epi16(nw, 15), h));
            __m512i d = _mm512_sub_epi16(kn, ko), mag = _mm512_abs_epi16(d);
            int nv = cnt - b < 32 ? cnt - b : 32;
            __mmask32 valid = nv == 32 ? 0xFFFFFFFFu : (1u << nv) - 1;
            __mmask32 ow32 = _mm512_cmpgt_epi16_mask(d, _mm512_setzero_si512()) ^ _mm512_movepi16_mask(ow);
            __mmask32 bg32 = _mm512_cmpgt_epu16_mask(mag, _mm512_set1_epi16(1)) & valid;
            uint16_t tl[32] __attribute__((aligned(64)));
            _mm512_store_si512((void *)tl, _mm512_maskz_compress_epi16(bg32, _mm512_sub_epi16(mag, _mm512_set1_epi16(2))));
            int nb = __builtin_popcount(bg32);
            for (int q = 0; q < nb; q += 8)
                _mm512_storeu_si512((void *)(tail + nbig + q),
                                    _mm512_cvtepu16_epi64(_mm_load_si128((const __m128i *)(tl + q))));
            nbig += nb;
            outw |= (uint64_t)ow32 << b;
            big |= (uint64_t)bg32 << b;
        }
    } else { /* 8 bits, or 4 (codes spread to bytes) */
        __m512i ow = _mm512_permutexvar_epi8(idxall, bits == 4 ? spread4(po) : _mm512_loadu_si512((const void *)po));
        __m512i nw = _mm512_permutexvar_epi8(idxall, bits == 4 ? spread4(pn) : _mm512_loadu_si512((const void *)pn));
        uint64_t valid = cnt == 64 ? ~0ULL : (1ULL << cnt) - 1;
        __m512i mag;
        if (bits == 8) {
            const __m512i h = _mm512_set1_epi8((char)0x80), f = _mm512_set1_epi8((char)0xFF);
            __mmask64 no = _mm512_movepi8_mask(ow), nn = _mm512_movepi8_mask(nw);
            __m512i ko = _mm512_xor_si512(ow, _mm512_mask_blend_epi8(no, h, f));
            __m512i kn = _mm512_xor_si512(nw, _mm512_mask_blend_epi8(nn, h, f));
            __m512i d = _mm512_sub_epi8(kn, ko);
            mag = _mm512_abs_epi8(d);
            outw = _mm512_cmpgt_epi8_mask(d, _mm512_setzero_si512()) ^ no;
        } else { /* 4-bit keys and steps inside bytes: d in 1..7 is positive, 8 is -S */
            const __m512i h = _mm512_set1_epi8(8), f = _mm512_set1_epi8(15);
            __mmask64 no = _mm512_test_epi8_mask(ow, h), nn = _mm512_test_epi8_mask(nw, h);
            __m512i ko = _mm512_xor_si512(ow, _mm512_mask_blend_epi8(no, h, f));
            __m512i kn = _mm512_xor_si512(nw, _mm512_mask_blend_epi8(nn, h, f));
            __m512i d = _mm512_and_si512(_mm512_sub_epi8(kn, ko), f);
            __mmask64 pos = _mm512_cmplt_epu8_mask(d, h);
            mag = _mm512_mask_blend_epi8(pos, _mm512_sub_epi8(_mm512_set1_epi8(16), d), d);
            outw = pos ^ no;
        }
        big = _mm512_cmpgt_epu8_mask(mag, _mm512_set1_epi8(1)) & valid;
        uint8_t tl[64] __attribute__((aligned(64)));
        _mm512_store_si512((void *)tl, _mm512_maskz_compress_epi8(big, _mm512_sub_epi8(mag, _mm512_set1_epi8(2))));
        nbig = __builtin_popcountll(big);
        for (int q = 0; q < nbig; q += 8)
            _mm512_storeu_si512((void *)(tail + q),
                                _mm512_cvtepu8_epi64(_mm_loadl_epi64((const __m128i *)(tl + q))));
    }
    word_recs(idx, cw, tb, outw, big, cnt, cp, wm0, wm1, rk, rec);
    return nbig;
}

/* The pass over whole blocks [0, nfull) of the chunk at `start` (nfull a multiple of JB),
 * bits 16 or 8 (a constant in each instance): like ENC_BODY (rp_encpass.c), records into w,
 * the contexts' counts into tab, the rp.sum128 change into sd. */
T512 static inline __attribute__((always_inline)) int
pass512(const int bits, const rp_kind *kd, const uint8_t *old, const uint8_t *new_,
        size_t nbytes, int64_t start, int64_t nfull, rp_encws *w, uint32_t *tab, uint64_t sd[2]) {
    const int sh = kd->shift, mk = (1 << kd->cbits) - 1;
    const int ncontexts = kd->cbits ? 1 << kd->cbits : 1;
    uint32_t *wrec = w->rec;
    uint64_t *wtail = w->tail, sd0 = 0, sd1 = 0;
    int64_t wk = w->k, wnb = w->nb, cwl = -1;
    uint8_t cbuf[JB] __attribute__((aligned(64)));
    uint32_t rk[JB] __attribute__((aligned(64)));
    uint64_t wmT[JB / 64][16] __attribute__((aligned(64)));
    uint32_t cpT[JB / 64][16] __attribute__((aligned(64)));
    uint8_t hot[WIN], slotb[64] __attribute__((aligned(64)));
    uint32_t cnt[WIN];
    int vc[WIN], slot[NCTX], nvc = 0, lo = 0;
    memset(hot, 0, sizeof hot);
    memset(rk, 0, sizeof rk);
    memset(wmT, 0, sizeof wmT);
    memset(cpT, 0, sizeof cpT);
    for (int c = 0; c < NCTX; c++) slot[c] = -1;
    { /* the hot window, from a sample of the chunk's start (as ENC_BODY) */
        uint32_t sample[NCTX] = {0};
        int64_t sn = nfull < 8192 ? nfull : 8192;
        for (int64_t b0 = 0; b0 < sn; b0 += JB) {
            block_ctx(kd, old, start + b0, JB, cbuf);
            for (int i = 0; i < JB; i++) sample[cbuf[i]]++;
        }
        int ww = ncontexts < WIN ? ncontexts : WIN;
        int64_t best = -1;
        for (int w0 = 0; w0 + ww <= ncontexts; w0++) {
            int64_t sum = 0;
            for (int c = w0; c < w0 + ww; c++) sum += sample[c];
            if (sum > best) { best = sum; lo = w0; }
        }
        for (int c = lo; c < lo + ww; c++)
            if (!kd->cbits || (int64_t)sample[c] * 512 >= sn) {
                hot[c - lo] = 0xFF;
                slot[c] = nvc;
                cnt[nvc] = tab[c];
                vc[nvc++] = c;
            }
    }
    for (int x = 0; x < 64; x++) slotb[x] = (uint8_t)(x < WIN && hot[x] ? slot[lo + x] : 16);
    const __m512i slotw = _mm512_load_si512((const void *)slotb);
    const __m512i lob = _mm512_set1_epi8((char)lo);
    const __m512i hotz = _mm512_zextsi128_si512(_mm_loadu_si128((const __m128i *)hot));
    const rp_kind kl = {bits, RP_SIGNMAG, kd->shift, kd->cbits}; /* constants for rec_word */
    const __m128i shc = _mm_cvtsi32_si128(sh);
    const int wb = 8 * bits; /* bytes per 64 elements */
    for (int64_t b0 = 0; b0 < nfull; b0 += JB) {
        const uint8_t *po = old + (start + b0) * bits / 8, *pn = new_ + (start + b0) * bits / 8;
        uint64_t dm[JB / 64];
        uint64_t any = 0;
        int nch = 0;
        if (bits == 16) {
            const __m512i mkv = _mm512_set1_epi16((short)mk);
            for (int i = 0; i < JB; i += 32) {
                __m512i x = _mm512_loadu_si512((const void *)(po + 2 * i));
                _mm256_store_si256((__m256i *)(cbuf + i),
                                   _mm512_cvtepi16_epi8(_mm512_and_si512(_mm512_srl_epi16(x, shc), mkv)));
            }
            for (int v = 0; v < JB / 64; v++) {
                __mmask32 a = _mm512_cmpneq_epi16_mask(_mm512_loadu_si512((const void *)(po + 128 * v)),
                                                       _mm512_loadu_si512((const void *)(pn + 128 * v)));
                __mmask32 b = _mm512_cmpneq_epi16_mask(_mm512_loadu_si512((const void *)(po + 128 * v + 64)),
                                                       _mm512_loadu_si512((const void *)(pn + 128 * v + 64)));
                dm[v] = (uint64_t)a | (uint64_t)b << 32;
            }
        } else { /* 8 bits, or 4 spread to bytes (sh + cbits <= 4: no bit of the next byte) */
            const __m512i mkv = _mm512_set1_epi8((char)mk);
            for (int v = 0; v < JB / 64; v++) {
                __m512i x = bits == 4 ? spread4(po + 32 * v) : _mm512_loadu_si512((const void *)(po + 64 * v));
                __m512i y = bits == 4 ? spread4(pn + 32 * v) : _mm512_loadu_si512((const void *)(pn + 64 * v));
                _mm512_store_si512((void *)(cbuf + 64 * v), _mm512_and_si512(_mm512_srl_epi16(x, shc), mkv));
                dm[v] = _mm512_cmpneq_epi8_mask(x, y);
            }
        }
        for (int v = 0; v < JB / 64; v++) {
            any |= dm[v];
            nch += __builtin_popcountll(dm[v]);
        }
        const __m512i *cbz = (const __m512i *)cbuf;
        __m512i rel[JB / 64]; /* each element's place in the window (>= WIN: outside it) */
        for (int v = 0; v < JB / 64; v++) rel[v] = _mm512_sub_epi8(_mm512_load_si512(cbz + v), lob);
        int masks = nch >= nvc;
        uint32_t bcs[WIN];
        if (masks) { /* the hot slots' masks and counts up to each word */
            for (int t = 0; t < nvc; t++) {
                __m512i bc = _mm512_set1_epi8((char)vc[t]);
                uint32_t acc = cnt[t];
                for (int v = 0; v < JB / 64; v++) {
                    uint64_t e = _mm512_cmpeq_epi8_mask(_mm512_load_si512(cbz + v), bc);
                    wmT[v][t] = e;
                    cpT[v][t] = acc;
                    acc += (uint32_t)__builtin_popcountll(e);
                }
                bcs[t] = acc - cnt[t];
            }
        } else { /* the window's 16 counts at once (rp_count512.h), the hot slots' taken */
            uint32_t c16[WIN] __attribute__((aligned(64)));
            _mm512_store_si512((void *)c16, slot_counts(rel));
            for (int t = 0; t < nvc; t++) bcs[t] = c16[vc[t] - lo];
        }
        for (int v = 0; v < JB / 64; v++) { /* cold elements: ranks through the table */
            const __m512i idx = rel[v];
            __mmask64 inw = _mm512_cmplt_epu8_mask(idx, _mm512_set1_epi8(WIN));
            __mmask64 hotm = _mm512_mask_test_epi8_mask(inw, _mm512_permutexvar_epi8(idx, hotz), _mm512_set1_epi8(-1));
            uint64_t m = ~(uint64_t)hotm;
            while (m) {
                int i = 64 * v + __builtin_ctzll(m);
                m &= m - 1;
                rk[i] = tab[cbuf[i]]++;
            }
        }
        if (!any) goto counts;
        if (wk + JB + 64 >= w->cap) {
            w->k = wk;
            w->nb = wnb;
            if (rp_ws_reserve(w, JB + 64)) return -1;
            wrec = w->rec;
            wtail = w->tail;
        }
        if (masks) {
            sumblk512(old, new_, (uint64_t)(start + b0) * bits / 64, JB * bits / 64, &sd0, &sd1);
            for (int v = 0; v < JB / 64; v++) {
                if (!dm[v]) continue;
                __m512i cp = _mm512_load_si512((const void *)cpT[v]);
                __m512i wm0 = _mm512_load_si512((const void *)wmT[v]);
                __m512i wm1 = _mm512_load_si512((const void *)(wmT[v] + 8));
                int k0 = __builtin_popcountll(dm[v]);
                wnb += word512(bits, po + wb * v, pn + wb * v, cbuf + 64 * v, dm[v], k0,
                               cp, wm0, wm1, slotw, lob, rk + 64 * v, wrec + wk, wtail + wnb);
                wk += k0;
            }
        } else { /* few changes: each on its own */
            for (int v = 0; v < JB / 64; v++) {
                uint64_t ch = dm[v];
                while (ch) {
                    int i = 64 * v + __builtin_ctzll(ch);
                    ch &= ch - 1;
                    unsigned c = cbuf[i];
                    int t = slot[c];
                    uint32_t rank;
                    if (t < 0) {
                        rank = rk[i];
                    } else {
                        __m512i bc = _mm512_set1_epi8((char)c);
                        rank = cnt[t];
                        for (int u = 0; u < v; u++)
                            rank += (uint32_t)__builtin_popcountll(_mm512_cmpeq_epi8_mask(_mm512_load_si512(cbz + u), bc));
                        rank += (uint32_t)__builtin_popcountll(
                            _mm512_cmpeq_epi8_mask(_mm512_load_si512(cbz + v), bc) & ((1ULL << (i & 63)) - 1));
                    }
                    int64_t j = (start + b0 + i) * bits / 64;
                    if (j != cwl) {
                        uint64_t wa = word_at(old, nbytes, (uint64_t)j), wb = word_at(new_, nbytes, (uint64_t)j);
                        sd0 += sum_term(0, wb, (uint64_t)j) - sum_term(0, wa, (uint64_t)j);
                        sd1 += sum_term(1, wb, (uint64_t)j) - sum_term(1, wa, (uint64_t)j);
                        cwl = j;
                    }
                    uint64_t mag;
                    wrec[wk++] = rec_word(&kl, rank, c, elem_get(po, bits, i), elem_get(pn, bits, i), &mag);
                    wtail[wnb] = mag - 2;
                    wnb += mag > 1;
                }
            }
        }
    counts:
        for (int t = 0; t < nvc; t++) cnt[t] += bcs[t];
    }
    for (int t = 0; t < nvc; t++) tab[vc[t]] = cnt[t];
    w->k = wk;
    w->nb = wnb;
    sd[0] += sd0;
    sd[1] += sd1;
    return 0;
}

T512 RP_HIDDEN int rp_pass512_16(const rp_kind *kd, const uint8_t *old, const uint8_t *new_,
                                 size_t nbytes, int64_t start, int64_t nfull, rp_encws *w,
                                 uint32_t *tab, uint64_t sd[2]) {
    return pass512(16, kd, old, new_, nbytes, start, nfull, w, tab, sd);
}

T512 RP_HIDDEN int rp_pass512_8(const rp_kind *kd, const uint8_t *old, const uint8_t *new_,
                                size_t nbytes, int64_t start, int64_t nfull, rp_encws *w,
                                uint32_t *tab, uint64_t sd[2]) {
    return pass512(8, kd, old, new_, nbytes, start, nfull, w, tab, sd);
}

T512 RP_HIDDEN int rp_pass512_4(const rp_kind *kd, const uint8_t *old, const uint8_t *new_,
                                size_t nbytes, int64_t start, int64_t nfull, rp_encws *w,
                                uint32_t *tab, uint64_t sd[2]) {
    return pass512(4, kd, old, new_, nbytes, start, nfull, w, tab, sd);
}
#endif
