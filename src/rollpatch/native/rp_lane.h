/* rollpatch native core, internal: the decoder's lane (rp_decode.c: params and phases A
 * and C; rp_join.c: phase B, the join; rp_group.c: the output of what it found). */
#ifndef RP_LANE_H
#define RP_LANE_H
#include "rp_internal.h"

typedef struct {
    int g;
    uint8_t cid[NCTX];
    uint64_t nc[NCTX], kc[NCTX], bc[NCTX];
    int eg[NCTX];
    uint64_t ks, k;
    size_t ustart, ulen, fstart, end;
} params_t;

typedef struct {
    params_t pp;
    br_t u, f;
    uint32_t *ranks;     /* per listed context, concatenated: index = context-order index */
    uint32_t *scratch;
    uint32_t *idx;
    uint64_t *outw;      /* outward flags, position order: change i is bit i & 63 of outw[i >> 6] */
    void *magc;          /* |step| of each change, context order (mw bytes each: a <= 2^(bits-1)) */
    int mw;
    uint64_t ofs[NCTX];  /* start of each listed context's ranks */
    uint32_t cnt[NCTX], tgt[NCTX];
    uint64_t cur[NCTX], endr[NCTX];
    int64_t emitted, done;
    uint32_t *rpos;      /* found changes: position (chunk-relative), old element, context-order index */
    uint64_t *rold;
    uint32_t *rci;
    /* outputs, and the in-place write (wdata = the base, or NULL) with its rp.sum128 change */
    int64_t *pos_out;
    void *old_out, *new_out;
    int ow;
    uint8_t *wdata;
    size_t wlen;
    uint64_t cj, before, d0, d1;
    uint64_t cap;        /* k the buffers above have room for (reused across chunks) */
    int hash;            /* sum the words as read (before any write) into h0, h1 */
    int64_t hashed;      /* elements [0, hashed) of the chunk are summed */
    uint64_t h0, h1;
    int notrack;         /* this group's change is summed whole (rp_lane_group) */
    uint64_t *jbm;       /* the AVX-512 join's bitmaps (rp_join512.c), kept across chunks */
    size_t jbmcap;       /* words jbm has room for */
    /* phase A's bitmaps of the sets it decoded from one (bs_decode_bm): listed context i's at
     * abm + abo[i] (-1: none), read by the AVX-512 join instead of rebuilt from its ranks */
    uint64_t *abm;
    size_t abmcap;
    int64_t abo[NCTX];
} lane_t;

/* The rp.sum128 change of the word being written (read before its first write). */
static inline void lane_flush(lane_t *l) {
    if (l->cj == UINT64_MAX) return;
    uint64_t after = word_at(l->wdata, l->wlen, l->cj);
    l->d0 += sum_term(0, after, l->cj) - sum_term(0, l->before, l->cj);
    l->d1 += sum_term(1, after, l->cj) - sum_term(1, l->before, l->cj);
    l->cj = UINT64_MAX;
}

/* Phase B, the join (rp_join.c), and its output (rp_finalize, rp_group.c); rp_lane_hash_to: the
 * in-pass rp.sum128 of the chunk's elements up to `upto`;
 * rp_lane_group: hash and write the group up to `upto`. */
RP_HIDDEN void rp_join_lane(const rp_kind *kd, const uint8_t *base, lane_t *l, int64_t start,
                            int64_t n);
/* The join's window: the WIN consecutive contexts that hold the most changed ranks; the
 * AVX-512 join (rp_join512.c); how many blocks ahead the joins prefetch the base. */
RP_HIDDEN int rp_join_window(const lane_t *l);
RP_HIDDEN int rp_join_lane_avx512(const rp_kind *kd, const uint8_t *base, lane_t *l,
                                   int64_t start, int64_t n);
#ifndef RP_PF
#define RP_PF 16
#endif
RP_HIDDEN void rp_finalize(const rp_kind *kd, lane_t *l, int64_t start, int partial);
RP_HIDDEN void rp_lane_hash_to(const rp_kind *kd, lane_t *l, int64_t start, int64_t upto);
RP_HIDDEN void rp_lane_group(const rp_kind *kd, lane_t *l, int64_t start, int64_t upto,
                            int last);

/* Whether the decoder's AVX-512 loops may run: the CPU has AVX-512 F/BW/VL (for
 * RP_V512_BSEQ, phase A's Golomb codes, also VBMI, VBMI2 and BMI2), and ROLLPATCH_ISA
 * (the core's switch: "scalar", "avx2" or "avx512"; read once) does not ask for less. */
enum { RP_V512_FIN = 0, RP_V512_BSEQ = 1 };
RP_HIDDEN int rp_avx512(int what);

/* Phase counters (cycles) behind a compile-time flag: -DRP_PROF prints them at exit. */
#ifdef RP_PROF
#include <x86intrin.h>
extern uint64_t rp_prof[8];
#define PROF_T() __rdtsc()
#define PROF_ADD(i, t0) (rp_prof[i] += __rdtsc() - (t0))
#else
#define PROF_T() 0
#define PROF_ADD(i, t0) ((void)(t0))
#endif

#endif /* RP_LANE_H */
