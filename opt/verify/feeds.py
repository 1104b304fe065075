"""Parity inputs the original model accepts: validated user inputs, derived sizes, a short ladder.

Random inputs at one default size fail on many real models (a detector whose height and width
must be multiples of 32, an audio net that pads by more than 16 samples), and a parity that does
not run proves nothing.  So the sizes are derived, then tried on the *original* model:

* every symbolic dim is one size across all inputs (a ``dim_param`` shared by two inputs gets
  one value); sizes fixed by ``--shape`` or ``--inputs`` bind the ``dim_param`` they fill;
* batch-like dims (axis 0, or named like ``batch``/``N``) are 1;
* spatial dims (axes ≥ 2 of a rank-4/5 float input, or named like height/width) follow the
  ladder 224, 256, 320, 128, 64, 640, 512, 32 — unless the model's metadata carries an image
  size (``imgsz``, ``image_size``...), which is tried first;
* other dims (sequences, samples) follow 16, 64, 256, 1024, 32, 128, 512, 4096;
* a size written as a sum of other dims (``past_sequence_length + 1``, ``s0 + s1``) is that
  sum;
* a decoder's cache (inputs named like ``past``/``cache``) has its own length, from the
  sequence ladder; a length named as a total (``total_seq``) is the cache's plus the new
  tokens', and one new token is tried too (a decoding step);
* integer inputs are drawn in [0, 100) (``mask``: ones with the first row's last quarter zero,
  as padding; ``token_type``/``segment``: zeros), then in {0, 1} once the ladder is exhausted
  (indices into a small table).

The first assignment on which the original runs is used.  User-given ``--shape`` / ``--inputs``
/ ``--tolerance`` that cannot apply to the model (unknown names, wrong dtype or rank, a size that
contradicts a static dim, a ``--shape`` size that contradicts another input's, empty,
non-positive, NaN, or more than :data:`MAX_INPUT_BYTES`) are usage errors, never silently
ignored.

Arrays given with ``--inputs`` that disagree on a shared ``dim_param`` are accepted: they are
how the model is really run, and onnxruntime does not hold a model to its dim_params (optimum's
merged decoders declare ``input_ids`` and ``attention_mask`` as ``[batch, sequence_length]``
while every decoding step with a cache feeds the mask the past and the new tokens, the ids the
new ones).  :func:`split_dims` names each such dim_param, with every input axis declaring it;
the optimizer gives each of those axes a symbol of its own in the IR, so that no rewrite relies
on their equality (the output keeps the declared interface), and reports it.  A ``--shape`` is
a statement about the model's sizes, not evidence of them, so it must agree with every size
given for its dim_params.  :func:`read_feeds` reads an
``--inputs`` file: an .npz of named arrays, or an .npy for a model with exactly one input.
"""

from __future__ import annotations

import json
import math
import os
import re
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx

from ..errors import GraphoptError, UsageError
from ..graph.compat import DimSplit
from .hazards import HazardError

SPATIAL_LADDER = (224, 256, 320, 128, 64, 640, 512, 32)
SEQUENCE_LADDER = (16, 64, 256, 1024, 32, 128, 512, 4096)
MAX_INPUT_BYTES = 4 << 30
BATCH_NAMES = re.compile(r"^(n|b|bs|batch|batch_size|batchsize|num_batches)$|batch", re.I)
SPATIAL_NAMES = re.compile(r"height|width|^h$|^w$|^H$|^W$|_h$|_w$|img|image", re.I)
SIZE_KEYS = re.compile(r"imgsz|image_size|img_size|input_size|input_shape|resolution", re.I)
#: inputs holding a decoder's key/value cache: their symbolic lengths are the cache's (the
#: past), a sequence, not an image's side
CACHE_INPUTS = re.compile(r"past|cache|pkv", re.I)
#: a length named as the cache and the new tokens together (the attention mask's)
TOTAL_NAMES = re.compile(r"total|full|all_seq|kv_seq|key_seq", re.I)

Dim = int | str | None  # static size, dim_param, or unknown


@dataclass(frozen=True)
class InputSpec:
    name: str
    dtype: np.dtype | None  # None: not a tensor (sequence, map, optional)
    dims: tuple[Dim, ...] | None  # None: rank unknown

    @property
    def spatial(self) -> bool:
        return (
            self.dims is not None
            and len(self.dims) in (4, 5)
            and self.dtype is not None
            and self.dtype.kind == "f"
        )


def input_specs(model: onnx.ModelProto) -> list[InputSpec]:
    """The graph inputs a caller feeds (initializers listed as inputs excluded)."""
    inits = {t.name for t in model.graph.initializer}
    specs = []
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        t = vi.type
        if t.WhichOneof("value") != "tensor_type":
            specs.append(InputSpec(vi.name, None, None))
            continue
        tt = t.tensor_type
        try:
            dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type))
        except (KeyError, TypeError, ValueError):
            dtype = None
        dims = None
        if tt.HasField("shape"):
            dims = tuple(
                d.dim_value if d.HasField("dim_value") else _symbol(d.dim_param)
                for d in tt.shape.dim
            )
        specs.append(InputSpec(vi.name, dtype, dims))
    return specs


def _declared_bytes(f) -> int:
    """The bytes the .npy array at ``f``'s position declares, from its header alone."""
    from numpy.lib import format as npy

    version = npy.read_magic(f)
    read_header = npy.read_array_header_1_0 if version == (1, 0) else npy.read_array_header_2_0
    shape, _, dtype = read_header(f)
    return math.prod(shape) * dtype.itemsize


def read_npz(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """The arrays of an .npz of plain arrays (never pickled objects), each header read before
    its data: an array that declares more than MAX_INPUT_BYTES (or all more than four times
    that) is a ValueError before anything is decompressed; a small file cannot unpack into
    gigabytes."""
    if not zipfile.is_zipfile(path):
        raise ValueError("not an .npz archive")
    with zipfile.ZipFile(path) as z:
        total = 0
        for info in z.infolist():
            if not info.filename.endswith(".npy"):
                continue
            with z.open(info) as f:
                size = _declared_bytes(f)
            total += size
            if size > MAX_INPUT_BYTES or total > 4 * MAX_INPUT_BYTES:
                raise ValueError(
                    f"'{info.filename[:-4]}' declares {size / (1 << 30):.1f} GiB, more than the "
                    f"{MAX_INPUT_BYTES >> 30} GiB an array may ({4 * MAX_INPUT_BYTES >> 30} "
                    "GiB all together)"
                )
    data = np.load(path, allow_pickle=False)
    if not isinstance(data, np.lib.npyio.NpzFile):
        raise ValueError("not an .npz archive")
    with data:
        return {k: data[k] for k in data.files}


def load_inputs(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """An ``--inputs`` .npz: its arrays by name.  A file that is no readable .npz (truncated,
    a bad checksum, not a zip, an .npy: :func:`read_feeds` reads those) or
    that holds no array is a UsageError (one line)."""
    try:
        arrays = read_npz(path)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as e:
        raise UsageError(f"--inputs {path}: cannot read as .npz/.npy ({e})") from None
    if not arrays:
        raise UsageError(f"--inputs {path}: the .npz holds no arrays (one per input name)")
    return arrays


def read_feeds(path: str | os.PathLike, model: onnx.ModelProto | str | os.PathLike):
    """``--inputs``: an .npz of named arrays, or an .npy holding the one input of a model (a
    proto or a path, read without its weights) that has exactly one."""
    from ..graph.io import load_model, non_regular_kind

    if (kind := non_regular_kind(path)) is not None:  # a FIFO would block the read
        raise UsageError(f"--inputs {path}: is {kind}, not a regular .npz or .npy file")
    try:
        with open(path, "rb") as f:
            is_npy = f.read(6) == b"\x93NUMPY"
    except OSError as e:
        raise UsageError(f"--inputs {path}: cannot read ({e.strerror or e})") from None
    if not is_npy:
        return _non_empty(path, load_inputs(path))
    try:
        with open(path, "rb") as f:
            size = _declared_bytes(f)
        if size > MAX_INPUT_BYTES:
            raise ValueError(
                f"it declares {size / (1 << 30):.1f} GiB, more than the "
                f"{MAX_INPUT_BYTES >> 30} GiB an array may"
            )
        array = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise UsageError(f"--inputs {path}: cannot read as .npy ({e})") from None
    if not isinstance(model, onnx.ModelProto):
        model = load_model(model, check=False, lazy_external=True)
    names = [s.name for s in input_specs(model)]
    if len(names) != 1:
        raise UsageError(
            f"--inputs {path}: an .npy holds one array but the model has {len(names)} inputs "
            f"({', '.join(names) or 'none'}); give an .npz with one array per input name"
        )
    _check_not_empty(f"--inputs {path}: the array", names[0], array)
    return {names[0]: array}


def _non_empty(path, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``arrays`` when none is empty (but a cache): parity on no elements compares nothing."""
    for name, array in arrays.items():
        _check_not_empty(f"--inputs {path}: '{name}'", name, array)
    return arrays


def _check_not_empty(what: str, name: str, array) -> None:
    """An input array of no elements is a UsageError, but for a decoder's cache
    (:data:`CACHE_INPUTS`): one of length 0 is the prefill's, and the other inputs hold values."""
    shape = list(np.shape(array))
    if 0 in shape and not CACHE_INPUTS.search(name):
        raise UsageError(
            f"{what} has shape {shape}, no elements: a check on it would compare nothing "
            "(every dim must be at least 1)"
        )


#: dim_params that mean "unknown", not a size shared with other dims (Paddle writes "?")
ANONYMOUS_DIMS = frozenset({"", "?", "-1", "None", "none", "null", "unk", "dynamic"})


def _symbol(dim_param: str) -> str | None:
    return None if dim_param.strip() in ANONYMOUS_DIMS else dim_param


# ------------------------------------------------------------------------------- validation
def validate_args(
    model: onnx.ModelProto,
    shapes: dict[str, list[int]] | None,
    inputs: dict[str, np.ndarray] | None,
    tolerances: dict[str, tuple[float, float]] | None = None,
) -> None:
    """Refuse --shape / --inputs / --tolerance that cannot apply to this model (exit 2)."""
    specs = {s.name: s for s in input_specs(model)}
    all_inputs = {vi.name for vi in model.graph.input}
    for flag, given in (("--shape", shapes), ("--inputs", inputs)):
        unknown = sorted(set(given or {}) - all_inputs)
        if unknown:
            raise UsageError(
                f"{flag} names unknown input(s): {', '.join(unknown)} "
                f"(model inputs: {', '.join(sorted(specs)) or 'none'})"
            )
    bound: dict[str, list[tuple[int, str]]] = {}
    for name, value in (inputs or {}).items():
        spec = specs.get(name)
        if spec is None or spec.dtype is None:
            continue
        arr = np.asarray(value)
        _check_not_empty(f"--inputs: '{name}'", name, arr)
        if arr.dtype != spec.dtype:
            raise UsageError(f"--inputs: '{name}' is {arr.dtype}, the model takes {spec.dtype}")
        # arrays disagreeing on a dim_param are the model's real use (see split_dims)
        _check_dims(f"--inputs: '{name}'", spec, list(arr.shape), bound, strict=False)
    for name, dims in (shapes or {}).items():
        spec = specs.get(name)
        if name in (inputs or {}):
            raise UsageError(f"--shape and --inputs both give '{name}'")
        if spec is None or spec.dtype is None:
            continue
        if not dims:
            raise UsageError(f"--shape {name}= gives no dims")
        if any(d <= 0 for d in dims):
            raise UsageError(f"--shape {name}: dims must be positive (got {dims})")
        nbytes = math.prod(dims) * spec.dtype.itemsize
        if nbytes > MAX_INPUT_BYTES:
            raise UsageError(
                f"--shape {name}: {nbytes / 2**30:.1f} GiB of input is more than the "
                f"{MAX_INPUT_BYTES >> 30} GiB parity allows"
            )
        _check_dims(f"--shape {name}", spec, list(dims), bound)
    outputs = {o.name for o in model.graph.output}
    for name, (rtol, atol) in (tolerances or {}).items():
        if name not in outputs:
            raise UsageError(
                f"--tolerance names unknown output '{name}' "
                f"(model outputs: {', '.join(sorted(outputs))})"
            )
        if not all(math.isfinite(v) and v >= 0 for v in (rtol, atol)):
            raise UsageError(
                f"--tolerance {name}: RTOL and ATOL must be finite and >= 0 (got {rtol}, {atol})"
            )


def _check_dims(
    what: str, spec: InputSpec, dims: list[int], bound: dict, strict: bool = True
) -> None:
    """Refuse ``dims`` for ``spec`` that contradict its static dims; ``bound``: dim_param →
    [(size, who gave it)]; ``strict``: a size that differs from one given before for its
    dim_param is refused too."""
    if spec.dims is None:
        return
    if len(dims) != len(spec.dims):
        raise UsageError(
            f"{what} has rank {len(dims)}, the model's input has rank {len(spec.dims)} "
            f"({_fmt(spec.dims)})"
        )
    for axis, (want, got) in enumerate(zip(spec.dims, dims)):
        if isinstance(want, int) and want > 0 and want != got:
            raise UsageError(
                f"{what}: axis {axis} is {got}, the model fixes it to {want} ({_fmt(spec.dims)})"
            )
        if isinstance(want, str):
            seen = bound.setdefault(want, [])
            other = next((s for s in seen if s[0] != got), None)
            if strict and other is not None:
                raise UsageError(
                    f"{what}: axis {axis} ('{want}') is {got}, but {other[1]} sets '{want}' "
                    f"to {other[0]}"
                )
            seen.append((got, what))


def split_dims(model: onnx.ModelProto, inputs: dict[str, np.ndarray] | None) -> list[DimSplit]:
    """The dim_params that the ``--inputs`` arrays give more than one size, in the order the
    graph inputs declare them (see the module docstring); [] when they agree."""
    if not inputs:
        return []
    specs = [s for s in input_specs(model) if s.dtype is not None and s.dims is not None]
    sizes: dict[str, set[int]] = {}
    declared: dict[str, list[tuple[str, int, int | None]]] = {}
    for s in specs:
        shape = np.shape(inputs[s.name]) if s.name in inputs else None
        if shape is not None and len(shape) != len(s.dims):
            shape = None
        for axis, d in enumerate(s.dims):
            if isinstance(d, str):
                got = int(shape[axis]) if shape is not None else None
                declared.setdefault(d, []).append((s.name, axis, got))
                if got is not None:
                    sizes.setdefault(d, set()).add(got)
    return [DimSplit(d, tuple(declared[d])) for d in declared if len(sizes.get(d, ())) > 1]


def _fmt(dims) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in dims) + "]"


# ----------------------------------------------------------------------------- derivation
def candidate_shapes(
    model: onnx.ModelProto,
    shapes: dict[str, list[int]] | None = None,
    inputs: dict[str, np.ndarray] | None = None,
) -> list[dict[str, list[int]]]:
    """Shape assignments to try, first the most likely; each covers every input not given."""
    specs = [s for s in input_specs(model) if s.dtype is not None and s.dims is not None]
    shapes, inputs = dict(shapes or {}), dict(inputs or {})
    fixed: dict[str, int] = {}  # dim_param -> size, from what the user gave
    for s in specs:
        given = shapes.get(s.name) or (list(np.shape(inputs[s.name])) if s.name in inputs else None)
        if given is not None and len(given) == len(s.dims):
            for d, v in zip(s.dims, given):
                if isinstance(d, str):
                    fixed.setdefault(d, int(v))
    free = [s for s in specs if s.name not in shapes and s.name not in inputs]
    kinds: dict[object, str] = {}  # symbol -> batch | spatial | sequence
    for s in free:
        for axis, d in enumerate(s.dims):
            if isinstance(d, int) and d > 0:
                continue
            key = d if isinstance(d, str) else (s.name, axis)
            if key in fixed:
                continue
            kinds[key] = _stronger(kinds.get(key), _kind(s, axis, d))
    hint = _metadata_image_size(model)
    spatial = ([hint] if hint else []) + [v for v in SPATIAL_LADDER if v != hint]
    # a decoder with a cache: the cache's length and the new tokens' are set apart, and a
    # total length (named so, or written as a sum) is their sum; the new tokens are tried
    # as many as the cache holds, then one (a decoding step)
    past = any(k == "past" for k in kinds.values())
    steps = [(step, None) for step in range(len(SEQUENCE_LADDER))]
    if past:
        steps[1:1] = [(0, 1)]
    out = []
    for step, new_tokens in steps:
        values: dict[object, int] = {}
        for key, kind in kinds.items():
            if kind == "batch":
                values[key] = 1
            elif kind == "spatial":
                values[key] = spatial[step % len(spatial)]
            elif kind == "sequence" and new_tokens is not None:
                values[key] = new_tokens
            else:
                values[key] = SEQUENCE_LADDER[step]
        _relate_lengths(values, kinds)
        assignment = {}
        for s in free:
            dims = []
            for axis, d in enumerate(s.dims):
                if isinstance(d, int) and d > 0:
                    dims.append(d)
                else:
                    key = d if isinstance(d, str) else (s.name, axis)
                    dims.append(fixed[key] if key in fixed else values.get(key, 1))
            assignment[s.name] = dims
        assignment.update(shapes)
        if assignment not in out:
            out.append(assignment)
        if not kinds:
            break
    return out


def _relate_lengths(values: dict[object, int], kinds: dict[object, str]) -> None:
    """In place: a dim_param written as a sum of others (``past_sequence_length + 1``,
    ``s0 + s1``) is that sum; in a decoder with a cache, one named as a total
    (:data:`TOTAL_NAMES`) is the cache's length plus the new tokens' (when each is one size)."""
    names = {k: v for k, v in values.items() if isinstance(k, str)}
    for key in names:
        if (total := _sum_of(key, names)) is not None:
            values[key] = total
    pasts = {values[k] for k, kind in kinds.items() if kind == "past"}
    news = {
        values[k]
        for k, kind in kinds.items()
        if kind == "sequence" and not _is_total(k) and not _is_sum(k)
    }
    if len(pasts) == 1 and len(news) == 1:
        total = pasts.pop() + news.pop()
        for key, kind in kinds.items():
            if kind == "sequence" and _is_total(key):
                values[key] = total


def _is_sum(key: object) -> bool:
    return isinstance(key, str) and "+" in key


def _is_total(key: object) -> bool:
    """A length named as the cache's and the new tokens' together (not written as a sum)."""
    return isinstance(key, str) and not _is_sum(key) and bool(TOTAL_NAMES.search(key))


_TERM = re.compile(r"^\s*(?:(\d+)|([A-Za-z_][\w.]*))\s*$")


def _sum_of(expression: str, values: dict[str, int]) -> int | None:
    """The value of a dim_param written as a sum of known dim_params and integers, else None."""
    if not _is_sum(expression):
        return None
    total = 0
    for term in expression.split("+"):
        m = _TERM.match(term)
        if m is None:
            return None
        if m.group(1) is not None:
            total += int(m.group(1))
        elif m.group(2) in values and m.group(2) != expression:
            total += values[m.group(2)]
        else:
            return None
    return total


def _kind(spec: InputSpec, axis: int, dim: Dim) -> str:
    name = dim if isinstance(dim, str) else ""
    if name and BATCH_NAMES.search(name):
        return "batch"
    if CACHE_INPUTS.search(spec.name) and axis > 0:
        return "past"
    if name and SPATIAL_NAMES.search(name):
        return "spatial"
    if axis == 0 and (spec.dims is None or len(spec.dims) > 1):
        return "batch"
    dims = spec.dims or ()
    if dim is None and 0 < axis < len(dims) - 1 and _static(dims[axis - 1]) and _static(dims[-1]):
        return "batch"  # [2, ?, 128]: a recurrent state or cache between static dims
    if spec.spatial and axis >= 2:
        return "spatial"
    return "sequence"


def _static(d: Dim) -> bool:
    return isinstance(d, int) and d > 0


def _stronger(old: str | None, new: str) -> str:
    """A symbol seen as batch anywhere stays batch; spatial beats a cache's length, which
    beats sequence."""
    order = {"batch": 3, "spatial": 2, "past": 1, "sequence": 0}
    return new if old is None or order[new] > order[old] else old


def _metadata_image_size(model: onnx.ModelProto) -> int | None:
    """An image size the model's metadata declares (ultralytics' imgsz, similar keys)."""
    for prop in model.metadata_props:
        if not SIZE_KEYS.search(prop.key):
            continue
        try:
            value = json.loads(prop.value.replace("(", "[").replace(")", "]"))
        except (ValueError, TypeError):
            continue
        if isinstance(value, int) and 8 <= value <= 4096:
            return value
        if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
            if 8 <= value[-1] <= 4096:
                return int(value[-1])
    return None


# ------------------------------------------------------------------------------ search
def find_runnable(
    model: onnx.ModelProto,
    run: Callable[[dict[str, np.ndarray]], list],
    make: Callable[[dict[str, list[int]], int], dict[str, np.ndarray]],
    shapes: dict[str, list[int]] | None,
    inputs: dict[str, np.ndarray] | None,
) -> tuple[dict[str, np.ndarray], list]:
    """Feeds on which ``run`` (the original model) succeeds, and its outputs.

    ``make(shapes, int_high)`` builds the feeds for one shape assignment.  Raises
    GraphoptError naming what was tried when nothing runs."""
    tried: list[str] = []
    first_error = None
    candidates = candidate_shapes(model, shapes, inputs)
    attempts = [(c, 100) for c in candidates]
    if _random_integers(model, shapes, inputs):
        attempts.append((candidates[0], 2))
    for assignment, high in attempts:
        feeds = make(assignment, high)
        try:
            return feeds, run(feeds)
        except HazardError:
            raise  # the model's own: no other input runs it
        except GraphoptError as e:
            first_error = first_error or str(e)
            tried.append(
                ", ".join(f"{k}={list(v.shape)}" for k, v in feeds.items())
                + ("" if high == 100 else " (integers in {0, 1})")
            )
    hint = "give real sizes with --shape NAME=D0,D1,... or real inputs with --inputs FILE.npz"
    raise GraphoptError(
        f"the original model did not run on any derived input ({len(tried)} tried, first: "
        f"{tried[0] if tried else 'none'}; {first_error}); {hint}"
    )


def _random_integers(model, shapes, inputs) -> bool:
    """Whether some integer input is drawn at random (not given by the user)."""
    return any(
        s.name not in (inputs or {}) and s.dtype is not None and s.dtype.kind in "iu"
        for s in input_specs(model)
    )
