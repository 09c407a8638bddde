"""setup.py's cache of the built native extension (#38): ``pip install .`` then
``pip install -e ".[test]"`` compiled the same C and Cython twice (1-2.5 min each).
A build reuses the extension built from the same inputs, and only those: any change to
a native source, setup.py, the compiler, the Python or the tools builds anew."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path
from typing import Any, List

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def setup_py() -> Any:
    """setup.py as a module (its ``main()`` runs only as ``__main__``, as the build backend runs it)."""
    spec = importlib.util.spec_from_file_location("pyengine_setup_py", ROOT / "setup.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of the native build's inputs."""
    copy = tmp_path / "tree"
    (copy / "bindings").mkdir(parents=True)
    shutil.copy(ROOT / "setup.py", copy / "setup.py")
    for pattern in ("*.pyx", "*.pxd", "*.pxi"):
        for f in (ROOT / "bindings").glob(pattern):
            shutil.copy(f, copy / "bindings" / f.name)
    shutil.copytree(ROOT / "csrc", copy / "csrc", ignore=shutil.ignore_patterns("*.o", "*.txt", "test*"))
    return copy


TOOLS = {"Cython": "3.1.2", "numpy": "2.2.0"}
GCC = "gcc -pthread -O3 -fPIC\ngcc (Debian 12.2.0-14) 12.2.0"


def test_the_key_is_the_content_not_the_place(setup_py: Any, tree: Path, tmp_path: Path) -> None:
    key = setup_py.cache_key(str(tree), GCC, TOOLS, ["-O3"])
    assert key == setup_py.cache_key(str(ROOT), GCC, TOOLS, ["-O3"])  # the repository and a copy of it
    moved = tmp_path / "elsewhere"
    shutil.copytree(tree, moved)
    assert setup_py.cache_key(str(moved), GCC, TOOLS, ["-O3"]) == key


def test_every_input_changes_the_key(setup_py: Any, tree: Path) -> None:
    key = setup_py.cache_key(str(tree), GCC, TOOLS, ["-O3"])
    seen = {key}

    def changed(new: str) -> None:
        assert new not in seen, "an input that changes the build left the key as it was"
        seen.add(new)

    header = sorted((tree / "csrc").glob("*.h"))[0]
    source = sorted((tree / "csrc").glob("*.c"))[0]
    for path in (header, source, tree / "bindings" / "_native.pyx", tree / "setup.py"):
        original = path.read_bytes()
        path.write_bytes(original + b"\n/* one more line */\n")
        changed(setup_py.cache_key(str(tree), GCC, TOOLS, ["-O3"]))
        path.write_bytes(original)
        assert setup_py.cache_key(str(tree), GCC, TOOLS, ["-O3"]) == key  # back as it was: the same key
    (tree / "csrc" / "new.h").write_text("#define X 1\n")  # a new file counts, by name too
    changed(setup_py.cache_key(str(tree), GCC, TOOLS, ["-O3"]))
    (tree / "csrc" / "new.h").unlink()
    changed(setup_py.cache_key(str(tree), GCC.replace("12.2.0-14", "13.1.0-1"), TOOLS, ["-O3"]))
    changed(setup_py.cache_key(str(tree), "clang -O3 -fPIC\nclang 16", TOOLS, ["-O3"]))
    changed(setup_py.cache_key(str(tree), GCC, {**TOOLS, "numpy": "1.26.4"}, ["-O3"]))
    changed(setup_py.cache_key(str(tree), GCC, {**TOOLS, "Cython": "3.0.8"}, ["-O3"]))
    changed(setup_py.cache_key(str(tree), GCC, TOOLS, ["-O0", "-g"]))  # PYENGINE_DEBUG_BUILD


def test_the_python_is_part_of_the_key(setup_py: Any, tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = setup_py.cache_key(str(tree), GCC, TOOLS, ["-O3"])
    config = dict(setup_py.sysconfig.get_config_vars())
    monkeypatch.setattr(
        setup_py.sysconfig,
        "get_config_var",
        lambda name: ".cpython-312-x86_64-linux-gnu.so" if name == "EXT_SUFFIX" else config.get(name),
    )
    assert setup_py.cache_key(str(tree), GCC, TOOLS, ["-O3"]) != key


def test_a_build_is_reused_only_under_its_key(setup_py: Any, tmp_path: Path) -> None:
    builds: List[str] = []
    target = tmp_path / "lib" / "pyengine" / "_native.so"

    def build(content: bytes) -> Any:
        def run() -> None:
            builds.append(content.decode())
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content)

        return run

    cache = tmp_path / "cache"
    assert setup_py.reuse_or_build(str(target), str(cache / "key-a"), build(b"built from a")) is False
    target.unlink()
    # the next build of the same inputs copies, without compiling
    assert setup_py.reuse_or_build(str(target), str(cache / "key-a"), build(b"built again")) is True
    assert target.read_bytes() == b"built from a" and builds == ["built from a"]
    # another key (a changed source) compiles, and keeps the old entry apart
    assert setup_py.reuse_or_build(str(target), str(cache / "key-b"), build(b"built from b")) is False
    assert target.read_bytes() == b"built from b" and builds == ["built from a", "built from b"]
    assert (cache / "key-a" / "_native.so").read_bytes() == b"built from a"
    assert not [p for p in cache.rglob(".partial-*")]


def test_a_failed_build_keeps_nothing(setup_py: Any, tmp_path: Path) -> None:
    def fails() -> None:
        raise RuntimeError("gcc: error")

    with pytest.raises(RuntimeError, match="gcc"):
        setup_py.reuse_or_build(str(tmp_path / "_native.so"), str(tmp_path / "cache" / "k"), fails)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*"))


def test_the_cache_is_in_the_tree_elsewhere_or_off(setup_py: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(setup_py.CACHE_ENV, raising=False)
    assert setup_py.cache_dir("/src") == os.path.join("/src", "build", "native-cache")
    monkeypatch.setenv(setup_py.CACHE_ENV, "/var/cache/pe")
    assert setup_py.cache_dir("/src") == "/var/cache/pe"
    monkeypatch.setenv(setup_py.CACHE_ENV, "off")
    assert setup_py.cache_dir("/src") is None
