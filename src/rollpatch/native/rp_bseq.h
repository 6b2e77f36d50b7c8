/* rollpatch native core, internal: the decoder's binary sequences (rp_decode.c, phase A):
 * runs of unary codes and the Golomb-coded sets of codec rp.ctxgolomb.v2
 * (docs/patch-format.md §4b). Each reader works on local copies of its bit readers: with
 * -fno-strict-aliasing a store to the output may alias a reader's fields, which the compiler
 * would otherwise reload after every code. */
#ifndef RP_BSEQ_H
#define RP_BSEQ_H
#include "rp_internal.h"
#include "rp_unary.h"

#if defined(__x86_64__) && defined(__GNUC__)
/* bs_decode_'s remainder loop, 16 codes per step (AVX-512 with VBMI, and BMI2): the 16
 * fields of w bits (16w bits = 2w whole bytes per step, so every lane's byte and bit offset
 * is the same each step) by one byte permute and two shifts; the long forms' extra bits by
 * one PDEP of pass 2's next bits onto the lanes that take one; the positions by a prefix sum
 * in registers. Stops (returning the codes done) where a 64-byte load would pass the
 * stream's end; *fp, *ep and *prev carry on into the scalar loop. A position >= n: -1. */
__attribute__((target("avx512f,avx512bw,avx512vbmi,bmi2"))) static int64_t
golomb_rem_avx512(const uint8_t *fb, size_t nbytes, uint64_t c, unsigned w, uint64_t m,
                  uint64_t uu, uint64_t n, uint32_t *mino, size_t *fp_, size_t *ep_,
                  int64_t *prev_) {
    size_t fp = *fp_, ep = *ep_;
    const unsigned sh0 = (unsigned)(fp & 7);
    uint8_t perm[64];
    uint32_t shl[16];
    for (int i = 0; i < 16; i++) { /* lane i: the big-endian u32 at its first byte */
        unsigned off = sh0 + (unsigned)i * w;
        for (int q = 0; q < 4; q++) perm[4 * i + q] = (uint8_t)((off >> 3) + 3 - (unsigned)q);
        shl[i] = off & 7;
    }
    const __m512i vperm = _mm512_loadu_si512(perm), vshl = _mm512_loadu_si512(shl);
    const __m512i vshr = _mm512_set1_epi32((int)(32 - w)), vuu = _mm512_set1_epi32((int)uu);
    const __m512i vm = _mm512_set1_epi32((int)m), one = _mm512_set1_epi32(1);
    const __m512i vn = _mm512_set1_epi32((int)n), z = _mm512_setzero_si512();
    const __m512i last = _mm512_set1_epi32(15);
    __m512i base = _mm512_set1_epi32((int)*prev_); /* -1 before the first code */
    uint64_t i = 0;
    for (; i + 16 <= c && (fp >> 3) + 64 <= nbytes && (ep >> 3) + 8 <= nbytes; i += 16) {
        __m512i raw = _mm512_loadu_si512(fb + (fp >> 3));
        __m512i t = _mm512_sllv_epi32(_mm512_permutexvar_epi8(vperm, raw), vshl);
        t = _mm512_srlv_epi32(t, vshr);
        fp += 16 * (size_t)w;
        __mmask16 ext = _mm512_cmpge_epu32_mask(t, vuu);
        uint64_t lb = load_lsb_first(fb + (ep >> 3)) >> (ep & 7); /* >= 57 bits of pass 2 */
        __mmask16 bit = (__mmask16)_pdep_u32((uint32_t)lb, (uint32_t)ext);
        ep += (size_t)__builtin_popcount((unsigned)ext);
        /* r = 2t + bit - uu for the long forms, t for the others; then gap + 1 = q*m + r + 1 */
        __m512i lng = _mm512_mask_add_epi32(_mm512_sub_epi32(_mm512_add_epi32(t, t), vuu), bit,
                                            _mm512_sub_epi32(_mm512_add_epi32(t, t), vuu), one);
        __m512i r = _mm512_mask_mov_epi32(t, ext, lng);
        __m512i g = _mm512_mullo_epi32(_mm512_loadu_si512(mino + i), vm);
        g = _mm512_add_epi32(_mm512_add_epi32(g, r), one);
        g = _mm512_add_epi32(g, _mm512_alignr_epi32(g, z, 15)); /* prefix sum over the lanes */
        g = _mm512_add_epi32(g, _mm512_alignr_epi32(g, z, 14));
        g = _mm512_add_epi32(g, _mm512_alignr_epi32(g, z, 12));
        g = _mm512_add_epi32(g, _mm512_alignr_epi32(g, z, 8));
        __m512i pv = _mm512_add_epi32(g, base);
        /* base < n and q <= n/m + 1 (the unary limit): each gap <= 3n, no u32 wrap here */
        if (_mm512_cmpge_epu32_mask(pv, vn)) return -1;
        _mm512_storeu_si512(mino + i, pv);
        base = _mm512_permutexvar_epi32(last, pv);
    }
    *fp_ = fp;
    *ep_ = ep;
    *prev_ = i ? (int64_t)(uint32_t)_mm_cvtsi128_si32(_mm512_castsi512_si128(base)) : *prev_;
    return (int64_t)i;
}
#endif

/* x with its 64 bits in reverse order (bit 63 - i of x is bit i of the result). */
static inline uint64_t rbit64(uint64_t x) {
    x = __builtin_bswap64(x);
    x = ((x >> 1) & 0x5555555555555555ULL) | ((x & 0x5555555555555555ULL) << 1);
    x = ((x >> 2) & 0x3333333333333333ULL) | ((x & 0x3333333333333333ULL) << 2);
    return ((x >> 4) & 0x0F0F0F0F0F0F0F0FULL) | ((x & 0x0F0F0F0F0F0F0F0FULL) << 4);
}

/* The 64 bits at bit `pos` (peek_at holds 64 - pos % 8 of them), MSB-aligned; zeros past
 * the end. */
static inline uint64_t peek64(const uint8_t *b, size_t nbits, size_t pos) {
    size_t byte = pos >> 3;
    unsigned sh = (unsigned)(pos & 7);
    uint64_t x = peek_at(b, nbits, pos & ~(size_t)7);
    if (sh) {
        x <<= sh;
        if (byte + 8 < nbits >> 3) x |= (uint64_t)(b[byte + 8] >> (8 - sh));
    }
    return x;
}

#if defined(__x86_64__) && defined(__GNUC__)
/* The positions of x's set bits, plus base, into out (popcount(x) of them): one byte
 * compress, then 16 per store. */
__attribute__((target("avx512f,avx512bw,avx512vbmi2"))) static void
set_bits_avx512(uint64_t x, uint32_t base, uint32_t *out) {
    uint8_t io[64];
    for (int q = 0; q < 64; q++) io[q] = (uint8_t)q;
    __m512i z = _mm512_maskz_compress_epi8(x, _mm512_loadu_si512(io));
    const __m512i b = _mm512_set1_epi32((int)base);
    uint64_t take = (uint64_t)__builtin_popcountll(x);
    for (uint64_t o = 0; o < take; o += 16) {
        uint64_t rest = take - o;
        __mmask16 k = rest >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << rest) - 1);
        __m512i v = _mm512_add_epi32(_mm512_cvtepu8_epi32(_mm512_castsi512_si128(z)), b);
        _mm512_mask_storeu_epi32(out + o, k, v);
        z = _mm512_alignr_epi32(z, z, 4);
    }
}
#endif

static int bs_decode_(br_t *u, br_t *f, uint64_t n, uint64_t j, uint32_t *out,
                      uint32_t *scratch, int v512, uint64_t *bmo, int *isbm) {
    if (j > n) return -1;
    if (j == 0) return 0;
    if (j == n) {
        for (uint64_t p = 0; p < n; p++) out[p] = (uint32_t)p;
        return 0;
    }
    int comp = 2 * j > n;
    uint64_t c = comp ? n - j : j, m = golomb_m(n, c);
    if (m == 1) { /* the slots themselves, one bit each, 64 at a time */
        if (n > f->nbits - f->pos) return -1;
        const uint8_t *const fb = f->b;
        const size_t nbits = f->nbits, pos = f->pos;
        uint64_t s = 0;
        for (uint64_t p = 0; p < n; p += 64) {
            uint64_t x = rbit64(peek64(fb, nbits, pos + p)); /* slot p + i is bit i */
            if (n - p < 64) x &= (1ULL << (n - p)) - 1;
            uint64_t cnt = (uint64_t)__builtin_popcountll(x);
            if (cnt > j - s) return -1;
            if (bmo) bmo[p >> 6] = x;
#if defined(__x86_64__) && defined(__GNUC__)
            if (v512) {
                set_bits_avx512(x, (uint32_t)p, out + s);
            } else
#endif
            {
                for (uint32_t *o = out + s; x; x &= x - 1)
                    *o++ = (uint32_t)(p + (uint64_t)__builtin_ctzll(x));
            }
            s += cnt;
        }
        f->pos = pos + n;
        if (bmo) {
            bmo[(n + 63) / 64] = bmo[(n + 63) / 64 + 1] = 0;
            *isbm = 1;
        }
        return s == j ? 0 : -1;
    }
    int b = bitlen64(m - 1);
    unsigned w = (unsigned)(b - 1);
    uint64_t uu = (1ULL << b) - m;
    uint32_t *mino = comp ? scratch : out;
    if (br_unary_run(u, c, n / m + 1, mino, v512)) return -1; /* q <= n/m + 1 < 2^32 */
    if (c * w > f->nbits - f->pos) return -1;
    const uint8_t *fb = f->b;
    const size_t nbits = f->nbits, nbytes = nbits >> 3;
    size_t fp = f->pos;
    /* pass 2's bits MSB first in a register: eb holds the bits from ep on, `used` of them
     * taken; bits past the end read as zero and are refused once at the end */
    size_t ep = f->pos + c * w;
    int64_t p = -1;
    uint64_t i = 0;
#if defined(__x86_64__) && defined(__GNUC__)
    /* w <= 19 (n <= 2^20: a chunk, params checked), so a lane's field with its bit offset
     * fits the 4 bytes it permutes in (7 + 19 <= 32) and 16 fields 41 bytes of the 64 */
    if (v512 && c >= 16) {
        int64_t done = golomb_rem_avx512(fb, nbytes, c, w, m, uu, n, mino, &fp, &ep, &p);
        if (done < 0) return -1;
        i = (uint64_t)done;
    }
#endif
    uint64_t eb = peek_at(fb, nbits, ep);
    unsigned used = 0;
    for (; i < c; i++) {
        uint64_t x = __builtin_expect((fp >> 3) + 8 <= nbytes, 1)
                         ? load_be64(fb + (fp >> 3)) : peek_at(fb, nbits, fp & ~(size_t)7);
        uint64_t t = (x << (fp & 7)) >> (63 - w) >> 1; /* w < 63; 0 when w == 0 */
        fp += w;
        /* the long form (t >= uu, about half the codes) without a branch: r < m either way */
        uint64_t ext = t >= uu;
        uint64_t bit = (eb << used) >> 63;
        used += (unsigned)ext;
        uint64_t r = ext ? 2 * t + bit - uu : t;
        p += 1 + (int64_t)((uint64_t)mino[i] * m + r); /* <= 3n per code (q <= n/m + 1) */
        mino[i] = (uint32_t)p;
        if (__builtin_expect(used >= 56, 0)) {
            ep += used;
            used = 0;
            eb = ep < nbits ? peek_at(fb, nbits, ep) : 0;
        }
    }
    ep += used;
    /* positions increase, so the last one below n bounds them all (and every gap) */
    if (ep > nbits || p >= (int64_t)n) return -1;
    f->pos = ep;
    if (comp) { /* the set slots are the complement of the minority */
        /* the minority as a bitmap after it in scratch (c < j <= k and n < 2k: scratch's
         * k + k/4 + 65 u32 hold c + 2 of them and n/64 + 1 words), its 64-bit words built in
         * a register (the positions increase) and stored, never re-read; then each word's
         * clear bits listed, 64 slots per step, instead of a loop per slot whose next load
         * waits on the last compare */
        uint64_t *const bm = bmo ? bmo : (uint64_t *)(void *)(scratch + ((c + 2) & ~(uint64_t)1));
        const uint64_t nw = (n + 63) / 64;
        memset(bm, 0, nw * 8);
        uint64_t acc = 0, wprev = 0;
        for (uint64_t q = 0; q < c; q++) {
            const uint64_t v = mino[q], wv = v >> 6;
            acc = (wv == wprev ? acc : 0) | 1ULL << (v & 63);
            wprev = wv;
            bm[wv] = acc;
        }
        uint64_t s = 0;
        for (uint64_t wv = 0; wv < nw; wv++) {
            uint64_t x = ~bm[wv];
            if (n - 64 * wv < 64) x &= (1ULL << (n - 64 * wv)) - 1;
            if (bmo) bmo[wv] = x; /* now the set slots' bitmap */
#if defined(__x86_64__) && defined(__GNUC__)
            if (v512) {
                set_bits_avx512(x, (uint32_t)(64 * wv), out + s);
                s += (uint64_t)__builtin_popcountll(x);
                continue;
            }
#endif
            for (; x; x &= x - 1) out[s++] = (uint32_t)(64 * wv + (uint64_t)__builtin_ctzll(x));
        }
        if (bmo) {
            bmo[nw] = bmo[nw + 1] = 0;
            *isbm = 1;
        }
    }
    return 0;
}

/* Inverse of bs_encode: writes the j set slots (sorted) into out, which has room for j + 1;
 * scratch holds min(j, n - j) + n/32 + 4 u32 (the minority, and a bitmap of it when the set
 * is its complement; the lane's k + k/4 + 65 with j <= k).
 * The truncated-binary pass 1 fields are read at one cursor and the pass-2 bits at another
 * (pass 2 starts exactly c * (b - 1) bits after pass 1).
 * bs_decode_bm: where the set is decoded from a bitmap (one bit per slot, m == 1, or the
 * complement of a minority) that bitmap too, into bmo: (n + 63) / 64 words, the bits past n
 * clear, then two zero words (the AVX-512 join's slot bitmap, rp_join512.c); *isbm says
 * whether it was written. */
static int bs_decode_bm(br_t *u0, br_t *f0, uint64_t n, uint64_t j, uint32_t *out,
                        uint32_t *scratch, int v512, uint64_t *bmo, int *isbm) {
    br_t u = *u0, f = *f0; /* local copies: the stores to out may alias *u0, *f0 */
    *isbm = 0;
    int rc = bs_decode_(&u, &f, n, j, out, scratch, v512, bmo, isbm);
    u0->pos = u.pos;
    f0->pos = f.pos;
    return rc;
}

static int bs_decode(br_t *u, br_t *f, uint64_t n, uint64_t j, uint32_t *out, uint32_t *scratch,
                     int v512) {
    int isbm;
    return bs_decode_bm(u, f, n, j, out, scratch, v512, NULL, &isbm);
}

/* bs_decode's set as a bitmap: slot p is bit p & 63 of bits[p >> 6] (n / 64 + 1 words, the
 * bits past n clear); idx (room for j + 1) and scratch as bs_decode's out and scratch. The
 * dense form (m == 1, one bit per slot: the outward flags, about half of all changes, and
 * any dense set) is copied 64 slots at a time, its set bits counted, never listed. */
static int bs_decode_bits(br_t *u, br_t *f, uint64_t n, uint64_t j, uint64_t *bits,
                          uint32_t *idx, uint32_t *scratch, int v512) {
    uint64_t nw = n / 64 + 1;
    memset(bits, 0, nw * 8);
    if (j > n) return -1;
    uint64_t c = 2 * j > n ? n - j : j;
    if (j && j < n && golomb_m(n, c) == 1) {
        if (n > f->nbits - f->pos) return -1;
        const uint8_t *const fb = f->b;
        const size_t nbits = f->nbits, pos = f->pos;
        uint64_t set = 0;
        for (uint64_t w = 0; 64 * w < n; w++) {
            uint64_t x = rbit64(peek64(fb, nbits, pos + 64 * w)); /* stream order from bit 0 */
            if (n - 64 * w < 64) x &= (1ULL << (n - 64 * w)) - 1;
            bits[w] = x;
            set += (uint64_t)__builtin_popcountll(x);
        }
        f->pos = pos + n;
        return set == j ? 0 : -1;
    }
    if (bs_decode(u, f, n, j, idx, scratch, v512)) return -1;
    for (uint64_t i = 0; i < j; i++) bits[idx[i] >> 6] |= 1ULL << (idx[i] & 63);
    return 0;
}

#endif /* RP_BSEQ_H */
