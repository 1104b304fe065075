"""Whether onnxruntime survives building a session of a model, asked in a child process.

onnxruntime's CPU graph optimizers at ``ORT_ENABLE_ALL`` have crashed the process on float16
graphs (1.32: a float16 ``Transpose(x, (1,0,2))`` feeding a MatMul of a constant weight dies
with SIGSEGV in its MatMul-transpose fusion and NCHWc transformer).  In graphopt's process that
kills the run with no message; in a user's bare session it kills their program.  So before a
float16 output is trusted, a child process builds the session a bare ``InferenceSession``
builds (CPU, ``ORT_ENABLE_ALL``); a child killed by a signal is the model's fault, and the
validity safety net (:func:`graphopt.opt.optimizer._keep_valid`) finds the rewrite that made
it and reverts it.  An exception in the child is not a crash: the in-process checks report
those.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import onnx

#: the child: build the session, nothing else (its exceptions are the parent's checks' business)
_CHILD = """
import sys
import onnxruntime as ort
so = ort.SessionOptions()
so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
so.log_severity_level = 4
src = sys.argv[1] if len(sys.argv) > 1 else sys.stdin.buffer.read()
try:
    ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])
except Exception:
    pass
"""
#: seconds the child may take; past them it is stopped and taken for alive
TIMEOUT_S = 300.0
#: models up to this size are asked (through the child's stdin, or its file); a larger one
#: would be held twice, by the child too
MAX_BYTES = 1 << 30
FLOAT16 = onnx.TensorProto.FLOAT16


def at_risk(model: onnx.ModelProto) -> bool:
    """Whether ``model`` computes in float16 (an initializer, an interface value, a Cast or a
    Constant of that type in its main graph): the graphs onnxruntime's crashes were seen on."""
    g = model.graph
    typed = [*g.input, *g.output, *g.value_info]
    if any(v.type.tensor_type.elem_type == FLOAT16 for v in typed):
        return True
    if any(t.data_type == FLOAT16 for t in g.initializer):
        return True
    for node in g.node:
        for a in node.attribute:
            if node.op_type == "Cast" and a.name == "to" and a.i == FLOAT16:
                return True
            if a.type == onnx.AttributeProto.TENSOR and a.t.data_type == FLOAT16:
                return True
    return False


def crash(data: bytes | None, path: Path | None, base_dir: Path | None) -> str | None:
    """Why building a default session of the model (its bytes ``data``, or the file ``path``)
    kills the process, e.g. ``onnxruntime crashed (SIGSEGV) building a session of it at
    ORT_ENABLE_ALL``; None when it does not (or cannot be asked: too large to pipe, no file)."""
    size = len(data) if data is not None else path.stat().st_size if path is not None else None
    if size is None or size > MAX_BYTES:
        return None
    args = [sys.executable, "-c", _CHILD] + ([str(path)] if path is not None else [])
    cwd = str(path.parent) if path is not None else str(base_dir) if base_dir else None
    try:
        proc = subprocess.run(
            args,
            input=data if path is None else None,
            capture_output=True,
            timeout=TIMEOUT_S,
            cwd=cwd,
        )
    except (subprocess.TimeoutExpired, OSError):
        return None
    if proc.returncode >= 0:
        return None
    try:
        name = signal.Signals(-proc.returncode).name
    except ValueError:
        name = f"signal {-proc.returncode}"
    return f"onnxruntime crashed ({name}) building a session of it at ORT_ENABLE_ALL on cpu"
