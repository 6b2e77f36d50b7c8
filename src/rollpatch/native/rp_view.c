/* rollpatch native core: every rp.ctxgolomb.v2 delta of a patch decoded and applied in one
 * call (rp_decode_apply_view): each tensor's chunk table and per-chunk counts checked against
 * its header count, its chunks cut into jobs, all jobs run on the pool (rp_decode_apply_jobs)
 * and the results summed per tensor. Why here and not in the caller: per tensor, the Python
 * around the pool parsed the table once more for the counts, built offsets and job tuples and
 * summed a result per job, ~1 ms of serial work per 100M view that no thread count shortens. */
#include <stdlib.h>

#include "rp_internal.h"

int rp_parse_table(const uint8_t *p, size_t len, int64_t nchunks, size_t *offs, size_t *lens) {
    size_t q = 0;
    for (int64_t i = 0; i < nchunks; i++) {
        uint64_t v = 0;
        int ok = 0;
        for (int s = 0; s < 9; s++) {
            if (q >= len) return -1;
            uint8_t c = p[q++];
            v |= (uint64_t)(c & 0x7F) << (7 * s);
            if (!(c & 0x80)) { ok = 1; break; }
        }
        if (!ok || v > len - q) return -1;
        offs[i] = q;
        lens[i] = (size_t)v;
        q += v;
    }
    return q == len ? 0 : -1;
}

/* One tensor's chunk table, counts and output offsets (one entry per chunk). */
typedef struct {
    int64_t nch, step; /* step: the caller's, at most nch (no overflow in the job count) */
    size_t *offs, *lens;
    int64_t *cnt, *off;
} vtab;

static void vtab_free(vtab *x) { free(x->offs); free(x->lens); free(x->cnt); free(x->off); }

/* The checks the decoder makes before it writes anything, in the order the per-tensor calls
 * made them: the table's size, the table, each chunk's count, their sum against the header. */
static int vtab_parse(const rp_dec_tensor *t, vtab *x, const char **err) {
    if (t->n < 0 || t->step < 1 || t->changed < 0) {
        *err = "bad tensor arguments";
        return RP_EARG;
    }
    x->nch = (t->n + RP_CHUNK - 1) / RP_CHUNK;
    x->step = t->step < x->nch ? t->step : (x->nch > 0 ? x->nch : 1);
    if ((uint64_t)x->nch > (uint64_t)t->plen) {
        *err = "payload shorter than its chunk table";
        return RP_ECORRUPT;
    }
    size_t m = (size_t)x->nch + 1;
    x->offs = malloc(m * sizeof *x->offs);
    x->lens = malloc(m * sizeof *x->lens);
    x->cnt = malloc(m * sizeof *x->cnt);
    x->off = malloc(m * sizeof *x->off);
    if (!x->offs || !x->lens || !x->cnt || !x->off) {
        *err = "out of memory";
        return RP_ENOMEM;
    }
    if (rp_parse_table(t->payload, t->plen, x->nch, x->offs, x->lens)) {
        *err = "corrupt chunk table";
        return RP_ECORRUPT;
    }
    int64_t total = 0;
    for (int64_t i = 0; i < x->nch; i++) {
        int64_t len = t->n - i * RP_CHUNK < RP_CHUNK ? t->n - i * RP_CHUNK : RP_CHUNK;
        int rc = rp_chunk_count(t->k, t->payload + x->offs[i], x->lens[i], len, &x->cnt[i], err);
        if (rc) return rc;
        x->off[i] = total;
        total += x->cnt[i]; /* each count is at most RP_CHUNK: no overflow */
    }
    if (total != t->changed) {
        *err = "changed count does not match the header";
        return RP_ECORRUPT;
    }
    return RP_OK;
}

typedef struct {
    int64_t size, t, c0, c1; /* elements, tensor, chunks [c0, c1) */
} vjob;

static int vjob_cmp(const void *a, const void *b) { /* largest first, then (tensor, chunk) */
    const vjob *x = a, *y = b;
    if (x->size != y->size) return x->size > y->size ? -1 : 1;
    if (x->t != y->t) return x->t < y->t ? -1 : 1;
    return x->c0 < y->c0 ? -1 : x->c0 > y->c0;
}

int rp_decode_apply_view(rp_dec_tensor *ts, int64_t nt, int nthreads, int hash, int64_t *failed,
                         const char **err) {
    int64_t p = nt, nj = 0, chunks = 0;
    int rc = RP_OK, prc = RP_OK;
    const char *perr = NULL;
    vtab *tab = calloc((size_t)nt + 1, sizeof *tab);
    vjob *vj = NULL;
    rp_dec_job *jobs = NULL;
    const uint8_t **body = NULL;
    size_t *len = NULL;
    int64_t *st = NULL, *nn = NULL;
    *failed = -1;
    if (!tab) { *err = "out of memory"; return RP_ENOMEM; }
    for (int64_t i = 0; i < nt; i++) {
        ts[i].delta[0] = ts[i].delta[1] = ts[i].sums[0] = ts[i].sums[1] = 0;
        if (p == nt && (prc = vtab_parse(&ts[i], &tab[i], &perr)) != RP_OK) p = i;
    }
    /* the tensors before a refused one are decoded all the same: a failure among them comes
     * first in header order (then everything is put back) */
    for (int64_t i = 0; i < p; i++) {
        nj += (tab[i].nch + tab[i].step - 1) / tab[i].step;
        chunks += tab[i].nch;
    }
    vj = malloc(((size_t)nj + 1) * sizeof *vj);
    jobs = calloc((size_t)nj + 1, sizeof *jobs);
    body = malloc(((size_t)chunks + 1) * sizeof *body);
    len = malloc(((size_t)chunks + 1) * sizeof *len);
    st = malloc(((size_t)chunks + 1) * sizeof *st);
    nn = malloc(((size_t)chunks + 1) * sizeof *nn);
    if (!vj || !jobs || !body || !len || !st || !nn) { rc = RP_ENOMEM; *err = "out of memory"; goto out; }
    int64_t j = 0;
    for (int64_t i = 0; i < p; i++)
        for (int64_t c0 = 0; c0 < tab[i].nch; c0 += tab[i].step) {
            int64_t c1 = c0 + tab[i].step < tab[i].nch ? c0 + tab[i].step : tab[i].nch;
            int64_t end = c1 * RP_CHUNK < ts[i].n ? c1 * RP_CHUNK : ts[i].n;
            vj[j++] = (vjob){end - c0 * RP_CHUNK, i, c0, c1};
        }
    qsort(vj, (size_t)nj, sizeof *vj, vjob_cmp);
    for (int64_t q = 0, at = 0; q < nj; q++) {
        rp_dec_tensor *t = &ts[vj[q].t];
        vtab *x = &tab[vj[q].t];
        rp_dec_job *b = &jobs[q];
        b->m = (int)(vj[q].c1 - vj[q].c0);
        for (int c = 0; c < b->m; c++) {
            int64_t ci = vj[q].c0 + c;
            body[at + c] = t->payload + x->offs[ci];
            len[at + c] = x->lens[ci];
            st[at + c] = ci * RP_CHUNK;
            nn[at + c] = t->n - st[at + c] < RP_CHUNK ? t->n - st[at + c] : RP_CHUNK;
        }
        b->k = t->k;
        b->data = t->data;
        b->nbytes = t->nbytes;
        b->body = body + at;
        b->len = len + at;
        b->start = st + at;
        b->n = nn + at;
        b->count = x->cnt + vj[q].c0;
        b->off = x->off + vj[q].c0;
        b->pos_out = t->pos_out;
        b->old_out = t->old_out;
        b->new_out = t->new_out;
        b->ow = t->k->bits == 4 ? 1 : t->k->bits / 8;
        b->hash = hash;
        at += b->m;
    }
    if (nj) {
        int64_t f;
        rc = rp_decode_apply_jobs(jobs, nj, nthreads, &f, err);
        if (rc) { /* everything is put back; report the first failure in (tensor, chunk) order */
            for (int64_t q = 0; q < nj; q++)
                if (jobs[q].rc && (vj[q].t < vj[f].t || (vj[q].t == vj[f].t && vj[q].c0 < vj[f].c0)))
                    f = q;
            *failed = vj[f].t;
            *err = jobs[f].err ? jobs[f].err : "native codec error";
            rc = jobs[f].rc;
            goto out;
        }
    }
    if (p < nt) {
        rp_dec_jobs_undo(jobs, nj);
        *failed = p;
        *err = perr ? perr : "native codec error";
        rc = prc;
        goto out;
    }
    for (int64_t q = 0; q < nj; q++) {
        rp_dec_tensor *t = &ts[vj[q].t];
        t->delta[0] += jobs[q].delta[0]; t->delta[1] += jobs[q].delta[1];
        t->sums[0] += jobs[q].sums[0]; t->sums[1] += jobs[q].sums[1];
    }
out:
    for (int64_t i = 0; i < nt; i++) vtab_free(&tab[i]);
    free(tab); free(vj); free(jobs); free(body); free(len); free(st); free(nn);
    return rc;
}
