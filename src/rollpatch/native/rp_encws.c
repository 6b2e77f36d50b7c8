/* rollpatch native core: the encoder's memory. Output buffers (rp_obuf: a payload grows in
 * place, in its own mapping once large, so freeing it returns its pages at once) and the
 * work buffers kept across the chunks of a range (rp_encws), and a coded body written out. */
#define _GNU_SOURCE /* mremap */
#include "rp_internal.h"

#if defined(__linux__)
#include <sys/mman.h>
#endif

/* ------------------------------------------------------------------ output buffers */

#define OBUF_MAP ((size_t)64 << 10)

int rp_obuf_reserve(rp_obuf *o, size_t extra) {
    if (o->len + extra <= o->cap) return 0;
    size_t cap = o->cap ? o->cap : 256;
    while (cap < o->len + extra) cap *= 2;
#if defined(__linux__)
    if (cap >= OBUF_MAP) {
        cap = (cap + 4095) & ~(size_t)4095;
        void *p;
        if (o->mapped) {
            p = mremap(o->b, o->cap, cap, MREMAP_MAYMOVE);
            if (p == MAP_FAILED) return -1;
        } else {
            p = mmap(NULL, cap, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            if (p == MAP_FAILED) return -1;
            if (o->len) memcpy(p, o->b, o->len);
            free(o->b);
            o->mapped = 1;
        }
        o->b = p;
        o->cap = cap;
        return 0;
    }
#endif
    uint8_t *nb = realloc(o->b, cap);
    if (!nb) return -1;
    o->b = nb;
    o->cap = cap;
    return 0;
}

/* Give back the room beyond the length (a tensor's payload is kept while the others are
 * coded: many small ones must not each hold a page or more). */
void rp_obuf_fit(rp_obuf *o) {
#if defined(__linux__)
    if (o->mapped) {
        size_t cap = (o->len + 4095) & ~(size_t)4095;
        if (cap && cap < o->cap) {
            void *p = mremap(o->b, o->cap, cap, 0); /* shrinks in place */
            if (p != MAP_FAILED) o->cap = cap;
        }
        return;
    }
#endif
    if (o->b && o->cap > o->len + 64) {
        uint8_t *nb = realloc(o->b, o->len ? o->len : 1);
        if (nb) {
            o->b = nb;
            o->cap = o->len ? o->len : 1;
        }
    }
}

void rp_obuf_free(rp_obuf *o) {
#if defined(__linux__)
    if (o->mapped) munmap(o->b, o->cap);
    else
#endif
        free(o->b);
    memset(o, 0, sizeof *o);
}

/* ------------------------------------------------------------------ work buffers */

/* At least `need` bytes in o, its bytes kept (amortised doubling). */
static int ogrow(rp_obuf *o, size_t need) {
    if (need <= o->cap) return 0;
    o->len = o->cap; /* keep every byte when the buffer moves */
    int rc = rp_obuf_reserve(o, need - o->cap);
    o->len = 0;
    return rc;
}

/* Room for `extra` more records (one shared capacity for rec and tail). */
int rp_ws_reserve(rp_encws *w, int64_t extra) {
    int64_t need = w->k + extra + 1;
    if (need <= w->cap) return 0;
    if (ogrow(&w->mrec, (size_t)need * 4) || ogrow(&w->mtail, (size_t)need * 8)) return -1;
    w->rec = (uint32_t *)w->mrec.b;
    w->tail = (uint64_t *)w->mtail.b;
    w->cap = (int64_t)(w->mrec.cap / 4 < w->mtail.cap / 8 ? w->mrec.cap / 4 : w->mtail.cap / 8);
    return 0;
}

/* Room for the coder's arrays of k records. */
int rp_ws_reserve_coder(rp_encws *w, int64_t k) {
    if (k + 1 <= w->gcap) return 0;
    size_t need = (size_t)k + 1;
    if (ogrow(&w->mgrp, need * 4) || ogrow(&w->mscr, need * 4) || ogrow(&w->mtsort, need * 8))
        return -1;
    w->grp = (uint32_t *)w->mgrp.b;
    w->scr = (uint32_t *)w->mscr.b;
    w->tsort = (uint64_t *)w->mtsort.b;
    size_t g = w->mgrp.cap / 4, c2 = w->mscr.cap / 4, c3 = w->mtsort.cap / 8;
    w->gcap = (int64_t)(g < c2 ? (g < c3 ? g : c3) : (c2 < c3 ? c2 : c3));
    return 0;
}

void rp_ws_free(rp_encws *w) {
    rp_obuf_free(&w->mrec); rp_obuf_free(&w->mgrp); rp_obuf_free(&w->mscr);
    rp_obuf_free(&w->mtail); rp_obuf_free(&w->mtsort);
    free(w->pw.b); free(w->uw.b); free(w->fw.b);
    memset(w, 0, sizeof *w);
}

static int varint_len(uint64_t v) {
    int n = 1;
    while (v >= 0x80) { v >>= 7; n++; }
    return n;
}

/* The body's length, and the body itself written at dst (room for that length). */
static size_t ws_body_len(const rp_encws *w) {
    if (!w->pw.len) return 0;
    return varint_len(w->pw.len) + w->pw.len + varint_len(w->uw.len) + w->uw.len + w->fw.len;
}

static uint8_t *put_varint(uint8_t *d, uint64_t v) {
    while (v >= 0x80) { *d++ = (uint8_t)(v | 0x80); v >>= 7; }
    *d++ = (uint8_t)v;
    return d;
}

static void ws_body(const rp_encws *w, uint8_t *d) {
    if (!w->pw.len) return;
    d = put_varint(d, w->pw.len);
    memcpy(d, w->pw.b, w->pw.len); d += w->pw.len;
    d = put_varint(d, w->uw.len);
    if (w->uw.len) memcpy(d, w->uw.b, w->uw.len);
    d += w->uw.len;
    if (w->fw.len) memcpy(d, w->fw.b, w->fw.len);
}

/* The body of the coded records in w as a malloc'd buffer (NULL, 0 when nothing changed). */
int rp_ws_body(const rp_encws *w, uint8_t **out, size_t *outlen) {
    size_t len = ws_body_len(w);
    *out = NULL;
    *outlen = 0;
    if (!len) return RP_OK;
    *out = malloc(len);
    if (!*out) return RP_ENOMEM;
    ws_body(w, *out);
    *outlen = len;
    return RP_OK;
}

/* Append varint(len) + the body of w's coded records to o. */
int rp_ws_append(const rp_encws *w, rp_obuf *o) {
    size_t len = ws_body_len(w);
    if (rp_obuf_reserve(o, len + 10)) return RP_ENOMEM;
    uint8_t *d = put_varint(o->b + o->len, len);
    ws_body(w, d);
    o->len = (size_t)(d - o->b) + len;
    return RP_OK;
}


rp_encws *rp_ws_new(void) { return calloc(1, sizeof(rp_encws)); }

void rp_ws_delete(rp_encws *w) {
    if (!w) return;
    rp_ws_free(w);
    free(w);
}
