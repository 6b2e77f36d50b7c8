/* rollpatch native core, internal: what the core's files (rp_encode.c, rp_encpass.c,
 * rp_decode.c, rp_join.c, rp_apply.c) share: element access and keys, the bit streams (rp_bits.h),
 * the encoder's records, the rp.sum128 terms and the block primitives of the join and the
 * encoder's pass. Not part of the API (rpcore.h); nothing here is exported from the module. */
#ifndef RP_INTERNAL_H
#define RP_INTERNAL_H
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
#define RP_HIDDEN __attribute__((visibility("hidden"))) /* internal across the core's files */

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

/* Put n written elements back: data[pos[i]] = old[i] (a failed decode is all or nothing). */
static inline void put_back(uint8_t *data, int bits, const int64_t *pos, const void *old, int ow,
                            int64_t n) {
    for (int64_t i = 0; i < n; i++) elem_put(data, bits, pos[i], arr_get(old, ow, i));
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
    /* signmag: negative -> ~x & m = x ^ m, else x | s = x ^ s (no branch on the sign) */
    if (k->order == RP_SIGNMAG) return x ^ (s | (m & (0 - ((x & s) >> (k->bits - 1)))));
    if (k->order == RP_TWOS) return x ^ s;
    return x;
}

static inline uint64_t from_key(const rp_kind *k, uint64_t y) {
    uint64_t s = ksign(k->bits), m = kmask(k->bits);
    /* signmag: key with the sign bit -> y ^ s, else ~y & m = y ^ m */
    if (k->order == RP_SIGNMAG) return y ^ (s | (m & (0 - (((y & s) >> (k->bits - 1)) ^ 1))));
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

/* the bit streams (writer and bounded reader) */
#include "rp_bits.h"

/* ------------------------------------------------------------------ encoder records */

typedef struct {
    uint32_t *pos;  /* relative position */
    uint32_t *rank; /* rank inside its context */
    uint8_t *ctx;
    uint64_t *oldv, *newv;
    int64_t k, cap;
} recs_t;

RP_HIDDEN int rp_recs_grow(recs_t *r);
RP_HIDDEN void rp_recs_free(recs_t *r);

/* What the coder needs of a chunk's changes, compact (4 bytes per change, 8 more per change
 * with |step| > 1), and the coder's buffers: kept across the chunks of a range, so a range
 * allocates once. rec[i] = rank | ctx << 20 | outward << 28 | big << 29 (position order; a
 * rank is < RP_CHUNK = 2^20); tail[] = |step| - 2 of the big ones, in position order. */
#define REC_RANK 0xFFFFFu
struct rp_encws {
    uint32_t *rec, *grp, *scr; /* records; grouped by context; the coder's scratch */
    uint64_t *tail, *tsort;    /* big steps' tails; grouped by context */
    int64_t k, nb, cap, gcap, kdone; /* kdone: the records the coder last coded */
    bw_t pw, uw, fw; /* the body's three streams */
    rp_obuf mrec, mgrp, mscr, mtail, mtsort; /* the arrays' memory: large ones mapped, so
                                                freeing the workspace gives them back */
};

RP_HIDDEN int rp_ws_reserve(rp_encws *w, int64_t extra);
RP_HIDDEN int rp_ws_reserve_coder(rp_encws *w, int64_t k); /* grp, scr, tsort for k records */
RP_HIDDEN void rp_ws_free(rp_encws *w);

/* One change's record word, and its step's magnitude, from the two elements. */
static inline uint32_t rec_word(const rp_kind *kd, uint32_t rank, unsigned c, uint64_t o,
                                uint64_t nv, uint64_t *magp) {
    uint64_t s = ksign(kd->bits), msk = kmask(kd->bits);
    uint64_t d = (to_key(kd, nv) - to_key(kd, o)) & msk;
    uint32_t positive = d < s;
    uint64_t mag = positive ? d : (0 - d) & msk;
    uint32_t neg = kd->order != RP_UNSIGNED && (o & s);
    *magp = mag;
    return rank | c << 20 | (positive ^ neg) << 28 | (uint32_t)(mag > 1) << 29;
}

/* One change into w (room reserved). */
static inline void ws_record(rp_encws *w, const rp_kind *kd, uint32_t rank, unsigned c,
                             uint64_t o, uint64_t nv) {
    uint64_t mag;
    w->rec[w->k++] = rec_word(kd, rank, c, o, nv, &mag);
    w->tail[w->nb] = mag - 2;
    w->nb += mag > 1;
}

/* Code w's records of one chunk whose context sizes are ncnt into w->pw/uw/fw (empty when
 * nothing changed); the body is varint(|pw|) pw varint(|uw|) uw fw. Consumes w->rec. */
RP_HIDDEN int rp_code_ws(const rp_kind *kd, int64_t n, const uint64_t *ncnt, rp_encws *w,
                         const char **err);
/* The coded body in w: as a malloc'd buffer (NULL, 0 when empty), or appended to o after
 * its varint length. */
RP_HIDDEN int rp_ws_body(const rp_encws *w, uint8_t **out, size_t *outlen);
RP_HIDDEN int rp_ws_append(const rp_encws *w, rp_obuf *o);
/* rp_encode_range without giving back the room beyond the length (an arena keeps growing). */
RP_HIDDEN int rp_encode_range_append(const rp_kind *kd, const uint8_t *old, const uint8_t *new_,
                                     size_t nbytes, int64_t n, int64_t c0, int64_t c1,
                                     rp_obuf *out, int64_t *changed, uint64_t sdelta[2],
                                     rp_encws *ws, const char **err);
/* Code the records (position order) of one chunk whose context sizes are ncnt. */
RP_HIDDEN int rp_code_chunk(const rp_kind *kd, int64_t n, const uint64_t *ncnt, const recs_t *r,
                            uint8_t **out, size_t *outlen, const char **err);

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

/* ------------------------------------------------------------------ blocks */

/* The join (rp_join.c) and the encoder's pass (rp_encpass.c) work in blocks of JB elements
 * and count the contexts of a window of WIN consecutive ones with byte compares. */
#define WIN 16
#define JB 256

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
#endif

#endif /* RP_INTERNAL_H */
