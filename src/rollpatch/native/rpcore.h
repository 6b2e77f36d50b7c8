/* rollpatch native core: the hot loops of codec rp.ctxgolomb.v2 and of the rp.sum128 view
 * digest (docs/patch-format.md §4b, §7). Pure C99 + GCC builtins, no Python: the CPython
 * binding (module.c) and the libFuzzer harness (fuzz/fuzz_decode.c) both build on it.
 *
 * Every length, count and width read from a payload is bounded before it is used; every
 * allocation is bounded by the chunk size (RP_CHUNK elements) or by counts already checked
 * against it. Functions return 0 or a negative RP_E* code and set *err to a static message. */
#ifndef RPCORE_H
#define RPCORE_H
#include <stddef.h>
#include <stdint.h>

#define RP_CHUNK_LOG2 20
#define RP_CHUNK ((int64_t)1 << RP_CHUNK_LOG2) /* elements per independently coded chunk */

enum { RP_SIGNMAG = 0, RP_TWOS = 1, RP_UNSIGNED = 2 };
enum { RP_OK = 0, RP_ENOMEM = -1, RP_ECORRUPT = -2, RP_EBASE = -3, RP_EARG = -4 };

/* The instruction sets the core's loops may use (rp_isa.c): RP_ISA_AVX2 is AVX2 (and BMI2's
 * PDEP where it is fast), RP_ISA_AVX512 adds AVX-512 F/BW/VL/VBMI/BITALG and GFNI. rp_isa:
 * the level in use, by default the best this CPU runs (rp_isa_best), or ROLLPATCH_ISA
 * ("scalar", "avx2", "avx512"; read once); rp_isa_set forces one (-1: back to the default;
 * never above the best) and returns the level in use. Every level gives the same bytes. */
enum { RP_ISA_SCALAR = 0, RP_ISA_AVX2 = 1, RP_ISA_AVX512 = 2 };
int rp_isa_best(void);
int rp_isa(void);
int rp_isa_set(int level);

typedef struct {
    int bits;  /* element width: 4 (two per byte, low nibble first), 8, 16, 32 or 64 */
    int order; /* RP_SIGNMAG, RP_TWOS or RP_UNSIGNED: how words map to ordered keys */
    int shift; /* context = (old >> shift) & ((1 << cbits) - 1) */
    int cbits; /* 0: one context for every element */
} rp_kind;

/* Elements [start, start + n) of a tensor of `nbytes` bytes, n <= RP_CHUNK. Encodes the
 * chunk body (possibly empty when nothing changed) into a malloc'd buffer the caller frees,
 * and adds to sdelta the rp.sum128 change of the new words over the old ones (the words
 * that hold changes; the chunk's words are its own: chunks start on word boundaries). */
int rp_encode_chunk(const rp_kind *k, const uint8_t *old, const uint8_t *new_, size_t nbytes,
                    int64_t start, int64_t n, uint8_t **out, size_t *outlen, int64_t *changed,
                    uint64_t sdelta[2], const char **err);

/* rp_encode_chunk that also hands over the chunk's changes (the diff the pass found, in
 * position order): *pos (relative to start), *oldv, *newv, *changed entries each, malloc'd
 * arrays the caller frees (NULL when nothing changed, or on failure). */
int rp_encode_chunk_keep(const rp_kind *k, const uint8_t *old, const uint8_t *new_,
                         size_t nbytes, int64_t start, int64_t n, uint8_t **out, size_t *outlen,
                         int64_t *changed, uint64_t sdelta[2], uint32_t **pos, uint64_t **oldv,
                         uint64_t **newv, const char **err);

/* A growable output buffer. On Linux, above 64 KiB it lives in its own anonymous mapping
 * (grown by mremap, without a copy), so freeing it gives its pages back at once. */
typedef struct {
    uint8_t *b;
    size_t len, cap;
    int mapped;
} rp_obuf;

int rp_obuf_reserve(rp_obuf *o, size_t extra);
void rp_obuf_fit(rp_obuf *o); /* gives back the room beyond the length */
void rp_obuf_free(rp_obuf *o);

/* The encoder's work buffers, reusable from one range to the next (one user at a time). */
typedef struct rp_encws rp_encws;
rp_encws *rp_ws_new(void);
void rp_ws_delete(rp_encws *w);

/* Chunks [c0, c1) of a tensor of n elements (nbytes bytes): appends each chunk's varint(body
 * length) + body to out (the payload's bytes for these chunks), adds the changes to *changed
 * and the rp.sum128 change to sdelta. Work buffers: ws, or (NULL) a set for this range. */
int rp_encode_range(const rp_kind *k, const uint8_t *old, const uint8_t *new_, size_t nbytes,
                    int64_t n, int64_t c0, int64_t c1, rp_obuf *out, int64_t *changed,
                    uint64_t sdelta[2], rp_encws *ws, const char **err);

/* The same from the changed elements only: positions relative to start (strictly
 * increasing), old and new element values (uint64), and the base words for contexts. */
int rp_encode_chunk_sparse(const rp_kind *k, const uint8_t *base, int64_t start, int64_t n,
                           const int64_t *pos, const uint64_t *oldv, const uint64_t *newv,
                           int64_t count, uint8_t **out, size_t *outlen, const char **err);

/* The same from records computed elsewhere (e.g. on the trainer's device): context sizes
 * ncnt[256] of the chunk, and per change its position (relative, increasing), context,
 * rank inside the context, old and new element. Everything is validated. */
int rp_encode_records(const rp_kind *k, int64_t n, const uint64_t *ncnt, const int64_t *pos,
                      const uint8_t *ctx, const uint32_t *rank, const uint64_t *oldv,
                      const uint64_t *newv, int64_t count, uint8_t **out, size_t *outlen,
                      const char **err);

/* Number of changed elements a chunk body declares (params only; validated). */
int rp_chunk_count(const rp_kind *k, const uint8_t *body, size_t len, int64_t n,
                   int64_t *count, const char **err);

/* Decode `m` (<= 4) chunks, one after the other. For chunk i: body[i]/len[i],
 * elements [start[i], start[i] + n[i]) of `base`, and count[i] outputs written at
 * pos_out + off[i] (absolute positions), old_out/new_out (element values, width `ow` bytes). */
int rp_decode_chunks(const rp_kind *k, const uint8_t *base, int m, const uint8_t *const *body,
                     const size_t *len, const int64_t *start, const int64_t *n,
                     const int64_t *count, const int64_t *off, int64_t *pos_out,
                     void *old_out, void *new_out, int ow, const char **err);

/* One chunk, decoded and applied in place: the outputs as rp_decode_chunks (offset 0), then,
 * once every check of the chunk has passed, the new elements written into `data` (the base)
 * and their rp.sum128 change added to delta[2]. On an error nothing is written. */
int rp_decode_apply(const rp_kind *k, uint8_t *data, size_t nbytes, const uint8_t *body,
                    size_t len, int64_t start, int64_t n, int64_t count, int64_t *pos_out,
                    void *old_out, void *new_out, int ow, uint64_t delta[2], const char **err);

/* rp_decode_apply over m chunks in order (chunk q: body[q]/len[q], elements [start[q],
 * start[q] + n[q]), each start a multiple of 4,096; count[q] outputs at offset off[q]), with
 * one set of work buffers. All or nothing: on an error every chunk this call wrote is put back.
 * sums (may be NULL): adds the rp.sum128 state of every word of the chunks as it was read,
 * before any write (the in-pass hash: sum + delta is the words' state after the writes). */
int rp_decode_apply_chunks(const rp_kind *k, uint8_t *data, size_t nbytes, int m,
                           const uint8_t *const *body, const size_t *len, const int64_t *start,
                           const int64_t *n, const int64_t *count, const int64_t *off,
                           int64_t *pos_out, void *old_out, void *new_out, int ow,
                           uint64_t delta[2], uint64_t sums[2], const char **err);

/* rp.sum128: additive 128-bit state over the 8-byte words [w0, w0 + nwords) of `data`
 * (whose total length is `len` bytes; the last word is zero-padded). */
void rp_sum128(const uint8_t *data, size_t len, uint64_t w0, uint64_t nwords, uint64_t out[2]);

/* rp.sum128 terms of words held apart from their tensor (a tensor-parallel rank's block):
 * `rows` runs of `row_words` whole words, packed in `data` one after another; run r's words
 * are the tensor's words j0 + r * j_stride, j0 + r * j_stride + 1, ... */
void rp_sum128_at(const uint8_t *data, uint64_t rows, uint64_t row_words, uint64_t j0,
                  uint64_t j_stride, uint64_t out[2]);

/* Gather elements at positions (must be < n_elements, checked) into `out` (width ow). */
int rp_gather(const rp_kind *k, const uint8_t *data, int64_t n_elements, const int64_t *pos,
              int64_t count, void *out, int ow, const char **err);

/* Where `data`'s 8-byte words sit in the tensor whose rp.sum128 state the change is of, for
 * data that holds a block of it (a tensor-parallel rank's rows or columns): word j of data is
 * the tensor's word j + j0 + (row_words ? (j / row_words) * j_skip : 0) (mod 2^64). NULL: the
 * same words (j itself). */
typedef struct {
    uint64_t j0, row_words, j_skip;
} rp_jmap;

/* Check that data holds `old` at `pos`, then write `new_` there; adds the rp.sum128 change
 * to delta[2] (mod 2^64), each word's terms at its index in the tensor (`jm`, NULL: in data).
 * Nothing is written unless every old element matches; nothing at all when `dry` (the checks
 * and the change the writes would make: data is only read). `readback`: the written elements
 * are read back and compared as the call goes (RP_ECORRUPT on a difference, every element
 * written put back first). */
int rp_apply(const rp_kind *k, uint8_t *data, size_t nbytes, const int64_t *pos,
             const void *old, const void *new_, int64_t count, int iw, int dry, int readback,
             const rp_jmap *jm, uint64_t delta[2], const char **err);

/* dst = a copy of src (nbytes, whole words of `width` bytes: 1, 2, 4 or 8) with the words at
 * `pos` (int64, increasing, in range) checked against `old` and replaced by `new_`, then read
 * back (rp_copyapply.c: block by block, in L1). On failure *bad is the change at fault:
 * RP_EARG (position out of range or order), RP_EBASE (a word differs from its old one),
 * RP_ECORRUPT (a read-back differs); dst is then partly written (a caller's scratch). */
int rp_copy_apply(int width, const uint8_t *src, uint8_t *dst, size_t nbytes,
                  const int64_t *pos, const void *old, const void *new_, int64_t count,
                  int64_t *bad);

/* Positions where a and b differ, over elements [start, start + n): writes at most `cap`
 * positions; returns the number found in *found (which may exceed cap: call again). */
int rp_diff(const rp_kind *k, const uint8_t *a, const uint8_t *b, int64_t start, int64_t n,
            int64_t *pos, int64_t cap, int64_t *found);
/* rp_diff, and the differing elements' words in a (olds) and in b (news), each with room for
 * cap elements; kinds of 8 bits and more (RP_EARG for 4-bit codes). */
int rp_diff_words(const rp_kind *k, const uint8_t *a, const uint8_t *b, int64_t start,
                  int64_t n, int64_t *pos, uint8_t *olds, uint8_t *news, int64_t cap,
                  int64_t *found);

/* The changes of applying p then q (positions strictly increasing in each; elements `w`
 * bytes wide): positions in either, old from p where p has it, new from q where q has it;
 * where both have a position, p's new must equal q's old (else RP_EBASE); positions whose old
 * equals their new are left out. r* have room for np_ + nq entries; *nout is the count. */
int rp_compose(int w, const int64_t *pp, const void *po, const void *pn, int64_t np_,
               const int64_t *qp, const void *qo, const void *qn, int64_t nq, int64_t *rp,
               void *ro, void *rn, int64_t *nout, const char **err);

/* Many jobs in one call on up to nthreads threads (rp_pool.c; the caller is one of them, at
 * most RP_MAX_THREADS). A job is one tensor's chunks [c0, c1) (encode) or m chunks of one
 * tensor (decode+apply); results are per job, identical for any thread count. On a failure
 * *failed is the lowest failing job's index, *err its message, and its code is returned. */
#define RP_MAX_THREADS 256

typedef struct {
    const rp_kind *k;                /* in: the tensor (as rp_encode_range) */
    const uint8_t *old, *new_;
    size_t nbytes;
    int64_t n, c0, c1;
    rp_obuf *out;                    /* in: the job's own payload buffer */
    int64_t changed;                 /* out */
    uint64_t sd[2];                  /* out: the rp.sum128 change */
    int rc;
    const char *err;
} rp_enc_job;

int rp_encode_jobs(rp_enc_job *jobs, int64_t njobs, int nthreads, int64_t *failed,
                   const char **err);

/* rp_encode_jobs whose results are laid out in job order in one buffer, `arena` (the jobs'
 * `out` is ignored): a job that starts when every job before it is in the arena writes there
 * directly; one that finishes early waits in a buffer of its own and is copied in as soon as
 * the jobs before it are, so the early results are all that is held besides the arena. at[j]:
 * where job j's bytes start. A tensor's jobs are consecutive, edge[j] marks its first and last
 * (RP_JOB_FIRST, RP_JOB_LAST); a tensor with no change leaves no bytes (its chunks' empty
 * bodies are taken back out). Run the jobs in the order the arena wants (no largest first). */
#define RP_JOB_FIRST 1
#define RP_JOB_LAST 2
int rp_encode_jobs_arena(rp_enc_job *jobs, int64_t njobs, int nthreads, rp_obuf *arena,
                         const unsigned char *edge, size_t *at, int64_t *failed,
                         const char **err);

typedef struct {
    const rp_kind *k;                /* in: as rp_decode_apply_chunks */
    uint8_t *data;
    size_t nbytes;
    int m;
    const uint8_t *const *body;
    const size_t *len;
    const int64_t *start, *n, *count, *off;
    int64_t *pos_out;
    void *old_out, *new_out;
    int ow, hash;                    /* hash: also sum every word as read (sums) */
    uint64_t delta[2], sums[2];      /* out */
    int rc;
    const char *err;
} rp_dec_job;

/* All or nothing across the jobs: on any failure every job's writes are put back. Jobs
 * must not share chunks (each writes and hashes only the words of its own chunks). */
int rp_decode_apply_jobs(rp_dec_job *jobs, int64_t njobs, int nthreads, int64_t *failed,
                         const char **err);
/* Put back every job that did not fail (each put its own chunks back if it did). */
void rp_dec_jobs_undo(rp_dec_job *jobs, int64_t njobs);

/* A payload's chunk table (varint length + body per chunk, nothing after): body offsets and
 * lengths, nchunks each; 0, or -1 when it is corrupt. */
int rp_parse_table(const uint8_t *p, size_t len, int64_t nchunks, size_t *offs, size_t *lens);

typedef struct {
    const rp_kind *k;                /* in: the tensor, as rp_decode_apply_chunks */
    uint8_t *data;
    size_t nbytes;
    int64_t n;
    const uint8_t *payload;          /* in: its whole rp.ctxgolomb.v2 payload */
    size_t plen;
    int64_t changed;                 /* in: the header's count; the outputs hold exactly it */
    int64_t step;                    /* in: chunks per job (>= 1) */
    int64_t *pos_out;
    void *old_out, *new_out;
    uint64_t delta[2], sums[2];      /* out: rp.sum128 change and in-pass hash, summed */
} rp_dec_tensor;

/* rp_decode_apply_jobs over every tensor's chunks in jobs of `step` chunks (largest first),
 * each tensor's table and counts checked first (rp_view.c). All or nothing; on a failure
 * *failed is the first failing tensor in the given order (a tensor whose table or counts are
 * refused comes after every decode failure of the tensors before it). */
int rp_decode_apply_view(rp_dec_tensor *ts, int64_t nt, int nthreads, int hash, int64_t *failed,
                         const char **err);

#endif
