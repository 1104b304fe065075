"""One BLAS thread while the passes run.

numpy's OpenBLAS starts a thread per core, and after each call its threads wait for the next
one spinning, a core each.  graphopt's own products are small (the precision guards' probe
products: 32 patches by one layer's weights) and run beside threads of its own (the compensated
rounding of float16 weights, onnxruntime's casts), which need those cores.  ResNet-50 fp16,
five ``optimize`` calls in one process (the library used in a loop): 2.0-2.2 s of CPU per call
and 0.88-1.04 s of passes with OpenBLAS's two threads, 1.2 s and 0.73-0.80 s with one; a single
command-line run measured the same either way, within this machine's noise.

:func:`one_blas_thread` sets OpenBLAS to one thread for a block and restores the count it had;
where numpy's BLAS is not an OpenBLAS this process loaded (found by name in ``/proc/self/maps``,
with the thread-count entry points OpenBLAS exports), it does nothing.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import lru_cache

import numpy as np  # noqa: F401  (loads numpy's BLAS, which is looked for among the libraries)

#: (get, set) entry points, as OpenBLAS builds name them (numpy's wheels: the scipy_ prefix and
#: the 64-bit-integer suffix)
_ENTRY_POINTS = [
    (f"{prefix}get_num_threads{suffix}", f"{prefix}set_num_threads{suffix}")
    for prefix in ("scipy_openblas_", "openblas_")
    for suffix in ("64_", "")
]

_lock = threading.Lock()
_depth = 0
_before = 0


@lru_cache(maxsize=1)
def _openblas() -> tuple[Callable[[], int], Callable[[int], None]] | None:
    """(get, set) of the thread count of the OpenBLAS loaded in this process, or None."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return None
    paths = sorted(
        {
            parts[5]
            for line in maps.splitlines()
            if len(parts := line.split(None, 5)) == 6 and "openblas" in parts[5].lower()
        }
    )
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for get_name, set_name in _ENTRY_POINTS:
            get, put = getattr(lib, get_name, None), getattr(lib, set_name, None)
            if get is not None and put is not None:
                get.restype, get.argtypes = ctypes.c_int, []
                put.restype, put.argtypes = None, [ctypes.c_int]
                return get, put
    return None


@contextmanager
def one_blas_thread() -> Iterator[None]:
    """OpenBLAS at one thread inside the block (nested blocks and threads share it: the count
    comes back when the last block ends)."""
    global _depth, _before
    lib = _openblas()
    if lib is None:
        yield
        return
    get, put = lib
    with _lock:
        if _depth == 0:
            _before = get()
            if _before > 1:
                put(1)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _before > 1:
                put(_before)
