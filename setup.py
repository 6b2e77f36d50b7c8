"""Builds the native codec core (C, CPython API only: no toolchain download, no build deps
beyond setuptools and the system C compiler). Metadata lives in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "rollpatch.native._rpcore",
            sources=[
                f"src/rollpatch/native/{f}.c"
                for f in (
                    "rp_encode",
                    "rp_encws",
                    "rp_encpass",
                    "rp_encpass512",
                    "rp_decode",
                    "rp_join",
                    "rp_group",
                    "rp_join512",
                    "rp_isa",
                    "rp_apply",
                    "module",
                )
            ],
            depends=[
                "src/rollpatch/native/rpcore.h",
                "src/rollpatch/native/rp_internal.h",
                "src/rollpatch/native/rp_lane.h",
                "src/rollpatch/native/rp_bseq.h",
            ],
            extra_compile_args=[
                "-O3",
                "-std=gnu11",
                "-fno-strict-aliasing",
                "-Wall",
                "-Wno-unused-function",
            ],
        )
    ]
)
