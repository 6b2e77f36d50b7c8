/* rollpatch native core: the decoder of codec rp.ctxgolomb.v2 (docs/patch-format.md §4b):
 * binary sequences, params, phases A and C of a lane, and the chunk-after-chunk decode with
 * its all-or-nothing in-place write. Phase B, the join, is rp_join.c. The numpy module
 * rollpatch.patch.ctxv2 is the executable reference: tests require identical decodes. */
#include "rp_lane.h"

/* ------------------------------------------------------------------ binary sequences */

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
        rc = lane_init(kd, l, body[q], len[q], n[q], count[q], err);
        if (rc) break;
        l->pos_out = pos_out + off[q];
        l->old_out = (uint8_t *)old_out + off[q] * ow;
        l->new_out = (uint8_t *)new_out + off[q] * ow;
        l->ow = ow;
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
        rp_lane_group(kd, l, start[q], n[q]);
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
