/* rollpatch native core: compose, two sorted change lists merged into one (the change of the
 * first followed by the second; an element both change takes the first's old word and the
 * second's new one; elements whose old and new words are equal are dropped).
 *
 * Why runs: the catch-up of a replica that followed from an anchor composes its rebuild (the
 * sparse list, ~1 change in 6 here) with the decoded folded patch (the dense one), 8.7M
 * entries at BF16 103M. The element-at-a-time merge, with a switch on the word width per
 * access and two passes that checked the positions' order first, took 26 ms of it. Here the
 * loop is specialised by word type, the order is checked as the entries are taken, and with
 * AVX-512 a run of one list's entries below the other's head is taken eight lanes at a time:
 * one compare gives the run's lanes (a prefix, the lists being sorted), the eight positions
 * and words are stored whole (the output has room: it holds every entry of both lists), and
 * the output moves on by the run's length (docs/engines.md, *The rewind's compose*). */
#include "rp_internal.h"

#define EINC "positions not increasing"
#define EDIS "patches disagree on intermediate elements"

/* After an error found on the way: the order first (the old loop checked it before merging). */
static int order_error(const int64_t *a, int64_t na, const int64_t *b, int64_t nb) {
    for (int64_t k = 1; k < na; k++)
        if (a[k] <= a[k - 1]) return 1;
    for (int64_t k = 1; k < nb; k++)
        if (b[k] <= b[k - 1]) return 1;
    return 0;
}

/* One entry of list x (positions xp, words xo/xn) at k: out, unless a no-op; order checked. */
#define TAKE1(xp, xo, xn, k, last)                                                          \
    do {                                                                                    \
        int64_t p_ = xp[k];                                                                 \
        bad |= (uint64_t)(p_ <= last);                                                      \
        last = p_;                                                                          \
        rp[o] = p_; ro[o] = xo[k]; rn[o] = xn[k];                                           \
        o += xo[k] != xn[k];                                                                \
        k++;                                                                                \
    } while (0)

/* Both lists' heads at the same position: the first's old word, the second's new one. */
#define TAKE_BOTH()                                                                         \
    do {                                                                                    \
        bad |= (uint64_t)(pp[i] <= lp) | (uint64_t)(qp[j] <= lq);                           \
        lp = pp[i]; lq = qp[j];                                                             \
        if (pn[i] != qo[j]) { disagree = 1; goto done; }                                    \
        rp[o] = pp[i]; ro[o] = po[i]; rn[o] = qn[j];                                        \
        o += po[i] != qn[j];                                                                \
        i++; j++;                                                                           \
    } while (0)

/* The merge's state: the lists' words typed, the three cursors, the last position taken from
 * each list (the order check), any order error, a disagreement. */
#define LOCALS(T)                                                                           \
    const T *po = po_, *pn = pn_, *qo = qo_, *qn = qn_;                                     \
    T *ro = ro_, *rn = rn_;                                                                 \
    int64_t i = 0, j = 0, o = 0, lp = INT64_MIN, lq = INT64_MIN;                            \
    uint64_t bad = 0;                                                                       \
    int disagree = 0;

#define TAIL_AND_RETURN()                                                                   \
    while (i < np_) TAKE1(pp, po, pn, i, lp);                                               \
    while (j < nq) TAKE1(qp, qo, qn, j, lq);                                                \
    done:                                                                                   \
    if (bad || (disagree && order_error(pp, np_, qp, nq))) { *err = EINC; return RP_EARG; } \
    if (disagree) { *err = EDIS; return RP_EBASE; }                                         \
    *nout = o;                                                                              \
    return RP_OK;

#define ARGS                                                                                \
    const int64_t *pp, const void *po_, const void *pn_, int64_t np_, const int64_t *qp,    \
        const void *qo_, const void *qn_, int64_t nq, int64_t *rp, void *ro_, void *rn_,    \
        int64_t *nout, const char **err

/* One merge, specialised by word type: TAKE_P / TAKE_Q take the head of the list that is below
 * the other's (one entry, or with AVX-512 its run); equal heads are taken together. */
#define DEFINE_COMPOSE(NAME, ATTR, T, TAKE_P, TAKE_Q)                                       \
    ATTR static int NAME(ARGS) {                                                            \
        LOCALS(T)                                                                           \
        while (i < np_ && j < nq) {                                                         \
            int64_t a = pp[i], b = qp[j];                                                   \
            if (a < b) TAKE_P;                                                              \
            else if (b < a) TAKE_Q;                                                         \
            else TAKE_BOTH();                                                               \
        }                                                                                   \
        TAIL_AND_RETURN()                                                                   \
    }
#define SCALAR(NAME, T) \
    DEFINE_COMPOSE(NAME, , T, TAKE1(pp, po, pn, i, lp), TAKE1(qp, qo, qn, j, lq))
SCALAR(compose_s8, uint8_t)
SCALAR(compose_s16, uint16_t)
SCALAR(compose_s32, uint32_t)
SCALAR(compose_s64, uint64_t)

#if defined(__x86_64__) && defined(__GNUC__)
#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,popcnt")))

/* Eight words of each of two lists copied to the output; the lanes where they differ. */
T512 static inline __mmask8 words8_u8(const uint8_t *a, const uint8_t *b, uint8_t *ra, uint8_t *rb) {
    __m128i x = _mm_loadl_epi64((const __m128i *)a), y = _mm_loadl_epi64((const __m128i *)b);
    _mm_storel_epi64((__m128i *)ra, x);
    _mm_storel_epi64((__m128i *)rb, y);
    return (__mmask8)_mm_cmpneq_epi8_mask(x, y);
}
T512 static inline __mmask8 words8_u16(const uint16_t *a, const uint16_t *b, uint16_t *ra, uint16_t *rb) {
    __m128i x = _mm_loadu_si128((const __m128i *)a), y = _mm_loadu_si128((const __m128i *)b);
    _mm_storeu_si128((__m128i *)ra, x);
    _mm_storeu_si128((__m128i *)rb, y);
    return _mm_cmpneq_epi16_mask(x, y);
}
T512 static inline __mmask8 words8_u32(const uint32_t *a, const uint32_t *b, uint32_t *ra, uint32_t *rb) {
    __m256i x = _mm256_loadu_si256((const __m256i *)a), y = _mm256_loadu_si256((const __m256i *)b);
    _mm256_storeu_si256((__m256i *)ra, x);
    _mm256_storeu_si256((__m256i *)rb, y);
    return _mm256_cmpneq_epi32_mask(x, y);
}
T512 static inline __mmask8 words8_u64(const uint64_t *a, const uint64_t *b, uint64_t *ra, uint64_t *rb) {
    __m512i x = _mm512_loadu_si512((const void *)a), y = _mm512_loadu_si512((const void *)b);
    _mm512_storeu_si512((void *)ra, x);
    _mm512_storeu_si512((void *)rb, y);
    return _mm512_cmpneq_epi64_mask(x, y);
}

/* The run of list x's entries below `lim` (at least its head), eight lanes a step while eight
 * are left (near the end: one per call). Stores past the run's end are overwritten later or lie past
 * the output (room: o <= i + j, and k + 8 <= nx). Order: each lane above the one before it
 * (the previous step's last in lane -1); a lane of the run that is not is an error. */
#define RUN(xp, xo, xn, k, nx, lim, last, W)                                                \
    do {                                                                                    \
        const __m512i vl_ = _mm512_set1_epi64(lim);                                         \
        for (;;) {                                                                          \
            if (k + 8 > nx) { /* near the end: one, if still below (the outer loop goes on) */ \
                if (k < nx && xp[k] < lim) TAKE1(xp, xo, xn, k, last);                      \
                break;                                                                      \
            }                                                                               \
            __m512i v_ = _mm512_loadu_si512((const void *)(xp + k));                        \
            __mmask8 m_ = _mm512_cmplt_epi64_mask(v_, vl_);                                 \
            __m512i sh_ = _mm512_alignr_epi64(v_, _mm512_set1_epi64(last), 7);              \
            bad |= (uint64_t)(m_ & (__mmask8)~_mm512_cmpgt_epi64_mask(v_, sh_));            \
            _mm512_storeu_si512((void *)(rp + o), v_);                                      \
            __mmask8 ne_ = W(xo + k, xn + k, ro + o, rn + o) & m_;                          \
            int c_ = __builtin_popcount(m_);                                                \
            if (ne_ == m_) o += c_;                                                         \
            else /* a no-op lane (or holes, when out of order): lane by lane */             \
                for (int l_ = 0; l_ < 8; l_++)                                              \
                    if ((m_ >> l_) & 1) {                                                   \
                        rp[o] = xp[k + l_]; ro[o] = xo[k + l_]; rn[o] = xn[k + l_];         \
                        o += xo[k + l_] != xn[k + l_];                                      \
                    }                                                                       \
            last = xp[k + c_ - 1];                                                          \
            k += c_;                                                                        \
            if (m_ != 0xFF) break;                                                          \
        }                                                                                   \
    } while (0)

#define VECTOR(NAME, T, W)                                                                  \
    DEFINE_COMPOSE(NAME, T512, T, RUN(pp, po, pn, i, np_, b, lp, W),                       \
                   RUN(qp, qo, qn, j, nq, a, lq, W))
VECTOR(compose_v8, uint8_t, words8_u8)
VECTOR(compose_v16, uint16_t, words8_u16)
VECTOR(compose_v32, uint32_t, words8_u32)
VECTOR(compose_v64, uint64_t, words8_u64)
#endif

int rp_compose(int w, const int64_t *pp, const void *po, const void *pn, int64_t np_,
               const int64_t *qp, const void *qo, const void *qn, int64_t nq, int64_t *rp,
               void *ro, void *rn, int64_t *nout, const char **err) {
    *nout = 0;
#if defined(__x86_64__) && defined(__GNUC__)
    if (rp_isa() >= RP_ISA_AVX512) {
        switch (w) {
        case 1: return compose_v8(pp, po, pn, np_, qp, qo, qn, nq, rp, ro, rn, nout, err);
        case 2: return compose_v16(pp, po, pn, np_, qp, qo, qn, nq, rp, ro, rn, nout, err);
        case 4: return compose_v32(pp, po, pn, np_, qp, qo, qn, nq, rp, ro, rn, nout, err);
        default: return compose_v64(pp, po, pn, np_, qp, qo, qn, nq, rp, ro, rn, nout, err);
        }
    }
#endif
    switch (w) {
    case 1: return compose_s8(pp, po, pn, np_, qp, qo, qn, nq, rp, ro, rn, nout, err);
    case 2: return compose_s16(pp, po, pn, np_, qp, qo, qn, nq, rp, ro, rn, nout, err);
    case 4: return compose_s32(pp, po, pn, np_, qp, qo, qn, nq, rp, ro, rn, nout, err);
    default: return compose_s64(pp, po, pn, np_, qp, qo, qn, nq, rp, ro, rn, nout, err);
    }
}
