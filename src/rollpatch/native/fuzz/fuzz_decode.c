/* libFuzzer target: the v2 decoder on hostile payloads (docs/patch-format.md §8).
 *
 * Input: an 8-byte header (kind, size, base seed: fuzz_common.h), then a delta payload. The
 * payload is decoded as rollpatch decodes it: the chunk table, rp_chunk_count per chunk,
 * outputs sized from those counts, rp_decode_chunks over all chunks at once with the AVX2
 * loops, and again one chunk at a time with the scalar loops; the two must agree. A payload
 * that decodes must keep every promise of a decode (fz_check_decoded), apply cleanly with a
 * consistent rp.sum128 change, and re-encode to a payload that decodes to the same changes.
 * Any other outcome, a sanitizer report or a leak is a bug. */
#include "fuzz_common.h"

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
        int64_t changed[FZ_MAXCH];
        size_t plen;
        uint8_t *pl = fz_encode(&c, target, &plen, changed);
        fz_decode(&c, pl, plen, FZ_MAXCH, &again);
        fz_same(&c, &a, &again, "re-encoding a decoded patch decodes differently");
        fz_out_free(&again);
        free(pl);
        free(target);
    }
    fz_out_free(&a);
    fz_out_free(&b);
    return 0;
}
