/* Force-included into each of the core's files (rp_*.c) for the fuzz builds only (-include):
 * the harness decides per call whether the core's AVX2 loops or its scalar ones run, so both
 * are fuzzed and compared. */
int rp_fuzz_cpu_supports(const char *feature);
#define __builtin_cpu_supports(feature) rp_fuzz_cpu_supports(feature)
