/* rollpatch native core: the encoder of codec rp.ctxgolomb.v2 (docs/patch-format.md §4b):
 * binary sequences and Exp-Golomb codes, and the coding of a chunk's records (the encoders
 * from changes found elsewhere: rp_encsparse.c). The numpy module
 * rollpatch.patch.ctxv2 is the executable reference: tests require byte-identical payloads. */
#include "rp_internal.h"

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
                     uint32_t *scratch, uint32_t sm) { /* sm: the bits of set[] that count */
    if (j == 0 || j == n) return 0;
    int comp = 2 * j > n;
    uint64_t c = comp ? n - j : j, m = golomb_m(n, c);
    if (m == 1) { /* one bit per slot, 32 slots per word */
        if (bw_reserve(f, n / 8 + 16)) return -1;
        uint64_t s = 0;
        for (uint64_t p = 0; p < n; p += 32) {
            unsigned take = n - p < 32 ? (unsigned)(n - p) : 32;
            uint32_t word = 0;
            for (; s < j && (set[s] & sm) < p + take; s++) word |= 1u << (take - 1 - ((set[s] & sm) - p));
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
            uint64_t g = (uint64_t)((int64_t)(set[i] & sm) - prev - 1);
            prev = (int64_t)(set[i] & sm);
            uint64_t q = (uint64_t)(((unsigned __int128)g * minv) >> 64);
            bw_unary_nc(u, q);
            scratch[i] = (uint32_t)(g - q * m);
        }
    } else { /* the clear slots: walk the gaps between set ones */
        uint64_t i = 0, s = 0;
        for (uint64_t p = 0; i < c; p++) {
            if (s < j && (set[s] & sm) == p) { s++; continue; }
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
    for (uint64_t i = 0; i < c; i++) { /* a bit only where r >= u: no branch per gap */
        uint64_t r = scratch[i];
        bw_put32_nc(f, (r + uu) & 1, (unsigned)(r >= uu));
    }
    return 0;
}

/* BS(n, j) of the flags at bit `bit` of recs[0, n), j of them set. Dense (M = 1): the flags
 * are the raw bits, taken straight from the records; else their positions go to set (which
 * may be recs itself: written behind the read) and to bs_encode. */
static int bs_flags(bw_t *u, bw_t *f, const uint32_t *recs, uint64_t n, uint64_t j, int bit,
                    uint32_t *set, uint32_t *scratch) {
    if (j == 0 || j == n) return 0;
    if (golomb_m(n, 2 * j > n ? n - j : j) == 1) {
        if (bw_reserve(f, n / 8 + 16)) return -1;
        for (uint64_t p = 0; p < n; p += 32) {
            unsigned take = n - p < 32 ? (unsigned)(n - p) : 32;
            uint32_t word = 0;
            for (unsigned i = 0; i < take; i++) word = word << 1 | ((recs[p + i] >> bit) & 1);
            bw_put32_nc(f, word, take);
        }
        return 0;
    }
    uint64_t s = 0;
    for (uint64_t i = 0; i < n; i++) {
        uint32_t r = recs[i];
        set[s] = (uint32_t)i;
        s += (r >> bit) & 1;
    }
    return bs_encode(u, f, set, j, n, scratch, ~0u);
}

/* Exp-Golomb of order eg: the length prefix to the unary stream, the low bits to the fixed
 * (room reserved by the caller: 2 * bitlen(x + 2^eg) - 1 - eg bits in all). */
static inline void eg_encode_nc(bw_t *u, bw_t *f, uint64_t x, int eg) {
    uint64_t v = x + (1ULL << eg);
    int len = bitlen64(v);
    bw_unary_nc(u, (uint64_t)(len - 1 - eg));
    uint64_t low = v - (1ULL << (len - 1));
    unsigned n = (unsigned)(len - 1);
    if (n > 32) {
        bw_put32_nc(f, low >> 32, n - 32);
        bw_put32_nc(f, low & 0xFFFFFFFFu, 32);
    } else {
        bw_put32_nc(f, low, n);
    }
}

static uint64_t eg_cost(const uint64_t *x, uint64_t count, int eg) {
    uint64_t cost = 0;
    for (uint64_t i = 0; i < count; i++) cost += 2 * (uint64_t)bitlen64(x[i] + (1ULL << eg)) - 1 - eg;
    return cost;
}

/* The Exp-Golomb order with the fewest bits (the smallest on ties, trying 0, 1, ... while
 * the cost falls), and its cost in *costp. Many values: one pass counts them by bit length L
 * and by t, the ones leading their L bits; x + 2^e has bit length L + 1 for L > e exactly
 * when t >= L - e (else L; e + 1 for L <= e), so each order's cost follows from the counts. */
static int best_order(const uint64_t *x, uint64_t count, int bits, uint64_t *costp) {
    int best = 0, top = bits < 63 ? bits : 63;
    uint64_t cost = 0;
    if (count < 256) {
        cost = eg_cost(x, count, 0);
        for (int e = 1; e < top; e++) {
            uint64_t c = eg_cost(x, count, e);
            if (c >= cost) break;
            best = e;
            cost = c;
        }
        *costp = cost;
        return best;
    }
    uint32_t h[65][66]; /* h[L][t], then ge[L][m]: how many of length L have t >= m */
    uint64_t cnt[65];
    for (int L = 0; L <= 64; L++) memset(h[L], 0, (size_t)(L + 2) * sizeof h[0][0]);
    for (uint64_t i = 0; i < count; i++) {
        uint64_t v = x[i];
        int L = bitlen64(v);
        uint64_t y = L ? ~(v << (64 - L)) : ~0ULL;
        int t = L ? (y ? __builtin_clzll(y) : 64) : 0;
        h[L][t]++;
    }
    for (int L = 0; L <= 64; L++) {
        uint32_t acc = 0;
        for (int m = L; m >= 0; m--) { acc += h[L][m]; h[L][m] = acc; }
        cnt[L] = acc;
    }
    for (int e = 0; e < (top > 1 ? top : 1); e++) {
        uint64_t c = 0;
        for (int L = 0; L <= 64; L++) {
            if (!cnt[L]) continue;
            if (L <= e) c += cnt[L] * (uint64_t)(e + 1);
            else c += cnt[L] * (uint64_t)(2 * L - 1 - e) + 2 * (uint64_t)h[L][L - e];
        }
        if (e > 0 && c >= cost) break;
        best = e;
        cost = c;
    }
    *costp = cost;
    return best;
}

/* ------------------------------------------------------------------ encoder */

int rp_recs_grow(recs_t *r) {
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

void rp_recs_free(recs_t *r) {
    free(r->pos); free(r->rank); free(r->ctx); free(r->oldv); free(r->newv);
}

static void bw_reset(bw_t *w) { w->len = 0; w->acc = 0; w->nacc = 0; w->oom = 0; }

int rp_code_ws(const rp_kind *kd, int64_t n, const uint64_t *ncnt, rp_encws *w,
               const char **err) {
    int rc = RP_OK;
    int64_t k = w->k;
    uint64_t kc[NCTX] = {0}, bc[NCTX] = {0}, first[NCTX], tfirst[NCTX], k_s = 0;
    int egc[NCTX] = {0};
    bw_reset(&w->pw); bw_reset(&w->uw); bw_reset(&w->fw);
    w->kdone = k;
    if (k == 0) return RP_OK;
    if (rp_ws_reserve_coder(w, k)) FAIL(RP_ENOMEM, "out of memory");
    const uint32_t *rec = w->rec;
    { /* changes and big steps per context, one 64-bit count each (kc | bc << 32) in two
         tables (no store-to-load chain between neighbours of one context) */
        uint64_t kb[2][NCTX];
        memset(kb, 0, sizeof kb);
        int64_t i = 0;
        for (; i + 2 <= k; i += 2) {
            uint32_t r0 = rec[i], r1 = rec[i + 1];
            kb[0][(r0 >> 20) & 255] += 1 + ((uint64_t)((r0 >> 29) & 1) << 32);
            kb[1][(r1 >> 20) & 255] += 1 + ((uint64_t)((r1 >> 29) & 1) << 32);
            k_s += ((r0 >> 28) & 1) + ((r1 >> 28) & 1);
        }
        if (i < k) {
            uint32_t r0 = rec[i];
            kb[0][(r0 >> 20) & 255] += 1 + ((uint64_t)((r0 >> 29) & 1) << 32);
            k_s += (r0 >> 28) & 1;
        }
        for (int c = 0; c < NCTX; c++) {
            uint64_t x = kb[0][c] + kb[1][c];
            kc[c] = x & 0xFFFFFFFFu;
            bc[c] = x >> 32;
        }
    }
    uint64_t acc = 0, tacc = 0; /* stable counting sort of the records by context */
    for (int c = 0; c < NCTX; c++) {
        first[c] = acc; acc += kc[c];
        tfirst[c] = tacc; tacc += bc[c];
    }
    {
        uint64_t fill[NCTX], tfill[NCTX];
        memcpy(fill, first, sizeof fill);
        memcpy(tfill, tfirst, sizeof tfill);
        int64_t jb = 0;
        for (int64_t i = 0; i < k; i++) { /* a small step's tail goes to slot k, unused */
            uint32_t r = rec[i];
            unsigned c = (r >> 20) & 255, big = (r >> 29) & 1;
            w->grp[fill[c]++] = r;
            w->tsort[big ? tfill[c] : (uint64_t)k] = w->tail[jb];
            tfill[c] += big;
            jb += big;
        }
    }
    uint64_t egbits[NCTX] = {0};
    for (int c = 0; c < NCTX; c++)
        if (bc[c]) egc[c] = best_order(w->tsort + tfirst[c], bc[c], kd->bits, &egbits[c]);
    bw_t *pw = &w->pw, *uw = &w->uw, *fw = &w->fw;
    int g = 0;
    for (int c = 0; c < NCTX; c++) g += kc[c] > 0;
    varint(pw, (uint64_t)g);
    for (int c = 0; c < NCTX; c++) {
        if (!kc[c]) continue;
        varint(pw, (uint64_t)c);
        varint(pw, ncnt[c]);
        varint(pw, kc[c]);
        varint(pw, bc[c]);
        varint(pw, (uint64_t)egc[c]);
    }
    varint(pw, k_s);
    for (int c = 0; c < NCTX; c++) /* (1) changed ranks per context */
        if (kc[c]) bs_encode(uw, fw, w->grp + first[c], kc[c], ncnt[c], w->scr, REC_RANK);
    /* (2) outward flags over all changes in position order (rec compacted in place) */
    bs_flags(uw, fw, w->rec, (uint64_t)k, k_s, 28, w->rec, w->scr);
    for (int c = 0; c < NCTX; c++) /* (3) which have |step| > 1, per context */
        if (kc[c]) bs_flags(uw, fw, w->grp + first[c], kc[c], bc[c], 29, w->rec, w->scr);
    for (int c = 0; c < NCTX; c++) { /* (4) their magnitudes (room: the order's cost) */
        if (!bc[c] || bw_reserve(uw, egbits[c] / 8 + 16) || bw_reserve(fw, egbits[c] / 8 + 16))
            continue;
        for (uint64_t i = 0; i < bc[c]; i++) eg_encode_nc(uw, fw, w->tsort[tfirst[c] + i], egc[c]);
    }
    bw_pad(uw, 1);
    bw_pad(fw, 0);
    if (pw->oom || uw->oom || fw->oom) FAIL(RP_ENOMEM, "out of memory");
done:
    w->k = 0;
    w->nb = 0;
    return rc;
}

/* Code the records (position order) of one chunk whose context sizes are ncnt. */
int rp_code_chunk(const rp_kind *kd, int64_t n, const uint64_t *ncnt, const recs_t *r,
                  uint8_t **out, size_t *outlen, const char **err) {
    int rc = RP_OK;
    rp_encws w = {0};
    *out = NULL;
    *outlen = 0;
    if (r->k == 0) return RP_OK;
    if (rp_ws_reserve(&w, r->k)) FAIL(RP_ENOMEM, "out of memory");
    for (int64_t i = 0; i < r->k; i++) ws_record(&w, kd, r->rank[i], r->ctx[i], r->oldv[i], r->newv[i]);
    rc = rp_code_ws(kd, n, ncnt, &w, err);
    if (rc == RP_OK && rp_ws_body(&w, out, outlen)) FAIL(RP_ENOMEM, "out of memory");
done:
    rp_ws_free(&w);
    return rc;
}
