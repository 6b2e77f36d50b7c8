/* rollpatch native core: the decoder's output, group by group (rp_lane_group): the changes
 * the join found (rp_join.c) become new elements, written into the outputs and in place, with
 * the in-pass rp.sum128 of the words as read and the change of those written. */
#include "rp_lane.h"

/* Phase B's output, the changes found since the last call, [done, emitted), in position
 * order: new elements from the outward flags and the magnitudes (by context-order index) into
 * the outputs and, when writing, into the base: the join calls this every few blocks, while
 * those words are still in cache. Typed loops for the common kinds. */
#define FIN_TYPED(T, LOG, MT, ORDER)                                                        \
    do {                                                                                    \
        enum { BITS_ = 8 << LOG };                                                          \
        const uint64_t s = 1ULL << (BITS_ - 1), msk = (T)~(T)0;                             \
        T *d = (T *)l->wdata, *po = (T *)l->old_out, *pn = (T *)l->new_out;                 \
        const MT *mg = (const MT *)l->magc;                                                 \
        const uint32_t *rpos = l->rpos, *rci = l->rci;                                      \
        const uint64_t *rold = l->rold;                                                     \
        const uint8_t *outw = l->outw;                                                      \
        int64_t *pout = l->pos_out;                                                         \
        const int64_t e_ = l->emitted;                                                      \
        uint64_t cj = l->cj, before = l->before, d0 = l->d0, d1 = l->d1;                    \
        const uint64_t nfull = l->wlen / 8;                                                 \
        const int notrack = l->notrack;                                                     \
        uint8_t *const wdata = l->wdata;                                                    \
        const size_t wlen = l->wlen;                                                        \
        /* the word being written is kept in a register (`after`): no reload of a word     \
         * just stored into (a store-forwarding stall). Every field is read into a local   \
         * first: the stores below may alias anything (-fno-strict-aliasing). */           \
        uint64_t after = before;                                                            \
        if (d && cj != UINT64_MAX) {                                                        \
            if (cj < nfull) memcpy(&after, wdata + 8 * cj, 8);                              \
            else after = word_at(wdata, wlen, cj);                                          \
        }                                                                                   \
        for (int64_t i = l->done; i < e_; i++) {                                            \
            __builtin_prefetch(mg + rci[i + 16 < e_ ? i + 16 : i]);                         \
            int64_t p = start + rpos[i];                                                    \
            uint64_t x = rold[i];                                                           \
            uint64_t neg = ORDER != RP_UNSIGNED ? (x >> (BITS_ - 1)) & 1 : 0;               \
            uint64_t key = ORDER == RP_SIGNMAG ? x ^ (s | (msk & (0 - neg)))                \
                           : ORDER == RP_TWOS ? x ^ s : x;                                  \
            uint64_t a = mg[rci[i]];                                                        \
            uint64_t sg = 0 - (uint64_t)!(outw[i] ^ (uint8_t)neg); /* 0: +a, ~0: -a */      \
            uint64_t yk = (key + ((a ^ sg) - sg)) & msk;                                    \
            T y = (T)(ORDER == RP_SIGNMAG ? yk ^ (s | (msk & (0 - ((yk >> (BITS_ - 1)) ^ 1)))) \
                      : ORDER == RP_TWOS ? yk ^ s : yk);                                    \
            pout[i] = p;                                                                    \
            po[i] = (T)x;                                                                   \
            pn[i] = y;                                                                      \
            if (d) {                                                                        \
                uint64_t j = (uint64_t)p >> (3 - LOG);                                      \
                if (notrack) {                                                              \
                } else if (j != cj) {                                                       \
                    if (cj != UINT64_MAX) {                                                 \
                        d0 += sum_term(0, after, cj) - sum_term(0, before, cj);             \
                        d1 += sum_term(1, after, cj) - sum_term(1, before, cj);             \
                    }                                                                       \
                    cj = j;                                                                 \
                    if (j < nfull) memcpy(&before, wdata + 8 * j, 8);                       \
                    else before = word_at(wdata, wlen, j);                                  \
                    after = before;                                                         \
                }                                                                           \
                unsigned sh_ = (unsigned)(p & ((8 >> LOG) - 1)) << (LOG + 3);               \
                after = (after & ~((uint64_t)(T)~(T)0 << sh_)) | ((uint64_t)y << sh_);      \
                d[p] = y;                                                                   \
            }                                                                               \
        }                                                                                   \
        l->cj = cj; l->before = before; l->d0 = d0; l->d1 = d1;                             \
    } while (0)

#define FIN_ORDERS(T, LOG, MT)                                                              \
    do {                                                                                    \
        if (kd->order == RP_SIGNMAG) FIN_TYPED(T, LOG, MT, RP_SIGNMAG);                     \
        else if (kd->order == RP_TWOS) FIN_TYPED(T, LOG, MT, RP_TWOS);                      \
        else FIN_TYPED(T, LOG, MT, RP_UNSIGNED);                                            \
    } while (0)

void rp_finalize(const rp_kind *kd, lane_t *l, int64_t start) {
    uint64_t s = ksign(kd->bits), msk = kmask(kd->bits);
    if (kd->bits == 16 && l->ow == 2) {
        FIN_ORDERS(uint16_t, 1, uint16_t);
    } else if (kd->bits == 8 && l->ow == 1) {
        FIN_ORDERS(uint8_t, 0, uint16_t);
    } else {
        for (int64_t i = l->done; i < l->emitted; i++) {
            int64_t p = start + l->rpos[i];
            uint64_t x = l->rold[i];
            int neg = kd->order != RP_UNSIGNED && (x & s);
            uint64_t key = to_key(kd, x), a = arr_get(l->magc, l->mw, l->rci[i]);
            uint64_t sg = 0 - (uint64_t)!(l->outw[i] ^ (uint8_t)neg); /* 0: +a, ~0: -a */
            uint64_t y = from_key(kd, (key + ((a ^ sg) - sg)) & msk);
            l->pos_out[i] = p;
            arr_put(l->old_out, l->ow, i, x);
            arr_put(l->new_out, l->ow, i, y);
            if (l->wdata) {
                uint64_t j = (uint64_t)p * (uint64_t)kd->bits / 64;
                if (!l->notrack && j != l->cj) {
                    lane_flush(l);
                    l->cj = j;
                    l->before = word_at(l->wdata, l->wlen, j);
                }
                elem_put(l->wdata, kd->bits, p, y);
            }
        }
    }
    l->done = l->emitted;
}
#undef FIN_ORDERS
#undef FIN_TYPED

/* rp.sum128 of the chunk's elements [l->hashed, upto), read before this lane writes them
 * (the in-pass hash): group boundaries are multiples of 4,096 elements, so word-aligned.
 * With `after`, the same words are summed again once written, into after[2]. */
static void hash_range(const rp_kind *kd, lane_t *l, int64_t start, int64_t upto,
                       uint64_t out[2]) {
    uint64_t b = (uint64_t)kd->bits, e0 = (uint64_t)(start + l->hashed), e1 = (uint64_t)(start + upto);
    uint64_t w0 = e0 * b / 64, w1 = (e1 * b + 63) / 64;
    rp_sum128(l->wdata, l->wlen, w0, w1 - w0, out);
}

void rp_lane_hash_to(const rp_kind *kd, lane_t *l, int64_t start, int64_t upto) {
    if (!l->hash || upto <= l->hashed) return;
    uint64_t out[2];
    hash_range(kd, l, start, upto, out);
    l->h0 += out[0];
    l->h1 += out[1];
    l->hashed = upto;
}

/* The group of elements up to `upto`: hashed as read (with the in-pass hash), then its
 * changes written. Where a group holds many changes (more than one per 64 elements), its
 * rp.sum128 change is the sum of its words after the write less the sum before (the words
 * are still in cache: cheaper than a change per written word, and exactly equal to it);
 * else each written word's change is summed as it is written. */
static void lane_group(const rp_kind *kd, lane_t *l, int64_t start, int64_t upto);
void rp_lane_group(const rp_kind *kd, lane_t *l, int64_t start, int64_t upto) {
    uint64_t t0 = PROF_T();
    lane_group(kd, l, start, upto);
    PROF_ADD(2, t0);
}

static void lane_group(const rp_kind *kd, lane_t *l, int64_t start, int64_t upto) {
    if (!l->hash || !l->wdata || upto <= l->hashed
        || (l->emitted - l->done) * 64 <= upto - l->hashed) {
        rp_lane_hash_to(kd, l, start, upto);
        rp_finalize(kd, l, start);
        return;
    }
    uint64_t before[2], after[2];
    lane_flush(l); /* the last tracked word lies in an earlier group */
    hash_range(kd, l, start, upto, before);
    l->notrack = 1;
    rp_finalize(kd, l, start);
    l->notrack = 0;
    hash_range(kd, l, start, upto, after);
    l->h0 += before[0];
    l->h1 += before[1];
    l->d0 += after[0] - before[0];
    l->d1 += after[1] - before[1];
    l->hashed = upto;
}
