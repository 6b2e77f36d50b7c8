/* rollpatch native core: the encoder's entry points over dense old/new tensors — one chunk
 * (rp_encode_chunk, rp_encode_chunk_keep) and a range of chunks (rp_encode_range) — each
 * chunk's pass at the best level the CPU runs (AVX-512: rp_encpass512.c; AVX2 and scalar:
 * rp_encpass.c), then coded (rp_encode.c). */
#include "rp_internal.h"

RP_HIDDEN int rp_enc_pass_scalar(const rp_kind *kd, const uint8_t *old, const uint8_t *new_,
                                 size_t nbytes, int64_t start, int64_t n, recs_t *r,
                                 rp_encws *w, uint32_t *tab, uint64_t sd[2]);
#if defined(__x86_64__) && defined(__GNUC__)
RP_HIDDEN __attribute__((target("avx2"))) int rp_enc_pass_avx2(
    const rp_kind *kd, const uint8_t *old, const uint8_t *new_, size_t nbytes, int64_t start,
    int64_t n, recs_t *r, rp_encws *w, uint32_t *tab, uint64_t sd[2]);
#endif
RP_HIDDEN int rp_pass512_16(const rp_kind *kd, const uint8_t *old, const uint8_t *new_,
                            size_t nbytes, int64_t start, int64_t nfull, rp_encws *w,
                            uint32_t *tab, uint64_t sd[2]);
RP_HIDDEN int rp_pass512_8(const rp_kind *kd, const uint8_t *old, const uint8_t *new_,
                           size_t nbytes, int64_t start, int64_t nfull, rp_encws *w,
                           uint32_t *tab, uint64_t sd[2]);
RP_HIDDEN int rp_pass512_4(const rp_kind *kd, const uint8_t *old, const uint8_t *new_,
                           size_t nbytes, int64_t start, int64_t nfull, rp_encws *w,
                           uint32_t *tab, uint64_t sd[2]);

/* One chunk: the pass into w (and r when not NULL), then coded into w's streams. */
static int encode_one(const rp_kind *kd, const uint8_t *old, const uint8_t *new_, size_t nbytes,
                      int64_t start, int64_t n, recs_t *r, rp_encws *w, uint64_t sd[2],
                      const char **err) {
    int rc = RP_OK;
    uint32_t tab[NCTX] = {0};
    uint64_t ncnt[NCTX];
    w->k = w->nb = 0;
    int isa = rp_isa();
    (void)isa; /* no vector loops off x86-64 */
#if defined(__x86_64__) && defined(__GNUC__)
    if (isa >= RP_ISA_AVX512 && !r && kd->bits <= 16 && kd->order == RP_SIGNMAG) {
        /* whole blocks with AVX-512, the short last one with AVX2 (counts carried in tab) */
        int64_t nfull = n & ~(int64_t)(JB - 1);
        if ((kd->bits == 16 ? rp_pass512_16 : kd->bits == 8 ? rp_pass512_8 : rp_pass512_4)(
                kd, old, new_, nbytes, start, nfull, w, tab, sd)
            || (n > nfull && rp_enc_pass_avx2(kd, old, new_, nbytes, start + nfull, n - nfull,
                                           NULL, w, tab, sd)))
            FAIL(RP_ENOMEM, "out of memory");
    } else if (isa >= RP_ISA_AVX2) {
        if (rp_enc_pass_avx2(kd, old, new_, nbytes, start, n, r, w, tab, sd))
            FAIL(RP_ENOMEM, "out of memory");
    } else
#endif
    if (rp_enc_pass_scalar(kd, old, new_, nbytes, start, n, r, w, tab, sd))
        FAIL(RP_ENOMEM, "out of memory");
    for (int c = 0; c < NCTX; c++) ncnt[c] = tab[c];
    rc = rp_code_ws(kd, n, ncnt, w, err);
done:
    return rc;
}

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
    rp_encws w = {0};
    int keep = pos && oldv && newv;
    uint64_t sd[2] = {0, 0};
    if (pos) *pos = NULL;
    if (oldv) *oldv = NULL;
    if (newv) *newv = NULL;
    *out = NULL;
    *outlen = 0;
    *changed = 0;
    if (!kind_ok(kd) || n < 0 || n > RP_CHUNK) FAIL(RP_EARG, "bad kind or chunk size");
    rc = encode_one(kd, old, new_, nbytes, start, n, keep ? &r : NULL, &w, sd, err);
    if (rc == RP_OK) *changed = w.kdone;
    if (rc == RP_OK && rp_ws_body(&w, out, outlen)) FAIL(RP_ENOMEM, "out of memory");
    sdelta[0] += sd[0];
    sdelta[1] += sd[1];
    if (rc == RP_OK && keep && r.k > 0) { /* hand the records over */
        *pos = r.pos; *oldv = r.oldv; *newv = r.newv;
        r.pos = NULL; r.oldv = NULL; r.newv = NULL;
    }
done:
    rp_recs_free(&r);
    rp_ws_free(&w);
    return rc;
}

int rp_encode_range_append(const rp_kind *kd, const uint8_t *old, const uint8_t *new_,
                           size_t nbytes, int64_t n, int64_t c0, int64_t c1, rp_obuf *out,
                           int64_t *changed, uint64_t sdelta[2], rp_encws *ws, const char **err) {
    int rc = RP_OK;
    rp_encws own = {0}, *w = ws ? ws : &own;
    *changed = 0;
    if (!kind_ok(kd) || n < 0 || c0 < 0 || c1 < c0 || c1 > (n + RP_CHUNK - 1) / RP_CHUNK)
        FAIL(RP_EARG, "bad kind or chunk range");
    for (int64_t i = c0; i < c1 && rc == RP_OK; i++) {
        int64_t s = i * RP_CHUNK, len = n - s < RP_CHUNK ? n - s : RP_CHUNK;
        rc = encode_one(kd, old, new_, nbytes, s, len, NULL, w, sdelta, err);
        *changed += w->kdone;
        if (rc == RP_OK && rp_ws_append(w, out)) FAIL(RP_ENOMEM, "out of memory");
    }
done:
    rp_ws_free(&own);
    return rc;
}

int rp_encode_range(const rp_kind *kd, const uint8_t *old, const uint8_t *new_, size_t nbytes,
                    int64_t n, int64_t c0, int64_t c1, rp_obuf *out, int64_t *changed,
                    uint64_t sdelta[2], rp_encws *ws, const char **err) {
    int rc = rp_encode_range_append(kd, old, new_, nbytes, n, c0, c1, out, changed, sdelta, ws,
                                    err);
    rp_obuf_fit(out);
    return rc;
}
