/* rollpatch native core: the encoders of codec rp.ctxgolomb.v2 from changes found elsewhere
 * (docs/patch-format.md §4b): from a chunk's changed positions and elements (the sparse
 * path, rp_diff's positions) and from records whose contexts and ranks the caller computed;
 * both code with rp_code_chunk (rp_encode.c) and must write the fused pass's bytes. */
#include "rp_internal.h"

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
        if (r.k == r.cap && rp_recs_grow(&r)) FAIL(RP_ENOMEM, "out of memory");                \
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
    rc = rp_code_chunk(kd, n, ncnt, &r, out, outlen, err);
done:
    free(t);
    rp_recs_free(&r);
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
    rc = rp_code_chunk(kd, n, ncnt, &r, out, outlen, err);
done:
    rp_recs_free(&r);
    return rc;
}
