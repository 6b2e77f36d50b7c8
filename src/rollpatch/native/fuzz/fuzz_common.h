/* Shared by the libFuzzer targets (fuzz_decode.c, fuzz_roundtrip.c): how a fuzz input becomes
 * a kind, a base tensor and the rest of the bytes, and a decoder driven the way module.c
 * drives it (chunk table, rp_chunk_count, output buffers sized from the counts, then
 * rp_decode_chunks). bench/fuzz_codec.py rebuilds the same bases in numpy to write the seed
 * corpus, so the layout below is fixed:
 *
 *   byte 0     kind: index into KINDS (real kinds, and single-context ones)
 *   byte 1     bits 0-2 size class (bit 6: the largest), bits 3-5 "spread" (few contexts)
 *   bytes 2-3  size value (little endian), see fz_elements()
 *   bytes 4-7  seed of the base's words (little endian)
 *   bytes 8-   the target's own bytes (a payload, or perturbations)
 *
 * the core (rp_*.c) is compiled with -include cpu_switch.h, so fz_simd chooses its vector or
 * scalar loops per call (the vector ones: AVX-512 where the CPU has it for even seeds, AVX2
 * for odd ones): each target runs both and requires identical results. */
#ifndef FUZZ_COMMON_H
#define FUZZ_COMMON_H
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../rpcore.h"

#define FZ_HEADER 8
#define FZ_MAXCH 4

int fz_simd = 1;   /* read by rp_fuzz_cpu_supports (cpu_switch.h): 0 = scalar loops only */
int fz_avx512 = 1; /* 0: the CPU's AVX-512 and GFNI are hidden (the AVX2 loops run) */

/* What the CPU has, as the core sees it: nothing with fz_simd = 0, no AVX-512 or GFNI
 * with fz_avx512 = 0 (fz_derive alternates it by the seed's low bit); a feature asked for
 * is answered truthfully (never an instruction the CPU lacks). */
int rp_fuzz_cpu_supports(const char *feature) {
    if (!fz_simd) return 0;
    if (!strcmp(feature, "avx2")) return __builtin_cpu_supports("avx2");
    if (!strcmp(feature, "bmi2")) return __builtin_cpu_supports("bmi2");
    if (!fz_avx512) return 0;
    if (!strcmp(feature, "avx512f")) return __builtin_cpu_supports("avx512f");
    if (!strcmp(feature, "avx512bw")) return __builtin_cpu_supports("avx512bw");
    if (!strcmp(feature, "avx512vl")) return __builtin_cpu_supports("avx512vl");
    if (!strcmp(feature, "avx512vbmi")) return __builtin_cpu_supports("avx512vbmi");
    if (!strcmp(feature, "avx512vbmi2")) return __builtin_cpu_supports("avx512vbmi2");
    if (!strcmp(feature, "avx512bitalg")) return __builtin_cpu_supports("avx512bitalg");
    if (!strcmp(feature, "avx512vpopcntdq")) return __builtin_cpu_supports("avx512vpopcntdq");
    if (!strcmp(feature, "gfni")) return __builtin_cpu_supports("gfni");
    return 0; /* a feature the harness does not know: its loops stay off */
}

/* (bits, order, shift, cbits): rollpatch.kinds.KINDS, then the single-context forms the
 * codec uses for tensors under 65,536 elements (rollpatch.native.kind_tuple). */
static const rp_kind KINDS[] = {
    {16, 0, 7, 8},  /* bf16 */
    {16, 0, 10, 5}, /* f16 */
    {32, 0, 23, 8}, /* f32 */
    {64, 0, 55, 8}, /* f64 */
    {8, 0, 3, 4},   /* e4m3, e4m3_u8 */
    {8, 0, 2, 5},   /* e5m2 */
    {4, 0, 0, 3},   /* e2m1x2 */
    {4, 1, 0, 3},   /* int4x2 */
    {8, 2, 0, 0},   /* e8m0, u8, bool */
    {8, 1, 0, 0},   /* i8 */
    {16, 2, 0, 0},  /* u16 */
    {16, 1, 0, 0},  /* i16 */
    {32, 2, 0, 0},  /* u32 */
    {32, 1, 0, 0},  /* i32 */
    {64, 2, 0, 0},  /* u64 */
    {64, 1, 0, 0},  /* i64 */
    {16, 0, 0, 0},  /* bf16, f16 single-context */
    {32, 0, 0, 0},  /* f32 single */
    {64, 0, 0, 0},  /* f64 single */
    {8, 0, 0, 0},   /* e4m3, e5m2 single */
    {4, 0, 0, 0},   /* e2m1x2 single */
    {4, 1, 0, 0},   /* int4x2 single */
};
#define NKINDS ((int)(sizeof KINDS / sizeof KINDS[0]))

typedef struct {
    rp_kind k;
    int64_t n;        /* elements */
    size_t nbytes;    /* bytes of base (4-bit: two elements per byte) */
    const uint8_t *base; /* exactly nbytes, heap (ASan sees any overread): fz_base */
    const uint8_t *rest;
    size_t rest_len;
    uint64_t seed;
    int spread;
} fz_case;

typedef struct {
    int rc;
    int64_t total;
    int64_t *pos;
    uint8_t *oldv, *newv; /* total elements of width ow */
} fz_out;

static void fz_fail(const char *what) {
    fprintf(stderr, "fuzz check failed: %s\n", what);
    abort();
}

static inline uint64_t fz_mask(int bits) { return bits >= 64 ? ~0ULL : (1ULL << bits) - 1; }
static inline int fz_ow(const rp_kind *k) { return k->bits == 4 ? 1 : k->bits / 8; }

static inline uint64_t fz_mix(uint64_t z) { /* splitmix64 finaliser */
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static inline uint64_t fz_get(const uint8_t *b, int bits, int64_t i) {
    uint64_t v = 0;
    if (bits == 4) return (b[i >> 1] >> ((i & 1) << 2)) & 15u;
    memcpy(&v, b + (size_t)i * (bits / 8), (size_t)bits / 8); /* little endian host */
    return v;
}

static inline void fz_put(uint8_t *b, int bits, int64_t i, uint64_t v) {
    if (bits == 4) {
        int sh = (int)(i & 1) << 2;
        b[i >> 1] = (uint8_t)((b[i >> 1] & ~(15u << sh)) | ((v & 15u) << sh));
        return;
    }
    memcpy(b + (size_t)i * (bits / 8), &v, (size_t)bits / 8);
}

static inline uint64_t fz_arr(const void *a, int w, int64_t i) {
    uint64_t v = 0;
    memcpy(&v, (const uint8_t *)a + (size_t)i * w, (size_t)w);
    return v;
}

/* Element count from the size class: mostly small (fast), sometimes past 65,536 (where real
 * tensors get contexts), rarely across the 2^20-element chunk boundary (class 7 with bit 6
 * set: ~0.3 s an input under the sanitizers, against ~1 ms for a small one). */
static int64_t fz_elements(const uint8_t *h) {
    int64_t v = h[2] | (h[3] << 8);
    switch (h[1] & 7) {
    case 4: return 1 + (v & 16383);
    case 5: return 1 + v;
    case 6: return 65536 + (v & 8191);
    case 7: return h[1] & 64 ? RP_CHUNK - 32768 + v : 1 + v;
    default: return 1 + (v & 1023);
    }
}

/* Word i of the base: splitmix64 of (seed, i), its context field (or top nibble) squeezed to
 * `spread` values so that a few contexts dominate, as they do in real weights. */
__attribute__((no_sanitize("coverage"))) static uint64_t fz_word(const rp_kind *k, uint64_t seed, int spread, int64_t i) {
    uint64_t z = fz_mix(seed * 0xD1B54A32D192ED03ULL + (uint64_t)(i + 1) * 0x9E3779B97F4A7C15ULL);
    uint64_t e = z & fz_mask(k->bits);
    if (spread) {
        int fw = k->cbits ? k->cbits : (k->bits < 4 ? k->bits : 4);
        int fs = k->cbits ? k->shift : k->bits - fw;
        uint64_t fm = (1ULL << fw) - 1;
        uint64_t v = ((z >> 40) % (uint64_t)spread + (seed >> 8)) & fm;
        e = (e & ~(fm << fs)) | (v << fs);
    }
    return e;
}

/* The base's words, made when first needed (most hostile payloads fail before) and kept
 * for the next input with the same header (mutations mostly change the payload): a 2-chunk
 * base costs more than its decode. Replacing it frees one buffer and allocates one, so
 * libFuzzer's per-input malloc/free balance (its leak heuristic) stays even. The buffer is
 * exactly nbytes long and read-only to the core, so ASan still sees any overread. */
static struct {
    uint8_t *buf;
    rp_kind k;
    int64_t n;
    uint64_t seed;
    int spread;
} fz_cache;

__attribute__((no_sanitize("coverage"))) static void fz_fill(const fz_case *c, uint8_t *b) {
    for (int64_t i = 0; i < c->n; i++) fz_put(b, c->k.bits, i, fz_word(&c->k, c->seed, c->spread, i));
}

static const uint8_t *fz_base(fz_case *c) {
    if (c->base) return c->base;
    if (!fz_cache.buf || memcmp(&fz_cache.k, &c->k, sizeof c->k) || fz_cache.n != c->n
        || fz_cache.seed != c->seed || fz_cache.spread != c->spread) {
        free(fz_cache.buf);
        fz_cache.buf = malloc(c->nbytes);
        if (!fz_cache.buf) fz_fail("out of memory for the base");
        fz_cache.k = c->k;
        fz_cache.n = c->n;
        fz_cache.seed = c->seed;
        fz_cache.spread = c->spread;
        fz_fill(c, fz_cache.buf);
    }
    c->base = fz_cache.buf;
    return c->base;
}

/* 0, or -1 when the input is too short for a header. */
static int fz_derive(const uint8_t *data, size_t size, fz_case *c) {
    if (size < FZ_HEADER) return -1;
    memset(c, 0, sizeof *c);
    c->k = KINDS[data[0] % NKINDS];
    c->n = fz_elements(data);
    if (c->k.bits == 4) c->n += c->n & 1; /* packed tensors hold whole bytes */
    c->nbytes = c->k.bits == 4 ? (size_t)c->n / 2 : (size_t)c->n * (c->k.bits / 8);
    c->seed = (uint64_t)data[4] | (uint64_t)data[5] << 8 | (uint64_t)data[6] << 16
              | (uint64_t)data[7] << 24;
    c->spread = (data[1] >> 3) & 7;
    fz_avx512 = !(c->seed & 1); /* odd seeds: the AVX2 loops against the scalar ones */
    c->rest = data + FZ_HEADER;
    c->rest_len = size - FZ_HEADER;
    return 0;
}

static int64_t fz_chunks(const fz_case *c) { return (c->n + RP_CHUNK - 1) / RP_CHUNK; }
static int64_t fz_chunk_n(const fz_case *c, int64_t i) {
    return c->n - i * RP_CHUNK < RP_CHUNK ? c->n - i * RP_CHUNK : RP_CHUNK;
}

static void fz_out_free(fz_out *o) {
    free(o->pos); free(o->oldv); free(o->newv);
    memset(o, 0, sizeof *o);
}

/* Decode a payload as rollpatch does: table, counts, buffers sized from the counts, then
 * rp_decode_chunks over `group` chunks at a time (module.c: up to 4). Each body is copied
 * into its own allocation so that reading past one is an ASan report, not the next body. */
static void fz_decode(fz_case *c, const uint8_t *pl, size_t len, int group, fz_out *o) {
    int64_t nch = fz_chunks(c), cnt[FZ_MAXCH], off[FZ_MAXCH + 1];
    size_t offs[FZ_MAXCH], lens[FZ_MAXCH];
    uint8_t *bodies[FZ_MAXCH] = {0};
    const char *err = NULL;
    int ow = fz_ow(&c->k);
    memset(o, 0, sizeof *o);
    o->rc = RP_ECORRUPT;
    if (nch > FZ_MAXCH || nch > (int64_t)len || rp_parse_table(pl, len, nch, offs, lens)) return;
    off[0] = 0;
    for (int64_t i = 0; i < nch; i++) {
        bodies[i] = malloc(lens[i] ? lens[i] : 1);
        if (!bodies[i]) fz_fail("out of memory for a body");
        memcpy(bodies[i], pl + offs[i], lens[i]);
        o->rc = rp_chunk_count(&c->k, bodies[i], lens[i], fz_chunk_n(c, i), &cnt[i], &err);
        if (o->rc) goto done;
        if (cnt[i] < 0 || cnt[i] > fz_chunk_n(c, i))
            fz_fail("rp_chunk_count: a count beyond the chunk's elements");
        off[i + 1] = off[i] + cnt[i];
    }
    o->total = off[nch];
    o->pos = malloc((size_t)o->total * 8 + 8);
    o->oldv = malloc((size_t)o->total * ow + 8);
    o->newv = malloc((size_t)o->total * ow + 8);
    if (!o->pos || !o->oldv || !o->newv) fz_fail("out of memory for outputs");
    for (int64_t g = 0; g < nch && o->rc == RP_OK; g += group) {
        int m = (int)(nch - g < group ? nch - g : group);
        const uint8_t *bp[FZ_MAXCH];
        size_t bl[FZ_MAXCH];
        int64_t st[FZ_MAXCH], nn[FZ_MAXCH], cc[FZ_MAXCH], of[FZ_MAXCH];
        for (int j = 0; j < m; j++) {
            bp[j] = bodies[g + j];
            bl[j] = lens[g + j];
            st[j] = (g + j) * RP_CHUNK;
            nn[j] = fz_chunk_n(c, g + j);
            cc[j] = cnt[g + j];
            of[j] = off[g + j];
        }
        err = NULL;
        o->rc = rp_decode_chunks(&c->k, fz_base(c), m, bp, bl, st, nn, cc, of, o->pos, o->oldv,
                                 o->newv, ow, &err);
        if (o->rc && !err) fz_fail("rp_decode_chunks failed without a message");
    }
    if (o->rc == RP_EARG) fz_fail("rp_decode_chunks: argument error on a well-formed call");
done:
    for (int64_t i = 0; i < nch; i++) free(bodies[i]);
}

static void fz_same(const fz_case *c, const fz_out *a, const fz_out *b, const char *what) {
    int ow = fz_ow(&c->k);
    /* chunks fail in a different order when decoded one by one: then only success must agree */
    if (fz_chunks(c) == 1 ? a->rc != b->rc : (a->rc == RP_OK) != (b->rc == RP_OK)) fz_fail(what);
    if (a->rc) return;
    if (a->total != b->total || memcmp(a->pos, b->pos, (size_t)a->total * 8)
        || memcmp(a->oldv, b->oldv, (size_t)a->total * ow)
        || memcmp(a->newv, b->newv, (size_t)a->total * ow))
        fz_fail(what);
}

/* What a successful decode promises: increasing positions inside the tensor, old elements
 * equal to the base's, new elements that differ from them and fit the width. */
static void fz_check_decoded(fz_case *c, const fz_out *o) {
    int ow = fz_ow(&c->k);
    for (int64_t i = 0; i < o->total; i++) {
        int64_t p = o->pos[i];
        if (p < 0 || p >= c->n || (i && p <= o->pos[i - 1])) fz_fail("decoded positions");
        uint64_t ov = fz_arr(o->oldv, ow, i), nv = fz_arr(o->newv, ow, i);
        if (ov != fz_get(fz_base(c), c->k.bits, p)) fz_fail("decoded old element is not the base's");
        if (nv == ov || (nv & ~fz_mask(c->k.bits))) fz_fail("decoded new element");
    }
}

static void fz_sum(const uint8_t *d, size_t len, uint64_t out[2]) {
    rp_sum128(d, len, 0, ((uint64_t)len + 7) / 8, out);
}

/* rp_apply of decoded changes onto a copy of the base: accepted, and the rp.sum128 change
 * it reports is the difference of the two full digests; a dry apply first reports the same
 * change and writes nothing. Returns the patched copy. */
static uint8_t *fz_apply(fz_case *c, const fz_out *o) {
    uint8_t *t = malloc(c->nbytes);
    uint64_t before[2], after[2], delta[2] = {0, 0}, dry[2] = {0, 0};
    const char *err = NULL;
    if (!t) fz_fail("out of memory for the target");
    memcpy(t, fz_base(c), c->nbytes);
    if (rp_apply(&c->k, t, c->nbytes, o->pos, o->oldv, o->newv, o->total, fz_ow(&c->k), 1, 0,
                 NULL, dry, &err))
        fz_fail("rp_apply (dry) refused a decoded patch");
    if (memcmp(t, fz_base(c), c->nbytes)) fz_fail("rp_apply (dry) wrote the words");
    if (rp_apply(&c->k, t, c->nbytes, o->pos, o->oldv, o->newv, o->total, fz_ow(&c->k), 0, 1,
                 NULL, delta, &err))
        fz_fail("rp_apply refused a decoded patch");
    if (dry[0] != delta[0] || dry[1] != delta[1])
        fz_fail("rp_apply's dry sum128 change differs from its change");
    fz_sum(c->base, c->nbytes, before);
    fz_sum(t, c->nbytes, after);
    if (after[0] != before[0] + delta[0] || after[1] != before[1] + delta[1])
        fz_fail("rp_apply's sum128 change differs from the digests");
    return t;
}

static void fz_varint(uint8_t *out, size_t *q, uint64_t v) {
    while (v >= 0x80) { out[(*q)++] = (uint8_t)(v | 0x80); v >>= 7; }
    out[(*q)++] = (uint8_t)v;
}

/* The real encoder (rp_encode_chunk, the fused dense pass) over every chunk, joined into a
 * payload; changed[i] per chunk. The caller frees the payload. */
static uint8_t *fz_encode(fz_case *c, const uint8_t *target, size_t *plen, int64_t *changed) {
    int64_t nch = fz_chunks(c);
    uint8_t *bodies[FZ_MAXCH] = {0};
    size_t lens[FZ_MAXCH] = {0}, total = 0, q = 0;
    const char *err = NULL;
    uint64_t sd[2] = {0, 0}, sa[2], sb[2];
    for (int64_t i = 0; i < nch; i++) {
        if (rp_encode_chunk(&c->k, fz_base(c), target, c->nbytes, i * RP_CHUNK, fz_chunk_n(c, i),
                            &bodies[i], &lens[i], &changed[i], sd, &err))
            fz_fail("rp_encode_chunk failed");
        if ((lens[i] == 0) != (changed[i] == 0)) fz_fail("rp_encode_chunk: empty body iff no change");
        total += lens[i] + 10;
    }
    /* the encoder's sum128 change over the changed words is exactly sum(target) - sum(base) */
    rp_sum128(fz_base(c), c->nbytes, 0, (c->nbytes + 7) / 8, sa);
    rp_sum128(target, c->nbytes, 0, (c->nbytes + 7) / 8, sb);
    if (sb[0] - sa[0] != sd[0] || sb[1] - sa[1] != sd[1])
        fz_fail("rp_encode_chunk: sum128 change differs from the re-hash");
    uint8_t *pl = malloc(total + 1);
    if (!pl) fz_fail("out of memory for a payload");
    for (int64_t i = 0; i < nch; i++) {
        fz_varint(pl, &q, lens[i]);
        if (lens[i]) memcpy(pl + q, bodies[i], lens[i]);
        q += lens[i];
        free(bodies[i]);
    }
    *plen = q;
    return pl;
}

#endif
