"""Numerical parity: run the original and the optimized model in onnxruntime on the same inputs.

Both run with session graph optimizations disabled, so each model is computed as written (a
runtime fusion must not hide, or cause, a difference).  Inputs are the user's (``.npz``) or
seeded random ones, with symbolic dims resolved from ``--shape name=d0,d1,...`` or defaults
(first axis 1, other symbolic axes 16).  Per output: max abs error, max error relative to the
output's scale, mismatch fraction; an output passes when every element is within
``atol + rtol * scale`` (rtol/atol by dtype; integers and booleans must be equal).  A parity that
did not run is reported as not run, never as passed.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from .errors import GraphoptError, UsageError
from .io import PROTOBUF_LIMIT, write_model_files

DEFAULT_TOLERANCES = {
    "float64": (1e-7, 1e-9),
    "float32": (1e-4, 1e-6),
    "float16": (1e-2, 1e-3),
    "bfloat16": (5e-2, 1e-2),
}

_ORT_TYPES = {
    "tensor(float)": np.float32,
    "tensor(double)": np.float64,
    "tensor(float16)": np.float16,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(int16)": np.int16,
    "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8,
    "tensor(uint16)": np.uint16,
    "tensor(uint32)": np.uint32,
    "tensor(uint64)": np.uint64,
    "tensor(bool)": np.bool_,
}


@dataclass(frozen=True)
class OutputDiff:
    name: str
    dtype: str
    shape: list[int]
    max_abs: float
    max_rel: float
    mismatch: float
    ok: bool
    rtol: float
    atol: float
    nan_mismatch: int = 0


@dataclass(frozen=True)
class ParityReport:
    ok: bool
    ran: bool
    outputs: list[OutputDiff] = field(default_factory=list)
    inputs: dict[str, list[int]] = field(default_factory=dict)
    seed: int = 0
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def not_run(cls, why: str) -> ParityReport:
        return cls(ok=False, ran=False, error=why)


def parse_shapes(specs: list[str] | None) -> dict[str, list[int]]:
    """``["x=1,3,224,224", "ids=2,128"]`` → {"x": [1,3,224,224], ...}."""
    shapes: dict[str, list[int]] = {}
    for spec in specs or []:
        name, sep, dims = spec.partition("=")
        try:
            if not sep or not name:
                raise ValueError
            shapes[name.strip()] = [int(d) for d in dims.replace("x", ",").split(",") if d.strip()]
        except ValueError:
            raise UsageError(f"--shape expects NAME=D0,D1,... (got '{spec}')") from None
    return shapes


def load_inputs(path: str | os.PathLike) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as data:
            return {k: data[k] for k in data.files}
    except (OSError, ValueError) as e:
        raise UsageError(f"--inputs {path}: cannot read as .npz/.npy ({e})") from None


class Session:
    """An onnxruntime session over a model proto, spilled to a temp dir when over 2 GB."""

    def __init__(
        self,
        model: onnx.ModelProto,
        providers=("CPUExecutionProvider",),
        level: ort.GraphOptimizationLevel = ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    ):
        so = ort.SessionOptions()
        so.graph_optimization_level = level
        so.log_severity_level = 4
        self._tmp = None
        try:
            if model.ByteSize() < PROTOBUF_LIMIT:
                self.sess = ort.InferenceSession(
                    model.SerializeToString(), so, providers=list(providers)
                )
            else:
                self._tmp = tempfile.TemporaryDirectory(prefix="graphopt-parity-")
                path = Path(self._tmp.name) / "model.onnx"
                write_model_files(model, path, external=True)
                self.sess = ort.InferenceSession(str(path), so, providers=list(providers))
        except Exception as e:  # noqa: BLE001 - onnxruntime raises several unrelated types
            raise GraphoptError(f"onnxruntime cannot load the model: {_first_line(e)}") from None

    def run(self, feeds: dict[str, np.ndarray], names: list[str] | None = None) -> list:
        try:
            return self.sess.run(names, feeds)
        except Exception as e:  # noqa: BLE001
            raise GraphoptError(f"onnxruntime failed to run the model: {_first_line(e)}") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def make_inputs(
    sess: ort.InferenceSession,
    shapes: dict[str, list[int]],
    seed: int,
    given: dict[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Seeded inputs for every graph input the user did not provide."""
    rng = np.random.default_rng(seed)
    feeds: dict[str, np.ndarray] = {}
    given = given or {}
    unknown = set(shapes) - {i.name for i in sess.get_inputs()}
    if unknown:
        raise UsageError(f"--shape names unknown input(s): {', '.join(sorted(unknown))}")
    for inp in sess.get_inputs():
        if inp.name in given:
            feeds[inp.name] = np.asarray(given[inp.name])
            continue
        if inp.type not in _ORT_TYPES:
            raise UsageError(f"input '{inp.name}' has type {inp.type}: provide it with --inputs")
        dtype = np.dtype(_ORT_TYPES[inp.type])
        if inp.name in shapes:
            shape = shapes[inp.name]
        else:
            shape = [
                d if isinstance(d, int) and d >= 0 else (1 if i == 0 else 16)
                for i, d in enumerate(inp.shape or [])
            ]
        feeds[inp.name] = _random(rng, inp.name.lower(), dtype, shape)
    return feeds


def _random(rng: np.random.Generator, name: str, dtype: np.dtype, shape: list[int]) -> np.ndarray:
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(bool)
    if "mask" in name:
        return np.ones(shape, dtype=dtype)
    if "token_type" in name or "segment" in name:
        return np.zeros(shape, dtype=dtype)
    return rng.integers(0, 100, shape).astype(dtype)


def compare_outputs(
    names: list[str], ref: list, got: list, tolerances: dict[str, tuple[float, float]] | None = None
) -> list[OutputDiff]:
    tolerances = tolerances or DEFAULT_TOLERANCES
    return [_diff(n, np.asarray(r), np.asarray(g), tolerances) for n, r, g in zip(names, ref, got)]


def _diff(name: str, ref: np.ndarray, got: np.ndarray, tol: dict) -> OutputDiff:
    shape = list(ref.shape)
    if ref.shape != got.shape or ref.dtype != got.dtype:
        return OutputDiff(
            name,
            f"{ref.dtype} vs {got.dtype}",
            shape,
            float("inf"),
            float("inf"),
            1.0,
            False,
            0.0,
            0.0,
        )
    if ref.dtype.kind not in "fc":
        if ref.dtype.kind not in "biu":  # strings, objects
            same = bool(np.array_equal(ref, got))
            return OutputDiff(
                name,
                str(ref.dtype),
                shape,
                0.0 if same else float("inf"),
                0.0 if same else float("inf"),
                0.0 if same else 1.0,
                same,
                0.0,
                0.0,
            )
        bad = int(np.count_nonzero(ref != got))
        diff = (
            float(np.max(np.abs(ref.astype(np.float64) - got.astype(np.float64))))
            if ref.size
            else 0.0
        )
        return OutputDiff(
            name, str(ref.dtype), shape, diff, diff, bad / max(ref.size, 1), bad == 0, 0.0, 0.0
        )
    rtol, atol = tol.get(ref.dtype.name, (1e-4, 1e-6))
    r, g = ref.astype(np.float64), got.astype(np.float64)
    nan_r, nan_g = ~np.isfinite(r), ~np.isfinite(g)
    nan_mismatch = int(np.count_nonzero(nan_r != nan_g)) + int(
        np.count_nonzero(nan_r & nan_g & ~((np.isnan(r) & np.isnan(g)) | (r == g)))
    )
    both = ~nan_r & ~nan_g
    if not both.any():
        return OutputDiff(
            name, str(ref.dtype), shape, 0.0, 0.0, 0.0, nan_mismatch == 0, rtol, atol, nan_mismatch
        )
    d = np.abs(r[both] - g[both])
    scale = float(np.max(np.abs(r[both])))
    bound = atol + rtol * scale
    max_abs = float(d.max())
    bad = int(np.count_nonzero(d > bound)) + nan_mismatch
    return OutputDiff(
        name,
        str(ref.dtype),
        shape,
        max_abs,
        max_abs / scale if scale else max_abs,
        bad / max(ref.size, 1),
        bad == 0,
        rtol,
        atol,
        nan_mismatch,
    )


def check_parity(
    original: onnx.ModelProto,
    optimized: onnx.ModelProto,
    *,
    shapes: dict[str, list[int]] | None = None,
    inputs: dict[str, np.ndarray] | None = None,
    seed: int = 0,
    tolerances: dict[str, tuple[float, float]] | None = None,
) -> ParityReport:
    """Run both models on the same inputs and compare every output of the original."""
    ref_sess = Session(original)
    feeds = make_inputs(ref_sess.sess, shapes or {}, seed, inputs)
    names = [o.name for o in ref_sess.sess.get_outputs()]
    ref = ref_sess.run(feeds, names)
    del ref_sess
    opt_sess = Session(optimized)
    opt_names = {o.name for o in opt_sess.sess.get_outputs()}
    missing = [n for n in names if n not in opt_names]
    if missing:
        return ParityReport(
            False,
            True,
            [],
            {k: list(v.shape) for k, v in feeds.items()},
            seed,
            f"optimized model lost output(s): {', '.join(missing)}",
        )
    opt_feeds = {i.name: feeds[i.name] for i in opt_sess.sess.get_inputs() if i.name in feeds}
    got = opt_sess.run(opt_feeds, names)
    diffs = compare_outputs(names, ref, got, tolerances)
    return ParityReport(
        all(d.ok for d in diffs), True, diffs, {k: list(v.shape) for k, v in feeds.items()}, seed
    )
