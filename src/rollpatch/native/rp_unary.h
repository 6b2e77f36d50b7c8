/* rollpatch native core, internal: runs of unary codes for the decoder's binary sequences
 * (rp_bseq.h; docs/patch-format.md §4 bit streams, §9 decoder pass): every code that ends in
 * 8 whole bytes of the stream is taken from them at once. The reader works on a local copy of
 * its bit reader: with -fno-strict-aliasing a store to the output may alias its fields. */
#ifndef RP_UNARY_H
#define RP_UNARY_H
#include "rp_internal.h"

static inline uint64_t load_be64(const uint8_t *b) {
    uint64_t x;
    memcpy(&x, b, 8);
    return __builtin_bswap64(x);
}

/* The 8 bytes at b, each byte's bits reversed: stream bit 8i + j (MSB first in byte i) is
 * bit 8i + j of the result, so the bits read from the LSB up in stream order. */
static inline uint64_t load_lsb_first(const uint8_t *b) {
    uint64_t x;
    memcpy(&x, b, 8);
    x = ((x >> 1) & 0x5555555555555555ULL) | ((x & 0x5555555555555555ULL) << 1);
    x = ((x >> 2) & 0x3333333333333333ULL) | ((x & 0x3333333333333333ULL) << 2);
    return ((x >> 4) & 0x0F0F0F0F0F0F0F0FULL) | ((x & 0x0F0F0F0F0F0F0F0FULL) << 4);
}

static int br_unary_run_slow(br_t *r, uint64_t cnt, uint64_t limit, uint32_t *out) {
    uint64_t i = 0;
    while (i < cnt) {
        size_t rest = r->nbits - r->pos;
        if (!rest) return -1;
        unsigned avail = 64 - (unsigned)(r->pos & 7), used = 0;
        if (avail > rest) avail = (unsigned)rest;
        uint64_t x = br_peek(r);
        while (i < cnt && used < avail) {
            uint64_t y = ~(x << used); /* used < 64 */
            unsigned ones = y ? (unsigned)__builtin_clzll(y) : 64;
            if (used + ones >= avail) break; /* its zero is not inside this peek */
            if (ones > limit) return -1;
            out[i++] = ones;
            used += ones + 1;
        }
        r->pos += used;
        if (!used) { /* a code longer than the peek */
            uint64_t q;
            if (br_unary(r, limit, &q)) return -1;
            out[i++] = (uint32_t)q;
        }
    }
    return 0;
}

/* Every code that ends inside 8 whole bytes of the stream is taken from them at once: the
 * zeros (code ends) of the word, LSB first, one TZCNT and one BLSR per code and no branch per
 * code; the codes' limit is checked once per word. The stream's last 7 bytes, and each code
 * with no zero in a word (more than 56 ones), go through br_unary_run_slow. */
#if defined(__x86_64__) && defined(__GNUC__)
/* br_unary_run_'s loop with AVX-512 VBMI2: all the codes that end in a word at once, their
 * zeros' bit positions listed by one byte compress, each code's ones the distance to the
 * zero before; stops at a word with no zero or the stream's last 7 bytes. Returns the codes
 * taken (*pos_ moved past them), -1 for a code over the limit. */
__attribute__((target("avx512f,avx512bw,avx512vbmi,avx512vbmi2,bmi2"))) static int64_t
unary_run_avx512(const uint8_t *b, size_t nbytes, size_t *pos_, uint64_t cnt, uint64_t limit,
                 uint32_t *out) {
    uint8_t io[64];
    for (int q = 0; q < 64; q++) io[q] = (uint8_t)q;
    const __m512i iota = _mm512_loadu_si512(io), ff = _mm512_set1_epi8(-1);
    const __m512i before = _mm512_add_epi8(iota, ff); /* lane q reads lane q - 1 */
    const __m512i lim = _mm512_set1_epi8((char)(limit < 255 ? limit : 255));
    size_t pos = *pos_;
    uint64_t i = 0;
    while (i < cnt && (pos >> 3) + 8 <= nbytes) {
        const unsigned sh = (unsigned)(pos & 7);
        uint64_t t = ~(load_lsb_first(b + (pos >> 3)) >> sh) & (~0ULL >> sh); /* zeros */
        if (!t) break;
        uint64_t take = (uint64_t)__builtin_popcountll(t);
        if (take > cnt - i) take = cnt - i;
        __m512i z = _mm512_maskz_compress_epi8(t, iota);
        __m512i zp = _mm512_mask_permutexvar_epi8(ff, ~(__mmask64)1, before, z); /* lane 0: -1 */
        __m512i q = _mm512_add_epi8(_mm512_sub_epi8(z, zp), ff);
        __mmask64 valid = take == 64 ? ~(__mmask64)0 : ((__mmask64)1 << take) - 1;
        if (_mm512_mask_cmpgt_epu8_mask(valid, q, lim)) return -1;
        for (uint64_t o = 0; o < take; o += 16) {
            uint64_t rest = take - o;
            __mmask16 k = rest >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << rest) - 1);
            __m512i v = _mm512_cvtepu8_epi32(_mm512_castsi512_si128(q));
            _mm512_mask_storeu_epi32(out + i + o, k, v);
            q = _mm512_alignr_epi32(q, q, 4);
        }
        pos += (size_t)__builtin_ctzll(_pdep_u64(1ULL << (take - 1), t)) + 1;
        i += take;
    }
    *pos_ = pos;
    return (int64_t)i;
}
#endif

static int br_unary_run_(br_t *r, uint64_t cnt, uint64_t limit, uint32_t *out, int v512) {
    const uint8_t *const b = r->b;
    const size_t nbytes = r->nbits >> 3;
    size_t pos = r->pos;
    uint64_t i = 0;
    while (i < cnt && (pos >> 3) + 8 <= nbytes) {
#if defined(__x86_64__) && defined(__GNUC__)
        if (v512) { /* up to a code longer than a word, or the stream's end */
            int64_t done = unary_run_avx512(b, nbytes, &pos, cnt - i, limit, out + i);
            if (done < 0) return -1;
            i += (uint64_t)done;
            if (i >= cnt || (pos >> 3) + 8 > nbytes) break;
        }
#endif
        const unsigned sh = (unsigned)(pos & 7);
        uint64_t t = ~(load_lsb_first(b + (pos >> 3)) >> sh) & (~0ULL >> sh); /* zeros */
        if (!t) { /* a code longer than the word */
            r->pos = pos;
            if (br_unary_run_slow(r, 1, limit, out + i)) return -1;
            i++;
            pos = r->pos;
            continue;
        }
        uint64_t take = (uint64_t)__builtin_popcountll(t), end;
        if (take > cnt - i) take = cnt - i;
        end = i + take;
        uint64_t at = 0, worst = 0;
        for (; i < end; i++) { /* the code's ones: its zero's bit less where it started */
            uint64_t z = (uint64_t)__builtin_ctzll(t);
            t &= t - 1;
            uint64_t q = z - at;
            out[i] = (uint32_t)q;
            worst = q > worst ? q : worst;
            at = z + 1;
        }
        if (worst > limit) return -1;
        pos += at;
    }
    r->pos = pos;
    return i < cnt ? br_unary_run_slow(r, cnt - i, limit, out + i) : 0;
}

/* `cnt` unary codes into out, each at most `limit` ones. */
static int br_unary_run(br_t *r0, uint64_t cnt, uint64_t limit, uint32_t *out, int v512) {
    br_t rr = *r0, *r = &rr; /* a local copy: the stores to out may alias *r0 */
    int rc = br_unary_run_(r, cnt, limit, out, v512);
    r0->pos = rr.pos;
    return rc;
}

#endif /* RP_UNARY_H */
