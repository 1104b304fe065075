"""Numerical parity: run the original and the optimized model in onnxruntime on the same inputs.

Both run with session graph optimizations disabled, so each model is computed as written (a
runtime fusion must not hide, or cause, a difference).  Inputs are the user's (``.npz``) or
seeded random ones, with symbolic dims resolved from ``--shape name=d0,d1,...`` or defaults
(first axis 1, other symbolic axes 16).

Per output: max abs error, max error relative to the output's scale, mean abs error, mismatch
fraction, cosine similarity, and NaN/Inf counts of each side (counted separately: a NaN where
the reference has a number is a mismatch, never "small").  An output passes when every finite
element is within ``atol + rtol * scale`` (rtol/atol by dtype, overridable per output) and the
non-finite positions agree; integers and booleans must be equal.

When parity fails, :func:`localize` names the first intermediate tensor (in the original's
topological order) that exists in both graphs and diverges.  A parity that did not run is
reported as not run, never as passed.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from .customops import register_libraries
from .errors import GraphoptError, UsageError
from .feeds import find_runnable, validate_args
from .io import serialize, write_model_files

Tolerance = tuple[float, float]  # (rtol relative to the output's scale, atol)

DEFAULT_TOLERANCES: dict[str, Tolerance] = {
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
    mean_abs: float
    mismatch: float
    cosine: float
    ok: bool
    rtol: float
    atol: float
    ref_nonfinite: int = 0
    got_nonfinite: int = 0
    nonfinite_mismatch: int = 0


@dataclass(frozen=True)
class ParityReport:
    ok: bool
    ran: bool
    outputs: list[OutputDiff] = field(default_factory=list)
    inputs: dict[str, list[int]] = field(default_factory=dict)
    seed: int = 0
    reference: str = "original"
    error: str | None = None
    first_divergence: dict[str, Any] | None = None
    #: the arrays parity ran on (the bundle's golden inputs); not part of report.json
    feeds: dict[str, np.ndarray] | None = field(default=None, repr=False, compare=False)
    #: the original model's outputs on them, by name (the golden outputs); not in report.json
    reference_outputs: dict[str, Any] | None = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(replace(self, feeds=None, reference_outputs=None))
        del out["feeds"], out["reference_outputs"]
        return out

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
        if not shapes[name.strip()] or any(d <= 0 for d in shapes[name.strip()]):
            raise UsageError(f"--shape {spec}: give one or more positive dims")
    return shapes


def parse_tolerances(specs: list[str] | None) -> dict[str, Tolerance]:
    """``["logits=1e-3,1e-5"]`` → {"logits": (1e-3, 1e-5)} (rtol, atol)."""
    out: dict[str, Tolerance] = {}
    for spec in specs or []:
        name, sep, vals = spec.partition("=")
        try:
            rtol, atol = (float(v) for v in vals.split(","))
            if not sep or not name:
                raise ValueError
        except ValueError:
            raise UsageError(f"--tolerance expects OUTPUT=RTOL,ATOL (got '{spec}')") from None
        out[name.strip()] = (rtol, atol)
    return out


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
        base_dir: str | os.PathLike | None = None,
        serialized: bytes | None = None,
        config: dict[str, str] | None = None,
    ):
        """``base_dir``: the folder external-data references resolve against (lazy loading);
        ``serialized``: the model's bytes when the caller has them already; ``config``: more
        session config entries."""
        so = ort.SessionOptions()
        so.graph_optimization_level = level
        so.log_severity_level = 4
        for key, value in (config or {}).items():
            so.add_session_config_entry(key, value)
        if base_dir is not None:
            so.add_session_config_entry(
                "session.model_external_initializers_file_folder_path", str(base_dir)
            )
        self._tmp = None
        try:
            register_libraries(so, model, providers[0] if providers else "CPUExecutionProvider")
            data = serialized if serialized is not None else serialize(model)
            if data is not None:
                self.sess = ort.InferenceSession(data, so, providers=list(providers))
            else:
                self._tmp = tempfile.TemporaryDirectory(prefix="graphopt-parity-")
                path = Path(self._tmp.name) / "model.onnx"
                write_model_files(model, path, external=True, base_dir=base_dir)
                self.sess = ort.InferenceSession(str(path), so, providers=list(providers))
        except Exception as e:  # noqa: BLE001 - onnxruntime raises several unrelated types
            raise GraphoptError(f"onnxruntime cannot load the model: {_first_line(e)}") from None

    def output_names(self) -> list[str]:
        return [o.name for o in self.sess.get_outputs()]

    def run(self, feeds: dict[str, np.ndarray], names: list[str] | None = None) -> list:
        wanted = {i.name for i in self.sess.get_inputs()}
        try:
            return self.sess.run(names, {k: v for k, v in feeds.items() if k in wanted})
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
    int_high: int = 100,
) -> dict[str, np.ndarray]:
    """Seeded inputs for every graph input the user did not provide (random integers in
    [0, ``int_high``))."""
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
        if inp.type not in _ORT_TYPES and inp.type != "tensor(string)":
            raise UsageError(f"input '{inp.name}' has type {inp.type}: provide it with --inputs")
        if inp.name in shapes:
            shape = shapes[inp.name]
        else:
            shape = [
                d if isinstance(d, int) and d >= 0 else (1 if i == 0 else 16)
                for i, d in enumerate(inp.shape or [])
            ]
        if inp.type == "tensor(string)":  # short words from a fixed vocabulary
            words = np.array(["the", "model", "graph", "a", "42", "x"], dtype=object)
            feeds[inp.name] = words[rng.integers(0, len(words), shape)]
            continue
        dtype = np.dtype(_ORT_TYPES[inp.type])
        feeds[inp.name] = _random(rng, inp.name.lower(), dtype, shape, int_high)
    return feeds


def _random(
    rng: np.random.Generator, name: str, dtype: np.dtype, shape: list[int], high: int = 100
) -> np.ndarray:
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(bool)
    if "mask" in name:
        return _padded_mask(shape, dtype)
    if "token_type" in name or "segment" in name:
        return np.zeros(shape, dtype=dtype)
    return rng.integers(0, high, shape).astype(dtype)


def _padded_mask(shape: list[int], dtype: np.dtype) -> np.ndarray:
    """Ones, but the first row's last quarter zero, as a padded batch has it: a rewrite that
    dropped the mask (a fused attention that ignored it) changes the outputs.  Every row keeps
    its leading positions, so no query is left with nothing to attend to."""
    mask = np.ones(shape, dtype=dtype)
    if len(shape) >= 2 and shape[-1] >= 4:
        mask[(0,) * (len(shape) - 1) + (slice(shape[-1] - shape[-1] // 4, None),)] = 0
    return mask


def compare_outputs(
    names: list[str],
    ref: list,
    got: list,
    tolerances: dict[str, Tolerance] | None = None,
    per_output: dict[str, Tolerance] | None = None,
    compute_dtype: str | None = None,
) -> list[OutputDiff]:
    """Compare arrays pairwise.  The tolerance follows the dtype of ``got``, or the model's
    compute dtype when that is looser (an fp16 model with fp32 outputs, keep_io_types)."""
    tolerances = dict(tolerances or DEFAULT_TOLERANCES)
    per_output = per_output or {}
    if compute_dtype in tolerances:
        loose = tolerances[compute_dtype]
        tolerances = {k: max(v, loose) for k, v in tolerances.items()}
    return [
        _diff(n, _as_array(r), _as_array(g), tolerances, per_output.get(n))
        for n, r, g in zip(names, ref, got)
    ]


def _as_array(value) -> np.ndarray:
    """An output as one array: tensors as they are; a map (ai.onnx.ml ZipMap) as its values
    by sorted key; a sequence of maps or of equal-shaped tensors stacked.  Anything else becomes
    an object array, compared for equality."""
    if isinstance(value, dict):
        keys = sorted(value)
        return np.asarray([value[k] for k in keys])
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        keys = sorted(value[0])
        if all(sorted(v) == keys for v in value):
            return np.asarray([[v[k] for k in keys] for v in value])
    if isinstance(value, list) and value and all(isinstance(v, np.ndarray) for v in value):
        if len({(v.shape, v.dtype) for v in value}) == 1:
            return np.stack(value)
    if isinstance(value, list):
        out = np.empty(len(value), dtype=object)
        out[:] = value
        return out
    return np.asarray(value)


def _diff(
    name: str,
    ref: np.ndarray,
    got: np.ndarray,
    tol: dict[str, Tolerance],
    override: Tolerance | None,
) -> OutputDiff:
    shape = list(ref.shape)
    # A float64 reference is compared with a float32/float16 result: float kinds may differ.
    float_pair = ref.dtype.kind in "fc" and got.dtype.kind in "fc"
    if ref.shape != got.shape or (ref.dtype != got.dtype and not float_pair):
        return OutputDiff(
            name,
            f"{ref.dtype} vs {got.dtype}",
            shape,
            *([float("inf")] * 3),
            1.0,
            0.0,
            False,
            0.0,
            0.0,
        )
    if ref.dtype.kind not in "fc":
        same = bool(np.array_equal(ref, got))
        if ref.dtype.kind in "biu":
            bad = int(np.count_nonzero(ref != got))
            d = np.abs(ref.astype(np.float64) - got.astype(np.float64)) if ref.size else np.zeros(1)
            return OutputDiff(
                name,
                str(ref.dtype),
                shape,
                float(d.max()),
                float(d.max()),
                float(d.mean()),
                bad / max(ref.size, 1),
                1.0 if bad == 0 else 0.0,
                bad == 0,
                0.0,
                0.0,
            )
        inf = 0.0 if same else float("inf")
        return OutputDiff(
            name,
            str(ref.dtype),
            shape,
            inf,
            inf,
            inf,
            0.0 if same else 1.0,
            1.0 if same else 0.0,
            same,
            0.0,
            0.0,
        )
    rtol, atol = override or tol.get(got.dtype.name, (1e-4, 1e-6))
    r, g = ref.astype(np.float64), got.astype(np.float64)
    fin_r, fin_g = np.isfinite(r), np.isfinite(g)
    # Non-finite positions must agree exactly (same NaN/±Inf); they are counted, not measured.
    same_nonfinite = (np.isnan(r) & np.isnan(g)) | (~fin_r & ~fin_g & (r == g))
    nonfinite_mismatch = int(np.count_nonzero((~fin_r | ~fin_g) & ~same_nonfinite))
    both = fin_r & fin_g
    counts = dict(
        ref_nonfinite=int((~fin_r).sum()),
        got_nonfinite=int((~fin_g).sum()),
        nonfinite_mismatch=nonfinite_mismatch,
    )
    if not both.any():
        return OutputDiff(
            name,
            str(got.dtype),
            shape,
            0.0,
            0.0,
            0.0,
            nonfinite_mismatch / max(ref.size, 1),
            1.0,
            nonfinite_mismatch == 0,
            rtol,
            atol,
            **counts,
        )
    rv, gv = r[both], g[both]
    d = np.abs(rv - gv)
    scale = float(np.max(np.abs(rv)))
    bound = atol + rtol * scale
    max_abs = float(d.max())
    bad = int(np.count_nonzero(d > bound)) + nonfinite_mismatch
    norms = float(np.linalg.norm(rv) * np.linalg.norm(gv))
    cosine = float(np.dot(rv, gv) / norms) if norms > 0 else (1.0 if max_abs == 0 else 0.0)
    return OutputDiff(
        name,
        str(got.dtype),
        shape,
        max_abs,
        max_abs / scale if scale else max_abs,
        float(d.mean()),
        bad / max(ref.size, 1),
        cosine,
        bad == 0,
        rtol,
        atol,
        **counts,
    )


def check_parity(
    original: onnx.ModelProto,
    optimized: onnx.ModelProto,
    *,
    shapes: dict[str, list[int]] | None = None,
    inputs: dict[str, np.ndarray] | None = None,
    seed: int = 0,
    tolerances: dict[str, Tolerance] | None = None,
    per_output: dict[str, Tolerance] | None = None,
    reference: onnx.ModelProto | None = None,
    reference_name: str = "original",
    localize_on_failure: bool = True,
    base_dir: str | os.PathLike | None = None,
    optimized_session: Session | None = None,
) -> ParityReport:
    """Run both models on the same inputs and compare every output of the original.

    ``reference`` (e.g. the float64 upcast of the original) replaces the original as the side
    the optimized model is compared with; inputs are still generated from the original.
    """
    validate_args(original, shapes, inputs, per_output)
    orig_sess = Session(original, base_dir=base_dir)
    names = orig_sess.output_names()
    feeds, ref = find_runnable(
        original,
        lambda f: orig_sess.run(f, names),
        lambda shp, high: make_inputs(orig_sess.sess, shp, seed, inputs, high),
        shapes,
        inputs,
    )
    shapes_used = {k: list(np.shape(v)) for k, v in feeds.items()}
    orig_sess = None  # free the session before the optimized one loads
    if reference is not None:
        ref = Session(reference, base_dir=base_dir).run(feeds, names)
    try:
        opt_sess = optimized_session or Session(optimized, base_dir=base_dir)
    except GraphoptError as e:  # the original loads, the optimized one does not: a failure
        return ParityReport(
            False,
            True,
            [],
            shapes_used,
            seed,
            reference_name,
            f"optimized model: {e}",
            feeds=feeds,
        )
    missing = [n for n in names if n not in set(opt_sess.output_names())]
    if missing:
        return ParityReport(
            False,
            True,
            [],
            shapes_used,
            seed,
            reference_name,
            f"optimized model lost output(s): {', '.join(missing)}",
            feeds=feeds,
        )
    got = opt_sess.run(feeds, names)
    del opt_sess
    diffs = compare_outputs(names, ref, got, tolerances, per_output, compute_dtype(original))
    ok = all(d.ok for d in diffs)
    divergence = None
    if not ok and localize_on_failure and reference is None:
        divergence = localize(original, optimized, feeds, tolerances, base_dir=base_dir)
    return ParityReport(
        ok,
        True,
        diffs,
        shapes_used,
        seed,
        reference_name,
        None,
        divergence,
        feeds=feeds,
        reference_outputs=dict(zip(names, ref)) if reference is None else None,
    )


def compute_dtype(model: onnx.ModelProto) -> str | None:
    """The narrowest float type the model's weights are stored in (float16 for an fp16 model
    converted with keep_io_types, whose outputs are float32 but carry fp16 error)."""
    kinds = {t.data_type for t in model.graph.initializer}
    for proto, name in (
        (onnx.TensorProto.FLOAT16, "float16"),
        (onnx.TensorProto.BFLOAT16, "bfloat16"),
    ):
        if proto in kinds:
            return name
    return None


def _with_outputs(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    have = {o.name for o in m.graph.output}
    m.graph.output.extend(onnx.ValueInfoProto(name=n) for n in names if n not in have)
    return m


def measure_ranges(
    model: onnx.ModelProto,
    inputs: dict[str, np.ndarray],
    *,
    shapes: dict[str, list[int]] | None = None,
    seed: int = 0,
    base_dir: str | os.PathLike | None = None,
) -> dict[str, float]:
    """Max |value| of every floating-point tensor the model computes on these inputs."""
    sess = Session(model, base_dir=base_dir)
    feeds = make_inputs(sess.sess, shapes or {}, seed, inputs)
    names = list(dict.fromkeys(o for n in model.graph.node for o in n.output if o))
    values = Session(_with_outputs(model, names), base_dir=base_dir).run(feeds, names)
    ranges = {}
    for name, v in zip(names, values):
        if isinstance(v, np.ndarray) and v.dtype.kind == "f" and v.size:
            finite = v[np.isfinite(v)]
            ranges[name] = float(np.max(np.abs(finite.astype(np.float64)))) if finite.size else 0.0
    for k, v in feeds.items():
        if v.dtype.kind == "f" and v.size:
            ranges[k] = float(np.max(np.abs(v.astype(np.float64))))
    return ranges


def localize(
    original: onnx.ModelProto,
    optimized: onnx.ModelProto,
    feeds: dict[str, np.ndarray],
    tolerances: dict[str, Tolerance] | None = None,
    base_dir: str | os.PathLike | None = None,
) -> dict[str, Any] | None:
    """The first tensor, in the original's topological order, present in both and diverging."""
    produced_opt = {o for n in optimized.graph.node for o in n.output if o}
    order = [
        (o, n.name, n.op_type)
        for n in original.graph.node
        for o in n.output
        if o and o in produced_opt
    ]
    if not order:
        return None
    names = [o for o, _, _ in order]
    try:
        ref = Session(_with_outputs(original, names), base_dir=base_dir).run(feeds, names)
        got = Session(_with_outputs(optimized, names), base_dir=base_dir).run(feeds, names)
    except GraphoptError:
        return None
    for (name, node, op), r, g in zip(order, ref, got):
        if not isinstance(r, np.ndarray) or not isinstance(g, np.ndarray):
            continue
        d = _diff(name, r, g, tolerances or DEFAULT_TOLERANCES, None)
        if not d.ok:
            return {
                "tensor": name,
                "producer": node,
                "op": op,
                "max_abs": d.max_abs,
                "max_rel": d.max_rel,
                "mismatch": d.mismatch,
            }
    return None
