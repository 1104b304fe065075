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

A model with more than :data:`PIECE_BYTES` (``GRAPHOPT_PIECE_MB``) of external weights runs
lean, the original and the optimized model alike (:func:`open_session`): piece by piece
(:class:`Pieces`), each piece's session holding at most that much weight, or about its largest
tensor when that is smaller (but a quarter of the budget at least), or one larger tensor alone;
weights mapped from their file and not pre-packed, freed before the next piece loads; one
session holds only one model at a time, and only the outputs are kept.  Memory then grows by
one piece,
not by the model (examples/large: a 5 GiB decoder's parity peaks at ~380 MB), and the results
are those of one session of the whole model without pre-packing, bit for bit.  The optimized
model's run also records every tensor's type and shape (``ParityReport.shapes``); a whole
session does too when it profiles (the output's validity session, kept for parity): the bundle's
memory plan then needs no run of its own.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import threading
import zlib
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

from ..environment import env_number
from ..errors import GraphoptError, UsageError
from ..graph.domains import RANDOM_OPS, is_default
from ..graph.io import has_data_files, serialize, skeleton, tensor_nbytes, write_model_files
from .customops import register_libraries
from .feeds import MAX_INPUT_BYTES, find_runnable, validate_args
from .hazards import HazardError, run_deadline, run_seconds, runtime_hazard

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
    #: how the output was passed: ``tolerance`` (within rtol/atol), ``own-noise`` (within
    #: :data:`NOISE_FACTOR` times as far as onnxruntime's own optimizations move the original)
    #: or ``selection-near-ties`` (an integer selection, or a selection's count, that the
    #: original itself changes between session levels)
    judged: str = "tolerance"
    #: the original's own drift on this output (max abs for floats, the fraction of changed
    #: elements for integers) when the output was judged against it
    own_noise: float | None = None


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
    #: how many pieces the original ran in (0: one session of the whole model; see Pieces)
    pieces: int = 0
    #: the arrays parity ran on (the bundle's golden inputs); not part of report.json
    feeds: dict[str, np.ndarray] | None = field(default=None, repr=False, compare=False)
    #: the original model's outputs on them, by name (the golden outputs); not in report.json
    reference_outputs: dict[str, Any] | None = field(default=None, repr=False, compare=False)
    #: (element type, dims) of every tensor the optimized model computed on them, when it ran
    #: in pieces (the bundle's memory plan needs no run of its own); not in report.json
    shapes: dict[str, tuple[int, list[int]]] | None = field(default=None, repr=False, compare=False)
    #: a model that missed the tolerance: per float output, how far onnxruntime's own
    #: optimizations (ORT_ENABLE_ALL, as the original is run by default) move the original's
    #: outputs; the optimized model is held to no more than :data:`NOISE_FACTOR` times that
    runtime_floor: dict[str, float] | None = None

    def floor_tolerances(self) -> dict[str, Tolerance]:
        """The per-output tolerances the runtime floor widened (for checks of the same model
        against the same reference outputs, such as the bundle's golden outputs)."""
        return {d.name: (d.rtol, d.atol) for d in self.outputs if d.judged == "own-noise"}

    def to_dict(self) -> dict[str, Any]:
        out = asdict(replace(self, feeds=None, reference_outputs=None, shapes=None))
        del out["feeds"], out["reference_outputs"], out["shapes"]
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


class RunFailed(GraphoptError):
    """onnxruntime refused to run a model it had loaded (a kernel's check on its inputs): not
    a run cut short by the time limit, nor one a hazard kept from running."""


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
        profile: bool = False,
    ):
        """``base_dir``: the folder external-data references resolve against (lazy loading);
        ``serialized``: the model's bytes when the caller has them already; ``config``: more
        session config entries; ``profile``: onnxruntime records every node it runs, so that
        :meth:`node_shapes` can tell the shapes of what a run computed."""
        so = ort.SessionOptions()
        so.graph_optimization_level = level
        so.log_severity_level = 4
        self._profile = None
        if profile:
            self._profile = tempfile.TemporaryDirectory(prefix="graphopt-profile-")
            so.enable_profiling = True
            so.profile_file_prefix = str(Path(self._profile.name) / "run")
        for key, value in (config or {}).items():
            so.add_session_config_entry(key, value)
        if base_dir is not None:
            so.add_session_config_entry(
                "session.model_external_initializers_file_folder_path", str(base_dir)
            )
        self._tmp = None
        #: why running the model would crash or exhaust the machine (told at the first run)
        self._hazard = runtime_hazard(model)
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

    def node_shapes(self, model: onnx.ModelProto) -> dict[str, tuple[int, list[int]]]:
        """(element type, dims) of the outputs of ``model``'s nodes as the runs since the session
        was made computed them (a profiling session; else, or once asked, empty).  A node is
        matched by its index and name, or by its name alone; the casts onnxruntime inserts around
        a node it runs in another type tell their tensor's dims.  Where it inserted any, element
        types are UNDEFINED (nodes ran in other types than the model's).  A node onnxruntime
        expanded into others (a function op) is not told."""
        if self._profile is None:
            return {}
        try:
            events = json.loads(Path(self.sess.end_profiling()).read_text())
        except (OSError, ValueError, RuntimeError):
            events = []
        finally:
            self._profile.cleanup()
            self._profile = None
        nodes = model.graph.node
        names = Counter(n.name for n in nodes)
        made = {o for n in nodes for o in n.output if o}
        by_name = {n.name: n for n in nodes if n.name and names[n.name] == 1}
        out: dict[str, tuple[int, list[int]]] = {}
        events = [e for e in events if isinstance(e, dict)] if isinstance(events, list) else []
        # where onnxruntime inserted casts, nodes ran in other types than the model's: their
        # dims are the model's, their element types are not told
        recast = any(str(e.get("name", "")).startswith(_INSERTED_CAST) for e in events)
        for e in events:
            if e.get("cat") != "Node":
                continue
            args, name = e.get("args") or {}, str(e.get("name", ""))
            if not name.endswith("_kernel_time"):
                continue
            name = name[: -len("_kernel_time")]
            index, shapes = int(args.get("node_index", -1)), args.get("output_type_shape") or []
            cast = name[len(_INSERTED_CAST) :] if name.startswith(_INSERTED_CAST) else None
            if cast and cast in made and cast not in out and len(shapes) == 1:
                # a cast onnxruntime put beside a node it runs in another type, named after
                # the model's tensor it converts: the same dims (an element type may differ)
                dims = next(iter(shapes[0].values()), None) if isinstance(shapes[0], dict) else None
                if isinstance(dims, list):
                    out[cast] = (onnx.TensorProto.UNDEFINED, [int(d) for d in dims])
            node = nodes[index] if 0 <= index < len(nodes) else None
            # a node onnxruntime replaced (run in another type between casts it inserted) keeps
            # its name, not its index: its dims are the model's, its element type may not be
            same = node is not None and node.name == name
            node = node if same else by_name.get(name)
            if node is None or len(shapes) != len(node.output):
                continue
            for tensor, typed in zip(node.output, shapes):
                if tensor and isinstance(typed, dict) and len(typed) == 1:
                    ((kind, dims),) = typed.items()
                    if kind in _PROFILE_TYPES and isinstance(dims, list):
                        typed_here = same and not recast
                        elem = _PROFILE_TYPES[kind] if typed_here else onnx.TensorProto.UNDEFINED
                        out[tensor] = (elem, [int(d) for d in dims])
        return out

    def run(
        self,
        feeds: dict[str, np.ndarray],
        names: list[str] | None = None,
        options: ort.RunOptions | None = None,
    ) -> list:
        if self._hazard is not None:
            raise HazardError(f"the model is not run: {self._hazard}")
        wanted = {i.name for i in self.sess.get_inputs()}
        options = options or ort.RunOptions()
        with run_deadline(options) as cut:
            try:
                return self.sess.run(
                    names, {k: v for k, v in feeds.items() if k in wanted}, options
                )
            except Exception as e:  # noqa: BLE001
                if cut.is_set():
                    raise GraphoptError(
                        f"onnxruntime's run of the model did not end within {run_seconds():.0f} s "
                        "(GRAPHOPT_RUN_SECONDS); it was cut short"
                    ) from None
                raise RunFailed(f"onnxruntime failed to run the model: {_first_line(e)}") from None


#: what onnxruntime names the casts it inserts around a node it runs in another type
_INSERTED_CAST = "InsertedPrecisionFreeCast_"

#: onnxruntime's profile names of element types (``float``, ``int64``, ...) -> TensorProto's
_PROFILE_TYPES = {
    onnx.TensorProto.DataType.Name(v).lower(): v
    for v in onnx.TensorProto.DataType.values()
    if v != onnx.TensorProto.UNDEFINED
}

#: weights (bytes) above which parity runs a model piece by piece (:class:`Pieces`); each piece
#: holds at most this much, or its one larger tensor (``GRAPHOPT_PIECE_MB`` overrides)
PIECE_BYTES = 256 << 20

#: main-graph nodes above which a model is checked in pieces of at most :data:`PIECE_NODES`
#: nodes and no check holds it whole (timing it, the bundle as deployed, its fast path):
#: onnxruntime's session creation grows faster than the node count (a chain of Sigmoids,
#: ORT_DISABLE_ALL: 3.0 s at 100k nodes, 17.7 s at 300k), pieces of a fixed size grow with it
#: (``GRAPHOPT_PIECE_NODES`` overrides the piece size; lean from twice that)
PIECE_NODES = 50_000

#: session config of parity's sessions (whole or a piece): weights are used where they lie
#: (mapped from their file, or the model's own bytes) instead of pre-packed copies for the
#: kernels.  Pre-packing costs a copy of every MatMul weight and, for one run, more time than
#: it saves (705 MB decoder, seq 16, loaded machine: create + run 1.0 s unpacked, 3.9 s packed;
#: DeiT-base: 1.1 s against 1.4-2.4 s, the same outputs)
LEAN_CONFIG = {"session.disable_prepacking": "1"}


#: session config of the original's run ahead of the passes (:class:`ReferenceRun`): its
#: threads wait without spinning, so that they leave the passes' thread its core
AHEAD_CONFIG = {**LEAN_CONFIG, "session.intra_op.allow_spinning": "0"}


def piece_bytes() -> int:
    """The weight budget of one piece: :data:`PIECE_BYTES` or ``GRAPHOPT_PIECE_MB``."""
    mib = env_number("GRAPHOPT_PIECE_MB", None)
    return PIECE_BYTES if mib is None else max(1, int(mib * (1 << 20)))


def piece_nodes() -> int:
    """The node budget of one piece: :data:`PIECE_NODES` or ``GRAPHOPT_PIECE_NODES``."""
    return int(env_number("GRAPHOPT_PIECE_NODES", PIECE_NODES))


def too_many_nodes(model: onnx.ModelProto) -> str | None:
    """Why ``model``'s main graph is too long for one session, or None (:data:`PIECE_NODES`)."""
    limit = 2 * piece_nodes()
    if len(model.graph.node) <= limit:
        return None
    return (
        f"its {len(model.graph.node)} nodes are more than one session is built for in linear "
        f"time ({limit}: twice GRAPHOPT_PIECE_NODES): checked in pieces only"
    )


def is_lean(model: onnx.ModelProto, budget: int | None = None) -> bool:
    """Whether parity runs ``model`` lean: its main graph has more nodes than one session is
    built for in linear time (:func:`too_many_nodes`), or it keeps its weights in external data
    and they (sizes from metadata) are more than the piece budget (default
    :func:`piece_bytes`).  Inline weights are in memory already, and their pieces would be
    copies: those models run whole (BERT-base, 438 MB inline: parity 3.8-4.6 s whole, 5.0-7.9 s
    in 6 pieces)."""
    budget = piece_bytes() if budget is None else budget
    if too_many_nodes(model):
        return True
    if sum(tensor_nbytes(t) for t in model.graph.initializer) <= budget:
        return False
    return has_data_files(model)  # weights left in their model file are inline ones


#: a check may hold a model whole (timing it, running the bundle as deployed) up to this many
#: piece budgets of external weights (1 GiB by default): a 705 MB decoder is still timed by the
#: safety net, a 5 GiB one is checked in pieces only
WHOLE_PIECES = 4


def too_large(model: onnx.ModelProto) -> str | None:
    """Why no check may hold ``model`` whole in one onnxruntime session (timing it, running the
    bundle as deployed): more external weights than :data:`WHOLE_PIECES` piece budgets.  None
    when one session may hold it."""
    if why := too_many_nodes(model):
        return why
    whole = piece_bytes() * WHOLE_PIECES
    if not is_lean(model, whole):
        return None
    total = sum(tensor_nbytes(t) for t in model.graph.initializer)
    return (
        f"its {total / 2**30:.1f} GiB of external weights are more than one session may hold "
        f"({whole / 2**20:.0f} MiB: {WHOLE_PIECES} x GRAPHOPT_PIECE_MB): checked in pieces only"
    )


def check_written(
    path: Path,
    feeds: dict[str, np.ndarray],
    expected: dict[str, np.ndarray],
    tolerances: dict[str, Tolerance] | None = None,
    per_output: dict[str, Tolerance] | None = None,
) -> dict[str, Any]:
    """A written model (``path``, its external data mapped from the files beside it) run lean
    on ``feeds`` and compared with ``expected`` (e.g. the bundle's golden outputs)."""
    from ..graph.io import load_model

    try:
        model = load_model(path, check=False, lazy_external=True)
        session = open_session(model, path.parent, lean=True)
        names = [n for n in session.output_names() if n in expected]
        got = session.run(feeds, names)
    except GraphoptError as e:
        return {"golden_ok": False, "failed": str(e)}
    diffs = compare_outputs(
        names, [expected[n] for n in names], got, tolerances, per_output=per_output
    )
    return {
        "providers": ["CPUExecutionProvider"],
        "graph_optimization_level": "ORT_DISABLE_ALL",
        "pieces": getattr(session, "count", 0),
        "golden_ok": all(d.ok for d in diffs),
        "max_abs": {d.name: d.max_abs for d in diffs},
        "what": f"{path.name} as written, its external data mapped from the bundle's files, "
        "run lean (in pieces, optimizations off) on this machine's CPU",
    }


def run_lean(
    model: onnx.ModelProto,
    feeds: dict[str, np.ndarray],
    names: list[str],
    base_dir: str | os.PathLike | None = None,
) -> list:
    """The values of ``names`` (any tensors the model computes) on ``feeds``, the model run
    lean (:func:`open_session`): for one run of a model too large to hold whole."""
    return open_session(_with_outputs(model, names), base_dir, lean=True).run(feeds, names)


def open_session(
    model: onnx.ModelProto,
    base_dir: str | os.PathLike | None = None,
    lean: bool | None = None,
    budget: int | None = None,
) -> Session | Pieces:
    """The session parity runs ``model`` in (optimizations off).  ``lean`` (default:
    :func:`is_lean`): piece by piece (:class:`Pieces`) when the graph can be cut, else one
    session without pre-packed weights (:data:`LEAN_CONFIG`); otherwise one plain session.
    A piece holds at most the budget, or about as much as the model's largest tensor when
    that is smaller (a quarter of the budget at least): the peak grows by about one tensor."""
    budget = piece_bytes() if budget is None else budget
    if lean is None:
        lean = is_lean(model, budget)
    if lean and Pieces.cuttable(model):
        largest = max((tensor_nbytes(t) for t in model.graph.initializer), default=0)
        piece = min(budget, max(largest, budget // 4))
        return Pieces(model, base_dir=base_dir, budget=piece)
    return Session(model, base_dir=base_dir, config=LEAN_CONFIG)  # run once: packing costs more


@dataclass(frozen=True)
class _Input:
    """A graph input as onnxruntime's NodeArg describes it (name, type text, shape)."""

    name: str
    type: str
    shape: list


@dataclass(frozen=True)
class _Piece:
    nodes: list[int]
    inputs: list[str]  # values it takes from the graph's inputs or from earlier pieces
    outputs: list[str]  # values later pieces (or the caller) use
    weights: int  # bytes of the initializers it holds


class Pieces:
    """A model run piece by piece, so that memory holds one piece's weights at a time.

    The main graph's nodes, in their (topological) order, are cut into consecutive pieces whose
    initializers (sizes from metadata: nothing is read to plan) stay within ``budget`` bytes and
    that have at most :func:`piece_nodes` nodes; a node whose own weights are more is a piece
    alone.  Each piece is a model of its nodes, the
    initializers they use (external ones still referenced from their file) and, as inputs, the
    values it takes from the graph or earlier pieces; it runs in its own session (optimizations
    off, :data:`LEAN_CONFIG`), which is freed before the next piece is built, and only the
    values later pieces or the caller need are kept.  Nodes compute exactly as in one session
    of the whole model with the same settings."""

    def __init__(
        self,
        model: onnx.ModelProto,
        base_dir: str | os.PathLike | None = None,
        budget: int = PIECE_BYTES,
    ):
        self.model, self.base_dir, self.budget = model, base_dir, budget
        self.max_nodes = piece_nodes()
        graph = model.graph
        self.sess = self  # make_inputs reads get_inputs() from here, as from a session
        self._sizes = {t.name: tensor_nbytes(t) for t in graph.initializer}
        # tuples, not sets: a set per node of a million-node graph is a gigabyte
        self._uses = [tuple(_node_uses(n)) for n in graph.node]
        self._declared = {vi.name: vi for vi in graph.input}
        self.count = 0  # pieces of the last run

    @staticmethod
    def cuttable(model: onnx.ModelProto) -> bool:
        """Whether pieces can run ``model``'s graph: its nodes in topological order, no sparse
        initializers, at least two nodes."""
        graph = model.graph
        if len(graph.node) < 2 or graph.sparse_initializer:
            return False
        known = {vi.name for vi in graph.input} | {t.name for t in graph.initializer} | {""}
        for node in graph.node:
            if any(n not in known for n in node.input):
                return False  # not topologically sorted (or uses an undefined value)
            known.update(node.output)
        return True

    def get_inputs(self) -> list[_Input]:
        inits = set(self._sizes)
        return [
            _Input(vi.name, _type_text(vi.type), _dims(vi.type))
            for vi in self.model.graph.input
            if vi.name not in inits
        ]

    def get_outputs(self) -> list[_Input]:
        return [
            _Input(vi.name, _type_text(vi.type), _dims(vi.type)) for vi in self.model.graph.output
        ]

    def output_names(self) -> list[str]:
        return [o.name for o in self.model.graph.output]

    def plan(self, wanted: set[str]) -> list[_Piece]:
        """The pieces, each with what it takes and what it must hand on for ``wanted``."""
        groups: list[tuple[list[int], int]] = []
        nodes: list[int] = []
        held: set[str] = set()
        size = 0
        for i, uses in enumerate(self._uses):
            mine = {n for n in uses if n in self._sizes}
            own = _constant_bytes(self.model.graph.node[i])
            extra = own + sum(self._sizes[n] for n in mine - held)
            # small weights (shape glue, norms' scales) may overflow the budget by an eighth
            slack = self.budget // 8 if extra <= self.budget // 64 else 0
            full = extra and size + extra > self.budget + slack
            if nodes and (full or len(nodes) >= self.max_nodes):
                groups.append((nodes, size))
                nodes, held, size = [], set(), 0
                extra = own + sum(self._sizes[n] for n in mine)
            nodes.append(i)
            held |= mine
            size += extra
        groups.append((nodes, size))
        last_use: dict[str, int] = {}
        for k, (idx, _) in enumerate(groups):
            for i in idx:
                for n in self._uses[i]:
                    last_use[n] = k
        pieces = []
        for k, (idx, weights) in enumerate(groups):
            made: set[str] = set()
            inputs: list[str] = []
            for i in idx:
                for n in self._uses[i]:
                    if n and n not in made and n not in self._sizes and n not in inputs:
                        inputs.append(n)
                made.update(o for o in self.model.graph.node[i].output if o)
            outputs = [
                o
                for i in idx
                for o in self.model.graph.node[i].output
                if o and (o in wanted or last_use.get(o, -1) > k)
            ]
            pieces.append(_Piece(idx, inputs, list(dict.fromkeys(outputs)), weights))
        return pieces

    def run(
        self,
        feeds: dict[str, np.ndarray],
        names: list[str] | None = None,
        shapes: dict[str, tuple[int, list[int]]] | None = None,
    ) -> list:
        """The values of ``names`` (default: the graph's outputs) on ``feeds``.  ``shapes``: filled
        with (element type, dims) of every tensor the nodes compute, each piece asked for all
        of its own (only what later pieces or the caller need is kept)."""
        names = list(names or self.output_names())
        values: dict[str, Any] = self._not_computed(names, feeds)
        pieces = self.plan(set(names))
        self.count = len(pieces)
        for k, piece in enumerate(pieces):
            asked = piece.outputs
            if shapes is not None:
                made = (o for i in piece.nodes for o in self.model.graph.node[i].output if o)
                asked = list(dict.fromkeys([*piece.outputs, *made]))
            sub = self._model_of(piece, feeds, values, asked)
            session = Session(sub, base_dir=self.base_dir, config=LEAN_CONFIG)
            given = {n: values[n] if n in values else feeds[n] for n in piece.inputs}
            outs = session.run(given, asked)
            del session, sub
            if shapes is not None:
                shapes.update(_shapes(asked, outs))
            values.update((n, v) for n, v in zip(asked, outs) if n in piece.outputs)
            later = {n for p in pieces[k + 1 :] for n in p.inputs}
            values = {n: v for n, v in values.items() if n in later or n in names}
        return [values[n] for n in names]

    def load(self) -> bool:
        """Build every piece's session and drop it, nothing run: whether onnxruntime loads the
        model, piece by piece (each piece's inputs typed from the graph's value_info).  False
        when a value crossing pieces has no declared type (then only a whole session tells);
        a piece onnxruntime refuses raises its error."""
        graph = self.model.graph
        typed = {vi.name: vi for vi in [*graph.value_info, *graph.output, *graph.input]}
        pieces = self.plan(set(self.output_names()))
        self.count = len(pieces)
        if any(n not in typed for p in pieces for n in p.inputs):
            typed.update(_inferred_types(self.model))  # a written model keeps few annotations
        for piece in pieces:
            declared = [typed.get(n) for n in piece.inputs]
            if any(vi is None or not vi.type.tensor_type.HasField("shape") for vi in declared):
                return False
            values = {vi.name: vi for vi in declared}
            sub = self._model_of(piece, {}, {}, None, declared=values)
            Session(sub, base_dir=self.base_dir, config=LEAN_CONFIG)
        return True

    def _not_computed(self, names: list[str], feeds: dict) -> dict[str, Any]:
        """Asked-for values no node computes: graph inputs (as fed) and initializers."""
        produced = {o for n in self.model.graph.node for o in n.output if o}
        out: dict[str, Any] = {}
        for name in (n for n in names if n not in produced):
            tensor = next((t for t in self.model.graph.initializer if t.name == name), None)
            if name in feeds:
                out[name] = np.asarray(feeds[name])
            elif tensor is not None:
                out[name] = numpy_helper.to_array(tensor, str(self.base_dir or ""))
            else:
                raise GraphoptError(f"onnxruntime failed to run the model: no value '{name}'")
        return out

    def _model_of(
        self,
        piece: _Piece,
        feeds: dict,
        values: dict,
        outputs: list[str] | None = None,
        declared: dict[str, onnx.ValueInfoProto] | None = None,
    ) -> onnx.ModelProto:
        """The piece as a model: its nodes, the initializers they use, typed inputs (from the
        ``values`` computed, else ``declared`` or the graph's inputs), ``outputs`` (default:
        what it hands on)."""
        graph = self.model.graph
        uses = set().union(*(self._uses[i] for i in piece.nodes))
        declared = {**self._declared, **(declared or {})}
        inputs = []
        for name in piece.inputs:
            if name in values:
                inputs.append(_value_info(name, values[name]))
            elif name in declared:
                inputs.append(declared[name])
            else:
                raise GraphoptError(
                    f"onnxruntime failed to run the model: input '{name}' not given"
                )
        sub = onnx.helper.make_graph(
            [graph.node[i] for i in piece.nodes],
            f"{graph.name or 'graph'}_piece",
            inputs,
            [onnx.ValueInfoProto(name=n) for n in (outputs or piece.outputs)],
            [t for t in graph.initializer if t.name in uses],
        )
        m = onnx.ModelProto(ir_version=self.model.ir_version, graph=sub)
        m.opset_import.extend(self.model.opset_import)
        m.functions.extend(self.model.functions)
        return m


def _inferred_types(model: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    """The value_info onnx's shape inference gives ``model``'s main graph (its large weights
    stand-ins: nothing is copied but the graph)."""
    stripped, _ = skeleton(model)
    try:
        inferred = onnx.shape_inference.infer_shapes(stripped)
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError):
        return {}
    return {vi.name: vi for vi in inferred.graph.value_info}


def _shapes(names: list[str], values: list) -> dict[str, tuple[int, list[int]]]:
    """(element type, dims) of the tensors among ``values``."""
    out = {}
    for name, v in zip(names, values):
        if isinstance(v, np.ndarray) and v.dtype != object:
            try:
                out[name] = (onnx.helper.np_dtype_to_tensor_dtype(v.dtype), list(v.shape))
            except (KeyError, TypeError, ValueError):
                continue
    return out


def _node_uses(node: onnx.NodeProto) -> set[str]:
    """The values a node reads: its inputs and what its subgraphs read from outer scopes."""
    uses = {n for n in node.input if n}
    for attr in node.attribute:
        graphs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
        for g in graphs:
            uses |= _outer_names(g)
    return uses


def _outer_names(graph: onnx.GraphProto) -> set[str]:
    """Names a subgraph reads that it does not define (its outer-scope values)."""
    defined = {vi.name for vi in graph.input} | {t.name for t in graph.initializer}
    read: set[str] = set()
    for node in graph.node:
        read |= _node_uses(node)
        defined.update(node.output)
    return read - defined


def _constant_bytes(node: onnx.NodeProto) -> int:
    return sum(tensor_nbytes(a.t) for a in node.attribute if a.type == onnx.AttributeProto.TENSOR)


def _value_info(name: str, value) -> onnx.ValueInfoProto:
    """A piece input typed from the value an earlier piece computed (tensor or sequence)."""
    if isinstance(value, list) and all(isinstance(v, np.ndarray) for v in value) and value:
        elem = onnx.helper.np_dtype_to_tensor_dtype(value[0].dtype)
        tp = onnx.helper.make_sequence_type_proto(onnx.helper.make_tensor_type_proto(elem, None))
        return onnx.helper.make_value_info(name, tp)
    if not isinstance(value, np.ndarray):
        raise GraphoptError(
            f"onnxruntime failed to run the model: '{name}' ({type(value).__name__}) cannot "
            "be handed between pieces"
        )
    if value.dtype == object:  # strings
        return onnx.helper.make_tensor_value_info(name, onnx.TensorProto.STRING, value.shape)
    elem = onnx.helper.np_dtype_to_tensor_dtype(value.dtype)
    return onnx.helper.make_tensor_value_info(name, elem, value.shape)


def _type_text(tp: onnx.TypeProto) -> str:
    """onnxruntime's spelling of a tensor type (``tensor(float)``); other kinds by name."""
    if tp.WhichOneof("value") != "tensor_type":
        return str(tp.WhichOneof("value"))
    try:
        np_type = onnx.helper.tensor_dtype_to_np_dtype(tp.tensor_type.elem_type)
    except (KeyError, TypeError, ValueError):
        return "tensor(undefined)"
    for text, known in _ORT_TYPES.items():
        if np.dtype(known) == np.dtype(np_type):
            return text
    return "tensor(string)" if np.dtype(np_type) == object else f"tensor({np_type})"


def _dims(tp: onnx.TypeProto) -> list:
    if tp.WhichOneof("value") != "tensor_type" or not tp.tensor_type.HasField("shape"):
        return []
    return [
        d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
        for d in tp.tensor_type.shape.dim
    ]


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
        _check_input_size(inp.name, shape, dtype)
        feeds[inp.name] = _random(rng, inp.name.lower(), dtype, shape, int_high)
    return feeds


def _check_input_size(name: str, shape: list[int], dtype: np.dtype) -> None:
    """A drawn input is at most :data:`~graphopt.opt.verify.feeds.MAX_INPUT_BYTES` (a declared dim
    of 2**62 is no size to allocate): a GraphoptError naming the input, its shape and the bound."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > MAX_INPUT_BYTES:
        raise GraphoptError(
            f"input '{name}' of shape {list(shape)} ({dtype}) would take {nbytes / 2**30:.3g} "
            f"GiB, more than the {MAX_INPUT_BYTES >> 30} GiB a drawn input may; give "
            "smaller sizes (--shape for symbolic dims) or real inputs with --inputs"
        )


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
    if ref.size and ref.dtype.kind == got.dtype.kind == "f" and _finite(r) and _finite(g):
        # the usual case, without the masks and the masked copies (the same numbers)
        rv, gv = r.reshape(-1), g.reshape(-1)
        return _finite_diff(name, shape, ref.size, rv, gv, str(got.dtype), rtol, atol)
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
    dtype = str(got.dtype)
    return _finite_diff(
        name, shape, ref.size, rv, gv, dtype, rtol, atol, nonfinite_mismatch, counts
    )


def _finite(a: np.ndarray) -> bool:
    """Whether float ``a`` holds no NaN or infinity: its smallest and largest values are
    finite (a NaN anywhere makes both NaN), without an array of flags."""
    return bool(np.isfinite(a.min()) and np.isfinite(a.max()))


def _finite_diff(
    name, shape, size: int, rv, gv, dtype: str, rtol, atol, nonfinite_mismatch=0, counts=None
) -> OutputDiff:
    """:func:`_diff` of the finite values ``rv`` (reference) and ``gv`` (1-D, float64 copies
    of outputs of ``size`` values; ``rv`` is overwritten).  No array beside the two: a large
    output's temporaries were mapped and faulted in afresh by every comparison (GPT-2's
    logits, 6.4 M values: 0.095 -> 0.055 s)."""
    scale = float(max(abs(rv.max()), abs(rv.min())))  # the largest |value|
    norms = float(np.linalg.norm(rv) * np.linalg.norm(gv))
    dot = np.dot(rv, gv)
    d = np.abs(np.subtract(rv, gv, out=rv), out=rv)
    bound = atol + rtol * scale
    max_abs = float(d.max())
    bad = int(np.count_nonzero(d > bound)) + nonfinite_mismatch
    cosine = float(dot / norms) if norms > 0 else (1.0 if max_abs == 0 else 0.0)
    return OutputDiff(
        name,
        dtype,
        shape,
        max_abs,
        max_abs / scale if scale else max_abs,
        float(d.mean()),
        bad / max(size, 1),
        cosine,
        bad == 0,
        rtol,
        atol,
        **(counts or {}),
    )


class ReferenceRun:
    """Parity's run of the original, started on a thread before the passes: the inputs it
    runs on, found as :func:`check_parity` finds them, and the original's outputs on them.
    The passes leave a core idle most of the time and never change the original; onnxruntime
    runs without the GIL (its session is made before the thread starts: it builds one with
    the GIL held).  Same session settings as parity's own run (its threads only wait
    without spinning: :data:`AHEAD_CONFIG`), so the same values.  Not for a model parity runs
    lean (:func:`is_lean`): its session would hold the weights beside the passes."""

    def __init__(
        self,
        original: onnx.ModelProto,
        *,
        shapes: dict[str, list[int]] | None = None,
        inputs: dict[str, np.ndarray] | None = None,
        seed: int = 0,
        base_dir: str | os.PathLike | None = None,
    ) -> None:
        self.original = original
        self._args = (shapes, inputs, seed, base_dir)
        self._options = ort.RunOptions()
        self._done: tuple | BaseException | None = None
        # made here: onnxruntime holds the GIL while it builds a session, so a thread would
        # only slow the passes down meanwhile; it runs without
        try:
            sess = Session(original, base_dir=base_dir, config=AHEAD_CONFIG)
        except GraphoptError as e:
            sess, self._done = None, e
        self._thread = threading.Thread(
            target=self._work, args=(sess,), name="graphopt-reference", daemon=True
        )
        self._thread.start()

    def matches(self, original, shapes, inputs, seed, base_dir) -> bool:
        """Whether this is the run :func:`check_parity` of these arguments would make."""
        mine = self._args
        return (
            original is self.original
            and mine[0] == shapes
            and mine[1] is inputs
            and mine[2] == seed
            and mine[3] == base_dir
        )

    def _work(self, sess: Session | None) -> None:
        if sess is None:
            return
        shapes, inputs, seed, _ = self._args
        try:
            names = sess.output_names()
            feeds, ref = find_runnable(
                self.original,
                lambda f: sess.run(f, names, self._options),
                lambda shp, high: make_inputs(sess.sess, shp, seed, inputs, high),
                shapes,
                inputs,
            )
            self._done = (names, feeds, ref)
        except BaseException as e:  # noqa: BLE001 - raised again where the result is taken
            self._done = e

    def result(self) -> tuple[list[str], dict[str, np.ndarray], list]:
        """(output names, feeds, the original's outputs), once the run is over; what it raised
        is raised here."""
        self._thread.join()
        if isinstance(self._done, BaseException):
            raise self._done
        assert self._done is not None
        return self._done

    def stop(self) -> None:
        """Cut the run short (the optimization went no further) and wait for the thread."""
        self._options.terminate = True
        self._thread.join()


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
    optimized_base_dir: str | os.PathLike | None = None,
    ahead: ReferenceRun | None = None,
) -> ParityReport:
    """Run both models on the same inputs and compare every output of the original.

    ``reference`` (e.g. the float64 upcast of the original) replaces the original as the side
    the optimized model is compared with; inputs are still generated from the original.
    ``base_dir``: where external weights resolve (``optimized_base_dir``: the optimized
    model's, when they are elsewhere).  ``ahead``: the original's run, started earlier
    (:class:`ReferenceRun`); used when it is the run these arguments make.
    """
    opt_dir = base_dir if optimized_base_dir is None else optimized_base_dir
    validate_args(original, shapes, inputs, per_output)
    seeded = with_seeded_randomness(original)
    if seeded is not None:  # both draw the same numbers, node by node: comparable outputs
        original, optimized = seeded, with_seeded_randomness(optimized) or optimized
        ahead = optimized_session = None
    lean = is_lean(original)
    pieces = 0
    if ahead is not None and not lean and ahead.matches(original, shapes, inputs, seed, base_dir):
        names, feeds, ref = ahead.result()
    else:
        orig_sess = open_session(original, base_dir, lean)
        names = orig_sess.output_names()
        feeds, ref = find_runnable(
            original,
            lambda f: orig_sess.run(f, names),
            lambda shp, high: make_inputs(orig_sess.sess, shp, seed, inputs, high),
            shapes,
            inputs,
        )
        pieces = getattr(orig_sess, "count", 0)
        orig_sess = None  # free the session before the optimized one loads
    shapes_used = {k: list(np.shape(v)) for k, v in feeds.items()}
    if reference is not None:
        ref = open_session(reference, base_dir, lean).run(feeds, names)
    if lean:  # both sides run lean, as the original did (a whole session would hold its weights)
        optimized_session = None
    try:
        opt_sess = optimized_session or open_session(optimized, opt_dir, lean)
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
    shapes = {} if isinstance(opt_sess, Pieces) else None
    try:
        got = (
            opt_sess.run(feeds, names, shapes) if shapes is not None else opt_sess.run(feeds, names)
        )
    except RunFailed as e:  # the original ran on these inputs, the optimized one does not
        return ParityReport(
            False, True, [], shapes_used, seed, reference_name, f"optimized model: {e}", feeds=feeds
        )
    if isinstance(opt_sess, Session):  # a profiling session saw the shapes of every node
        shapes = opt_sess.node_shapes(optimized) or None
    del opt_sess
    diffs = compare_outputs(names, ref, got, tolerances, per_output, compute_dtype(original))
    ok = all(d.ok for d in diffs)
    floor = None
    if not ok and reference is None and not lean:
        noise = runtime_noise(original, base_dir, feeds, names, ref)
        floor = dict(noise.floats)
        diffs = judge_by_noise(diffs, ref, got, noise)
        ok = all(d.ok for d in diffs)
    divergence = None
    if not ok and localize_on_failure and reference is None:
        divergence = localize(
            original, optimized, feeds, tolerances, base_dir, lean, optimized_base_dir=opt_dir
        )
    return ParityReport(
        ok,
        True,
        diffs,
        shapes_used,
        seed,
        reference_name,
        None,
        divergence,
        pieces,
        feeds=feeds,
        reference_outputs=dict(zip(names, ref)) if reference is None else None,
        shapes=shapes,
        runtime_floor=floor,
    )


#: how many times as far as onnxruntime's own optimizations move the original an optimized
#: model may move an output that missed its tolerance: the two are draws of the same rounding
#: noise (fusions that round differently, a dynamic quantization scale that moves a bucket, a
#: near-tie that selects another box), and the larger of two such draws is up to about twice one
NOISE_FACTOR = 2.0


@dataclass(frozen=True)
class OwnNoise:
    """How far the original moves from itself between two session levels, per output."""

    #: float outputs of one shape: the largest absolute difference
    floats: dict[str, float] = field(default_factory=dict)
    #: integer and boolean outputs of one shape: the fraction of elements that differ
    mismatch: dict[str, float] = field(default_factory=dict)
    #: outputs whose shape differs (a selection that keeps another number of elements)
    reshaped: frozenset[str] = frozenset()


def with_seeded_randomness(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """A copy of ``model`` whose random ops without a seed have one, taken from the node's name
    (so that the original and the optimized model draw the same numbers where a node kept its
    name); None when every random op has one already.  onnxruntime derives an unseeded op's
    seed from where it stands, which any rewrite moves: parity would compare two draws."""

    from ..graph.ir import all_graphs

    def unseeded(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
        return [
            n
            for g in all_graphs(graph)
            for n in g.node
            if is_default(n.domain)
            and n.op_type in RANDOM_OPS
            and not any(a.name == "seed" for a in n.attribute)
        ]

    if not unseeded(model.graph):
        return None
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for node in unseeded(copy.graph):
        value = float(zlib.crc32((node.name or node.output[0]).encode()) % 2**24)
        node.attribute.append(onnx.helper.make_attribute("seed", value))
    return copy


def own_noise(names: list[str], written: list, deployed: list) -> OwnNoise:
    """The original's own drift: its outputs as written (``written``, optimizations off) against
    the same model as onnxruntime runs it by default (``deployed``)."""
    floats, mismatch, reshaped = {}, {}, set()
    for name, a, b in zip(names, written, deployed):
        a, b = _as_array(a), _as_array(b)
        if a.shape != b.shape:
            reshaped.add(name)
        elif not a.size or a.dtype.kind == "O":
            continue
        elif a.dtype.kind == "f" and b.dtype == a.dtype:
            diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
            if np.isfinite(diff).all():
                floats[name] = float(diff.max())
        elif a.dtype.kind in "biu" and b.dtype == a.dtype:
            mismatch[name] = float(np.count_nonzero(a != b)) / a.size
    return OwnNoise(floats, mismatch, frozenset(reshaped))


def runtime_noise(original, base_dir, feeds, names, ref) -> OwnNoise:
    """The original's own drift on ``feeds``: as written (optimizations off: ``ref``) against
    onnxruntime's default (ORT_ENABLE_ALL).  In float16 its own fusions round differently
    (torchvision ResNet-50 fp16 moves by 1.6 % of its logits' scale, over parity's 1 %); an
    ill-conditioned float32 net, a dynamically quantized one (the scale is taken from the data:
    one rounding upstream moves a whole bucket) or a detector's near-tie selections move too."""
    try:
        deployed = Session(
            original, level=ort.GraphOptimizationLevel.ORT_ENABLE_ALL, base_dir=base_dir
        ).run(feeds, names)
    except GraphoptError:
        return OwnNoise()
    return own_noise(names, ref, deployed)


def judge_by_noise(diffs: list[OutputDiff], ref: list, got: list, noise: OwnNoise) -> list:
    """``diffs`` with each output that missed its tolerance judged again against the original's
    own drift (:data:`NOISE_FACTOR` times it): a float output within it passes as ``own-noise``,
    an integer selection that changes no more elements than that (or changes its count where the
    original's own does) as ``selection-near-ties``.  An output the original does not move at
    all is not widened: a real break still fails."""
    out = []
    for d, r, g in zip(diffs, ref, got):
        out.append(d if d.ok else _judged(d, _as_array(r), _as_array(g), noise))
    return out


def _judged(d: OutputDiff, r: np.ndarray, g: np.ndarray, noise: OwnNoise) -> OutputDiff:
    """One failed output judged against the original's own drift (see judge_by_noise)."""
    if r.shape != g.shape:
        if d.name in noise.reshaped:
            return replace(d, ok=True, judged="selection-near-ties")
        return d
    floor = noise.floats.get(d.name, 0.0)
    if floor > 0 and r.dtype.kind == "f":
        again = _diff(d.name, r, g, {}, (d.rtol, max(d.atol, NOISE_FACTOR * floor)))
        return replace(again, judged="own-noise", own_noise=floor) if again.ok else d
    own = noise.mismatch.get(d.name, 0.0)
    if own > 0 and r.dtype.kind in "biu" and d.mismatch <= NOISE_FACTOR * own:
        return replace(d, ok=True, judged="selection-near-ties", own_noise=own)
    return d


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
    sess = open_session(model, base_dir)
    feeds = make_inputs(sess.sess, shapes or {}, seed, inputs)
    names = list(dict.fromkeys(o for n in model.graph.node for o in n.output if o))
    values = open_session(_with_outputs(model, names), base_dir, is_lean(model)).run(feeds, names)
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
    lean: bool | None = None,
    optimized_base_dir: str | os.PathLike | None = None,
) -> dict[str, Any] | None:
    """The first tensor, in the original's topological order, present in both and diverging
    (``lean``: run as :func:`open_session` runs a large model, default :func:`is_lean`)."""
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
        lean = is_lean(original) if lean is None else lean
        ref = open_session(_with_outputs(original, names), base_dir, lean).run(feeds, names)
        opt_dir = base_dir if optimized_base_dir is None else optimized_base_dir
        got = open_session(_with_outputs(optimized, names), opt_dir, lean).run(feeds, names)
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
