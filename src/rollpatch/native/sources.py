"""The native core's C files, named once: setup.py builds them (with the CPython
bindings, ``BINDING``) and bench/fuzz_codec.py compiles the same ones into the fuzz targets. Plain data,
no imports: both load it by path (setup.py runs before the package is importable)."""

#: The core's C files (without ``.c``), in link order.
CORE = (
    "rp_encode",
    "rp_encsparse",
    "rp_encws",
    "rp_encpass",
    "rp_encpass512",
    "rp_encrange",
    "rp_decode",
    "rp_join",
    "rp_join512",
    "rp_group",
    "rp_isa",
    "rp_apply",
    "rp_copyapply",
    "rp_diff",
    "rp_compose",
    "rp_cast",
    "rp_pool",
    "rp_view",
)
#: The CPython binding's files (setup.py only: the fuzz targets call the core directly).
BINDING = ("module", "mod_encode", "mod_encjobs", "mod_decode", "mod_ops")
BINDING_HEADERS = ("module.h",)
#: The headers they include (the build's ``depends``; the internal ones are in the fuzz
#: script's coverage report: the public ones hold declarations only).
PUBLIC_HEADERS = ("rpcore.h", "rp_cast.h")  # declarations of the core's entry points
INTERNAL_HEADERS = (
    "rp_internal.h",
    "rp_bits.h",
    "rp_lane.h",
    "rp_count512.h",
    "rp_unary.h",
    "rp_bseq.h",
    "rp_join512.h",
)  # static inline helpers
