/* rollpatch native core, internal: the decoder's binary sequences (rp_decode.c, phase A):
 * runs of unary codes and the Golomb-coded sets of codec rp.ctxgolomb.v2
 * (docs/patch-format.md §4b). Each reader works on local copies of its bit readers: with
 * -fno-strict-aliasing a store to the output may alias a reader's fields, which the compiler
 * would otherwise reload after every code. */
#ifndef RP_BSEQ_H
#define RP_BSEQ_H
#include "rp_internal.h"

static int br_unary_run_(br_t *r, uint64_t cnt, uint64_t limit, uint32_t *out) {
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

/* `cnt` unary codes into out, each at most `limit` ones: every code that ends inside one
 * 64-bit peek is taken from it (a code longer than a peek goes through br_unary). */
static int br_unary_run(br_t *r0, uint64_t cnt, uint64_t limit, uint32_t *out) {
    br_t rr = *r0, *r = &rr; /* a local copy: the stores to out may alias *r0 */
    int rc = br_unary_run_(r, cnt, limit, out);
    r0->pos = rr.pos;
    return rc;
}

static int bs_decode_(br_t *u, br_t *f, uint64_t n, uint64_t j, uint32_t *out,
                      uint32_t *scratch) {
    if (j > n) return -1;
    if (j == 0) return 0;
    if (j == n) {
        for (uint64_t p = 0; p < n; p++) out[p] = (uint32_t)p;
        return 0;
    }
    int comp = 2 * j > n;
    uint64_t c = comp ? n - j : j, m = golomb_m(n, c);
    if (m == 1) {
        if (n > f->nbits - f->pos) return -1;
        uint64_t s = 0, v = 0;
        for (uint64_t p = 0; p < n; p += 56) { /* 56 slots per read, set bits by clz */
            unsigned take = n - p < 56 ? (unsigned)(n - p) : 56;
            br_get(f, take, &v);
            v <<= 64 - take;
            while (v) {
                int z = __builtin_clzll(v);
                if (s == j) return -1;
                out[s++] = (uint32_t)(p + (uint64_t)z);
                v &= ~(1ULL << (63 - z));
            }
        }
        return s == j ? 0 : -1;
    }
    int b = bitlen64(m - 1);
    unsigned w = (unsigned)(b - 1);
    uint64_t uu = (1ULL << b) - m;
    uint32_t *mino = comp ? scratch : out;
    if (br_unary_run(u, c, n / m + 1, mino)) return -1; /* q <= n/m + 1 < 2^32 */
    if (c * w > f->nbits - f->pos) return -1;
    const uint8_t *fb = f->b;
    size_t nbits = f->nbits, fp = f->pos, ep = f->pos + c * w;
    int64_t prev = -1;
    for (uint64_t i = 0; i < c; i++) {
        uint64_t t = w ? peek_at(fb, nbits, fp) >> (64 - w) : 0;
        fp += w;
        /* the long form (t >= uu, about half the codes) without a branch: its extra bit is
         * read either way (zero past the end, refused below) */
        uint64_t ext = t >= uu;
        uint64_t bit = ep < nbits ? peek_at(fb, nbits, ep) >> 63 : 0;
        if (ext & (ep >= nbits)) return -1;
        uint64_t r = ext ? 2 * t + bit - uu : t;
        ep += ext;
        uint64_t g = (uint64_t)mino[i] * m + r;
        if (r >= m || g >= n) return -1;
        int64_t p = prev + 1 + (int64_t)g;
        if (p >= (int64_t)n) return -1;
        mino[i] = (uint32_t)p;
        prev = p;
    }
    f->pos = ep;
    if (comp) { /* the set slots are the complement of the minority */
        uint64_t s = 0, i = 0;
        for (uint64_t p = 0; p < n; p++) {
            if (i < c && mino[i] == p) { i++; continue; }
            out[s++] = (uint32_t)p;
        }
    }
    return 0;
}

/* Inverse of bs_encode: writes the j set slots (sorted) into out. scratch holds n/2+1.
 * The truncated-binary pass 1 fields are read at one cursor and the pass-2 bits at another
 * (pass 2 starts exactly c * (b - 1) bits after pass 1). */
static int bs_decode(br_t *u0, br_t *f0, uint64_t n, uint64_t j, uint32_t *out,
                     uint32_t *scratch) {
    br_t u = *u0, f = *f0; /* local copies: the stores to out may alias *u0, *f0 */
    int rc = bs_decode_(&u, &f, n, j, out, scratch);
    u0->pos = u.pos;
    f0->pos = f.pos;
    return rc;
}

#endif /* RP_BSEQ_H */
