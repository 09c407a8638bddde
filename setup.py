"""Builds pyengine._native: the Cython bindings in bindings/ plus the C core in csrc/.

Everything else about the package is declared in pyproject.toml.
"""

from __future__ import annotations

import os
from glob import glob

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _rel(pattern: str) -> list[str]:
    return sorted(os.path.relpath(p, HERE) for p in glob(os.path.join(HERE, pattern)))


# csrc/ is held to C99 by CMakeLists.txt (-std=c99 -Wpedantic -Werror); the
# Cython-generated file follows the C standard of the Python headers instead.
extra_compile_args = ["-O3"] if os.name != "nt" else []
if os.environ.get("PYENGINE_DEBUG_BUILD"):
    extra_compile_args = ["-O0", "-g"]

native = Extension(
    "pyengine._native",
    sources=["bindings/_native.pyx", *_rel("csrc/*.c")],
    depends=[*_rel("bindings/*.pxi"), *_rel("bindings/*.pxd"), *_rel("csrc/*.h")],
    include_dirs=["csrc", "bindings", numpy.get_include()],
    define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    extra_compile_args=extra_compile_args,
)

setup(
    ext_modules=cythonize(
        [native],
        include_path=["bindings"],
        compiler_directives={"language_level": "3"},
    ),
)
