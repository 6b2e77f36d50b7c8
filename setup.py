"""Builds the native codec core (C, CPython API only: no toolchain download, no build deps
beyond setuptools and the system C compiler). Metadata lives in pyproject.toml."""

from pathlib import Path
from runpy import run_path

from setuptools import Extension, setup

NATIVE = "src/rollpatch/native"
_SOURCES = run_path(str(Path(__file__).resolve().parent / NATIVE / "sources.py"))  # named once
CORE: tuple[str, ...] = _SOURCES["CORE"]
HEADERS: tuple[str, ...] = (*_SOURCES["PUBLIC_HEADERS"], *_SOURCES["INTERNAL_HEADERS"])
BINDING: tuple[str, ...] = _SOURCES["BINDING"]
BINDING_HEADERS: tuple[str, ...] = _SOURCES["BINDING_HEADERS"]

setup(
    ext_modules=[
        Extension(
            "rollpatch.native._rpcore",
            sources=[f"{NATIVE}/{f}.c" for f in (*CORE, *BINDING)],
            depends=[f"{NATIVE}/{h}" for h in (*HEADERS, *BINDING_HEADERS)],
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
