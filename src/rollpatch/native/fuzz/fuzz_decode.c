/* libFuzzer target: the v2 decoder on hostile payloads (docs/patch-format.md §8).
 *
 * Input: an 8-byte header (kind, size, base seed: fuzz_common.h), then a delta payload. The
 * payload is decoded as rollpatch decodes it: the chunk table, rp_chunk_count per chunk,
 * outputs sized from those counts, rp_decode_chunks over all chunks at once with the AVX2
 * loops, and again one chunk at a time with the scalar loops; the two must agree. A payload
 * that decodes must keep every promise of a decode (fz_check_decoded), apply cleanly with a
 * consistent rp.sum128 change, and re-encode to a payload that decodes to the same changes.
 * The in-place path (rp_decode_apply, chunk by chunk on a copy of the base) must succeed
 * exactly when the decode does, with the same outputs, the same patched bytes and an exact
 * rp.sum128 change, and must leave a failing chunk's bytes as they were; and the whole payload
 * at once through rp_decode_apply_chunks with the in-pass hash (fz_decode_apply_all), and one
 * job per chunk on 3 threads through rp_decode_apply_jobs (fz_decode_apply_jobs), and the
 * payload whole through rp_decode_apply_view with its table parsed there (fz_decode_apply_view).
 * Any other outcome, a sanitizer report or a leak is a bug. */
#include "fuzz_common.h"

static void fz_decode_apply(fz_case *c, const uint8_t *pl, size_t len, const fz_out *ref,
                            const uint8_t *target) {
    int64_t nch = fz_chunks(c), cnt, done = 0;
    size_t offs[FZ_MAXCH], lens[FZ_MAXCH];
    const char *err = NULL;
    int ow = fz_ow(&c->k), rc = RP_OK;
    if (nch > FZ_MAXCH || nch > (int64_t)len || rp_parse_table(pl, len, nch, offs, lens)) {
        if (ref->rc == RP_OK) fz_fail("decode_apply: a table the decode accepted");
        return;
    }
    uint8_t *work = malloc(c->nbytes + 1);
    int64_t *pos = malloc((size_t)c->n * 8 + 8);
    uint8_t *ov = malloc((size_t)c->n * ow + 8), *nv = malloc((size_t)c->n * ow + 8);
    uint64_t delta[2] = {0, 0}, before[2], after[2];
    if (!work || !pos || !ov || !nv) fz_fail("out of memory");
    memcpy(work, fz_base(c), c->nbytes);
    for (int64_t i = 0; i < nch && rc == RP_OK; i++) {
        uint8_t *body = malloc(lens[i] ? lens[i] : 1);
        if (!body) fz_fail("out of memory for a body");
        memcpy(body, pl + offs[i], lens[i]);
        rc = rp_chunk_count(&c->k, body, lens[i], fz_chunk_n(c, i), &cnt, &err);
        if (rc == RP_OK && lens[i]) {
            size_t b0 = (size_t)(i * RP_CHUNK) * (size_t)c->k.bits / 8;
            size_t b1 = (size_t)(i * RP_CHUNK + fz_chunk_n(c, i)) * (size_t)c->k.bits / 8;
            uint8_t *keep = malloc(b1 - b0 + 1);
            if (!keep) fz_fail("out of memory");
            memcpy(keep, work + b0, b1 - b0);
            err = NULL;
            rc = rp_decode_apply(&c->k, work, c->nbytes, body, lens[i], i * RP_CHUNK,
                                 fz_chunk_n(c, i), cnt, pos + done, ov + done * ow,
                                 nv + done * ow, ow, delta, &err);
            if (rc && !err) fz_fail("rp_decode_apply failed without a message");
            if (rc && memcmp(keep, work + b0, b1 - b0)) fz_fail("rp_decode_apply wrote a chunk it refused");
            free(keep);
            if (rc == RP_OK) done += cnt;
        }
        free(body);
    }
    if ((rc == RP_OK) != (ref->rc == RP_OK)) fz_fail("rp_decode_apply and the decode disagree");
    if (rc == RP_OK) {
        if (done != ref->total || memcmp(pos, ref->pos, (size_t)done * 8)
            || memcmp(ov, ref->oldv, (size_t)done * ow) || memcmp(nv, ref->newv, (size_t)done * ow))
            fz_fail("rp_decode_apply's outputs differ from the decode's");
        if (memcmp(work, target, c->nbytes)) fz_fail("rp_decode_apply wrote other bytes than apply");
        fz_sum(fz_base(c), c->nbytes, before);
        fz_sum(work, c->nbytes, after);
        if (after[0] != before[0] + delta[0] || after[1] != before[1] + delta[1])
            fz_fail("rp_decode_apply's sum128 change differs from the digests");
    }
    free(work); free(pos); free(ov); free(nv);
}

/* The same chunks as one job each on 3 of the core's threads (rp_decode_apply_jobs,
 * rp_pool.c): the same outcome and code as rp_decode_apply_chunks (rc, work, its outputs and
 * sums: the first failing chunk is the lowest failing job), the same bytes, the per-job
 * changes and hashes summing to its; on a failure nothing stays written. */
static void fz_decode_apply_jobs(fz_case *c, int64_t nch, const uint8_t *const *bodies,
                                 const size_t *lens, const int64_t *st, const int64_t *nn,
                                 const int64_t *cnt, const int64_t *off, int64_t tot, int rc,
                                 const uint8_t *work, const int64_t *pos, const uint8_t *ov,
                                 const uint8_t *nv, const uint64_t delta[2],
                                 const uint64_t sums[2]) {
    int ow = fz_ow(&c->k);
    rp_dec_job jobs[FZ_MAXCH];
    if (nch < 1) return; /* rp_decode_apply_chunks refuses no chunks; no jobs is no work */
    uint8_t *w2 = malloc(c->nbytes + 1);
    int64_t *pos2 = malloc((size_t)tot * 8 + 8), failed = -2;
    uint8_t *ov2 = malloc((size_t)tot * ow + 8), *nv2 = malloc((size_t)tot * ow + 8);
    if (!w2 || !pos2 || !ov2 || !nv2) fz_fail("out of memory");
    memcpy(w2, fz_base(c), c->nbytes);
    memset(jobs, 0, sizeof jobs);
    for (int64_t i = 0; i < nch; i++) {
        rp_dec_job *b = &jobs[i];
        b->k = &c->k; b->data = w2; b->nbytes = c->nbytes; b->m = 1;
        b->body = &bodies[i]; b->len = &lens[i]; b->start = &st[i]; b->n = &nn[i];
        b->count = &cnt[i]; b->off = &off[i];
        b->pos_out = pos2; b->old_out = ov2; b->new_out = nv2; b->ow = ow; b->hash = 1;
    }
    const char *err = NULL;
    int rc2 = rp_decode_apply_jobs(jobs, nch, 3, &failed, &err);
    if (rc2 != rc) fz_fail("rp_decode_apply_jobs and rp_decode_apply_chunks disagree");
    if (memcmp(w2, work, c->nbytes)) fz_fail("rp_decode_apply_jobs wrote other bytes");
    if (rc2) {
        if (!err || failed < 0 || failed >= nch || !jobs[failed].rc)
            fz_fail("rp_decode_apply_jobs failed without its failing job");
    } else {
        uint64_t d[2] = {0, 0}, h[2] = {0, 0};
        for (int64_t i = 0; i < nch; i++) {
            d[0] += jobs[i].delta[0]; d[1] += jobs[i].delta[1];
            h[0] += jobs[i].sums[0]; h[1] += jobs[i].sums[1];
        }
        if (failed != -1 || d[0] != delta[0] || d[1] != delta[1] || h[0] != sums[0] || h[1] != sums[1])
            fz_fail("rp_decode_apply_jobs' changes or hashes differ");
        if (memcmp(pos2, pos, (size_t)tot * 8) || memcmp(ov2, ov, (size_t)tot * ow)
            || memcmp(nv2, nv, (size_t)tot * ow))
            fz_fail("rp_decode_apply_jobs' outputs differ");
    }
    free(w2); free(pos2); free(ov2); free(nv2);
}

/* The whole payload through rp_decode_apply_chunks at once, with the in-pass hash: it must
 * succeed exactly when the decode does, with the same outputs and bytes, a hash equal to the
 * base's rp.sum128 (every word as read) and a change that reaches the target's; on a failure
 * every chunk it wrote must be put back (the copy equals the base again). */
static void fz_decode_apply_all(fz_case *c, const uint8_t *pl, size_t len, const fz_out *ref,
                                const uint8_t *target) {
    int64_t nch = fz_chunks(c), cnt[FZ_MAXCH], st[FZ_MAXCH], nn[FZ_MAXCH], off[FZ_MAXCH], tot = 0;
    size_t offs[FZ_MAXCH], lens[FZ_MAXCH];
    const uint8_t *bodies[FZ_MAXCH] = {0};
    const char *err = NULL;
    int ow = fz_ow(&c->k), rc = RP_OK;
    if (nch > FZ_MAXCH || nch > (int64_t)len || rp_parse_table(pl, len, nch, offs, lens)) return;
    for (int64_t i = 0; i < nch; i++) {
        uint8_t *body = malloc(lens[i] ? lens[i] : 1);
        if (!body) fz_fail("out of memory for a body");
        memcpy(body, pl + offs[i], lens[i]);
        bodies[i] = body;
        st[i] = i * RP_CHUNK;
        nn[i] = fz_chunk_n(c, i);
        cnt[i] = 0;
        if (lens[i] && rp_chunk_count(&c->k, body, lens[i], nn[i], &cnt[i], &err)) rc = RP_ECORRUPT;
        off[i] = tot;
        tot += cnt[i];
    }
    if (rc == RP_OK) {
        uint8_t *work = malloc(c->nbytes + 1);
        int64_t *pos = malloc((size_t)tot * 8 + 8);
        uint8_t *ov = malloc((size_t)tot * ow + 8), *nv = malloc((size_t)tot * ow + 8);
        uint64_t delta[2] = {0, 0}, sums[2] = {0, 0}, want[2];
        if (!work || !pos || !ov || !nv) fz_fail("out of memory");
        memcpy(work, fz_base(c), c->nbytes);
        err = NULL;
        rc = rp_decode_apply_chunks(&c->k, work, c->nbytes, (int)nch, bodies, lens, st, nn, cnt,
                                    off, pos, ov, nv, ow, delta, sums, &err);
        if (rc && !err) fz_fail("rp_decode_apply_chunks failed without a message");
        if ((rc == RP_OK) != (ref->rc == RP_OK)) fz_fail("rp_decode_apply_chunks and the decode disagree");
        if (rc) {
            if (memcmp(work, fz_base(c), c->nbytes)) fz_fail("rp_decode_apply_chunks kept a write it refused");
        } else {
            if (tot != ref->total || memcmp(pos, ref->pos, (size_t)tot * 8)
                || memcmp(ov, ref->oldv, (size_t)tot * ow) || memcmp(nv, ref->newv, (size_t)tot * ow))
                fz_fail("rp_decode_apply_chunks' outputs differ from the decode's");
            if (target && memcmp(work, target, c->nbytes)) fz_fail("rp_decode_apply_chunks wrote other bytes");
            fz_sum(fz_base(c), c->nbytes, want);
            if (sums[0] != want[0] || sums[1] != want[1]) fz_fail("the in-pass hash differs from the base's sum128");
            fz_sum(work, c->nbytes, want);
            if (sums[0] + delta[0] != want[0] || sums[1] + delta[1] != want[1])
                fz_fail("in-pass hash + change differs from the target's sum128");
        }
        fz_decode_apply_jobs(c, nch, bodies, lens, st, nn, cnt, off, tot, rc, work, pos, ov, nv,
                             delta, sums);
        free(work); free(pos); free(ov); free(nv);
    }
    for (int64_t i = 0; i < nch; i++) free((void *)bodies[i]);
}

/* The whole payload through rp_decode_apply_view (rp_view.c: the table and counts parsed
 * there, one job per chunk on 3 threads), told the decode's count: it must succeed exactly
 * when the decode does, with its outputs, the target's bytes and the in-pass hash; told one
 * change more (or, for a refused payload, none), it must refuse with the tensor named and
 * every byte in place. */
static void fz_decode_apply_view(fz_case *c, const uint8_t *pl, size_t len, const fz_out *ref,
                                 const uint8_t *target) {
    int ow = fz_ow(&c->k);
    for (int lie = 0; lie < 2; lie++) {
        int64_t k = ref->rc == RP_OK ? ref->total + lie : 0;
        if (ref->rc != RP_OK && lie) return;
        uint8_t *work = malloc(c->nbytes + 1);
        int64_t *pos = malloc((size_t)k * 8 + 8), failed = -2;
        uint8_t *ov = malloc((size_t)k * ow + 8), *nv = malloc((size_t)k * ow + 8);
        uint64_t want[2];
        if (!work || !pos || !ov || !nv) fz_fail("out of memory");
        memcpy(work, fz_base(c), c->nbytes);
        rp_dec_tensor t = {&c->k, work, c->nbytes, c->n, pl, len, k, 1, pos, ov, nv, {0, 0}, {0, 0}};
        const char *err = NULL;
        int rc = rp_decode_apply_view(&t, 1, 3, 1, &failed, &err);
        if (ref->rc == RP_OK && !lie) {
            if (rc) fz_fail("rp_decode_apply_view refused what the decode accepts");
            if (failed != -1 || memcmp(pos, ref->pos, (size_t)k * 8)
                || memcmp(ov, ref->oldv, (size_t)k * ow) || memcmp(nv, ref->newv, (size_t)k * ow))
                fz_fail("rp_decode_apply_view's outputs differ from the decode's");
            if (memcmp(work, target, c->nbytes)) fz_fail("rp_decode_apply_view wrote other bytes");
            fz_sum(fz_base(c), c->nbytes, want);
            if (t.sums[0] != want[0] || t.sums[1] != want[1])
                fz_fail("rp_decode_apply_view's hash differs from the base's sum128");
            fz_sum(work, c->nbytes, want);
            if (t.sums[0] + t.delta[0] != want[0] || t.sums[1] + t.delta[1] != want[1])
                fz_fail("rp_decode_apply_view's hash + change differs from the target's");
        } else {
            if (rc == RP_OK || !err || failed != 0) fz_fail("rp_decode_apply_view took a false count");
            if (memcmp(work, fz_base(c), c->nbytes)) fz_fail("rp_decode_apply_view kept a write it refused");
        }
        free(work); free(pos); free(ov); free(nv);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static int verbose = -1; /* FZ_VERBOSE=1: one line per input (checks the seed corpus) */
    fz_case c;
    fz_out a, b, again;
    if (verbose < 0) verbose = getenv("FZ_VERBOSE") != NULL;
    if (fz_derive(data, size, &c)) return 0;
    fz_simd = 1;
    fz_decode(&c, c.rest, c.rest_len, FZ_MAXCH, &a);
    fz_simd = 0;
    fz_decode(&c, c.rest, c.rest_len, 1, &b);
    fz_simd = 1;
    fz_same(&c, &a, &b, "AVX2 all-chunks decode differs from scalar per-chunk decode");
    if (verbose)
        fprintf(stderr, "fz: bits=%d cbits=%d n=%lld rc=%d changed=%lld\n", c.k.bits, c.k.cbits,
                (long long)c.n, a.rc, (long long)a.total);
    if (a.rc == RP_OK) {
        fz_check_decoded(&c, &a);
        uint8_t *target = fz_apply(&c, &a);
        fz_decode_apply(&c, c.rest, c.rest_len, &a, target);
        fz_decode_apply_all(&c, c.rest, c.rest_len, &a, target);
        fz_decode_apply_view(&c, c.rest, c.rest_len, &a, target);
        int64_t changed[FZ_MAXCH];
        size_t plen;
        uint8_t *pl = fz_encode(&c, target, &plen, changed);
        fz_decode(&c, pl, plen, FZ_MAXCH, &again);
        fz_same(&c, &a, &again, "re-encoding a decoded patch decodes differently");
        fz_out_free(&again);
        free(pl);
        free(target);
    }
    else {
        fz_decode_apply(&c, c.rest, c.rest_len, &a, NULL);
        fz_decode_apply_all(&c, c.rest, c.rest_len, &a, NULL);
        fz_decode_apply_view(&c, c.rest, c.rest_len, &a, NULL);
    }
    fz_out_free(&a);
    fz_out_free(&b);
    return 0;
}
