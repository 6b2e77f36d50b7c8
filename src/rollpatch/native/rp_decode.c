/* rollpatch native core: the decoder of codec rp.ctxgolomb.v2 (docs/patch-format.md §4b):
 * params, phases A and C of a lane (its binary sequences are rp_bseq.h), and the
 * chunk-after-chunk decode with its all-or-nothing in-place write. Phase B, the join, is
 * rp_join.c. The numpy module rollpatch.patch.ctxv2 is the executable reference: tests
 * require identical decodes. */
#include "rp_bseq.h"
#include "rp_lane.h"

#ifdef RP_PROF /* cycles per phase, printed at exit (rp_lane.h) */
#include <stdio.h>
uint64_t rp_prof[8];
__attribute__((destructor)) static void prof_dump(void) {
    static const char *nm[8] = {"A", "B+group", "group", "-", "A ranks", "A signs", "A mags", "-"};
    for (int i = 0; i < 8; i++)
        if (rp_prof[i]) fprintf(stderr, "  %-8s %9.1f Mcyc\n", nm[i], rp_prof[i] / 1e6);
}
#endif

/* ------------------------------------------------------------------ decoder */

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

static void lane_free(lane_t *l) {
    free(l->ranks); free(l->scratch); free(l->idx); free(l->outw); free(l->magc);
    free(l->rpos); free(l->rold); free(l->rci); free(l->jbm);
    l->jbm = NULL;
    l->jbmcap = 0;
    free(l->abm);
    l->abm = NULL;
    l->abmcap = 0;
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
    l->outw = malloc((c / 64 + 2) * 8);
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
    l->u = (br_t){b + l->pp.ustart, l->pp.ulen * 8, 0};
    l->f = (br_t){b + l->pp.fstart, (l->pp.end - l->pp.fstart) * 8, 0};
    for (int c = 0; c < NCTX; c++) l->tgt[c] = UINT32_MAX;
    memset(l->cnt, 0, sizeof l->cnt);
    const int v512 = rp_avx512(RP_V512_BSEQ);
    uint64_t o = 0, t0 = PROF_T();
    /* room for every listed context's bitmap, for the AVX-512 join (kept by the lane) */
    uint64_t *abm = NULL;
    if (v512 && kd->cbits) {
        size_t need = 0;
        for (int i = 0; i < l->pp.g; i++) need += (l->pp.nc[i] + 63) / 64 + 2;
        if (need > l->abmcap) {
            free(l->abm);
            l->abmcap = 0;
            l->abm = malloc((need + need / 4 + 1) * 8);
            if (l->abm) l->abmcap = need + need / 4 + 1;
        }
        abm = l->abm;
    }
    size_t ao = 0;
    for (int i = 0; i < l->pp.g; i++) {
        int c = l->pp.cid[i], isbm = 0;
        if (bs_decode_bm(&l->u, &l->f, l->pp.nc[i], l->pp.kc[i], l->ranks + o, l->scratch, v512,
                         abm ? abm + ao : NULL, &isbm)) {
            *err = "corrupt position stream"; return RP_ECORRUPT;
        }
        l->abo[i] = isbm ? (int64_t)ao : -1;
        if (isbm) ao += (l->pp.nc[i] + 63) / 64 + 2;
        l->ofs[i] = o;
        l->cur[c] = o;
        l->endr[c] = o + l->pp.kc[i];
        l->tgt[c] = l->ranks[o];
        o += l->pp.kc[i];
    }
    PROF_ADD(4, t0);
    t0 = PROF_T();
    if (bs_decode_bits(&l->u, &l->f, k, l->pp.ks, l->outw, l->idx, l->scratch, v512)) {
        *err = "corrupt sign stream"; return RP_ECORRUPT;
    }
    { /* fields in locals: the stores may alias them (-fno-strict-aliasing) */
        void *const magc = l->magc;
        const int mw = l->mw;
        if (mw == 2) for (uint64_t i = 0; i < k; i++) ((uint16_t *)magc)[i] = 1;
        else for (uint64_t i = 0; i < k; i++) arr_put(magc, mw, (int64_t)i, 1);
    }
    PROF_ADD(5, t0);
    t0 = PROF_T();
    uint64_t bo[NCTX], nb = 0;
    for (int i = 0; i < l->pp.g; i++) {
        if (bs_decode(&l->u, &l->f, l->pp.kc[i], l->pp.bc[i], l->idx + nb, l->scratch, v512)) {
            *err = "corrupt magnitude flags"; return RP_ECORRUPT;
        }
        bo[i] = nb;
        nb += l->pp.bc[i];
    }
    uint64_t s = ksign(kd->bits);
    int width = kd->bits < 63 ? kd->bits : 63;
    { /* fields and readers in locals: the stores may alias them (-fno-strict-aliasing) */
        br_t u = l->u, f = l->f;
        void *const magc = l->magc;
        const int mw = l->mw;
        const uint32_t *const idx = l->idx;
        uint32_t *const qb = l->scratch; /* room for k + 1 */
        for (int i = 0; i < l->pp.g; i++) {
            const int eg = l->pp.eg[i];
            const uint64_t bc = l->pp.bc[i], o_ = l->ofs[i], b_ = bo[i];
            /* a context's Exp-Golomb codes: their unary parts are consecutive in one stream
             * and their low bits in the other, so the unary parts are read as one run
             * (q + eg <= width: the limit), then the low bits at a cursor */
            if (br_unary_run(&u, bc, (uint64_t)(width - eg), qb, v512)) {
                *err = "corrupt magnitude stream"; return RP_ECORRUPT;
            }
            const uint8_t *const fb = f.b;
            const size_t nbits = f.nbits;
            size_t fp = f.pos;
            uint64_t j = 0;
            if (mw == 2 && width <= 16) { /* w <= 16: one load per code while 8 bytes remain
                                           * (>= 57 bits: no overrun), no switch per store */
                uint16_t *const m16 = (uint16_t *)magc;
                const size_t nbytes = nbits >> 3;
                for (; j < bc && (fp >> 3) + 8 <= nbytes; j++) {
                    const uint64_t w = qb[j] + (uint64_t)eg;
                    const uint64_t low = (load_be64(fb + (fp >> 3)) << (fp & 7)) >> (63 - w) >> 1;
                    fp += w;
                    const uint64_t a = ((1ULL << w) + low - (1ULL << eg)) + 2; /* >= 2 */
                    if (a > s) { *err = "delta magnitude beyond the word range"; return RP_ECORRUPT; }
                    m16[o_ + idx[b_ + j]] = (uint16_t)a;
                }
            }
            for (; j < bc; j++) {
                uint64_t w = qb[j] + (uint64_t)eg; /* <= 63 */
                if (w > nbits - fp) { *err = "corrupt magnitude stream"; return RP_ECORRUPT; }
                uint64_t low = peek64(fb, nbits, fp) >> (63 - w) >> 1;
                fp += w;
                uint64_t a = ((1ULL << w) + low - (1ULL << eg)) + 2;
                if (a > s || a < 2) { *err = "delta magnitude beyond the word range"; return RP_ECORRUPT; }
                arr_put(magc, mw, (int64_t)(o_ + idx[b_ + j]), a);
            }
            f.pos = fp;
        }
        l->u = u;
        l->f = f;
    }
    PROF_ADD(6, t0);
    if (br_finish(&l->u, 1) || br_finish(&l->f, 0)) { *err = "unused bits after the last code"; return RP_ECORRUPT; }
    l->emitted = l->done = 0;
    l->cj = UINT64_MAX;
    l->d0 = l->d1 = 0;
    return RP_OK;
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
            rp_lane_hash_to(kd, l, start[q], n[q]);
            continue;
        }
        uint64_t t0 = PROF_T();
        rc = lane_init(kd, l, body[q], len[q], n[q], count[q], err);
        PROF_ADD(0, t0);
        if (rc) break;
        l->pos_out = pos_out + off[q];
        l->old_out = (uint8_t *)old_out + off[q] * ow;
        l->new_out = (uint8_t *)new_out + off[q] * ow;
        l->ow = ow;
        t0 = PROF_T();
        if (kd->cbits) {
            rp_join_lane(kd, base, l, start[q], n[q]);
        } else { /* one context: the ranks are the positions */
            for (uint64_t i = 0; i < l->pp.k; i++) {
                l->rpos[i] = l->ranks[i];
                l->rold[i] = elem_get(base, kd->bits, start[q] + l->ranks[i]);
                l->rci[i] = (uint32_t)i;
            }
            l->emitted = (int64_t)l->pp.k;
        }
        rp_lane_group(kd, l, start[q], n[q], 1);
        PROF_ADD(1, t0);
        rc = lane_finish(kd, l, err);
        if (rc) { /* all or nothing: put back what this chunk wrote */
            if (wdata) put_back(wdata, kd->bits, l->pos_out, l->old_out, ow, l->done);
            break;
        }
        if (wdata) {
            d0 += l->d0;
            d1 += l->d1;
        }
    }
    if (rc && wdata) /* and what the earlier chunks of this call wrote */
        for (int p = q - 1; p >= 0; p--)
            put_back(wdata, kd->bits, pos_out + off[p], (const uint8_t *)old_out + off[p] * ow,
                     ow, count[p]);
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
