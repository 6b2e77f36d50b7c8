/* Force-included into each of the core's files (rp_*.c) for the fuzz builds only (-include):
 * the harness decides per call whether the core's vector loops or its scalar ones run (and
 * per input whether the AVX-512 ones may), so every path is fuzzed and compared. rp_isa.c
 * then chooses its level on every call (RP_ISA_NOCACHE) instead of once. */
int rp_fuzz_cpu_supports(const char *feature);
#define __builtin_cpu_supports(feature) rp_fuzz_cpu_supports(feature)
#define RP_ISA_NOCACHE 1
