/* rollpatch native core: codec rp.ctxgolomb.v2 and the rp.sum128 digest. See rpcore.h and
 * docs/patch-format.md §4b. The numpy module rollpatch.patch.ctxv2 is the executable
 * reference: tests require byte-identical payloads and identical decodes from both. */
#include "rpcore.h"

#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#define NCTX 256
#define FAIL(code, msg)    \
    do {                   \
        *err = (msg);      \
        rc = (code);       \
        goto done;         \
    } while (0)

/* ------------------------------------------------------------------ elements and keys */

static inline uint64_t elem_get(const uint8_t *b, int bits, int64_t i) {
    switch (bits) {
    case 4: return (b[i >> 1] >> ((i & 1) << 2)) & 15u;
    case 8: return b[i];
    case 16: { uint16_t v; memcpy(&v, b + 2 * i, 2); return v; }
    case 32: { uint32_t v; memcpy(&v, b + 4 * i, 4); return v; }
    default: { uint64_t v; memcpy(&v, b + 8 * i, 8); return v; }
    }
}

static inline void elem_put(uint8_t *b, int bits, int64_t i, uint64_t v) {
    switch (bits) {
    case 4: {
        int sh = (int)(i & 1) << 2;
        b[i >> 1] = (uint8_t)((b[i >> 1] & ~(15u << sh)) | ((v & 15u) << sh));
        return;
    }
    case 8: b[i] = (uint8_t)v; return;
    case 16: { uint16_t x = (uint16_t)v; memcpy(b + 2 * i, &x, 2); return; }
    case 32: { uint32_t x = (uint32_t)v; memcpy(b + 4 * i, &x, 4); return; }
    default: memcpy(b + 8 * i, &v, 8); return;
    }
}

static inline uint64_t arr_get(const void *a, int w, int64_t i) {
    switch (w) {
    case 1: return ((const uint8_t *)a)[i];
    case 2: return ((const uint16_t *)a)[i];
    case 4: return ((const uint32_t *)a)[i];
    default: return ((const uint64_t *)a)[i];
    }
}

static inline void arr_put(void *a, int w, int64_t i, uint64_t v) {
    switch (w) {
    case 1: ((uint8_t *)a)[i] = (uint8_t)v; return;
    case 2: ((uint16_t *)a)[i] = (uint16_t)v; return;
    case 4: ((uint32_t *)a)[i] = (uint32_t)v; return;
    default: ((uint64_t *)a)[i] = v; return;
    }
}

static inline uint64_t kmask(int bits) { return bits >= 64 ? ~0ULL : (1ULL << bits) - 1; }
static inline uint64_t ksign(int bits) { return 1ULL << (bits - 1); }

static inline uint64_t to_key(const rp_kind *k, uint64_t x) {
    uint64_t s = ksign(k->bits), m = kmask(k->bits);
    if (k->order == RP_SIGNMAG) return (x & s) ? (~x & m) : (x | s);
    if (k->order == RP_TWOS) return x ^ s;
    return x;
}

static inline uint64_t from_key(const rp_kind *k, uint64_t y) {
    uint64_t s = ksign(k->bits), m = kmask(k->bits);
    if (k->order == RP_SIGNMAG) return (y & s) ? (y ^ s) : (~y & m);
    if (k->order == RP_TWOS) return y ^ s;
    return y;
}

static inline unsigned ctx_of(const rp_kind *k, uint64_t x) {
    return k->cbits ? (unsigned)((x >> k->shift) & ((1u << k->cbits) - 1)) : 0u;
}

static inline int bitlen64(uint64_t v) { return v ? 64 - __builtin_clzll(v) : 0; }

static uint64_t golomb_m(uint64_t n, uint64_t c) {
    unsigned __int128 num = (unsigned __int128)(n - c) * 693147u + (unsigned __int128)500000u * c;
    uint64_t m = (uint64_t)(num / ((unsigned __int128)1000000u * c));
    return m ? m : 1;
}

static int kind_ok(const rp_kind *k) {
    if (!(k->bits == 4 || k->bits == 8 || k->bits == 16 || k->bits == 32 || k->bits == 64))
        return 0;
    if (k->order < 0 || k->order > 2 || k->cbits < 0 || k->cbits > 8) return 0;
    return k->shift >= 0 && k->shift + k->cbits <= k->bits;
}

/* ------------------------------------------------------------------ bit streams */

typedef struct {
    uint8_t *b;
    size_t len, cap;
    uint64_t acc;
    unsigned nacc;
    int oom;
} bw_t;

/* Room for `extra` more bytes (amortised doubling); sets oom and fails when out of memory. */
static int bw_reserve(bw_t *w, size_t extra) {
    if (w->len + extra <= w->cap) return 0;
    if (w->oom) return -1;
    size_t cap = w->cap ? w->cap : 256;
    while (cap < w->len + extra) cap *= 2;
    uint8_t *nb = realloc(w->b, cap);
    if (!nb) { w->oom = 1; return -1; }
    w->b = nb;
    w->cap = cap;
    return 0;
}

static void bw_byte(bw_t *w, uint8_t v) { /* only with no pending bits */
    if (bw_reserve(w, 1)) return;
    w->b[w->len++] = v;
}

static void bw_bytes(bw_t *w, const uint8_t *p, size_t n) { /* only with no pending bits */
    if (!n || bw_reserve(w, n)) return;
    memcpy(w->b + w->len, p, n);
    w->len += n;
}

/* Bits accumulate MSB first in acc (fewer than 32 pending between calls); whole 32-bit words
 * are flushed big-endian, so the bytes are those of a bit-at-a-time writer. */
static inline void bw_put32(bw_t *w, uint64_t v, unsigned n) { /* n <= 32 */
    if (!n) return;
    w->acc = (w->acc << n) | (v & ((1ULL << n) - 1));
    w->nacc += n;
    if (w->nacc >= 32) {
        w->nacc -= 32;
        if (bw_reserve(w, 4)) return;
        uint32_t x = __builtin_bswap32((uint32_t)(w->acc >> w->nacc));
        memcpy(w->b + w->len, &x, 4);
        w->len += 4;
        w->acc &= (1ULL << w->nacc) - 1;
    }
}

static inline void bw_put(bw_t *w, uint64_t v, unsigned n) { /* n <= 64 */
    if (n > 32) {
        bw_put32(w, v >> 32, n - 32);
        bw_put32(w, v & 0xFFFFFFFFu, 32);
    } else {
        bw_put32(w, v, n);
    }
}

static inline void bw_unary(bw_t *w, uint64_t q) {
    while (q >= 31) { bw_put32(w, 0xFFFFFFFFu, 31); q -= 31; }
    bw_put32(w, ((1ULL << q) - 1) << 1, (unsigned)q + 1);
}

/* Pads to a byte boundary with ones (unary) or zeros (fixed) and flushes every pending bit. */
static void bw_pad(bw_t *w, int ones) {
    unsigned r = w->nacc & 7;
    if (r) bw_put32(w, ones ? (1ULL << (8 - r)) - 1 : 0, 8 - r);
    while (w->nacc >= 8) {
        w->nacc -= 8;
        if (bw_reserve(w, 1)) return;
        w->b[w->len++] = (uint8_t)(w->acc >> w->nacc);
    }
    w->acc = 0;
}

static void varint(bw_t *w, uint64_t v) {
    while (v >= 0x80) { bw_byte(w, (uint8_t)(v | 0x80)); v >>= 7; }
    bw_byte(w, (uint8_t)v);
}

typedef struct {
    const uint8_t *b;
    size_t nbits, pos;
} br_t;

/* The next 64 bits at bit `pos` (<= nbits, a multiple of 8), MSB-aligned; zeros past the end. */
static inline uint64_t peek_at(const uint8_t *b, size_t nbits, size_t pos) {
    size_t byte = pos >> 3, nb = (nbits >> 3) - byte;
    uint64_t x = 0;
    if (__builtin_expect(nb >= 8, 1)) {
        memcpy(&x, b + byte, 8);
        x = __builtin_bswap64(x);
    } else {
        for (size_t i = 0; i < nb; i++) x |= (uint64_t)b[byte + i] << (56 - 8 * i);
    }
    return x << (pos & 7);
}

static inline uint64_t br_peek(const br_t *r) { /* next bits MSB-aligned; zeros past the end */
    return peek_at(r->b, r->nbits, r->pos);
}

static inline int br_get(br_t *r, unsigned n, uint64_t *v) { /* n <= 64 */
    if (n > r->nbits - r->pos) return -1;
    if (!n) { *v = 0; return 0; }
    if (n > 56) {
        uint64_t hi = 0, lo = 0;
        br_get(r, n - 32, &hi);
        br_get(r, 32, &lo);
        *v = (hi << 32) | lo;
        return 0;
    }
    *v = br_peek(r) >> (64 - n);
    r->pos += n;
    return 0;
}

/* One unary code: ones up to a zero; refuses codes longer than `limit` ones. */
static inline int br_unary(br_t *r, uint64_t limit, uint64_t *q) {
    uint64_t total = 0;
    for (;;) {
        size_t rest = r->nbits - r->pos;
        if (!rest) return -1;
        unsigned avail = 64 - (unsigned)(r->pos & 7);
        if (avail > rest) avail = (unsigned)rest;
        uint64_t x = br_peek(r);
        unsigned ones = (~x) ? (unsigned)__builtin_clzll(~x) : 64;
        if (ones < avail) {
            total += ones;
            r->pos += ones + 1;
            if (total > limit) return -1;
            *q = total;
            return 0;
        }
        total += avail;
        r->pos += avail;
        if (total > limit) return -1;
    }
}

/* Streams end with fewer than 8 padding bits: ones (unary) or zeros (fixed). */
static int br_finish(const br_t *r, int ones) {
    size_t rest = r->nbits - r->pos;
    if (rest >= 8) return -1;
    if (!rest) return 0;
    uint64_t v = br_peek(r) >> (64 - rest);
    return v == (ones ? (1ULL << rest) - 1 : 0) ? 0 : -1;
}

static int rd_varint(const uint8_t *b, size_t len, size_t *p, uint64_t *v) {
    uint64_t x = 0;
    for (int i = 0; i < 9; i++) {
        if (*p >= len) return -1;
        uint8_t c = b[(*p)++];
        x |= (uint64_t)(c & 0x7F) << (7 * i);
        if (!(c & 0x80)) {
            if (x >> 63) return -1;
            *v = x;
            return 0;
        }
    }
    return -1;
}

/* ------------------------------------------------------------------ binary sequences */

/* bw_put32 without the capacity check: only inside a bw_reserve'd span. */
static inline void bw_put32_nc(bw_t *w, uint64_t v, unsigned n) { /* n <= 32 */
    w->acc = (w->acc << n) | (v & ((1ULL << n) - 1));
    w->nacc += n;
    if (w->nacc >= 32) {
        w->nacc -= 32;
        uint32_t x = __builtin_bswap32((uint32_t)(w->acc >> w->nacc));
        memcpy(w->b + w->len, &x, 4);
        w->len += 4;
        w->acc &= (1ULL << w->nacc) - 1;
    }
}

static inline void bw_unary_nc(bw_t *w, uint64_t q) {
    while (q >= 31) { bw_put32_nc(w, 0xFFFFFFFFu, 31); q -= 31; }
    bw_put32_nc(w, ((1ULL << q) - 1) << 1, (unsigned)q + 1);
}

/* BS(n, j): code the j sorted set slots `set` among n (docs/patch-format.md §4); n < 2^32.
 * The streams are reserved up front (unary: at most n/m + c bits; fixed: c * b bits, or n
 * raw bits); q = g / m by a 64-bit reciprocal, exact for g, m < 2^32. */
static int bs_encode(bw_t *u, bw_t *f, const uint32_t *set, uint64_t j, uint64_t n,
                     uint32_t *scratch) {
    if (j == 0 || j == n) return 0;
    int comp = 2 * j > n;
    uint64_t c = comp ? n - j : j, m = golomb_m(n, c);
    if (m == 1) { /* one bit per slot, 32 slots per word */
        if (bw_reserve(f, n / 8 + 16)) return -1;
        uint64_t s = 0;
        for (uint64_t p = 0; p < n; p += 32) {
            unsigned take = n - p < 32 ? (unsigned)(n - p) : 32;
            uint32_t word = 0;
            for (; s < j && set[s] < p + take; s++) word |= 1u << (take - 1 - (set[s] - p));
            bw_put32_nc(f, word, take);
        }
        return 0;
    }
    int b = bitlen64(m - 1);
    uint64_t uu = (1ULL << b) - m, minv = UINT64_MAX / m + 1;
    if (bw_reserve(u, (n / m + c) / 8 + 16) || bw_reserve(f, c * (uint64_t)b / 8 + 16)) return -1;
    int64_t prev = -1;
    if (!comp) { /* the set slots are the minority */
        for (uint64_t i = 0; i < c; i++) {
            uint64_t g = (uint64_t)((int64_t)set[i] - prev - 1);
            prev = (int64_t)set[i];
            uint64_t q = (uint64_t)(((unsigned __int128)g * minv) >> 64);
            bw_unary_nc(u, q);
            scratch[i] = (uint32_t)(g - q * m);
        }
    } else { /* the clear slots: walk the gaps between set ones */
        uint64_t i = 0, s = 0;
        for (uint64_t p = 0; i < c; p++) {
            if (s < j && set[s] == p) { s++; continue; }
            uint64_t g = (uint64_t)((int64_t)p - prev - 1);
            prev = (int64_t)p;
            uint64_t q = (uint64_t)(((unsigned __int128)g * minv) >> 64);
            bw_unary_nc(u, q);
            scratch[i++] = (uint32_t)(g - q * m);
        }
    }
    unsigned w = (unsigned)(b - 1);
    for (uint64_t i = 0; i < c; i++) {
        uint64_t r = scratch[i];
        bw_put32_nc(f, r < uu ? r : (r + uu) >> 1, w);
    }
    for (uint64_t i = 0; i < c; i++) {
        uint64_t r = scratch[i];
        if (r >= uu) bw_put32_nc(f, (r + uu) & 1, 1);
    }
    return 0;
}

/* `cnt` unary codes into out, each at most `limit` ones: every code that ends inside one
 * 64-bit peek is taken from it (a code longer than a peek goes through br_unary). */
static int br_unary_run(br_t *r, uint64_t cnt, uint64_t limit, uint32_t *out) {
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

/* Inverse of bs_encode: writes the j set slots (sorted) into out. scratch holds n/2+1.
 * The truncated-binary pass 1 fields are read at one cursor and the pass-2 bits at another
 * (pass 2 starts exactly c * (b - 1) bits after pass 1). */
static int bs_decode(br_t *u, br_t *f, uint64_t n, uint64_t j, uint32_t *out,
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
        uint64_t r = t;
        if (t >= uu) {
            if (ep >= nbits) return -1;
            r = 2 * t + (peek_at(fb, nbits, ep) >> 63) - uu;
            ep++;
        }
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

/* Exp-Golomb of order eg: the length prefix to the unary stream, the low bits to the fixed. */
static void eg_encode(bw_t *u, bw_t *f, uint64_t x, int eg) {
    uint64_t v = x + (1ULL << eg);
    int len = bitlen64(v);
    bw_unary(u, (uint64_t)(len - 1 - eg));
    bw_put(f, v - (1ULL << (len - 1)), (unsigned)(len - 1));
}

static uint64_t eg_cost(const uint64_t *x, uint64_t count, int eg) {
    uint64_t cost = 0;
    for (uint64_t i = 0; i < count; i++) cost += 2 * (uint64_t)bitlen64(x[i] + (1ULL << eg)) - 1 - eg;
    return cost;
}

static int best_order(const uint64_t *x, uint64_t count, int bits) {
    int best = 0, top = bits < 63 ? bits : 63;
    uint64_t cost = eg_cost(x, count, 0);
    for (int e = 1; e < top; e++) {
        uint64_t c = eg_cost(x, count, e);
        if (c >= cost) break;
        best = e;
        cost = c;
    }
    return best;
}

/* ------------------------------------------------------------------ encoder */

typedef struct {
    uint32_t *pos;  /* relative position */
    uint32_t *rank; /* rank inside its context */
    uint8_t *ctx;
    uint64_t *oldv, *newv;
    int64_t k, cap;
} recs_t;

static int recs_grow(recs_t *r) {
    int64_t cap = r->cap ? 2 * r->cap : 1024;
    void *a = realloc(r->pos, cap * 4), *b = a ? realloc(r->rank, cap * 4) : NULL;
    if (a) r->pos = a;
    if (b) r->rank = b;
    void *c = b ? realloc(r->ctx, cap) : NULL;
    if (c) r->ctx = c;
    void *d = c ? realloc(r->oldv, cap * 8) : NULL;
    if (d) r->oldv = d;
    void *e = d ? realloc(r->newv, cap * 8) : NULL;
    if (e) r->newv = e;
    if (!e) return -1;
    r->cap = cap;
    return 0;
}

static void recs_free(recs_t *r) {
    free(r->pos); free(r->rank); free(r->ctx); free(r->oldv); free(r->newv);
}

/* Code the records (position order) of one chunk whose context sizes are ncnt. */
static int code_chunk(const rp_kind *kd, int64_t n, const uint64_t *ncnt, const recs_t *r,
                      uint8_t **out, size_t *outlen, const char **err) {
    int rc = RP_OK;
    int64_t k = r->k;
    uint64_t kc[NCTX] = {0}, bc[NCTX] = {0}, first[NCTX];
    int egc[NCTX] = {0};
    uint32_t *order = NULL, *buf = NULL, *scratch = NULL;
    uint64_t *mag = NULL, *tails = NULL;
    uint8_t *outw = NULL;
    bw_t pw = {0}, uw = {0}, fw = {0}, ow = {0};
    *out = NULL;
    *outlen = 0;
    if (k == 0) return RP_OK;
    order = malloc(k * 4);
    buf = malloc(k * 4);
    scratch = malloc((k + 1) * 4); /* a minority is never larger than k */
    mag = malloc(k * 8);
    tails = malloc(k * 8);
    outw = malloc(k);
    if (!order || !buf || !scratch || !mag || !tails || !outw) FAIL(RP_ENOMEM, "out of memory");
    uint64_t s = ksign(kd->bits), msk = kmask(kd->bits), k_s = 0;
    for (int64_t i = 0; i < k; i++) {
        kc[r->ctx[i]]++;
        uint64_t d = (to_key(kd, r->newv[i]) - to_key(kd, r->oldv[i])) & msk;
        int positive = d < s;
        mag[i] = positive ? d : (0 - d) & msk;
        int neg = kd->order != RP_UNSIGNED && (r->oldv[i] & s);
        outw[i] = (uint8_t)(positive ^ neg);
        k_s += outw[i];
    }
    uint64_t acc = 0; /* stable counting sort of the records by context */
    for (int c = 0; c < NCTX; c++) { first[c] = acc; acc += kc[c]; }
    {
        uint64_t fill[NCTX];
        memcpy(fill, first, sizeof fill);
        for (int64_t i = 0; i < k; i++) order[fill[r->ctx[i]]++] = (uint32_t)i;
    }
    for (int c = 0; c < NCTX; c++) {
        uint64_t nt = 0;
        for (uint64_t i = first[c]; i < first[c] + kc[c]; i++) { /* no branch per record */
            uint64_t mg = mag[order[i]];
            tails[first[c] + nt] = mg - 2;
            nt += mg > 1;
        }
        bc[c] = nt;
        egc[c] = best_order(tails + first[c], nt, kd->bits);
    }
    int g = 0;
    for (int c = 0; c < NCTX; c++) g += kc[c] > 0;
    varint(&pw, (uint64_t)g);
    for (int c = 0; c < NCTX; c++) {
        if (!kc[c]) continue;
        varint(&pw, (uint64_t)c);
        varint(&pw, ncnt[c]);
        varint(&pw, kc[c]);
        varint(&pw, bc[c]);
        varint(&pw, (uint64_t)egc[c]);
    }
    varint(&pw, k_s);
    for (int c = 0; c < NCTX; c++) { /* (1) changed ranks per context */
        if (!kc[c]) continue;
        for (uint64_t i = 0; i < kc[c]; i++) buf[i] = r->rank[order[first[c] + i]];
        bs_encode(&uw, &fw, buf, kc[c], ncnt[c], scratch);
    }
    {   /* (2) outward flags over all changes in position order */
        uint64_t j = 0;
        for (int64_t i = 0; i < k; i++) { buf[j] = (uint32_t)i; j += outw[i]; }
        bs_encode(&uw, &fw, buf, j, (uint64_t)k, scratch);
    }
    for (int c = 0; c < NCTX; c++) { /* (3) which have |step| > 1, per context */
        if (!kc[c]) continue;
        uint64_t j = 0;
        for (uint64_t i = 0; i < kc[c]; i++) {
            buf[j] = (uint32_t)i;
            j += mag[order[first[c] + i]] > 1;
        }
        bs_encode(&uw, &fw, buf, j, kc[c], scratch);
    }
    for (int c = 0; c < NCTX; c++) /* (4) their magnitudes */
        for (uint64_t i = 0; i < bc[c]; i++) eg_encode(&uw, &fw, tails[first[c] + i], egc[c]);
    bw_pad(&uw, 1);
    bw_pad(&fw, 0);
    varint(&ow, pw.len);
    bw_bytes(&ow, pw.b, pw.len);
    varint(&ow, uw.len);
    bw_bytes(&ow, uw.b, uw.len);
    bw_bytes(&ow, fw.b, fw.len);
    if (pw.oom || uw.oom || fw.oom || ow.oom) FAIL(RP_ENOMEM, "out of memory");
    *out = ow.b;
    *outlen = ow.len;
    ow.b = NULL;
done:
    free(order); free(buf); free(scratch); free(mag); free(tails); free(outw);
    free(pw.b); free(uw.b); free(fw.b); free(ow.b);
    return rc;
}


static inline void block_ctx(const rp_kind *kd, const uint8_t *base, int64_t s, int len,
                             uint8_t *cb) {
    const unsigned sh = (unsigned)kd->shift, mk = (1u << kd->cbits) - 1;
    if (kd->bits == 16) {
        const uint16_t *p = (const uint16_t *)base + s;
        for (int i = 0; i < len; i++) cb[i] = (uint8_t)((p[i] >> sh) & mk);
    } else if (kd->bits == 8) {
        const uint8_t *p = base + s;
        for (int i = 0; i < len; i++) cb[i] = (uint8_t)((p[i] >> sh) & mk);
    } else if (kd->bits == 4 && !(s & 1)) { /* two codes per byte, low nibble first */
        const uint8_t *p = base + (s >> 1);
        int h = len >> 1;
        for (int i = 0; i < h; i++) {
            cb[2 * i] = (uint8_t)((p[i] >> sh) & mk);
            cb[2 * i + 1] = (uint8_t)((p[i] >> (4 + sh)) & mk);
        }
        if (len & 1) cb[len - 1] = (uint8_t)((p[h] >> sh) & mk);
    } else {
        for (int i = 0; i < len; i++) cb[i] = (uint8_t)ctx_of(kd, elem_get(base, kd->bits, s + i));
    }
}




/* Running context counts with four interleaved tables (no store-to-load chains); the rank of
 * element i is the sum of the four tables' counts before it. */
#define COUNT_LOOP(GET)                                                                     \
    do {                                                                                    \
        int64_t i = 0;                                                                      \
        for (; i + 4 <= n; i += 4) {                                                        \
            for (int l = 0; l < 4; l++) {                                                   \
                uint64_t x = GET(i + l);                                                    \
                unsigned c = ctx_of(kd, x);                                                 \
                if (__builtin_expect(ISCHANGED(i + l, x), 0)) {                             \
                    RECORD(i + l, c, x);                                                    \
                }                                                                           \
                t[l][c]++;                                                                  \
            }                                                                               \
        }                                                                                   \
        for (; i < n; i++) {                                                                \
            uint64_t x = GET(i);                                                            \
            unsigned c = ctx_of(kd, x);                                                     \
            if (ISCHANGED(i, x)) { RECORD(i, c, x); }                                       \
            t[0][c]++;                                                                      \
        }                                                                                   \
    } while (0)

#define RANK(c) (t[0][c] + t[1][c] + t[2][c] + t[3][c])

int rp_encode_chunk_sparse(const rp_kind *kd, const uint8_t *base, int64_t start, int64_t n,
                           const int64_t *pos, const uint64_t *oldv, const uint64_t *newv,
                           int64_t count, uint8_t **out, size_t *outlen, const char **err) {
    int rc = RP_OK;
    recs_t r = {0};
    uint32_t (*t)[NCTX] = calloc(4, sizeof *t);
    uint64_t ncnt[NCTX];
    int64_t j = 0;
    *out = NULL;
    *outlen = 0;
    if (!t) FAIL(RP_ENOMEM, "out of memory");
    if (!kind_ok(kd) || n < 0 || n > RP_CHUNK || count < 0 || count > n)
        FAIL(RP_EARG, "bad kind, chunk size or count");
    for (int64_t i = 0; i < count; i++)
        if (pos[i] < 0 || pos[i] >= n || (i && pos[i] <= pos[i - 1]))
            FAIL(RP_EARG, "positions must be strictly increasing inside the chunk");
#define RECORD(i, c, x)                                                                     \
    do {                                                                                    \
        if (r.k == r.cap && recs_grow(&r)) FAIL(RP_ENOMEM, "out of memory");                \
        if (oldv[j] != (x) || newv[j] == (x)) FAIL(RP_EARG, "old elements differ from base"); \
        r.pos[r.k] = (uint32_t)(i); r.rank[r.k] = RANK(c); r.ctx[r.k] = (uint8_t)(c);       \
        r.oldv[r.k] = (x); r.newv[r.k] = newv[j]; r.k++; j++;                               \
    } while (0)
#define ISCHANGED(i, x) (j < count && pos[j] == (i))
    if (kd->bits == 16) {
        const uint16_t *a = (const uint16_t *)base + start;
#define GET(i) ((uint64_t)a[i])
        COUNT_LOOP(GET);
#undef GET
    } else if (kd->bits == 8) {
        const uint8_t *a = base + start;
#define GET(i) ((uint64_t)a[i])
        COUNT_LOOP(GET);
#undef GET
    } else {
#define GET(i) elem_get(base, kd->bits, start + (i))
        COUNT_LOOP(GET);
#undef GET
    }
#undef RECORD
#undef ISCHANGED
    for (int c = 0; c < NCTX; c++) ncnt[c] = RANK(c);
    rc = code_chunk(kd, n, ncnt, &r, out, outlen, err);
done:
    free(t);
    recs_free(&r);
    return rc;
}

int rp_encode_records(const rp_kind *kd, int64_t n, const uint64_t *ncnt, const int64_t *pos,
                      const uint8_t *ctx, const uint32_t *rank, const uint64_t *oldv,
                      const uint64_t *newv, int64_t count, uint8_t **out, size_t *outlen,
                      const char **err) {
    int rc = RP_OK;
    recs_t r = {0};
    uint64_t total = 0;
    int64_t last[NCTX];
    int ncontexts = kd->cbits ? 1 << kd->cbits : 1;
    *out = NULL;
    *outlen = 0;
    if (!kind_ok(kd) || n < 0 || n > RP_CHUNK || count < 0 || count > n)
        FAIL(RP_EARG, "bad kind, chunk size or count");
    for (int c = 0; c < NCTX; c++) {
        if (c >= ncontexts && ncnt[c]) FAIL(RP_EARG, "context sizes beyond the kind's contexts");
        total += ncnt[c];
        last[c] = -1;
    }
    if (total != (uint64_t)n) FAIL(RP_EARG, "context sizes do not add up to the chunk");
    r.pos = malloc(count * 4 + 4); r.rank = malloc(count * 4 + 4); r.ctx = malloc(count + 1);
    r.oldv = malloc(count * 8 + 8); r.newv = malloc(count * 8 + 8);
    if (!r.pos || !r.rank || !r.ctx || !r.oldv || !r.newv) FAIL(RP_ENOMEM, "out of memory");
    for (int64_t i = 0; i < count; i++) {
        unsigned c = ctx[i];
        if (pos[i] < 0 || pos[i] >= n || (i && pos[i] <= pos[i - 1]) || c >= (unsigned)ncontexts
            || rank[i] >= ncnt[c] || (int64_t)rank[i] <= last[c] || oldv[i] == newv[i]
            || ((oldv[i] | newv[i]) & ~kmask(kd->bits)))
            FAIL(RP_EARG, "records are not sorted, in range and consistent");
        last[c] = rank[i];
        r.pos[i] = (uint32_t)pos[i]; r.rank[i] = rank[i]; r.ctx[i] = (uint8_t)c;
        r.oldv[i] = oldv[i]; r.newv[i] = newv[i];
    }
    r.k = r.cap = count;
    rc = code_chunk(kd, n, ncnt, &r, out, outlen, err);
done:
    recs_free(&r);
    return rc;
}

/* ------------------------------------------------------------------ rp.sum128 terms */

static const uint64_t SUM_K[2] = {0x9E3779B97F4A7C15ULL, 0xC2B2AE3D27D4EB4FULL};
static const uint64_t SUM_S[2] = {0x243F6A8885A308D3ULL, 0x13198A2E03707344ULL};

static inline uint64_t rotl(uint64_t w, int r) { return (w << r) | (w >> (64 - r)); }

static inline uint64_t sum_term(int lane, uint64_t w, uint64_t j) {
    uint64_t x = w ^ (SUM_S[lane] + j * SUM_K[lane]);
    return (x & 0xFFFFFFFFu) * (x >> 32) + rotl(w, lane ? 17 : 32);
}

static inline uint64_t word_at(const uint8_t *d, size_t len, uint64_t j) {
    uint64_t w = 0;
    size_t o = (size_t)j * 8;
    if (o + 8 <= len) memcpy(&w, d + o, 8);
    else if (o < len) memcpy(&w, d + o, len - o);
    return w;
}

/* ------------------------------------------------------------------ decoder */

typedef struct {
    int g;
    uint8_t cid[NCTX];
    uint64_t nc[NCTX], kc[NCTX], bc[NCTX];
    int eg[NCTX];
    uint64_t ks, k;
    size_t ustart, ulen, fstart, end;
} params_t;

static int parse_params(const rp_kind *kd, const uint8_t *b, size_t len, int64_t n,
                        params_t *pp, const char **err) {
    size_t p = 0, pend;
    uint64_t plen, v, ulen;
    int ncontexts = kd->cbits ? 1 << kd->cbits : 1;
    if (rd_varint(b, len, &p, &plen) || plen > len - p) { *err = "params overrun the chunk"; return RP_ECORRUPT; }
    pend = p + plen;
    if (rd_varint(b, pend, &p, &v) || v < 1 || v > (uint64_t)ncontexts) { *err = "invalid context count"; return RP_ECORRUPT; }
    pp->g = (int)v;
    uint64_t sum_n = 0, sum_k = 0;
    int prev = -1;
    for (int i = 0; i < pp->g; i++) {
        uint64_t c, nc, kc, bc, eg;
        if (rd_varint(b, pend, &p, &c) || rd_varint(b, pend, &p, &nc) || rd_varint(b, pend, &p, &kc)
            || rd_varint(b, pend, &p, &bc) || rd_varint(b, pend, &p, &eg)) { *err = "truncated params"; return RP_ECORRUPT; }
        if ((int64_t)c <= prev || c >= (uint64_t)ncontexts || nc > (uint64_t)n || kc < 1 || kc > nc
            || bc > kc || eg > 63 || eg >= (uint64_t)(kd->bits < 63 ? kd->bits : 63)) {
            *err = "invalid context parameters"; return RP_ECORRUPT;
        }
        prev = (int)c;
        pp->cid[i] = (uint8_t)c;
        pp->nc[i] = nc; pp->kc[i] = kc; pp->bc[i] = bc; pp->eg[i] = (int)eg;
        sum_n += nc;
        sum_k += kc;
    }
    if (sum_n > (uint64_t)n || (!kd->cbits && sum_n != (uint64_t)n)) { *err = "context sizes exceed the chunk"; return RP_ECORRUPT; }
    if (rd_varint(b, pend, &p, &pp->ks) || pp->ks > sum_k) { *err = "invalid outward count"; return RP_ECORRUPT; }
    if (p != pend) { *err = "extra params"; return RP_ECORRUPT; }
    if (rd_varint(b, len, &p, &ulen) || ulen > len - p) { *err = "unary stream overruns the chunk"; return RP_ECORRUPT; }
    pp->k = sum_k;
    pp->ustart = p;
    pp->ulen = ulen;
    pp->fstart = p + ulen;
    pp->end = len;
    return RP_OK;
}

int rp_chunk_count(const rp_kind *kd, const uint8_t *body, size_t len, int64_t n,
                   int64_t *count, const char **err) {
    params_t pp;
    *count = 0;
    if (!kind_ok(kd) || n < 0 || n > RP_CHUNK) { *err = "bad kind or chunk size"; return RP_EARG; }
    if (len == 0) return RP_OK;
    int rc = parse_params(kd, body, len, n, &pp, err);
    if (rc == RP_OK) *count = (int64_t)pp.k;
    return rc;
}

typedef struct {
    params_t pp;
    br_t u, f;
    uint32_t *ranks;     /* per listed context, concatenated: index = context-order index */
    uint32_t *scratch;
    uint32_t *idx;
    uint8_t *outw;       /* outward flag of each change, position order */
    void *magc;          /* |step| of each change, context order (mw bytes each: a <= 2^(bits-1)) */
    int mw;
    uint64_t ofs[NCTX];  /* start of each listed context's ranks */
    uint32_t cnt[NCTX], tgt[NCTX];
    uint64_t cur[NCTX], endr[NCTX];
    int64_t emitted, done;
    uint32_t *rpos;      /* found changes: position (chunk-relative), old element, context-order index */
    uint64_t *rold;
    uint32_t *rci;
    /* outputs, and the in-place write (wdata = the base, or NULL) with its rp.sum128 change */
    int64_t *pos_out;
    void *old_out, *new_out;
    int ow;
    uint8_t *wdata;
    size_t wlen;
    uint64_t cj, before, d0, d1;
    uint64_t cap;        /* k the buffers above have room for (reused across chunks) */
    int hash;            /* sum the words as read (before any write) into h0, h1 */
    int64_t hashed;      /* elements [0, hashed) of the chunk are summed */
    uint64_t h0, h1;
} lane_t;

static void lane_free(lane_t *l) {
    free(l->ranks); free(l->scratch); free(l->idx); free(l->outw); free(l->magc);
    free(l->rpos); free(l->rold); free(l->rci);
    l->ranks = l->scratch = l->idx = l->rpos = l->rci = NULL;
    l->outw = NULL; l->magc = NULL; l->rold = NULL;
    l->cap = 0;
}

/* Room for k changes; a lane decoding chunk after chunk keeps its buffers (no fresh pages
 * per chunk). */
static int lane_reserve(lane_t *l, uint64_t k, int mw) {
    if (l->cap >= k && l->mw == mw && l->ranks) return 0;
    lane_free(l);
    uint64_t c = k + k / 4 + 64;
    l->mw = mw;
    l->ranks = malloc(c * 4 + 4);
    l->scratch = malloc((c + 1) * 4); /* a minority is never larger than k */
    l->idx = malloc(c * 4 + 4);
    l->outw = malloc(c + 1);
    l->magc = malloc(c * (uint64_t)mw + 8);
    l->rpos = malloc(c * 4 + 4);
    l->rold = malloc(c * 8 + 8);
    l->rci = malloc(c * 4 + 4);
    if (!l->ranks || !l->scratch || !l->idx || !l->outw || !l->magc || !l->rpos || !l->rold || !l->rci) {
        lane_free(l);
        return -1;
    }
    l->cap = c;
    return 0;
}

/* Phase A, everything the base is not needed for: params, the changed ranks of every listed
 * context, the outward flags, and every magnitude (in context order); the streams must end
 * exactly there. */
static int lane_init(const rp_kind *kd, lane_t *l, const uint8_t *b, size_t len, int64_t n,
                     int64_t expect, const char **err) {
    int rc = parse_params(kd, b, len, n, &l->pp, err);
    if (rc) return rc;
    if ((int64_t)l->pp.k != expect) { *err = "chunk count differs from its table"; return RP_ECORRUPT; }
    uint64_t k = l->pp.k;
    if (lane_reserve(l, k, kd->bits <= 16 ? 2 : kd->bits <= 32 ? 4 : 8)) {
        *err = "out of memory"; return RP_ENOMEM;
    }
    memset(l->outw, 0, k + 1);
    l->u = (br_t){b + l->pp.ustart, l->pp.ulen * 8, 0};
    l->f = (br_t){b + l->pp.fstart, (l->pp.end - l->pp.fstart) * 8, 0};
    for (int c = 0; c < NCTX; c++) l->tgt[c] = UINT32_MAX;
    memset(l->cnt, 0, sizeof l->cnt);
    uint64_t o = 0;
    for (int i = 0; i < l->pp.g; i++) {
        int c = l->pp.cid[i];
        if (bs_decode(&l->u, &l->f, l->pp.nc[i], l->pp.kc[i], l->ranks + o, l->scratch)) {
            *err = "corrupt position stream"; return RP_ECORRUPT;
        }
        l->ofs[i] = o;
        l->cur[c] = o;
        l->endr[c] = o + l->pp.kc[i];
        l->tgt[c] = l->ranks[o];
        o += l->pp.kc[i];
    }
    if (bs_decode(&l->u, &l->f, k, l->pp.ks, l->idx, l->scratch)) { *err = "corrupt sign stream"; return RP_ECORRUPT; }
    for (uint64_t i = 0; i < l->pp.ks; i++) l->outw[l->idx[i]] = 1;
    if (l->mw == 2) for (uint64_t i = 0; i < k; i++) ((uint16_t *)l->magc)[i] = 1;
    else for (uint64_t i = 0; i < k; i++) arr_put(l->magc, l->mw, (int64_t)i, 1);
    uint64_t bo[NCTX], nb = 0;
    for (int i = 0; i < l->pp.g; i++) {
        if (bs_decode(&l->u, &l->f, l->pp.kc[i], l->pp.bc[i], l->idx + nb, l->scratch)) {
            *err = "corrupt magnitude flags"; return RP_ECORRUPT;
        }
        bo[i] = nb;
        nb += l->pp.bc[i];
    }
    uint64_t s = ksign(kd->bits);
    int width = kd->bits < 63 ? kd->bits : 63;
    for (int i = 0; i < l->pp.g; i++) {
        int eg = l->pp.eg[i];
        for (uint64_t j = 0; j < l->pp.bc[i]; j++) {
            uint64_t q, low;
            if (br_unary(&l->u, 64, &q) || q + eg > (uint64_t)width
                || br_get(&l->f, (unsigned)(q + eg), &low)) {
                *err = "corrupt magnitude stream"; return RP_ECORRUPT;
            }
            uint64_t w = q + eg;
            uint64_t a = ((w >= 64 ? 0 : (1ULL << w)) + low - (1ULL << eg)) + 2;
            if (a > s || a < 2) { *err = "delta magnitude beyond the word range"; return RP_ECORRUPT; }
            arr_put(l->magc, l->mw, (int64_t)(l->ofs[i] + l->idx[bo[i] + j]), a);
        }
    }
    if (br_finish(&l->u, 1) || br_finish(&l->f, 0)) { *err = "unused bits after the last code"; return RP_ECORRUPT; }
    l->emitted = l->done = 0;
    l->cj = UINT64_MAX;
    l->d0 = l->d1 = 0;
    return RP_OK;
}

static void lane_hash_to(const rp_kind *kd, lane_t *l, int64_t start, int64_t upto);

/* The rp.sum128 change of the word being written (read before its first write). */
static inline void lane_flush(lane_t *l) {
    if (l->cj == UINT64_MAX) return;
    uint64_t after = word_at(l->wdata, l->wlen, l->cj);
    l->d0 += sum_term(0, after, l->cj) - sum_term(0, l->before, l->cj);
    l->d1 += sum_term(1, after, l->cj) - sum_term(1, l->before, l->cj);
    l->cj = UINT64_MAX;
}

/* Phase B's output, the changes found since the last call, [done, emitted), in position
 * order: new elements from the outward flags and the magnitudes (by context-order index) into
 * the outputs and, when writing, into the base: the join calls this every few blocks, while
 * those words are still in cache. Typed loops for the common kinds. */
#define FIN_TYPED(T, LOG, MT)                                                               \
    do {                                                                                    \
        T *d = (T *)l->wdata, *po = (T *)l->old_out, *pn = (T *)l->new_out;                 \
        const MT *mg = (const MT *)l->magc;                                                 \
        const uint32_t *rpos = l->rpos, *rci = l->rci;                                      \
        const uint64_t *rold = l->rold;                                                     \
        const uint8_t *outw = l->outw;                                                      \
        int64_t *pout = l->pos_out;                                                         \
        const int64_t e_ = l->emitted;                                                      \
        uint64_t cj = l->cj, before = l->before, d0 = l->d0, d1 = l->d1;                    \
        const uint64_t nfull = l->wlen / 8;                                                 \
        /* the word being written is kept in a register (`after`): no reload of a word     \
         * just stored into (a store-forwarding stall) */                                   \
        uint64_t after = before;                                                            \
        if (d && cj != UINT64_MAX) {                                                        \
            if (cj < nfull) memcpy(&after, l->wdata + 8 * cj, 8);                           \
            else after = word_at(l->wdata, l->wlen, cj);                                    \
        }                                                                                   \
        for (int64_t i = l->done; i < e_; i++) {                                            \
            __builtin_prefetch(mg + rci[i + 16 < e_ ? i + 16 : i]);                         \
            int64_t p = start + rpos[i];                                                    \
            uint64_t x = rold[i];                                                           \
            int neg = kd->order != RP_UNSIGNED && (x & s);                                  \
            uint64_t key = to_key(kd, x), a = mg[rci[i]];                                   \
            uint64_t sg = 0 - (uint64_t)!(outw[i] ^ (uint8_t)neg); /* 0: +a, ~0: -a */      \
            T y = (T)from_key(kd, (key + ((a ^ sg) - sg)) & msk);                           \
            pout[i] = p;                                                                    \
            po[i] = (T)x;                                                                   \
            pn[i] = y;                                                                      \
            if (d) {                                                                        \
                uint64_t j = (uint64_t)p >> (3 - LOG);                                      \
                if (j != cj) {                                                              \
                    if (cj != UINT64_MAX) {                                                 \
                        d0 += sum_term(0, after, cj) - sum_term(0, before, cj);             \
                        d1 += sum_term(1, after, cj) - sum_term(1, before, cj);             \
                    }                                                                       \
                    cj = j;                                                                 \
                    if (j < nfull) memcpy(&before, l->wdata + 8 * j, 8);                    \
                    else before = word_at(l->wdata, l->wlen, j);                            \
                    after = before;                                                         \
                }                                                                           \
                unsigned sh_ = (unsigned)(p & ((8 >> LOG) - 1)) << (LOG + 3);               \
                after = (after & ~((uint64_t)(T)~(T)0 << sh_)) | ((uint64_t)y << sh_);      \
                d[p] = y;                                                                   \
            }                                                                               \
        }                                                                                   \
        l->cj = cj; l->before = before; l->d0 = d0; l->d1 = d1;                             \
    } while (0)

static void finalize(const rp_kind *kd, lane_t *l, int64_t start) {
    uint64_t s = ksign(kd->bits), msk = kmask(kd->bits);
    if (kd->bits == 16 && l->ow == 2) {
        FIN_TYPED(uint16_t, 1, uint16_t);
    } else if (kd->bits == 8 && l->ow == 1) {
        FIN_TYPED(uint8_t, 0, uint16_t);
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
                if (j != l->cj) {
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
#undef FIN_TYPED

/* Phase B, the join: blocks of JB elements; each block's contexts are computed once into an
 * L1 buffer from the base; every listed context inside the densest window of W consecutive
 * contexts is counted per block with byte compares (no branch per element or per vector), and
 * only a block where a context reaches its next changed rank is scanned again for that
 * context to find the positions. Listed contexts outside the window (rare: a window of 16
 * holds every context of 8-bit and 4-bit kinds, and >99.9% of BF16 weights) go through a
 * table, element by element. Found positions are collected from a bitmap in order. */
#define WIN 16
#define JB 256

static int pick_window(const lane_t *l) {
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

#define JOIN_BODY(COUNTS, EQ32, OUT32)                                                      \
    uint8_t cbuf[JB] __attribute__((aligned(32)));                                          \
    uint8_t listed[NCTX];                                                                   \
    int vc[WIN], nvc = 0, outside = 0;                                                      \
    uint32_t cnt[WIN], tgt[WIN], bcs[WIN];                                                  \
    uint8_t vcb[WIN];                                                                       \
    uint64_t cur[WIN], endr[WIN];                                                           \
    int lo = pick_window(l);                                                                \
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
                __builtin_prefetch((const uint8_t *)l->magc + (cu + 32) * (uint64_t)l->mw); \
                g = ++cu < endr[t] ? l->ranks[cu] : UINT32_MAX;                             \
            }                                                                               \
            tgt[t] = g;                                                                     \
            cur[t] = cu;                                                                    \
        }                                                                                   \
        for (int t = 0; t < nvc; t++) cnt[t] += bcs[t];                                     \
        if (__builtin_expect(outside, 0)) {                                                 \
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
        for (int w = 0; w < JB / 64; w++) { /* in position order, old words still in L1 */  \
            uint64_t x = bb[w];                                                             \
            while (x) {                                                                     \
                int e = 64 * w + __builtin_ctzll(x);                                        \
                x &= x - 1;                                                                 \
                if ((uint64_t)l->emitted >= l->pp.k) break; /* refused in phase C */        \
                l->rpos[l->emitted] = (uint32_t)(b0 + e);                                   \
                l->rold[l->emitted] = elem_get(base, kd->bits, start + b0 + e);             \
                l->rci[l->emitted++] = bci[e];                                              \
            }                                                                               \
        }                                                                                   \
        if ((b0 & (16 * JB - 1)) == 15 * JB) {                                              \
            if (l->hash) lane_hash_to(kd, l, start, b0 + len);                              \
            finalize(kd, l, start);                                                         \
        }                                                                                   \
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

static inline uint32_t blkcnt_scalar(const uint8_t *p, int c) {
    uint32_t k = 0;
    for (int i = 0; i < JB; i++) k += p[i] == c;
    return k;
}

static inline uint32_t eq32_scalar(const uint8_t *p, int c) {
    uint32_t m = 0;
    for (int i = 0; i < 32; i++) m |= (uint32_t)(p[i] == c) << i;
    return m;
}

static inline uint32_t out32_scalar(const uint8_t *p, int lo) {
    uint32_t m = 0;
    for (int i = 0; i < 32; i++) m |= (uint32_t)((unsigned)(p[i] - lo) >= WIN) << i;
    return m;
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
    JOIN_BODY(counts_scalar, eq32_scalar, out32_scalar)
}
#undef SELECT64
#undef BLOCKCTX

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx2"))) static inline uint32_t blkcnt_avx2(const uint8_t *p, int c) {
    __m256i cc = _mm256_set1_epi8((char)c), acc = _mm256_setzero_si256();
    for (int v = 0; v < JB / 32; v++) /* each byte lane counts at most JB/32 < 256 */
        acc = _mm256_sub_epi8(acc, _mm256_cmpeq_epi8(_mm256_load_si256((const __m256i *)(p + 32 * v)), cc));
    __m256i s = _mm256_sad_epu8(acc, _mm256_setzero_si256());
    __m128i h = _mm_add_epi64(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    return (uint32_t)(_mm_cvtsi128_si64(h) + _mm_extract_epi64(h, 1));
}

__attribute__((target("avx2"))) static inline uint32_t eq32_avx2(const uint8_t *p, int c) {
    __m256i v = _mm256_load_si256((const __m256i *)p);
    return (uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(v, _mm256_set1_epi8((char)c)));
}

__attribute__((target("avx2"))) static inline uint32_t out32_avx2(const uint8_t *p, int lo) {
    __m256i v = _mm256_sub_epi8(_mm256_load_si256((const __m256i *)p), _mm256_set1_epi8((char)lo));
    __m256i top = _mm256_set1_epi8(WIN - 1);
    __m256i in = _mm256_cmpeq_epi8(_mm256_max_epu8(v, top), top);
    return ~(uint32_t)_mm256_movemask_epi8(in);
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

/* block_ctx for 16-bit kinds, JB elements (the base may end mid-block: the caller pads) */
__attribute__((target("avx2"))) static inline void block_ctx16_avx2(const uint16_t *p, int len,
                                                                     int sh, int mk,
                                                                     uint8_t *cb) {
    if (len < JB) {
        for (int i = 0; i < len; i++) cb[i] = (uint8_t)((p[i] >> sh) & mk);
        return;
    }
    __m128i shc = _mm_cvtsi32_si128(sh);
    __m256i m = _mm256_set1_epi16((short)mk);
    for (int i = 0; i < JB; i += 32) {
        __m256i a = _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)(p + i)), shc), m);
        __m256i b = _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)(p + i + 16)), shc), m);
        __m256i x = _mm256_permute4x64_epi64(_mm256_packus_epi16(a, b), 0xD8);
        _mm256_store_si256((__m256i *)(cb + i), x);
    }
}

#define BLOCKCTX16(KD, BASE, S, LEN, CB)                                                    \
    do {                                                                                    \
        if ((KD)->bits == 16)                                                               \
            block_ctx16_avx2((const uint16_t *)(BASE) + (S), (LEN), (KD)->shift,            \
                             (1 << (KD)->cbits) - 1, (CB));                                 \
        else                                                                                \
            block_ctx((KD), (BASE), (S), (LEN), (CB));                                      \
    } while (0)

__attribute__((target("avx2"))) static void join_avx2(const rp_kind *kd, const uint8_t *base,
                                                       lane_t *l, int64_t start, int64_t n) {
#define BLOCKCTX BLOCKCTX16
#define SELECT64 select64_loop
    JOIN_BODY(counts_avx2, eq32_avx2, out32_avx2)
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
    JOIN_BODY(counts_avx2, eq32_avx2, out32_avx2)
#undef SELECT64
#undef BLOCKCTX
}
#endif

static void join_lane(const rp_kind *kd, const uint8_t *base, lane_t *l, int64_t start,
                      int64_t n) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (__builtin_cpu_supports("avx2")) {
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

#define ENC_BODY(BLKCNT, EQ32, COLD32, BLOCKCTX, CHANGED)                                  \
    uint8_t cbuf[JB] __attribute__((aligned(32)));                                          \
    uint32_t rk[JB];                                                                        \
    uint64_t dm[JB / 64];                                                                   \
    uint8_t hot[WIN];                                                                       \
    uint32_t cnt[WIN], bcs[WIN];                                                            \
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
                cnt[nvc] = 0;                                                               \
                vc[nvc++] = c;                                                              \
            }                                                                               \
    }                                                                                       \
    uint8_t pad = (uint8_t)(lo + WIN < NCTX ? lo + WIN : lo - 1); /* in no window */       \
    int64_t cw = -1; /* the last word whose sum change is counted */                        \
    for (int64_t b0 = 0; b0 < n; b0 += JB) {                                                \
        int len = n - b0 < JB ? (int)(n - b0) : JB;                                         \
        BLOCKCTX(kd, old, start + b0, len, cbuf);                                           \
        if (len < JB) memset(cbuf + len, pad, (size_t)(JB - len));                          \
        CHANGED(kd, old, new_, start + b0, len, dm);                                        \
        for (int t = 0; t < nvc; t++) bcs[t] = BLKCNT(cbuf, vc[t]);                         \
        for (int v = 0; v * 32 < len; v++) { /* cold elements: ranks through the table */   \
            uint32_t m = COLD32(cbuf + 32 * v, lo, hot);                                    \
            if (len - 32 * v < 32) m &= (1u << (len - 32 * v)) - 1;                         \
            while (m) {                                                                     \
                int i = 32 * v + __builtin_ctz(m);                                          \
                m &= m - 1;                                                                 \
                rk[i] = tab[cbuf[i]]++;                                                     \
            }                                                                               \
        }                                                                                   \
        for (int v = 0; v < JB / 64; v++) {                                                 \
            uint64_t ch = dm[v];                                                            \
            while (ch) {                                                                    \
                int i = 64 * v + __builtin_ctzll(ch);                                       \
                ch &= ch - 1;                                                               \
                unsigned c = cbuf[i];                                                       \
                uint32_t rank;                                                              \
                int t = slot[c];                                                            \
                if (t >= 0) {                                                               \
                    rank = cnt[t];                                                          \
                    for (int u = 0; u <= v; u++) {                                          \
                        uint64_t e = (uint64_t)EQ32(cbuf + 64 * u, (int)c)                  \
                                     | (uint64_t)EQ32(cbuf + 64 * u + 32, (int)c) << 32;    \
                        if (u == v) e &= (1ULL << (i & 63)) - 1;                            \
                        rank += (uint32_t)__builtin_popcountll(e);                          \
                    }                                                                       \
                } else {                                                                    \
                    rank = rk[i];                                                           \
                }                                                                           \
                if (r->k == r->cap && recs_grow(r)) return -1;                              \
                uint64_t x = elem_get(old, kd->bits, start + b0 + i);                       \
                uint64_t y = elem_get(new_, kd->bits, start + b0 + i);                      \
                r->pos[r->k] = (uint32_t)(b0 + i);                                          \
                r->rank[r->k] = rank;                                                       \
                r->ctx[r->k] = (uint8_t)c;                                                  \
                r->oldv[r->k] = x;                                                          \
                r->newv[r->k] = y;                                                          \
                r->k++;                                                                     \
                int64_t j = (int64_t)((uint64_t)(start + b0 + i) * (uint64_t)kd->bits / 64);\
                if (j != cw) {                                                              \
                    uint64_t wa = word_at(old, nbytes, (uint64_t)j);                        \
                    uint64_t wb = word_at(new_, nbytes, (uint64_t)j);                       \
                    sd[0] += sum_term(0, wb, (uint64_t)j) - sum_term(0, wa, (uint64_t)j);   \
                    sd[1] += sum_term(1, wb, (uint64_t)j) - sum_term(1, wa, (uint64_t)j);   \
                    cw = j;                                                                 \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
        for (int t = 0; t < nvc; t++) cnt[t] += bcs[t];                                     \
    }                                                                                       \
    for (int t = 0; t < nvc; t++) tab[vc[t]] += cnt[t];                                     \
    return 0;

#define BLOCKCTX_PLAIN block_ctx
static int enc_pass_scalar(const rp_kind *kd, const uint8_t *old, const uint8_t *new_,
                           size_t nbytes, int64_t start, int64_t n, recs_t *r, uint32_t *tab,
                           uint64_t sd[2]) {
    ENC_BODY(blkcnt_scalar, eq32_scalar, cold32_scalar, BLOCKCTX_PLAIN, changed_generic)
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

__attribute__((target("avx2"))) static int enc_pass_avx2(const rp_kind *kd, const uint8_t *old,
                                                          const uint8_t *new_, size_t nbytes,
                                                          int64_t start, int64_t n, recs_t *r,
                                                          uint32_t *tab, uint64_t sd[2]) {
#define BLOCKCTX BLOCKCTX16
    ENC_BODY(blkcnt_avx2, eq32_avx2, cold32_avx2, BLOCKCTX, changed_avx2)
#undef BLOCKCTX
}
#endif

int rp_encode_chunk(const rp_kind *kd, const uint8_t *old, const uint8_t *new_, size_t nbytes,
                    int64_t start, int64_t n, uint8_t **out, size_t *outlen, int64_t *changed,
                    uint64_t sdelta[2], const char **err) {
    return rp_encode_chunk_keep(kd, old, new_, nbytes, start, n, out, outlen, changed, sdelta,
                                NULL, NULL, NULL, err);
}

int rp_encode_chunk_keep(const rp_kind *kd, const uint8_t *old, const uint8_t *new_,
                         size_t nbytes, int64_t start, int64_t n, uint8_t **out, size_t *outlen,
                         int64_t *changed, uint64_t sdelta[2], uint32_t **pos, uint64_t **oldv,
                         uint64_t **newv, const char **err) {
    int rc = RP_OK;
    recs_t r = {0};
    if (pos) *pos = NULL;
    if (oldv) *oldv = NULL;
    if (newv) *newv = NULL;
    uint32_t tab[NCTX] = {0};
    uint64_t ncnt[NCTX], sd[2] = {0, 0};
    *out = NULL;
    *outlen = 0;
    *changed = 0;
    if (!kind_ok(kd) || n < 0 || n > RP_CHUNK) FAIL(RP_EARG, "bad kind or chunk size");
#if defined(__x86_64__) && defined(__GNUC__)
    if (__builtin_cpu_supports("avx2")) {
        if (enc_pass_avx2(kd, old, new_, nbytes, start, n, &r, tab, sd)) FAIL(RP_ENOMEM, "out of memory");
    } else
#endif
    if (enc_pass_scalar(kd, old, new_, nbytes, start, n, &r, tab, sd)) FAIL(RP_ENOMEM, "out of memory");
    for (int c = 0; c < NCTX; c++) ncnt[c] = tab[c];
    rc = code_chunk(kd, n, ncnt, &r, out, outlen, err);
    *changed = r.k;
    sdelta[0] += sd[0];
    sdelta[1] += sd[1];
    if (rc == RP_OK && pos && oldv && newv && r.k > 0) { /* hand the records over */
        *pos = r.pos; *oldv = r.oldv; *newv = r.newv;
        r.pos = NULL; r.oldv = NULL; r.newv = NULL;
    }
done:
    recs_free(&r);
    return rc;
}

/* Phase C: the rest of the streams, then old/new elements. */
/* Phase C: the join met every listed context's size and rank exactly (else the view is not
 * the patch's base); then the last word's rp.sum128 change. */
static int lane_finish(const rp_kind *kd, lane_t *l, const char **err) {
    if (kd->cbits) {
        for (int i = 0; i < l->pp.g; i++) {
            int c = l->pp.cid[i];
            if (l->cnt[c] != l->pp.nc[i] || l->cur[c] != l->endr[c]) {
                *err = "context sizes differ from the base: not the patch's base"; return RP_EBASE;
            }
        }
        if ((uint64_t)l->emitted != l->pp.k) { *err = "positions do not match the base"; return RP_EBASE; }
    }
    if (l->wdata) lane_flush(l);
    return RP_OK;
}

/* rp.sum128 of the chunk's elements [l->hashed, upto), read before this lane writes them
 * (the in-pass hash): group boundaries are multiples of 4,096 elements, so word-aligned. */
static void lane_hash_to(const rp_kind *kd, lane_t *l, int64_t start, int64_t upto) {
    if (!l->hash || upto <= l->hashed) return;
    uint64_t b = (uint64_t)kd->bits, e0 = (uint64_t)(start + l->hashed), e1 = (uint64_t)(start + upto);
    uint64_t w0 = e0 * b / 64, w1 = (e1 * b + 63) / 64, out[2];
    rp_sum128(l->wdata, l->wlen, w0, w1 - w0, out);
    l->h0 += out[0];
    l->h1 += out[1];
    l->hashed = upto;
}

/* Chunks one after the other through one lane (its buffers reused). With wdata, each chunk
 * is written in place once it passed every check; on an error the chunk that failed puts
 * itself back and every earlier chunk of this call is put back too (all or nothing).
 * sums (with wdata only; may be NULL): the rp.sum128 of every word of the chunks as read
 * before any write, added on success. */
static int decode_lanes(const rp_kind *kd, const uint8_t *base, int m, const uint8_t *const *body,
                        const size_t *len, const int64_t *start, const int64_t *n,
                        const int64_t *count, const int64_t *off, int64_t *pos_out,
                        void *old_out, void *new_out, int ow, uint8_t *wdata, size_t wlen,
                        uint64_t delta[2], uint64_t sums[2], const char **err) {
    lane_t lane, *l = &lane;
    int rc = RP_OK, q = 0;
    uint64_t d0 = 0, d1 = 0;
    memset(l, 0, sizeof *l);
    l->h0 = l->h1 = 0;
    if (!kind_ok(kd) || m < 1) { *err = "bad kind or chunk count"; return RP_EARG; }
    for (q = 0; q < m; q++) {
        if (n[q] < 0 || n[q] > RP_CHUNK) { *err = "bad chunk size"; rc = RP_EARG; break; }
        l->hash = wdata && sums;
        l->hashed = 0;
        l->wdata = wdata;
        l->wlen = wlen;
        if (len[q] == 0) {
            if (count[q]) { *err = "empty chunk with changes"; rc = RP_ECORRUPT; break; }
            lane_hash_to(kd, l, start[q], n[q]);
            continue;
        }
        rc = lane_init(kd, l, body[q], len[q], n[q], count[q], err);
        if (rc) break;
        l->pos_out = pos_out + off[q];
        l->old_out = (uint8_t *)old_out + off[q] * ow;
        l->new_out = (uint8_t *)new_out + off[q] * ow;
        l->ow = ow;
        if (kd->cbits) {
            join_lane(kd, base, l, start[q], n[q]);
        } else { /* one context: the ranks are the positions */
            for (uint64_t i = 0; i < l->pp.k; i++) {
                l->rpos[i] = l->ranks[i];
                l->rold[i] = elem_get(base, kd->bits, start[q] + l->ranks[i]);
                l->rci[i] = (uint32_t)i;
            }
            l->emitted = (int64_t)l->pp.k;
        }
        lane_hash_to(kd, l, start[q], n[q]);
        finalize(kd, l, start[q]);
        rc = lane_finish(kd, l, err);
        if (rc) { /* all or nothing: put back what this chunk wrote */
            if (wdata)
                for (int64_t i = 0; i < l->done; i++)
                    elem_put(wdata, kd->bits, l->pos_out[i], arr_get(l->old_out, ow, i));
            break;
        }
        if (wdata) {
            d0 += l->d0;
            d1 += l->d1;
        }
    }
    if (rc && wdata) /* and what the earlier chunks of this call wrote */
        for (int p = q - 1; p >= 0; p--) {
            const uint8_t *po = (const uint8_t *)old_out + off[p] * ow;
            for (int64_t i = 0; i < count[p]; i++)
                elem_put(wdata, kd->bits, pos_out[off[p] + i], arr_get(po, ow, i));
        }
    if (rc == RP_OK && wdata) {
        delta[0] += d0;
        delta[1] += d1;
        if (sums) { sums[0] += l->h0; sums[1] += l->h1; }
    }
    lane_free(l);
    return rc;
}

int rp_decode_chunks(const rp_kind *kd, const uint8_t *base, int m, const uint8_t *const *body,
                     const size_t *len, const int64_t *start, const int64_t *n,
                     const int64_t *count, const int64_t *off, int64_t *pos_out,
                     void *old_out, void *new_out, int ow, const char **err) {
    if (m > 4) { *err = "bad kind or lane count"; return RP_EARG; }
    return decode_lanes(kd, base, m, body, len, start, n, count, off, pos_out, old_out, new_out,
                        ow, NULL, 0, NULL, NULL, err);
}

static int chunk_range_ok(const rp_kind *kd, size_t nbytes, int64_t start, int64_t n) {
    int64_t n_el = kd->bits == 4 ? (int64_t)nbytes * 2 : (int64_t)(nbytes / (size_t)(kd->bits / 8));
    return kind_ok(kd) && start >= 0 && n >= 0 && start <= n_el && n <= n_el - start;
}

int rp_decode_apply(const rp_kind *kd, uint8_t *data, size_t nbytes, const uint8_t *body,
                    size_t len, int64_t start, int64_t n, int64_t count, int64_t *pos_out,
                    void *old_out, void *new_out, int ow, uint64_t delta[2], const char **err) {
    if (!chunk_range_ok(kd, nbytes, start, n)) { *err = "bad chunk range"; return RP_EARG; }
    int64_t off = 0;
    return decode_lanes(kd, data, 1, &body, &len, &start, &n, &count, &off, pos_out, old_out,
                        new_out, ow, data, nbytes, delta, NULL, err);
}

int rp_decode_apply_chunks(const rp_kind *kd, uint8_t *data, size_t nbytes, int m,
                           const uint8_t *const *body, const size_t *len, const int64_t *start,
                           const int64_t *n, const int64_t *count, const int64_t *off,
                           int64_t *pos_out, void *old_out, void *new_out, int ow,
                           uint64_t delta[2], uint64_t sums[2], const char **err) {
    for (int q = 0; q < m; q++)
        if (!chunk_range_ok(kd, nbytes, start[q], n[q])
            || (start[q] & ((int64_t)4096 - 1)) != 0) { /* hashed groups start word-aligned */
            *err = "bad chunk range"; return RP_EARG;
        }
    return decode_lanes(kd, data, m, body, len, start, n, count, off, pos_out, old_out,
                        new_out, ow, data, nbytes, delta, sums, err);
}

/* ------------------------------------------------------------------ gather / apply / diff */

int rp_gather(const rp_kind *kd, const uint8_t *data, int64_t n_el, const int64_t *pos,
              int64_t count, void *out, int ow, const char **err) {
    for (int64_t i = 0; i < count; i++)
        if (pos[i] < 0 || pos[i] >= n_el) { *err = "position out of range"; return RP_EARG; }
    if (kd->bits == 16 && ow == 2) {
        const uint16_t *d = (const uint16_t *)data;
        uint16_t *o = out;
        for (int64_t i = 0; i < count; i++) o[i] = d[pos[i]];
    } else if (kd->bits == 8 && ow == 1) {
        uint8_t *o = out;
        for (int64_t i = 0; i < count; i++) o[i] = data[pos[i]];
    } else {
        for (int64_t i = 0; i < count; i++) arr_put(out, ow, i, elem_get(data, kd->bits, pos[i]));
    }
    return RP_OK;
}

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx2"))) static void sum_avx2(const uint8_t *d, uint64_t j0,
                                                      uint64_t nw, uint64_t acc[2]) {
    __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
    __m256i k0 = _mm256_set_epi64x((long long)(SUM_S[0] + (j0 + 3) * SUM_K[0]),
                                   (long long)(SUM_S[0] + (j0 + 2) * SUM_K[0]),
                                   (long long)(SUM_S[0] + (j0 + 1) * SUM_K[0]),
                                   (long long)(SUM_S[0] + j0 * SUM_K[0]));
    __m256i k1 = _mm256_set_epi64x((long long)(SUM_S[1] + (j0 + 3) * SUM_K[1]),
                                   (long long)(SUM_S[1] + (j0 + 2) * SUM_K[1]),
                                   (long long)(SUM_S[1] + (j0 + 1) * SUM_K[1]),
                                   (long long)(SUM_S[1] + j0 * SUM_K[1]));
    const __m256i s0 = _mm256_set1_epi64x((long long)(4 * SUM_K[0]));
    const __m256i s1 = _mm256_set1_epi64x((long long)(4 * SUM_K[1]));
    for (uint64_t i = 0; i < nw; i += 4) {
        __m256i w = _mm256_loadu_si256((const __m256i *)(d + 8 * i));
        __m256i x0 = _mm256_xor_si256(w, k0), x1 = _mm256_xor_si256(w, k1);
        __m256i p0 = _mm256_mul_epu32(x0, _mm256_srli_epi64(x0, 32));
        __m256i p1 = _mm256_mul_epu32(x1, _mm256_srli_epi64(x1, 32));
        __m256i r0 = _mm256_or_si256(_mm256_slli_epi64(w, 32), _mm256_srli_epi64(w, 32));
        __m256i r1 = _mm256_or_si256(_mm256_slli_epi64(w, 17), _mm256_srli_epi64(w, 47));
        a0 = _mm256_add_epi64(a0, _mm256_add_epi64(p0, r0));
        a1 = _mm256_add_epi64(a1, _mm256_add_epi64(p1, r1));
        k0 = _mm256_add_epi64(k0, s0);
        k1 = _mm256_add_epi64(k1, s1);
    }
    uint64_t t0[4], t1[4];
    _mm256_storeu_si256((__m256i *)t0, a0);
    _mm256_storeu_si256((__m256i *)t1, a1);
    acc[0] += t0[0] + t0[1] + t0[2] + t0[3];
    acc[1] += t1[0] + t1[1] + t1[2] + t1[3];
}
#endif

void rp_sum128(const uint8_t *d, size_t len, uint64_t w0, uint64_t nw, uint64_t out[2]) {
    uint64_t acc[2] = {0, 0}, j = w0, end = w0 + nw;
    uint64_t full = len / 8; /* words that lie wholly inside the data */
    uint64_t fast_end = end < full ? end : full;
#if defined(__x86_64__) && defined(__GNUC__)
    if (fast_end > j && __builtin_cpu_supports("avx2")) {
        uint64_t cnt = (fast_end - j) & ~3ULL;
        if (cnt) {
            sum_avx2(d + 8 * j, j, cnt, acc);
            j += cnt;
        }
    }
#endif
    for (; j < end; j++) {
        uint64_t w = word_at(d, len, j);
        acc[0] += sum_term(0, w, j);
        acc[1] += sum_term(1, w, j);
    }
    out[0] = acc[0];
    out[1] = acc[1];
}

/* Typed fast path: T elements, 8 / sizeof(T) per 64-bit word. */
#define APPLY_TYPED(T, LOG)                                                                 \
    do {                                                                                    \
        T *d = (T *)data;                                                                   \
        const T *o = (const T *)old, *nw = (const T *)new_;                                 \
        int64_t i = 0, bad = -1;                                                            \
        while (i < count && bad < 0) {                                                      \
            uint64_t j = (uint64_t)pos[i] >> (3 - LOG);                                     \
            uint64_t before = word_at(data, nbytes, j);                                     \
            for (; i < count && ((uint64_t)pos[i] >> (3 - LOG)) == j; i++) {                \
                if (pos[i] < 0 || pos[i] >= n_el || (i && pos[i] <= pos[i - 1])            \
                    || d[pos[i]] != o[i]) { bad = i; break; }                               \
                d[pos[i]] = nw[i];                                                          \
            }                                                                               \
            uint64_t after = word_at(data, nbytes, j);                                      \
            d0 += sum_term(0, after, j) - sum_term(0, before, j);                           \
            d1 += sum_term(1, after, j) - sum_term(1, before, j);                           \
        }                                                                                   \
        if (bad >= 0) { /* all or nothing: put back what this call wrote */                 \
            for (int64_t q = 0; q < bad; q++) d[pos[q]] = o[q];                             \
            if (pos[bad] < 0 || pos[bad] >= n_el || (bad && pos[bad] <= pos[bad - 1])) {    \
                *err = "positions out of range or not increasing"; return RP_EARG;          \
            }                                                                               \
            *err = "old elements differ from the patch's base"; return RP_EBASE;            \
        }                                                                                   \
    } while (0)

int rp_apply(const rp_kind *kd, uint8_t *data, size_t nbytes, const int64_t *pos,
             const void *old, const void *new_, int64_t count, int iw, uint64_t delta[2],
             const char **err) {
    int64_t n_el = kd->bits == 4 ? (int64_t)nbytes * 2 : (int64_t)(nbytes / (size_t)(kd->bits / 8));
    uint64_t d0 = 0, d1 = 0;
    if (kd->bits == 16 && iw == 2) APPLY_TYPED(uint16_t, 1);
    else if (kd->bits == 8 && iw == 1) APPLY_TYPED(uint8_t, 0);
    else if (kd->bits == 32 && iw == 4) APPLY_TYPED(uint32_t, 2);
    else if (kd->bits == 64 && iw == 8) APPLY_TYPED(uint64_t, 3);
    else {
        for (int64_t i = 0; i < count; i++) {
            if (pos[i] < 0 || pos[i] >= n_el || (i && pos[i] <= pos[i - 1])) {
                *err = "positions out of range or not increasing"; return RP_EARG;
            }
            if (elem_get(data, kd->bits, pos[i]) != arr_get(old, iw, i)) {
                *err = "old elements differ from the patch's base"; return RP_EBASE;
            }
        }
        int64_t i = 0;
        while (i < count) {
            uint64_t j = (uint64_t)pos[i] / 16; /* 16 nibbles per word */
            uint64_t before = word_at(data, nbytes, j);
            for (; i < count && (uint64_t)pos[i] / 16 == j; i++)
                elem_put(data, kd->bits, pos[i], arr_get(new_, iw, i));
            uint64_t after = word_at(data, nbytes, j);
            d0 += sum_term(0, after, j) - sum_term(0, before, j);
            d1 += sum_term(1, after, j) - sum_term(1, before, j);
        }
    }
    delta[0] += d0;
    delta[1] += d1;
    return RP_OK;
}

int rp_diff(const rp_kind *kd, const uint8_t *a, const uint8_t *b, int64_t start, int64_t n,
            int64_t *pos, int64_t cap, int64_t *found) {
    int64_t f = 0;
    if (kd->bits == 4) {
        for (int64_t i = start; i < start + n; i++)
            if (elem_get(a, 4, i) != elem_get(b, 4, i)) { if (f < cap) pos[f] = i; f++; }
        *found = f;
        return RP_OK;
    }
    size_t w = (size_t)kd->bits / 8, lo = (size_t)start * w, hi = (size_t)(start + n) * w;
    size_t o = lo;
    for (; o + 32 <= hi; o += 32) { /* skip equal 32-byte blocks fast */
        uint64_t x[4], y[4];
        memcpy(x, a + o, 32);
        memcpy(y, b + o, 32);
        if (((x[0] ^ y[0]) | (x[1] ^ y[1]) | (x[2] ^ y[2]) | (x[3] ^ y[3])) == 0) continue;
        for (size_t e = o; e < o + 32; e += w)
            if (memcmp(a + e, b + e, w)) { if (f < cap) pos[f] = (int64_t)(e / w); f++; }
    }
    for (size_t e = o; e < hi; e += w)
        if (memcmp(a + e, b + e, w)) { if (f < cap) pos[f] = (int64_t)(e / w); f++; }
    *found = f;
    return RP_OK;
}

/* ------------------------------------------------------------------ compose */

int rp_compose(int w, const int64_t *pp, const void *po, const void *pn, int64_t np_,
               const int64_t *qp, const void *qo, const void *qn, int64_t nq, int64_t *rp,
               void *ro, void *rn, int64_t *nout, const char **err) {
    int64_t i = 0, j = 0, o = 0;
    *nout = 0;
    for (int64_t a = 1; a < np_; a++)
        if (pp[a] <= pp[a - 1]) { *err = "positions not increasing"; return RP_EARG; }
    for (int64_t a = 1; a < nq; a++)
        if (qp[a] <= qp[a - 1]) { *err = "positions not increasing"; return RP_EARG; }
    while (i < np_ || j < nq) {
        int64_t pos;
        uint64_t old, nw;
        if (j >= nq || (i < np_ && pp[i] < qp[j])) {
            pos = pp[i]; old = arr_get(po, w, i); nw = arr_get(pn, w, i); i++;
        } else if (i >= np_ || qp[j] < pp[i]) {
            pos = qp[j]; old = arr_get(qo, w, j); nw = arr_get(qn, w, j); j++;
        } else {
            if (arr_get(pn, w, i) != arr_get(qo, w, j)) {
                *err = "patches disagree on intermediate elements"; return RP_EBASE;
            }
            pos = pp[i]; old = arr_get(po, w, i); nw = arr_get(qn, w, j); i++; j++;
        }
        rp[o] = pos;
        arr_put(ro, w, o, old);
        arr_put(rn, w, o, nw);
        o += old != nw;
    }
    *nout = o;
    return RP_OK;
}
