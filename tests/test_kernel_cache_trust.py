"""The kernel build cache holds code: a cached library is loaded only if it is the one its
build recorded (sha256) and nobody but this user could have written it; else it is rebuilt."""

import os
import sys

import pytest

from graphopt.targets.codegen import toolchain

BUILD = "open('lib.so', 'wb').write(b'the built library')"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHOPT_KERNEL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _build():
    compiler = toolchain.Compiler("cc", sys.executable, "test")
    return toolchain.build({"k.c": "int x;"}, [sys.executable, "-c", BUILD], "lib.so", compiler)


def test_a_cached_build_is_reused_when_untouched(cache):
    first = _build()
    again = _build()
    assert not first.cached and again.cached and again.library == first.library


@pytest.mark.parametrize("tamper", ["substituted", "group-writable", "linked"])
def test_a_tampered_cached_library_is_rebuilt_not_loaded(cache, tamper, tmp_path):
    lib = _build().library
    if tamper == "substituted":
        lib.write_bytes(b"planted code")
        os.chmod(lib, 0o755)
    elif tamper == "group-writable":
        os.chmod(lib, 0o775)
    else:
        planted = tmp_path / "planted.so"
        planted.write_bytes(b"the built library")
        lib.unlink()
        lib.symlink_to(planted)
    rebuilt = _build()
    assert not rebuilt.cached
    assert not rebuilt.library.is_symlink()
    assert rebuilt.library.read_bytes() == b"the built library"
