"""Exact float16 <-> float32 conversion of large arrays.

numpy converts float16 one value at a time on machines without AVX-512, while onnxruntime's Cast
kernel uses the processor's half-precision instructions (about 30x faster: docs/benchmarks.md).
Both round to nearest even, keep signed zeros and subnormals and overflow to infinity, so the
results are the same bit for bit (checked in tests against numpy on every float16 and on float32
values at every rounding tie).  Arrays below :data:`SMALL` values take numpy's cast (a session
run costs tens of microseconds).  float64 → float16 is not offered: onnxruntime rounds it twice
(through float32), which differs at ties.  float16 → float64 takes the optional C extension
(``opt/numerics/_rounding.c``) where it was built: one pass instead of two.
"""

from __future__ import annotations

import threading

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

try:  # the optional C extension (setup.py)
    from . import _rounding as native
except ImportError:
    native = None

#: below this many values numpy's cast is cheaper than a session run
SMALL = 1 << 16

_sessions: dict[tuple[int, int], ort.InferenceSession] = {}
_lock = threading.Lock()


def _cast_session(src: int, dst: int) -> ort.InferenceSession:
    """A one-node Cast session, made once per direction (thread-safe: sessions run
    concurrently)."""
    key = (src, dst)
    with _lock:
        sess = _sessions.get(key)
        if sess is None:
            node = helper.make_node("Cast", ["x"], ["y"], to=dst)
            graph = helper.make_graph(
                [node],
                "cast",
                [helper.make_tensor_value_info("x", src, None)],
                [helper.make_tensor_value_info("y", dst, None)],
            )
            model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
            model.ir_version = min(model.ir_version, onnx.IR_VERSION, 9)
            so = ort.SessionOptions()
            so.log_severity_level = 4
            so.intra_op_num_threads = 1  # memory-bound: one thread keeps up, and never spins
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
            sess = ort.InferenceSession(
                model.SerializeToString(), so, providers=["CPUExecutionProvider"]
            )
            _sessions[key] = sess
        return sess


def _cast(a: np.ndarray, src: int, dst: int) -> np.ndarray:
    flat = np.ascontiguousarray(a).reshape(-1)
    out = _cast_session(src, dst).run(None, {"x": flat})[0]
    return out.reshape(a.shape)


def to_float16(a: np.ndarray) -> np.ndarray:
    """float32 ``a`` rounded to float16 (as ``a.astype(np.float16)``)."""
    if a.dtype != np.float32:
        raise TypeError(f"to_float16 takes float32, not {a.dtype}")
    if a.size < SMALL:
        with np.errstate(over="ignore", under="ignore", invalid="ignore"):
            return a.astype(np.float16)
    return _cast(a, TensorProto.FLOAT, TensorProto.FLOAT16)


def widen(a: np.ndarray, dtype=np.float32) -> np.ndarray:
    """float16 ``a`` as float32 or float64 (exact, as ``a.astype(dtype)``); float64 in one
    pass where the native extension was built."""
    if a.dtype != np.float16:
        raise TypeError(f"widen takes float16, not {a.dtype}")
    dtype = np.dtype(dtype)
    if a.size < SMALL:
        return a.astype(dtype)
    if dtype == np.float64 and native is not None:
        out = np.empty(a.shape)
        native.widen(np.ascontiguousarray(a).view(np.uint16), out)
        return out
    wide = _cast(a, TensorProto.FLOAT16, TensorProto.FLOAT)
    return wide if dtype == np.float32 else wide.astype(dtype)


def float64(a: np.ndarray) -> np.ndarray:
    """``a`` as float64 (a float16 ``a`` through :func:`widen`)."""
    return widen(a, np.float64) if a.dtype == np.float16 else np.asarray(a, dtype=np.float64)
