/* libFuzzer target: encoder/decoder round trip, a differential check (docs/patch-format.md §8).
 *
 * Input: an 8-byte header (kind, size, base seed: fuzz_common.h); byte 8 a density of random
 * changes (byte 9 their style), then 8-byte edits (3 bytes position, 1 byte op, 4 bytes value)
 * that set chosen elements to chosen words: sign flips, extreme keys, NaN payloads, ±0.
 * Per chunk the three encoders must write the same bytes: the fused dense pass with AVX-512,
 * AVX2 and scalar loops (rp_encode_chunk), the sparse one from rp_diff's positions
 * (rp_encode_chunk_sparse), the one from records (rp_encode_records) and the keep path that
 * also hands over the changes (rp_encode_chunk_keep: they must equal rp_diff's); the range
 * encoder (rp_encode_range, work buffers reused across chunks and inputs) the whole payload,
 * with AVX-512 and scalar loops. The payload must
 * decode to exactly the diff; rp_apply must turn the base into the target with a consistent
 * rp.sum128 change, and refuse, writing nothing, a base that differs at one changed position;
 * rp_gather must read the new elements back; rp.sum128 must add up over any split of words;
 * rp_compose of base -> mid -> target must give the base -> target change. */
#include "fuzz_common.h"

static uint64_t to_key(const rp_kind *k, uint64_t x) {
    uint64_t s = 1ULL << (k->bits - 1), m = fz_mask(k->bits);
    if (k->order == RP_SIGNMAG) return (x & s) ? (~x & m) : (x | s);
    return k->order == RP_TWOS ? x ^ s : x;
}

static uint64_t from_key(const rp_kind *k, uint64_t y) {
    uint64_t s = 1ULL << (k->bits - 1), m = fz_mask(k->bits);
    if (k->order == RP_SIGNMAG) return (y & s) ? (y ^ s) : (~y & m);
    return k->order == RP_TWOS ? y ^ s : y;
}

/* The target: the base with random changes (density from byte 0 of `ed`) and explicit edits. */
static uint8_t *perturb(fz_case *c, const uint8_t *ed, size_t len) {
    const rp_kind *k = &c->k;
    uint8_t *t = malloc(c->nbytes);
    uint64_t m = fz_mask(k->bits);
    if (!t) fz_fail("out of memory for the target");
    memcpy(t, fz_base(c), c->nbytes);
    if (len >= 2 && ed[0]) {
        /* up to ~99% changed; at most 0.4% across the chunk boundary, as real steps are
         * (a dense 2-chunk case costs seconds under the sanitizers) */
        uint64_t thr = c->n > RP_CHUNK / 2 ? ed[0] : (uint64_t)ed[0] * ed[0], style = ed[1];
        for (int64_t i = 0; i < c->n; i++) {
            uint64_t z = fz_mix(c->seed ^ 0x5851F42D4C957F2DULL ^ (uint64_t)i * 0x2545F4914F6CDD1DULL);
            if ((z & 0xFFFF) >= thr) continue;
            uint64_t x = fz_get(t, k->bits, i), step = 1 + ((z >> 16) & ((1ULL << (style & 15)) - 1));
            uint64_t y = (style & 0x80) ? (z >> 20) & m
                                        : from_key(k, (to_key(k, x) + ((z >> 63) ? step : 0 - step)) & m);
            fz_put(t, k->bits, i, y);
        }
    }
    for (size_t o = 2; o + 8 <= len; o += 8) {
        const uint8_t *e = ed + o;
        int64_t i = (int64_t)((e[0] | e[1] << 8 | (uint64_t)e[2] << 16) % (uint64_t)c->n);
        uint32_t v32 = (uint32_t)e[4] | (uint32_t)e[5] << 8 | (uint32_t)e[6] << 16 | (uint32_t)e[7] << 24;
        uint64_t v = (uint64_t)v32 * 0x100000001ULL, x = fz_get(t, k->bits, i), y;
        switch (e[3] & 7) {
        case 0: y = x ^ v; break;                                        /* flip chosen bits */
        case 1: y = v; break;                                            /* set a word */
        case 2: y = from_key(k, (to_key(k, x) + (uint64_t)(int64_t)(int32_t)v32) & m); break;
        case 3: y = x ^ (1ULL << (k->bits - 1)); break;                  /* sign flip: ±0 too */
        case 4: y = from_key(k, (to_key(k, x) + (1ULL << (k->bits - 1))) & m); break; /* farthest */
        case 5: y = e[3] & 8 ? m : 0; break;                             /* all ones (NaN) / zero */
        case 6: y = from_key(k, v32 & 1 ? m : 0); break;                 /* extreme keys */
        default: y = x + 1; break;
        }
        fz_put(t, k->bits, i, y & m);
    }
    return t;
}

/* The encoder's keep path (rp_encode_chunk_keep, the publisher's one-pass encode and diff)
 * on chunk i must write `body`, hand over exactly rp_diff's changes (positions relative to the
 * chunk, old and new elements) and the same rp.sum128 change as rp_encode_chunk. */
static void keep_path(const fz_case *c, const uint8_t *t, int64_t i, const uint8_t *body,
                      size_t blen, const int64_t *pos, const uint64_t *ov, const uint64_t *nv,
                      int64_t found) {
    const rp_kind *k = &c->k;
    int64_t s = i * RP_CHUNK, n = fz_chunk_n(c, i), got = -1, got2 = -1;
    uint8_t *out = NULL, *out2 = NULL;
    size_t olen = 0, olen2 = 0;
    uint64_t d[2] = {0, 0}, d2[2] = {0, 0}, *kov = NULL, *knv = NULL;
    uint32_t *kpos = NULL;
    const char *err = NULL;
    if (rp_encode_chunk_keep(k, c->base, t, c->nbytes, s, n, &out, &olen, &got, d, &kpos, &kov,
                             &knv, &err))
        fz_fail("rp_encode_chunk_keep failed");
    if (rp_encode_chunk(k, c->base, t, c->nbytes, s, n, &out2, &olen2, &got2, d2, &err))
        fz_fail("rp_encode_chunk failed");
    if (olen != blen || (blen && memcmp(out, body, blen))) fz_fail("keep encoder bytes differ");
    if (got != found || got2 != found) fz_fail("keep encoder counts other changes than rp_diff");
    if (d[0] != d2[0] || d[1] != d2[1]) fz_fail("keep encoder's sum128 change differs");
    if (found && (!kpos || !kov || !knv)) fz_fail("keep encoder handed over no changes");
    for (int64_t j = 0; j < found; j++)
        if ((int64_t)kpos[j] != pos[j] || kov[j] != ov[j] || knv[j] != nv[j])
            fz_fail("keep encoder's changes differ from rp_diff");
    free(out); free(out2); free(kpos); free(kov); free(knv);
}

/* rp_encode_chunk_sparse and rp_encode_records on chunk i must write `body`. */
static void other_encoders(const fz_case *c, const uint8_t *t, int64_t i, const uint8_t *body,
                           size_t blen, int64_t changed) {
    const rp_kind *k = &c->k;
    int64_t s = i * RP_CHUNK, n = fz_chunk_n(c, i), found = 0;
    int64_t *pos = malloc((size_t)n * 8 + 8);
    uint64_t *ov = malloc((size_t)n * 8 + 8), *nv = malloc((size_t)n * 8 + 8);
    uint32_t *rank = malloc((size_t)n * 4 + 4);
    uint8_t *ctx = malloc((size_t)n + 1), *out = NULL;
    uint64_t ncnt[256] = {0};
    size_t olen = 0;
    const char *err = NULL;
    if (!pos || !ov || !nv || !rank || !ctx) fz_fail("out of memory");
    rp_diff(k, c->base, t, s, n, pos, n, &found);
    if (found != changed) fz_fail("rp_diff and rp_encode_chunk count different changes");
    int64_t j = 0;
    for (int64_t e = 0; e < n; e++) { /* contexts and ranks of the changes, the slow way */
        uint64_t x = fz_get(c->base, k->bits, s + e);
        unsigned cx = k->cbits ? (unsigned)((x >> k->shift) & ((1u << k->cbits) - 1)) : 0;
        if (j < found && pos[j] == s + e) {
            ctx[j] = (uint8_t)cx;
            rank[j] = (uint32_t)ncnt[cx];
            ov[j] = x;
            nv[j] = fz_get(t, k->bits, s + e);
            j++;
        }
        ncnt[cx]++;
    }
    for (j = 0; j < found; j++) pos[j] -= s;
    if (rp_encode_chunk_sparse(k, c->base, s, n, pos, ov, nv, found, &out, &olen, &err))
        fz_fail("rp_encode_chunk_sparse failed");
    if (olen != blen || (blen && memcmp(out, body, blen))) fz_fail("sparse encoder bytes differ");
    free(out);
    out = NULL;
    if (rp_encode_records(k, n, ncnt, pos, ctx, rank, ov, nv, found, &out, &olen, &err))
        fz_fail("rp_encode_records failed");
    if (olen != blen || (blen && memcmp(out, body, blen))) fz_fail("records encoder bytes differ");
    free(out);
    keep_path(c, t, i, body, blen, pos, ov, nv, found);
    free(pos); free(ov); free(nv); free(rank); free(ctx);
}

/* rp_gather reads back the new elements; rp_apply onto a base that differs at one changed
 * position refuses with RP_EBASE and leaves every byte as it was (all or nothing). */
static void check_gather_refuse(fz_case *c, const uint8_t *t, const fz_out *o, uint64_t pick) {
    int ow = fz_ow(&c->k);
    uint8_t *got = malloc((size_t)o->total * ow + 8), *w = malloc(c->nbytes), *snap = malloc(c->nbytes);
    uint64_t delta[2] = {0, 0};
    const char *err = NULL;
    if (!got || !w || !snap) fz_fail("out of memory");
    if (rp_gather(&c->k, t, c->n, o->pos, o->total, got, ow, &err)
        || memcmp(got, o->newv, (size_t)o->total * ow))
        fz_fail("rp_gather of the target differs from the decoded new elements");
    if (o->total) {
        int64_t j = (int64_t)(pick % (uint64_t)o->total);
        memcpy(w, c->base, c->nbytes);
        fz_put(w, c->k.bits, o->pos[j], fz_get(w, c->k.bits, o->pos[j]) ^ 1);
        memcpy(snap, w, c->nbytes);
        if (rp_apply(&c->k, w, c->nbytes, o->pos, o->oldv, o->newv, o->total, ow, 0, 0, NULL,
                     delta, &err) != RP_EBASE)
            fz_fail("rp_apply accepted a base that differs at a changed position");
        if (memcmp(w, snap, c->nbytes) || delta[0] || delta[1])
            fz_fail("rp_apply changed a base it refused");
    }
    free(got); free(w); free(snap);
}

/* Changes a -> b as rp_diff's positions and the two sides' elements (width ow). */
static int64_t diff_lists(const fz_case *c, const uint8_t *a, const uint8_t *b, int64_t **pos,
                          uint8_t **ov, uint8_t **nv) {
    int ow = fz_ow(&c->k);
    int64_t n = c->n, found = 0;
    const char *err = NULL;
    *pos = malloc((size_t)n * 8 + 8);
    *ov = malloc((size_t)n * ow + 8);
    *nv = malloc((size_t)n * ow + 8);
    if (!*pos || !*ov || !*nv) fz_fail("out of memory");
    rp_diff(&c->k, a, b, 0, n, *pos, n, &found);
    if (rp_gather(&c->k, a, n, *pos, found, *ov, ow, &err)
        || rp_gather(&c->k, b, n, *pos, found, *nv, ow, &err))
        fz_fail("rp_gather refused rp_diff's positions");
    if (c->k.bits >= 8) { /* the words taken in the compare's pass = the gathers' */
        int64_t *p2 = malloc((size_t)n * 8 + 8), f2 = -1;
        uint8_t *o2 = malloc((size_t)n * ow + 8), *n2 = malloc((size_t)n * ow + 8);
        if (!p2 || !o2 || !n2) fz_fail("out of memory");
        if (rp_diff_words(&c->k, a, b, 0, n, p2, o2, n2, n, &f2) != RP_OK || f2 != found
            || (found && (memcmp(p2, *pos, (size_t)found * 8)
                          || memcmp(o2, *ov, (size_t)found * ow)
                          || memcmp(n2, *nv, (size_t)found * ow))))
            fz_fail("rp_diff_words differs from rp_diff and two gathers");
        /* a copy of a with the change written in is b; an old word off by one bit is refused
         * at its change */
        uint8_t *cp = malloc(c->nbytes + 8);
        int64_t bad = -2;
        if (!cp) fz_fail("out of memory");
        if (rp_copy_apply(ow, a, cp, c->nbytes, *pos, *ov, *nv, found, &bad) != RP_OK
            || memcmp(cp, b, c->nbytes))
            fz_fail("rp_copy_apply of a with the change is not b");
        if (found) {
            int64_t j = (int64_t)(c->seed % (uint64_t)found);
            o2[(size_t)j * ow] ^= 1;
            if (rp_copy_apply(ow, a, cp, c->nbytes, *pos, o2, *nv, found, &bad) != RP_EBASE
                || bad != j)
                fz_fail("rp_copy_apply took a wrong old word");
        }
        free(cp);
        free(p2); free(o2); free(n2);
    }
    return found;
}

/* rp_compose of base -> mid with mid -> target must be exactly the decoded base -> target
 * change (`o`): mid has about half of the changes (some to the target's word, some to another)
 * and words changed that the target puts back (dropped as no-ops); then a second list whose old
 * word disagrees with the first's new one at a shared position is refused (RP_EBASE). The
 * vector loop (AVX-512) or the scalar one, as the input's level allows. */
static void check_compose(const fz_case *c, const uint8_t *t, const fz_out *o) {
    int ow = fz_ow(&c->k);
    uint64_t m = fz_mask(c->k.bits);
    uint8_t *mid = malloc(c->nbytes);
    if (!mid) fz_fail("out of memory");
    memcpy(mid, c->base, c->nbytes);
    for (int64_t j = 0; j < o->total; j++) {
        uint64_t z = fz_mix(c->seed ^ 0x9E3779B97F4A7C15ULL ^ (uint64_t)j * 0xBF58476D1CE4E5B9ULL);
        if (z & 1) fz_put(mid, c->k.bits, o->pos[j], z & 2 ? fz_arr(o->newv, ow, j) : (z >> 8) & m);
    }
    for (int64_t e = 0; e < c->n && e < 4096; e += 1 + (int64_t)(c->seed % 61)) /* put back */
        if (fz_get(t, c->k.bits, e) == fz_get(c->base, c->k.bits, e))
            fz_put(mid, c->k.bits, e, fz_get(c->base, c->k.bits, e) ^ 1);
    int64_t *pp, *qp, *rp = malloc((size_t)(2 * c->n) * 8 + 8);
    uint8_t *po, *pn, *qo, *qn, *ro = malloc((size_t)(2 * c->n) * ow + 8), *rn = malloc((size_t)(2 * c->n) * ow + 8);
    if (!rp || !ro || !rn) fz_fail("out of memory");
    int64_t np_ = diff_lists(c, c->base, mid, &pp, &po, &pn), nq = diff_lists(c, mid, t, &qp, &qo, &qn);
    int64_t nr = -1;
    const char *err = NULL;
    if (rp_compose(ow, pp, po, pn, np_, qp, qo, qn, nq, rp, ro, rn, &nr, &err))
        fz_fail("rp_compose refused two lists of changes that follow each other");
    if (nr != o->total || memcmp(rp, o->pos, (size_t)nr * 8) || memcmp(ro, o->oldv, (size_t)nr * ow)
        || memcmp(rn, o->newv, (size_t)nr * ow))
        fz_fail("rp_compose of base -> mid -> target differs from the decoded change");
    for (int64_t i = 0, j = 0; i < np_ && j < nq;) { /* a shared position: disagree there */
        if (pp[i] < qp[j]) i++;
        else if (qp[j] < pp[i]) j++;
        else {
            qo[(size_t)j * ow] ^= 1;
            if (rp_compose(ow, pp, po, pn, np_, qp, qo, qn, nq, rp, ro, rn, &nr, &err) != RP_EBASE)
                fz_fail("rp_compose accepted lists that disagree on an intermediate element");
            break;
        }
    }
    free(pp); free(po); free(pn); free(qp); free(qo); free(qn); free(rp); free(ro); free(rn); free(mid);
}

static void check_sum_split(const uint8_t *d, size_t len, uint64_t w) {
    uint64_t nw = ((uint64_t)len + 7) / 8, all[2], lo[2], hi[2];
    w = nw ? w % (nw + 1) : 0;
    rp_sum128(d, len, 0, nw, all);
    rp_sum128(d, len, 0, w, lo);
    rp_sum128(d, len, w, nw - w, hi);
    if (lo[0] + hi[0] != all[0] || lo[1] + hi[1] != all[1]) fz_fail("rp_sum128 is not additive");
}

/* rp_encode_range over every chunk must write the joined payload `pl` (each chunk's varint
 * length + body), count every change and sum the same rp.sum128 change, with a workspace kept
 * from earlier inputs (other kinds and sizes: buffers reused across chunks and tensors) and
 * with one of its own; its output buffer may start non-empty (it appends). */
static void range_path(const fz_case *c, const uint8_t *t, const uint8_t *pl, size_t plen,
                       int64_t total) {
    static rp_encws *kept;
    uint64_t sa[2], sb[2];
    rp_sum128(c->base, c->nbytes, 0, (c->nbytes + 7) / 8, sa);
    rp_sum128(t, c->nbytes, 0, (c->nbytes + 7) / 8, sb);
    if (!kept && !(kept = rp_ws_new())) fz_fail("out of memory");
    for (int own = 0; own < 2; own++) {
        rp_obuf o = {0};
        int64_t got = 0;
        uint64_t sd[2] = {0, 0};
        const char *err = NULL;
        if (rp_obuf_reserve(&o, 3)) fz_fail("out of memory");
        memcpy(o.b, "pre", 3);
        o.len = 3;
        if (rp_encode_range(&c->k, c->base, t, c->nbytes, c->n, 0, fz_chunks(c), &o, &got, sd,
                            own ? NULL : kept, &err))
            fz_fail("rp_encode_range failed");
        if (o.len != plen + 3 || memcmp(o.b, "pre", 3) || memcmp(o.b + 3, pl, plen))
            fz_fail("rp_encode_range bytes differ from the chunks' bodies");
        if (got != total) fz_fail("rp_encode_range counts other changes");
        if (sd[0] != sb[0] - sa[0] || sd[1] != sb[1] - sa[1])
            fz_fail("rp_encode_range's sum128 change differs from the re-hash");
        rp_obuf_free(&o);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fz_case c;
    fz_out o;
    if (fz_derive(data, size, &c)) return 0;
    uint8_t *t = perturb(&c, c.rest, c.rest_len);
    int64_t nch = fz_chunks(&c), changed[FZ_MAXCH], changed2[FZ_MAXCH], total = 0;
    size_t plen, plen2;
    fz_simd = 1;
    uint8_t *pl = fz_encode(&c, t, &plen, changed);
    fz_simd = 0;
    uint8_t *pl2 = fz_encode(&c, t, &plen2, changed2);
    fz_simd = 1;
    if (plen != plen2 || memcmp(pl, pl2, plen)) fz_fail("vector and scalar encoders differ");
    if (fz_avx512) { /* this input's vector loops were AVX-512: AVX2 must agree too */
        free(pl2);
        fz_avx512 = 0;
        pl2 = fz_encode(&c, t, &plen2, changed2);
        fz_avx512 = 1;
        if (plen != plen2 || memcmp(pl, pl2, plen)) fz_fail("AVX-512 and AVX2 encoders differ");
    }
    size_t q = 0; /* walk the joined table to compare each body with the other encoders */
    for (int64_t i = 0; i < nch; i++) {
        uint64_t len = 0;
        for (int s = 0;; s++) {
            uint8_t b = pl[q++];
            len |= (uint64_t)(b & 0x7F) << (7 * s);
            if (!(b & 0x80)) break;
        }
        other_encoders(&c, t, i, pl + q, (size_t)len, changed[i]);
        q += len;
        total += changed[i];
    }
    range_path(&c, t, pl, plen, total);
    fz_simd = 0;
    range_path(&c, t, pl, plen, total);
    fz_simd = 1;
    fz_decode(&c, pl, plen, FZ_MAXCH, &o);
    if (o.rc) fz_fail("a fresh payload does not decode");
    if (o.total != total) fz_fail("decoded count differs from the encoder's");
    fz_check_decoded(&c, &o);
    for (int64_t i = 0; i < o.total; i++)
        if (fz_arr(o.newv, fz_ow(&c.k), i) != fz_get(t, c.k.bits, o.pos[i]))
            fz_fail("decoded new element is not the target's");
    uint8_t *applied = fz_apply(&c, &o);
    if (memcmp(applied, t, c.nbytes)) fz_fail("base + decoded patch != target");
    check_sum_split(t, c.nbytes, c.seed ^ (uint64_t)size);
    check_gather_refuse(&c, t, &o, c.seed + (uint64_t)size);
    check_compose(&c, t, &o);
    free(applied);
    fz_out_free(&o);
    free(pl); free(pl2); free(t);
    return 0;
}
