"""Builds the native codec core (C, CPython API only: no toolchain download, no build deps
beyond setuptools and the system C compiler). Metadata lives in pyproject.toml.

Without a C compiler the build stops with one message saying what to install; with
``ROLLPATCH_NO_NATIVE=1`` it builds no extension, and the numpy reference (same bytes,
several times slower) runs instead (``rollpatch --version`` says which runs)."""

import os
import sys
from pathlib import Path
from runpy import run_path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError, CompileError, ExecError, PlatformError

NATIVE = "src/rollpatch/native"
_SOURCES = run_path(str(Path(__file__).resolve().parent / NATIVE / "sources.py"))  # named once
CORE: tuple[str, ...] = _SOURCES["CORE"]
HEADERS: tuple[str, ...] = (*_SOURCES["PUBLIC_HEADERS"], *_SOURCES["INTERNAL_HEADERS"])
BINDING: tuple[str, ...] = _SOURCES["BINDING"]
BINDING_HEADERS: tuple[str, ...] = _SOURCES["BINDING_HEADERS"]


class BuildCore(build_ext):
    """The extension's build, with a compiler failure said in one message."""

    def run(self) -> None:
        try:
            super().run()
        except (CCompilerError, CompileError, ExecError, PlatformError) as e:
            sys.exit(
                f"error: rollpatch's native codec core did not compile ({e}).\n"
                "It needs a C compiler (gcc or clang: `apt-get install build-essential`, "
                "`dnf install gcc`) and the Python headers (python3-dev). Or set "
                "ROLLPATCH_NO_NATIVE=1 to install without it: the numpy reference runs instead "
                "(same bytes, several times slower)."
            )


NO_NATIVE = os.environ.get("ROLLPATCH_NO_NATIVE", "0") == "1"

setup(
    cmdclass={"build_ext": BuildCore},
    ext_modules=[]
    if NO_NATIVE
    else [
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
    ],
)
