/* rollpatch native core, internal: the bit streams of the context coder, a writer (bw_t:
 * amortised growth, bits MSB first, unary and fixed codes, varints) and a bounded reader
 * (br_t: every read checked against the stream's length, unary codes capped), shared by the
 * encoder and the decoder through rp_internal.h. Not part of the API. */
#ifndef RP_BITS_H
#define RP_BITS_H
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

#endif /* RP_BITS_H */
