/* rollpatch native core: the publisher's BF16 cast of float32 masters (rp_cast.c). */
#ifndef RP_CAST_H
#define RP_CAST_H
#include <stdint.h>

/* dst[i] = the BF16 word of the float32 whose bits are src[i], i < n: round to nearest, ties
 * to even, on the bits (±0, subnormals and ±inf kept, the largest finite values overflow to
 * ±inf), and every NaN 0xFFFF (formats.floats.f32_to_bf16_bits, torch's vectorised CPU cast).
 * Returns how many elements were NaN. src and dst must not overlap. */
int64_t rp_cast_bf16(const uint32_t *src, uint16_t *dst, int64_t n);

/* rp_cast_bf16 that also compares each new word with prev[i] (the previous snapshot's words)
 * in the same pass and lists the differences in position order: pos[j] = i, oldv[j] =
 * prev[i], newv[j] = dst[i], for the first `cap` of them. Returns how many differ (possibly
 * more than cap: then only cap are listed); *nans gets the NaN count. prev may not overlap
 * dst; src may not overlap either. */
int64_t rp_cast_bf16_diff(const uint32_t *src, const uint16_t *prev, uint16_t *dst, int64_t n,
                          int64_t *pos, uint16_t *oldv, uint16_t *newv, int64_t cap,
                          int64_t *nans);

#endif
