/* rollpatch native core: which instruction sets the core's loops use. Every loop has a scalar
 * form; the join, the encoder's pass and rp.sum128 also have AVX2 forms, and the join and
 * the encoder's pass AVX-512 ones (rp_join512.c, rp_encpass512.c). The default is the best this CPU runs; ROLLPATCH_ISA (scalar, avx2, avx512),
 * read once, or rp_isa_set lowers it, so tests on one machine run every path and require
 * identical bytes (tests/test_native.py), and a slow path can be ruled out in the field. */
#include <stdlib.h>
#include <string.h>

#include "rpcore.h"

static int isa_level = -1; /* -1: not chosen yet */

int rp_isa_best(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2")) return RP_ISA_SCALAR;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vbmi")
        && __builtin_cpu_supports("avx512vbmi2") && __builtin_cpu_supports("avx512bitalg")
        && __builtin_cpu_supports("avx512vpopcntdq") && __builtin_cpu_supports("gfni")
        && __builtin_cpu_supports("avx512dq")
        && __builtin_cpu_supports("bmi2"))
        return RP_ISA_AVX512;
    return RP_ISA_AVX2;
#else
    return RP_ISA_SCALAR;
#endif
}

static int clamp_level(int level) {
    int best = rp_isa_best();
    if (level < 0 || level > best) return best;
    return level;
}

int rp_isa(void) {
    int level = __atomic_load_n(&isa_level, __ATOMIC_RELAXED);
#ifndef RP_ISA_NOCACHE /* the fuzz builds change what the CPU has between calls */
    if (level >= 0) return level;
#else
    if (level >= 0) return clamp_level(level);
#endif
    const char *env = getenv("ROLLPATCH_ISA");
    level = -1;
    if (env && !strcmp(env, "scalar")) level = RP_ISA_SCALAR;
    else if (env && !strcmp(env, "avx2")) level = RP_ISA_AVX2;
    else if (env && !strcmp(env, "avx512")) level = RP_ISA_AVX512;
    level = clamp_level(level);
#ifndef RP_ISA_NOCACHE
    __atomic_store_n(&isa_level, level, __ATOMIC_RELAXED);
#endif
    return level;
}

int rp_isa_set(int level) {
    level = level < 0 ? -1 : clamp_level(level);
    __atomic_store_n(&isa_level, level, __ATOMIC_RELAXED);
    return rp_isa();
}
