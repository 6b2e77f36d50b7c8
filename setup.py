"""Builds the native codec core (C, CPython API only: no toolchain download, no build deps
beyond setuptools and the system C compiler). Metadata lives in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "rollpatch.native._rpcore",
            sources=["src/rollpatch/native/rpcore.c", "src/rollpatch/native/module.c"],
            depends=["src/rollpatch/native/rpcore.h"],
            extra_compile_args=["-O3", "-std=gnu11", "-fno-strict-aliasing", "-Wall",
                                "-Wno-unused-function"],
        )
    ]
)
