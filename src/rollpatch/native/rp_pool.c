/* rollpatch native core: many encode or decode+apply jobs (a tensor's range of chunks each) in
 * one call, on threads of the core's own. Why not a Python pool: every job handed out by
 * Python takes the GIL twice (dispatch, result), the submitting thread burns a core the
 * workers need (on 2 cores, 3 ms of a 35 ms encode), and a thread preempted while it holds
 * the GIL stalls the other; here the GIL is released once for the whole set, the calling
 * thread is worker 0, and a worker takes the next job with one atomic add. Jobs are run in
 * the order given (callers put the largest first), each on one worker; results are per job,
 * so they are the same for any number of threads. */
#include <pthread.h>

#include "rp_internal.h"

typedef struct {
    void (*fn)(void *ctx, int64_t job, int worker);
    void *ctx;
    int64_t njobs;
    int64_t next; /* the next job to take (atomic) */
} pool_t;

typedef struct {
    pool_t *p;
    int worker;
} warg_t;

static void *pool_worker(void *arg) {
    warg_t *a = arg;
    pool_t *p = a->p;
    for (;;) {
        int64_t j = __atomic_fetch_add(&p->next, 1, __ATOMIC_RELAXED);
        if (j >= p->njobs) break;
        p->fn(p->ctx, j, a->worker);
    }
    return NULL;
}

/* fn(ctx, job, worker) for every job in [0, njobs), on up to nthreads threads (the caller is
 * worker 0; workers are numbered below min(nthreads, njobs)). A thread that cannot be started
 * leaves its share to the others. Returns when every job is done. */
static void rp_run(int nthreads, int64_t njobs, void (*fn)(void *, int64_t, int), void *ctx) {
    pool_t p = {fn, ctx, njobs, 0};
    int nt = nthreads < 1 ? 1 : nthreads;
    if ((int64_t)nt > njobs) nt = njobs < 1 ? 1 : (int)njobs;
    if (nt > RP_MAX_THREADS) nt = RP_MAX_THREADS;
    pthread_t tid[RP_MAX_THREADS];
    warg_t args[RP_MAX_THREADS];
    int started[RP_MAX_THREADS] = {0};
    for (int i = 1; i < nt; i++) {
        args[i].p = &p;
        args[i].worker = i;
        started[i] = pthread_create(&tid[i], NULL, pool_worker, &args[i]) == 0;
    }
    args[0].p = &p;
    args[0].worker = 0;
    pool_worker(&args[0]);
    for (int i = 1; i < nt; i++)
        if (started[i]) pthread_join(tid[i], NULL);
}

/* ------------------------------------------------------------------ encode */

typedef struct {
    rp_enc_job *jobs;
    rp_encws **ws; /* one per worker */
} enc_ctx;

static void enc_one(void *c, int64_t j, int worker) {
    enc_ctx *x = c;
    rp_enc_job *b = &x->jobs[j];
    b->changed = 0;
    b->sd[0] = b->sd[1] = 0;
    b->err = NULL;
    b->rc = rp_encode_range(b->k, b->old, b->new_, b->nbytes, b->n, b->c0, b->c1, b->out,
                            &b->changed, b->sd, x->ws[worker], &b->err);
}

int rp_encode_jobs(rp_enc_job *jobs, int64_t njobs, int nthreads, int64_t *failed,
                   const char **err) {
    int nt = nthreads < 1 ? 1 : nthreads > RP_MAX_THREADS ? RP_MAX_THREADS : nthreads;
    rp_encws *ws[RP_MAX_THREADS] = {0};
    *failed = -1;
    for (int i = 0; i < nt; i++)
        if (!(ws[i] = rp_ws_new())) {
            for (int q = 0; q < i; q++) rp_ws_delete(ws[q]);
            *err = "out of memory";
            return RP_ENOMEM;
        }
    enc_ctx x = {jobs, ws};
    rp_run(nt, njobs, enc_one, &x);
    for (int i = 0; i < nt; i++) rp_ws_delete(ws[i]);
    for (int64_t j = 0; j < njobs; j++)
        if (jobs[j].rc) {
            *failed = j;
            *err = jobs[j].err ? jobs[j].err : "native codec error";
            return jobs[j].rc;
        }
    return RP_OK;
}

/* ------------------------------------------------------------------ encode into one arena */

typedef struct {
    rp_enc_job *jobs;
    rp_encws **ws;
    rp_obuf *arena, *own; /* own[j]: job j's bytes while jobs before it are not done */
    size_t *at, tstart;   /* tstart, tchanged: the tensor being committed */
    const unsigned char *edge;
    unsigned char *done;  /* 1: in own[j]; 2: written in the arena */
    int64_t njobs, cursor, tchanged; /* cursor: the first job not in the arena (under mu) */
    int stop;              /* a job failed or the arena could not grow: commit no more */
    int nspare, maxspare;  /* committed buffers kept for the next early job (under mu), as */
    rp_obuf spare[RP_MAX_THREADS]; /* many as other workers: pages touched once, not per job */
    pthread_mutex_t mu;
} arena_ctx;

/* Every finished job at the cursor into the arena, in order (mu held). */
static void commit_ready(arena_ctx *x) {
    while (!x->stop && x->cursor < x->njobs && x->done[x->cursor]) {
        int64_t j = x->cursor;
        rp_obuf *o = &x->own[j];
        if (x->jobs[j].rc) { x->stop = 1; break; }
        if (x->done[j] == 1) {
            if (o->len && rp_obuf_reserve(x->arena, o->len)) {
                x->jobs[j].rc = RP_ENOMEM;
                x->jobs[j].err = "out of memory";
                x->stop = 1;
                break;
            }
            x->at[j] = x->arena->len;
            if (o->len) memcpy(x->arena->b + x->arena->len, o->b, o->len);
            x->arena->len += o->len;
            o->len = 0;
            if (x->nspare < x->maxspare) x->spare[x->nspare++] = *o;
            else rp_obuf_free(o);
            memset(o, 0, sizeof *o);
        }
        if (x->edge[j] & RP_JOB_FIRST) {
            x->tstart = x->at[j];
            x->tchanged = 0;
        }
        x->tchanged += x->jobs[j].changed;
        if ((x->edge[j] & RP_JOB_LAST) && !x->tchanged) x->arena->len = x->tstart;
        x->cursor++;
    }
}

static void arena_one(void *c, int64_t j, int worker) {
    arena_ctx *x = c;
    rp_enc_job *b = &x->jobs[j];
    pthread_mutex_lock(&x->mu);
    /* the cursor stays at j until j is done: nothing else touches the arena meanwhile */
    int direct = !x->stop && j == x->cursor;
    if (direct) x->at[j] = x->arena->len;
    else if (x->nspare) x->own[j] = x->spare[--x->nspare];
    pthread_mutex_unlock(&x->mu);
    b->changed = 0;
    b->sd[0] = b->sd[1] = 0;
    b->err = NULL;
    b->out = direct ? x->arena : &x->own[j];
    b->rc = rp_encode_range_append(b->k, b->old, b->new_, b->nbytes, b->n, b->c0, b->c1, b->out,
                                   &b->changed, b->sd, x->ws[worker], &b->err);
    pthread_mutex_lock(&x->mu);
    x->done[j] = direct ? 2 : 1;
    commit_ready(x);
    pthread_mutex_unlock(&x->mu);
}

int rp_encode_jobs_arena(rp_enc_job *jobs, int64_t njobs, int nthreads, rp_obuf *arena,
                         const unsigned char *edge, size_t *at, int64_t *failed,
                         const char **err) {
    int nt = nthreads < 1 ? 1 : nthreads > RP_MAX_THREADS ? RP_MAX_THREADS : nthreads;
    rp_encws *ws[RP_MAX_THREADS] = {0};
    arena_ctx x = {.jobs = jobs, .ws = ws, .arena = arena, .at = at, .edge = edge,
                   .own = calloc(njobs + 1, sizeof(rp_obuf)), .done = calloc(njobs + 1, 1),
                   .njobs = njobs, .maxspare = nt - 1, .mu = PTHREAD_MUTEX_INITIALIZER};
    int rc = RP_OK;
    *failed = -1;
    for (int i = 0; i < nt && x.own && x.done; i++)
        if (!(ws[i] = rp_ws_new())) break;
    if (!x.own || !x.done || !ws[nt - 1]) {
        *err = "out of memory";
        rc = RP_ENOMEM;
    } else {
        rp_run(nt, njobs, arena_one, &x);
        for (int64_t j = 0; j < njobs && rc == RP_OK; j++)
            if (jobs[j].rc) {
                *failed = j;
                *err = jobs[j].err ? jobs[j].err : "native codec error";
                rc = jobs[j].rc;
            }
    }
    for (int i = 0; i < nt; i++) rp_ws_delete(ws[i]);
    for (int64_t j = 0; x.own && j < njobs; j++) rp_obuf_free(&x.own[j]);
    for (int i = 0; i < x.nspare; i++) rp_obuf_free(&x.spare[i]);
    free(x.own);
    free(x.done);
    pthread_mutex_destroy(&x.mu);
    return rc;
}

/* ------------------------------------------------------------------ decode + apply */

void rp_dec_jobs_undo(rp_dec_job *jobs, int64_t njobs) {
    for (int64_t j = 0; j < njobs; j++) {
        rp_dec_job *b = &jobs[j];
        if (b->rc) continue;
        for (int q = 0; q < b->m; q++)
            put_back(b->data, b->k->bits, b->pos_out + b->off[q],
                     (const uint8_t *)b->old_out + b->off[q] * b->ow, b->ow, b->count[q]);
    }
}

static void dec_one(void *c, int64_t j, int worker) {
    (void)worker;
    rp_dec_job *b = &((rp_dec_job *)c)[j];
    b->delta[0] = b->delta[1] = b->sums[0] = b->sums[1] = 0;
    b->err = NULL;
    b->rc = rp_decode_apply_chunks(b->k, b->data, b->nbytes, b->m, b->body, b->len, b->start,
                                   b->n, b->count, b->off, b->pos_out, b->old_out, b->new_out,
                                   b->ow, b->delta, b->hash ? b->sums : NULL, &b->err);
}

int rp_decode_apply_jobs(rp_dec_job *jobs, int64_t njobs, int nthreads, int64_t *failed,
                         const char **err) {
    rp_run(nthreads, njobs, dec_one, jobs);
    *failed = -1;
    for (int64_t j = 0; j < njobs && *failed < 0; j++)
        if (jobs[j].rc) *failed = j;
    if (*failed < 0) return RP_OK;
    rp_dec_jobs_undo(jobs, njobs); /* all or nothing: a failed job put its own chunks back */
    *err = jobs[*failed].err ? jobs[*failed].err : "native codec error";
    return jobs[*failed].rc;
}
