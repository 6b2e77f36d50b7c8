"""The native core's C files, named once: setup.py builds them (with ``module.c``, the CPython
bindings) and bench/fuzz_codec.py compiles the same ones into the fuzz targets. Plain data,
no imports: both load it by path (setup.py runs before the package is importable)."""

#: The core's C files (without ``.c``), in link order.
CORE = (
    "rp_encode",
    "rp_encws",
    "rp_encpass",
    "rp_encpass512",
    "rp_decode",
    "rp_join",
    "rp_join512",
    "rp_group",
    "rp_isa",
    "rp_apply",
    "rp_cast",
    "rp_pool",
)
#: The headers they include (the build's ``depends``; the fuzz script's coverage report).
HEADERS = ("rpcore.h", "rp_internal.h", "rp_lane.h", "rp_bseq.h", "rp_cast.h")
