"""Compilers and the build cache for generated kernels.

* ``gcc`` (override: ``GRAPHOPT_CC``) builds the cpu library; ``nvcc`` (``GRAPHOPT_NVCC``) the
  cuda one.  ``GRAPHOPT_NO_COMPILER=1`` (or ``cc``/``nvcc``) hides them, which is how the tests
  exercise the "no compiler" path: the fusion pass then skips with a remark, never an error.
* ``-march``: ``x86-64-v3`` (AVX2, FMA, F16C) when this CPU has those, else ``x86-64-v2``; the
  manifest records it (a v3 library does not load on a v2 machine).
* Builds are content-addressed: ``<cache>/<sha256 of source, flags, compiler>/``, written in a
  temporary directory and renamed into place, so concurrent builds and reruns are safe and a
  rebuild of the same source costs nothing.  Cache: ``GRAPHOPT_KERNEL_CACHE`` or
  ``~/.cache/graphopt/kernels``.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

BUILD_TIMEOUT_S = 300


class BuildError(Exception):
    """A compiler failed; ``log`` holds its output."""

    def __init__(self, message: str, log: str = ""):
        super().__init__(message)
        self.log = log


@dataclass(frozen=True)
class Compiler:
    kind: str  # "cc" | "nvcc"
    path: str
    version: str


def _hidden(kind: str) -> bool:
    v = os.environ.get("GRAPHOPT_NO_COMPILER", "").strip().lower()
    return v in ("1", "true", "yes", "all") or kind in {p.strip() for p in v.split(",")}


def find_compiler(kind: str) -> Compiler | None:
    """The compiler of ``kind`` ("cc" or "nvcc"), or None when there is none (or it is hidden)."""
    if _hidden(kind):
        return None
    env = {"cc": "GRAPHOPT_CC", "nvcc": "GRAPHOPT_NVCC"}[kind]
    name = os.environ.get(env) or {"cc": "gcc", "nvcc": "nvcc"}[kind]
    path = shutil.which(name)
    if path is None and kind == "nvcc" and Path("/usr/local/cuda/bin/nvcc").exists():
        path = "/usr/local/cuda/bin/nvcc"
    if path is None:
        return None
    return Compiler(kind, path, _version(path))


@lru_cache(maxsize=8)
def _version(path: str) -> str:
    try:
        out = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=30
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    lines = [ln for ln in out.splitlines() if ln.strip()]
    if "nvcc" in path:
        return next((ln for ln in lines if "release" in ln), lines[-1] if lines else "unknown")
    return lines[0] if lines else "unknown"


#: the /proc/cpuinfo flags each -march level the cpu kernels are built for needs
MARCH_FEATURES = {
    "x86-64-v3": frozenset({"avx2", "fma", "f16c", "bmi2"}),
    "x86-64-v2": frozenset({"sse4_2", "popcnt", "ssse3"}),
}


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """This CPU's /proc/cpuinfo flags (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def cpu_march() -> str:
    return "x86-64-v3" if MARCH_FEATURES["x86-64-v3"] <= cpu_flags() else "x86-64-v2"


def march_missing(march: str | None) -> str | None:
    """Why a library built with ``-march=march`` cannot run on this CPU, or None when it can."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"it is built for x86-64 and this machine is {platform.machine()}"
    lacking = sorted(MARCH_FEATURES.get(march or "", frozenset()) - cpu_flags())
    if lacking:
        return f"it is built for {march} and this CPU lacks {', '.join(lacking)}"
    return None


def cache_root() -> Path:
    root = os.environ.get("GRAPHOPT_KERNEL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "graphopt" / "kernels"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _trusted(entry: Path, output: str) -> dict | None:
    """The build record of a cached build that may be loaded, else None: the entry and its
    library are this user's, writable by no one else, regular files (no link), and the library
    is the one the build recorded (its sha256).  A library is code: a cache another user or a
    restored CI artifact could have written into is rebuilt, not trusted."""
    uid = os.getuid() if hasattr(os, "getuid") else None
    try:
        for p in (entry, entry / output, entry / "build.json"):
            st = os.lstat(p)
            if p != entry and not stat.S_ISREG(st.st_mode):
                return None
            if (uid is not None and st.st_uid != uid) or st.st_mode & 0o022:
                return None
        info = json.loads((entry / "build.json").read_text())
        if not isinstance(info, dict) or info.get("sha256") != _sha256(entry / output):
            return None
        return info if isinstance(info.get("command"), list) else None
    except (OSError, ValueError, RecursionError):
        return None


@dataclass(frozen=True)
class Build:
    """A finished build: its directory, the library and the compiler's messages."""

    dir: Path
    library: Path
    log: str
    command: tuple[str, ...]
    seconds: float
    cached: bool


def build(
    files: dict[str, str],
    command: list[str],
    output: str,
    compiler: Compiler,
    *,
    extra_outputs: tuple[str, ...] = (),
) -> Build:
    """Write ``files`` and run ``command`` (argv, relative names) in a cache directory.

    ``command`` must produce ``output``; its stdout+stderr is kept as ``build.log``."""
    key = hashlib.sha256(
        json.dumps(
            {"files": files, "command": command, "compiler": [compiler.path, compiler.version]},
            sort_keys=True,
        ).encode()
    ).hexdigest()[:24]
    root = cache_root()
    final = root / key
    meta = final / "build.json"
    if meta.exists() and (final / output).exists():
        info = _trusted(final, output)
        if info is not None:
            return Build(
                final,
                final / output,
                (final / "build.log").read_text(),
                tuple(info["command"]),
                info["seconds"],
                True,
            )
        shutil.rmtree(final, ignore_errors=True)  # rebuilt below, never loaded
        if final.exists():
            raise BuildError(f"the kernel cache entry {final} is not to be trusted and stays")
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=root))
    try:
        for name, text in files.items():
            (work / name).write_text(text)
        import time

        t0 = time.perf_counter()
        try:
            proc = subprocess.run(
                command, cwd=work, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            raise BuildError(
                f"{Path(command[0]).name} timed out after {BUILD_TIMEOUT_S} s"
            ) from None
        except OSError as e:
            raise BuildError(f"cannot run {command[0]}: {e}") from None
        seconds = time.perf_counter() - t0
        log = proc.stdout + proc.stderr
        (work / "build.log").write_text(log)
        if proc.returncode != 0 or not (work / output).exists():
            raise BuildError(
                f"{Path(command[0]).name} failed (exit {proc.returncode}): "
                + (log.strip().splitlines() or [""])[-1][:300],
                log,
            )
        os.chmod(work / output, 0o755)  # whatever the umask: writable by this user alone
        digest = _sha256(work / output)
        (work / "build.json").write_text(
            json.dumps(
                {"command": command, "seconds": round(seconds, 3), "sha256": digest},
                sort_keys=True,
            )
        )
        try:
            os.rename(work, final)
        except OSError:  # another process finished the same build first
            shutil.rmtree(work, ignore_errors=True)
        return Build(final, final / output, log, tuple(command), seconds, False)
    finally:
        if work.exists() and work != final:
            shutil.rmtree(work, ignore_errors=True)
