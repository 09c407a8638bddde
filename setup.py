"""Builds pyengine._native: the Cython bindings in bindings/ plus the C core in csrc/.

Everything else about the package is declared in pyproject.toml.

Each ``pip install`` builds the package anew (``.`` then ``-e ".[test]"`` then ``".[spark]"``),
and compiling the native code takes one to two and a half minutes; the result depends only on
the native sources, the compiler and the Python it is built for. So a built extension is kept
in a cache (``build/native-cache/`` of this tree; ``PYENGINE_NATIVE_CACHE`` names another
directory, or ``off`` to always compile) under the hash of exactly those inputs, and the next
build with the same inputs copies it instead of compiling. Any change to a file under
``bindings/`` or ``csrc/``, to this file, to the compiler's command line or version, to the
Python version or ABI, or to the Cython or numpy used, changes the key: that build compiles.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from glob import glob
from typing import Any, Callable, Dict, List, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
CACHE_ENV = "PYENGINE_NATIVE_CACHE"
# Every input of the native build that lives in the tree (bindings/*.c is Cython's output).
NATIVE_INPUTS = ("setup.py", "bindings/*.pyx", "bindings/*.pxd", "bindings/*.pxi", "csrc/*.c", "csrc/*.h")
CYTHON_OPTIONS: Dict[str, Any] = {"include_path": ["bindings"], "compiler_directives": {"language_level": "3"}}


def _rel(pattern: str, root: str = HERE) -> List[str]:
    return sorted(os.path.relpath(p, root) for p in glob(os.path.join(root, pattern)))


def native_sources(root: str = HERE) -> List[str]:
    return ["bindings/_native.pyx", *_rel("csrc/*.c", root)]


def compiler_identity(command: Sequence[str]) -> str:
    """The compiler's command line and what its ``--version`` says (a different gcc or
    clang behind the same name is a different build)."""
    try:
        version = subprocess.run(
            [command[0], "--version"], capture_output=True, text=True, timeout=30, check=False
        ).stdout
    except (OSError, IndexError, subprocess.SubprocessError):
        version = "unknown"
    return " ".join(command) + "\n" + version


def cache_key(root: str, compiler: str, tools: Dict[str, str], flags: Sequence[str]) -> str:
    """The hash of everything the built extension depends on: the content of every native
    input under ``root`` (names included), ``compiler`` (``compiler_identity``), the
    versions of ``tools`` (Cython, numpy), the extension's ``flags``, and the Python
    it is built for (version, ABI tag and extension suffix, platform)."""
    digest = hashlib.sha256()

    def part(label: str, data: bytes) -> None:
        digest.update(f"{label}\0{len(data)}\0".encode())
        digest.update(data)

    for pattern in NATIVE_INPUTS:
        for rel in _rel(pattern, root):
            with open(os.path.join(root, rel), "rb") as f:
                part("file:" + rel.replace(os.sep, "/"), f.read())
    part("compiler", compiler.encode())
    for name, version in sorted(tools.items()):
        part("tool:" + name, version.encode())
    part("flags", "\0".join(flags).encode())
    python = (
        sys.version,
        sys.implementation.cache_tag or "",
        str(sysconfig.get_config_var("EXT_SUFFIX")),
        str(sysconfig.get_config_var("SOABI")),
        sysconfig.get_platform(),
        platform.machine(),
    )
    part("python", "\0".join(python).encode())
    return digest.hexdigest()[:32]


def cache_dir(root: str = HERE) -> Optional[str]:
    """Where built extensions are kept, or None when caching is off."""
    configured = os.environ.get(CACHE_ENV, "")
    if configured.lower() in ("off", "0", "no", "false"):
        return None
    return configured or os.path.join(root, "build", "native-cache")


def _log(message: str) -> None:
    print(f"pyengine setup.py: {message}", file=sys.stderr, flush=True)


def _build_ext_class() -> Any:
    from setuptools.command.build_ext import build_ext

    class CachedBuildExt(build_ext):  # type: ignore[misc, valid-type]
        """``build_ext`` that copies a cached extension built from the same inputs, and
        keeps what it compiles for the next build."""

        def build_extension(self, ext: Any) -> None:
            def compile_it() -> None:
                from Cython.Build import cythonize

                ext.sources = native_sources()  # setuptools renames .pyx to .c where Cython was absent
                ext.sources = cythonize([ext], **CYTHON_OPTIONS)[0].sources  # the same ext, setuptools' own
                super(CachedBuildExt, self).build_extension(ext)

            where = cache_dir()
            if where is None:
                compile_it()
                return
            key = cache_key(
                HERE,
                compiler_identity(list(getattr(self.compiler, "compiler_so", None) or ["cc"]))
                + "\nlinker: "
                + " ".join(getattr(self.compiler, "linker_so", None) or []),
                _tool_versions(),
                [*ext.extra_compile_args, *ext.extra_link_args, *(f"{k}={v}" for k, v in ext.define_macros)],
            )
            reuse_or_build(self.get_ext_fullpath(ext.name), os.path.join(where, key), compile_it)

    return CachedBuildExt


def _tool_versions() -> Dict[str, str]:
    import Cython
    import numpy

    return {"Cython": Cython.__version__, "numpy": numpy.__version__}


def reuse_or_build(target: str, directory: str, build: Callable[[], None]) -> bool:
    """Puts the extension at ``target``: a copy of the one kept in ``directory`` (the
    cache entry of this build's key) when there is one, and True; else ``build()`` writes
    it, it is kept in ``directory`` for the next build, and False. A failed build keeps
    nothing."""
    cached = os.path.join(directory, os.path.basename(target))
    if os.path.isfile(cached):
        os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
        shutil.copyfile(cached, target)
        _log(f"reused {cached} (same native sources, compiler and Python; {CACHE_ENV}=off compiles)")
        return True
    build()
    _store(target, directory)
    return False


def _store(built: str, directory: str) -> None:
    """Copies ``built`` into ``directory`` atomically (a concurrent build, or one killed
    half-way, never leaves a partial file under the key's name): a failure to cache is
    said, not raised, since the build itself succeeded."""
    tmp = None
    try:
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".partial-")
        os.close(fd)
        shutil.copyfile(built, tmp)
        os.replace(tmp, os.path.join(directory, os.path.basename(built)))
    except OSError as exc:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        _log(f"could not keep the built extension in {directory} ({exc}); the next build compiles again")


def main() -> None:
    import numpy
    from setuptools import Extension, setup

    # csrc/ is held to C99 by CMakeLists.txt (-std=c99 -Wpedantic -Werror); the
    # Cython-generated file follows the C standard of the Python headers instead.
    extra_compile_args = ["-O3"] if os.name != "nt" else []
    if os.environ.get("PYENGINE_DEBUG_BUILD"):
        extra_compile_args = ["-O0", "-g"]

    native = Extension(
        "pyengine._native",
        sources=native_sources(),
        depends=[*_rel("bindings/*.pxi"), *_rel("bindings/*.pxd"), *_rel("csrc/*.h")],
        include_dirs=["csrc", "bindings", numpy.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        extra_compile_args=extra_compile_args,
    )
    # cythonized in build_extension, and only when the cache does not hold the result
    setup(ext_modules=[native], cmdclass={"build_ext": _build_ext_class()})


if __name__ == "__main__":  # setuptools' build backend runs this file as __main__
    main()
