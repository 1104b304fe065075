"""Loading, validating and atomically saving ONNX models, external data included.

Loading refuses, with one clear line, anything that is not a usable model: missing, empty,
truncated or non-ONNX files, external-data references that escape the model's directory
(absolute paths, ``..``, symlinks pointing outside) or point past the end of their file.
A large file is read once: onnx's checker reads the model without its weights
(:func:`check_without_weights`, refusing what it refuses on the whole model), and the
external-data files of a large file are listed from its field headers (:func:`external_data_files`).
Saving never leaves a half-written file: everything goes to a temporary sibling first and is
renamed into place, and the input model is never written to.  Temporaries are named after their
output and the writing process (``.NAME.graphopt-KIND-PID-...``), removed on every failure path,
and one left by a killed run is removed by the next write of that output.

Where outputs may go: :func:`check_output_dir` lets a folder be replaced only when it is one
graphopt wrote (a marker file with its schema) and holds nothing else; :func:`check_side_outputs`
refuses a file output that would land on an input model, its external data, an input file, or
inside a folder being read or written.  A file output only ever creates a regular file or replaces
one (:func:`check_regular_target`, up front and again at write time): a device, FIFO, socket or
folder at its path is refused, never replaced.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import math
import mmap
import os
import re
import shutil
import stat
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import onnx
from google.protobuf.message import DecodeError, EncodeError
from onnx import external_data_helper

from ..errors import ModelLoadError, ModelSaveError, UsageError
from .compat import CycleError, accept_on_load, sort_on_load
from .domains import is_default

# Protobuf cannot serialize a message of 2 GiB or more; stay well below when deciding.
PROTOBUF_LIMIT = 2**31 - 1
EXTERNAL_THRESHOLD = 1_800_000_000


def load_model(
    path: str | os.PathLike,
    *,
    check: bool = True,
    lazy_external: bool = False,
    in_place: bool = False,
) -> onnx.ModelProto:
    """Read and validate a model file, with its external data resolved safely.

    With ``lazy_external`` the external data is validated but not read: the tensors keep their
    references (relative to the model's directory, which the caller passes on as ``base_dir``)
    and are memory-mapped only when a pass needs their values.  With ``in_place`` too, the
    large weights of a large file are not read either (:func:`_read_in_place`): the model then
    references its own file, and is written with :func:`write_model_files` (or a bundle).
    """
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: no such file") from None
    except (OSError, ValueError) as e:  # a name too long, a symlink loop, no permission
        raise ModelLoadError(f"{path}: cannot read ({_why(e)})") from None
    if stat.S_ISDIR(st.st_mode):
        raise ModelLoadError(f"{path}: is a directory, expected an .onnx file")
    if not stat.S_ISREG(st.st_mode):
        raise ModelLoadError(f"{path}: is {non_regular_kind(path)}, expected an .onnx file")
    size = st.st_size
    if size == 0:
        raise ModelLoadError(f"{path}: empty file, not an ONNX model")
    key = _file_key(path)  # taken before reading: a file changed since is parsed again
    model = data = None
    try:
        if lazy_external and in_place and size >= in_place_above():
            model = _read_in_place(path)  # None: not well-formed, parsed whole below (why)
        if model is None:
            with open(path, "rb") as f:
                data = f.read()
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read ({_why(e)})") from None
    if model is not None:
        # the bundle records the input's sha256: read on a thread while the passes run
        if key is not None:
            _remember_digest(key, ThreadPoolExecutor(1).submit(_hash_file, path))
        _check_structure(model, path)
    else:
        # the input's sha256, taken from these bytes on a thread while they are parsed and
        # checked (hashlib lets go of the GIL), not by reading the file again later
        digest = ThreadPoolExecutor(1).submit(hashlib.sha256, data) if key is not None else None
        try:
            model = _parsed(data, path)
            _check_structure(model, path)
        finally:
            if digest is not None:
                _remember_digest(key, digest.result().hexdigest())
    base = path.resolve().parent
    _check_raw_sizes(model, data, path)
    # one walk over every tensor (a graph of 100k constants: 1.5 s a walk)
    stored = [t for t in _all_tensors(model) if external_data_helper.uses_external_data(t)]
    check_external_data(stored, base, path)
    files = [t for t in stored if not is_in_place(t)]
    if key is not None:
        if len(_EXTERNAL_FILES) >= 64:
            _EXTERNAL_FILES.clear()
        _EXTERNAL_FILES[key] = _located([_location(t) for t in files], path)
    # the bytes read stop being the model once its external data is read in or it is fixed up
    external = bool(files)
    changed = model.ir_version < 4 or external or data is None
    if external and not lazy_external:
        external_data_helper.load_external_data_for_model(model, str(base))
    accept_on_load(model)  # in memory: what onnxruntime runs and onnx's checker refuses
    if check:
        # the checker reads the model without its weights (the bytes just read are its own,
        # unless fixed up since); external data still on disk (lazy) is checked through the file
        lazy = external and lazy_external
        try:
            validate(model, path, by_path=lazy, whole=None if changed else data)
        except ModelLoadError as e:
            # nodes out of order: onnxruntime sorts them on load, so do we, then check again
            # (the checker finds them in C++: a sorted model pays no walk over its nodes in
            # Python); neither the file nor the bytes read are the model then: its weights are
            # checked as stand-ins (external references were validated above)
            if UNSORTED not in str(e):
                raise
            try:
                sort_on_load(model)
            except CycleError as cycle:
                raise ModelLoadError(f"{path}: invalid ONNX model: {cycle}") from None
            validate(model, path, external=True)
    return model


def _why(e: Exception) -> str:
    """An OSError's reason in a few words (``Permission denied``)."""
    return (e.strerror if isinstance(e, OSError) else None) or str(e) or type(e).__name__


#: what onnx's checker says of a graph whose nodes are not in topological order
UNSORTED = "topologically sorted"


# ------------------------------------------------------------------ weights left in their file
#: a model file of at least this many bytes (``GRAPHOPT_IN_PLACE_ABOVE``: bytes) is read by
#: :func:`load_model` ``(lazy_external=True)`` without its large weights (see _read_in_place):
#: neither its bytes nor a parsed copy of its weights are held (MobileNetV3, 22 MB: peak RSS of
#: `optimize --no-check` 163 -> 126 MB, no slower); a smaller file is read whole
IN_PLACE_ABOVE = 1 << 20
#: a top-level initializer of at least this many raw bytes is left in its file
IN_PLACE_BYTES = 64 << 10
#: the files weights were left in: the location their references name → the resolved file
_IN_PLACE: dict[str, Path] = {}


def in_place_above() -> int:
    from ..environment import env_number

    return int(env_number("GRAPHOPT_IN_PLACE_ABOVE", IN_PLACE_ABOVE))


def is_in_place(tensor: onnx.TensorProto) -> bool:
    """Whether ``tensor`` is a weight :func:`load_model` left in its model file: a reference
    (location, offset, length) to where its raw bytes lie in that file.  It is inline data as
    far as writing goes (a model holding it is written whole, its bytes copied from the file)."""
    return (
        tensor.data_location == onnx.TensorProto.EXTERNAL
        and bool(_IN_PLACE)
        and _location(tensor) in _IN_PLACE
    )


def in_place_region(tensor: onnx.TensorProto) -> tuple[Path, int, int]:
    """(file, offset, length) of a weight left in its file."""
    info = {e.key: e.value for e in tensor.external_data}
    return _IN_PLACE[info["location"]], int(info["offset"]), int(info["length"])


#: TensorProto fields that hold values other than raw_data, or say where they are stored
_VALUE_FIELD_NUMBERS = {3, 4, 5, 6, 7, 10, 11, 13, 14}  # segment, *_data, external_data, location


def _read_in_place(path: Path) -> onnx.ModelProto | None:
    """The model in ``path`` read without its large weights: each top-level initializer of at
    least :data:`IN_PLACE_BYTES` raw bytes (of a plainly sized type, as many bytes as its dims
    need, nothing else holding values) becomes a reference to where those bytes lie in the file
    (:func:`is_in_place`), and the rest is parsed in runs of consecutive fields, so that neither
    the file's bytes nor the weights are ever held (BERT-base: ~10 MB read instead of 438).
    The weights are read, memory-mapped, only where a pass needs their values, and copied from
    the file into the output.  None when the bytes are not a well-formed message."""
    model = onnx.ModelProto()
    location = path.name
    left = 0
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            top, graph = _Runs(buf, model), _Runs(buf, model.graph)
            for num, wire, start, a, b in _spans(buf, 0, len(buf)):
                if num != 7 or wire != 2:  # ModelProto.graph
                    top.add(start, b)
                    continue
                top.flush()
                for g_num, g_wire, g_start, g_a, g_b in _spans(buf, a, b):
                    ref = None
                    if g_num == 5 and g_wire == 2 and g_b - g_a >= IN_PLACE_BYTES:
                        ref = _reference(buf, g_a, g_b, location)
                    if ref is None:
                        graph.add(g_start, g_b)
                    else:
                        graph.flush()
                        model.graph.initializer.append(ref)
                        left += 1
                graph.flush()
            top.flush()
        except (_Malformed, DecodeError):
            return None
    if left:
        _IN_PLACE[location] = path.resolve()
    return model


class _Runs:
    """Consecutive fields of one message in a buffer, parsed into ``target`` a run at a time."""

    def __init__(self, buf, target) -> None:
        self.buf, self.target, self.start, self.end = buf, target, 0, 0

    def add(self, start: int, end: int) -> None:
        if start != self.end or end - self.start > CHUNK:
            self.flush()
            self.start = start
        self.end = end

    def flush(self) -> None:
        if self.end > self.start:
            self.target.MergeFromString(self.buf[self.start : self.end])
        self.start = self.end


def _reference(buf, start: int, end: int, location: str) -> onnx.TensorProto | None:
    """The TensorProto serialized at ``buf[start:end]`` with its raw bytes left where they are
    (an external reference into the file), or None where it is not such a plain weight."""
    raw = None
    for num, wire, tag, a, b in _spans(buf, start, end):
        if num == 9 and wire == 2 and raw is None:
            raw = (tag, a, b)
        elif num == 9 or num in _VALUE_FIELD_NUMBERS:
            return None
    if raw is None:
        return None
    tag, a, b = raw
    tensor = onnx.TensorProto.FromString(buf[start:tag] + buf[b:end])
    if tensor.data_type in _KEPT_TYPES or tensor_nbytes(tensor) != b - a:
        return None
    tensor.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(a)), ("length", str(b - a))):
        tensor.external_data.add(key=key, value=value)
    return tensor


#: bytes :func:`_hash_file` reads at a time, into one buffer: no allocation per read (a read
#: of many MiB is a fresh mapping each time, and glibc then keeps later temporaries of that
#: size in its heap instead of giving them back)
HASH_BLOCK = 1 << 20


def _hash_file(path: Path) -> str:
    sha = hashlib.sha256()
    buf = bytearray(HASH_BLOCK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            sha.update(view[:n])
    return sha.hexdigest()


def _parsed(data: bytes, path: Path) -> onnx.ModelProto:
    try:
        return onnx.load_model_from_string(data)
    except (DecodeError, RuntimeError, ValueError) as e:
        raise ModelLoadError(
            f"{path}: not a valid ONNX model (protobuf parse failed: {e})"
        ) from None


#: sha256 of the files load_model read: file key (path, size, mtime, inode) → hex digest, or
#: the digest being taken on a thread
_DIGESTS: dict[tuple, str | Future] = {}


def _remember_digest(key: tuple, digest: str | Future) -> None:
    if len(_DIGESTS) >= 64:
        _DIGESTS.clear()
    _DIGESTS[key] = digest


def file_sha256(path: str | os.PathLike) -> str | None:
    """The sha256 of a file (None when it cannot be read); of a model file :func:`load_model`
    read and that has not changed since, from that read."""
    key = _file_key(Path(path))
    if key is not None and key in _DIGESTS:
        known = _DIGESTS[key]
        try:
            return known.result() if isinstance(known, Future) else known
        except OSError:
            return None
    try:
        return _hash_file(Path(path))
    except OSError:
        return None


def validate(
    model: onnx.ModelProto,
    path: str | os.PathLike = "<model>",
    *,
    by_path: bool = False,
    data: bytes | None = None,
    whole: bytes | None = None,
    external: bool = False,
) -> None:
    """onnx.checker on the model: on its file when external data must resolve beside it, on
    ``data`` when the caller gives other bytes to check, else without its weights
    (:func:`check_without_weights`; ``whole``: the model's own bytes when the caller has them;
    ``external``: its external-data references, validated already, stand in for their data).
    Raise ModelLoadError with the checker's first line, or when the graph has no output."""
    if not model.graph.output:
        raise ModelLoadError(f"{path}: invalid ONNX model: the graph has no outputs")
    try:
        if by_path:
            onnx.checker.check_model(str(path))
        elif external:
            check_without_weights(model, external=True)
        elif data is not None:
            onnx.checker.check_model(data)
        elif whole is None and any(is_in_place(t) for t in model.graph.initializer):
            check_without_weights(model, written=(Path(path), None))  # the file is the model
        else:
            check_without_weights(model, data=whole)
    except onnx.checker.ValidationError as e:
        raise ModelLoadError(f"{path}: invalid ONNX model: {_checker_line(e)}") from None


def _checker_line(e: Exception) -> str:
    """The checker's first line; one that ends in a colon (it prints a node after it) with the
    lines up to the next blank one, joined."""
    lines = str(e).strip().splitlines()
    if not lines:
        return type(e).__name__
    if not lines[0].rstrip().endswith(":"):
        return lines[0]
    rest = []
    for line in lines[1:]:
        if not line.strip():
            break
        rest.append(line.strip())
    return " ".join([lines[0].strip(), *rest])


def _check_structure(model: onnx.ModelProto, path: Path) -> None:
    """Protobuf parses many random byte strings; require what every real model has."""
    if model.ir_version <= 0 or not model.HasField("graph"):
        raise ModelLoadError(f"{path}: not an ONNX model (no ir_version or graph)")
    if not model.opset_import:
        raise ModelLoadError(f"{path}: not an ONNX model (no opset_import)")
    newest = onnx.defs.onnx_opset_version()
    for imp in model.opset_import:
        if is_default(imp.domain) and imp.version > newest:
            raise ModelLoadError(
                f"{path}: default-domain opset {imp.version} is newer than this onnx supports "
                f"(up to {newest}); upgrade onnx/onnxruntime or re-export at a released opset"
            )
    if model.ir_version > onnx.IR_VERSION + 2:
        raise ModelLoadError(
            f"{path}: IR version {model.ir_version} is newer than this onnx supports "
            f"({onnx.IR_VERSION}); upgrade onnx or re-export the model"
        )
    _check_types(model, path)


_KNOWN_TYPES = frozenset(onnx.TensorProto.DataType.values())


def _check_types(model: onnx.ModelProto, path: Path) -> None:
    """Every tensor's element type is one ONNX defines, and no initializer is stored in
    segments (onnx cannot read them)."""
    for graph in _graphs(model.graph):
        for info in (*graph.input, *graph.output, *graph.value_info):
            t = info.type.tensor_type if info.type.HasField("tensor_type") else None
            if t is not None and t.elem_type not in _KNOWN_TYPES:
                raise ModelLoadError(
                    f"{path}: '{info.name}' has element type {t.elem_type}, which ONNX does not "
                    "define"
                )
        for tensor in (*graph.initializer, *(sp.values for sp in graph.sparse_initializer)):
            if tensor.data_type not in _KNOWN_TYPES:
                raise ModelLoadError(
                    f"{path}: initializer '{tensor.name}' has element type {tensor.data_type}, "
                    "which ONNX does not define"
                )
            if tensor.HasField("segment"):
                raise ModelLoadError(
                    f"{path}: initializer '{tensor.name}' is stored in segments, which onnx "
                    "cannot load; re-export it whole"
                )


#: tensors outside the top-level initializers are measured only below this size (reading a
#: bytes field copies it); the top-level ones are measured from the file's field headers
_MEASURED_BYTES = 1 << 20


def _check_raw_sizes(model: onnx.ModelProto, data: bytes | None, path: Path) -> None:
    """Every tensor's raw data holds exactly what its dims and element type need (a mutated or
    hand-edited file says otherwise: one line and exit 1, not an error deep in a pass)."""
    inits = model.graph.initializer
    lengths = _raw_lengths(data) if data is not None else None
    if lengths is None or len(lengths) != len(inits):
        lengths = [None] * len(inits)
    for tensor, raw in zip(inits, lengths):
        if raw is not None:
            _check_raw_size(tensor, raw, path)
    for graph in _graphs(model.graph):
        for node in graph.node:
            for attr in node.attribute:
                for tensor in [attr.t] if attr.HasField("t") else attr.tensors:
                    if tensor.HasField("raw_data") and tensor.ByteSize() < _MEASURED_BYTES:
                        _check_raw_size(tensor, len(tensor.raw_data), path)


def _graphs(graph: onnx.GraphProto):
    """``graph`` and every subgraph inside it (If/Loop/Scan bodies)."""
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            for sub in [attr.g] if attr.HasField("g") else attr.graphs:
                yield from _graphs(sub)


def _check_raw_size(tensor: onnx.TensorProto, raw: int, path: Path) -> None:
    if external_data_helper.uses_external_data(tensor) or tensor.data_type in _KEPT_TYPES:
        return
    need = _declared_nbytes(tensor)
    if need is not None and raw != need:
        kind = onnx.TensorProto.DataType.Name(tensor.data_type)
        raise ModelLoadError(
            f"{path}: tensor '{tensor.name}' holds {raw} bytes of raw data; its dims "
            f"{list(tensor.dims)} and type {kind} need {need}"
        )


def _all_tensors(model: onnx.ModelProto):
    yield from external_data_helper._get_all_tensors(model)


def check_external_data(tensors: Sequence[onnx.TensorProto], base: Path, path: Path) -> None:
    """Every external reference (of ``tensors``, those stored externally) must stay inside the
    model's directory and fit its file."""
    for tensor in tensors:
        info = {e.key: e.value for e in tensor.external_data}
        location = info.get("location", "")
        if not location:
            raise ModelLoadError(
                f"{path}: tensor '{tensor.name}' has external data without a location"
            )
        if "\x00" in location:
            raise ModelLoadError(
                f"{path}: tensor '{tensor.name}' external data location contains a NUL byte"
            )
        rel = Path(location)
        if rel.is_absolute() or ".." in rel.parts:
            raise ModelLoadError(
                f"{path}: tensor '{tensor.name}' external data location '{location}' escapes the "
                "model directory (absolute paths and '..' are refused)"
            )
        try:
            target = (base / rel).resolve(strict=True)
        except (OSError, RuntimeError) as e:  # missing, a symlink loop, unreadable
            why = e.strerror if isinstance(e, OSError) and e.strerror else "a symlink loop"
            if isinstance(e, FileNotFoundError):
                raise ModelLoadError(
                    f"{path}: external data file '{location}' for tensor '{tensor.name}' is missing"
                ) from None
            raise ModelLoadError(
                f"{path}: external data file '{location}' for tensor '{tensor.name}' cannot be "
                f"resolved ({why})"
            ) from None
        if base not in target.parents:
            raise ModelLoadError(
                f"{path}: tensor '{tensor.name}' external data '{location}' resolves outside the "
                "model directory (symlink?)"
            )
        if (kind := non_regular_kind(target)) is not None:
            raise ModelLoadError(
                f"{path}: external data file '{location}' for tensor '{tensor.name}' is {kind}, "
                "not a regular file"
            )
        offset = _byte_count(info, "offset", tensor, path) or 0
        length = _byte_count(info, "length", tensor, path)
        end = offset + (length or 0)
        declared = _declared_nbytes(tensor)
        if length is not None and declared is not None and length != declared:
            raise ModelLoadError(
                f"{path}: tensor '{tensor.name}' has external data length {length} but its "
                f"dims {list(tensor.dims)} need {declared} bytes"
            )
        if end > target.stat().st_size:
            raise ModelLoadError(
                f"{path}: external data for tensor '{tensor.name}' ends at byte {end} but "
                f"'{location}' has only {target.stat().st_size} bytes (truncated?)"
            )


def _byte_count(info: dict[str, str], key: str, tensor: onnx.TensorProto, path: Path) -> int | None:
    """An external-data entry's ``offset`` or ``length``: a non-negative decimal integer (None
    when absent or empty); anything else is a ModelLoadError naming the tensor and the value."""
    value = info.get(key, "").strip()
    if not value:
        return None
    if not value.isascii() or not value.isdigit():
        raise ModelLoadError(
            f"{path}: tensor '{tensor.name}' has external data {key} '{info[key]}', "
            "not a byte count (a non-negative integer)"
        )
    return int(value)


def has_external_data(model: onnx.ModelProto) -> bool:
    """Whether any tensor's bytes are not in the message (external files, or left in place)."""
    return any(external_data_helper.uses_external_data(t) for t in _all_tensors(model))


def has_data_files(model: onnx.ModelProto) -> bool:
    """Whether any tensor's bytes are in an external-data file (weights left in their model
    file by :func:`load_model` are not: they are written inline, as they were read)."""
    return any(
        external_data_helper.uses_external_data(t) and not is_in_place(t)
        for t in _all_tensors(model)
    )


def tensor_nbytes(tensor: onnx.TensorProto) -> int:
    """The bytes of a tensor's values from its metadata (dims and element type; an external
    tensor's recorded length), without reading or copying the values."""
    if external_data_helper.uses_external_data(tensor):
        info = {e.key: e.value for e in tensor.external_data}
        if info.get("length"):
            return int(info["length"])
    if tensor.data_type == onnx.TensorProto.STRING:
        return sum(len(s) for s in tensor.string_data)
    declared = _declared_nbytes(tensor)
    return math.prod(tensor.dims) if declared is None else declared


def _declared_nbytes(tensor: onnx.TensorProto) -> int | None:
    """The bytes a tensor's dims and element type need, packed as raw data; None for strings
    and element types whose width is unknown."""
    bits = _ELEMENT_BITS.get(tensor.data_type)
    if bits is None:
        if tensor.data_type in (onnx.TensorProto.STRING, onnx.TensorProto.UNDEFINED):
            return None
        try:
            bits = 8 * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
        except (KeyError, TypeError, ValueError):
            return None
    return (math.prod(tensor.dims) * bits + 7) // 8


#: element widths numpy cannot tell (packed and 8-bit float types)
_ELEMENT_BITS = {
    getattr(onnx.TensorProto, name): bits
    for name, bits in (
        ("INT4", 4),
        ("UINT4", 4),
        ("INT2", 2),
        ("UINT2", 2),
        ("FLOAT4E2M1", 4),
        ("FLOAT8E4M3FN", 8),
        ("FLOAT8E4M3FNUZ", 8),
        ("FLOAT8E5M2", 8),
        ("FLOAT8E5M2FNUZ", 8),
        ("FLOAT8E8M0", 8),
        ("BFLOAT16", 16),
    )
    if hasattr(onnx.TensorProto, name)
}


def serialize(model: onnx.ModelProto) -> bytes | None:
    """The model's bytes, or None when it cannot be one protobuf message (2 GiB).  A model whose
    inline weights (sizes from their metadata) are well below the limit is serialized directly:
    asking its ByteSize() first walks the whole model once more, as long as serializing it."""
    inline = sum(
        tensor_nbytes(t)
        for t in model.graph.initializer
        if not external_data_helper.uses_external_data(t)
    )
    if inline < PROTOBUF_LIMIT // 2:
        try:
            return model.SerializeToString()
        except (EncodeError, ValueError, RuntimeError, OverflowError):
            return None  # large constants or bodies beyond the initializers
    return model.SerializeToString() if model.ByteSize() < PROTOBUF_LIMIT else None


# ------------------------------------------------------------------ checking without the weights
#: inline tensors of at least this many bytes are checked as stand-ins (name, type and dims; the
#: values are never read by the checker); smaller ones (shape constants) are checked as they are
STANDIN_BYTES = 1024
#: where a stand-in says its values are: onnx's checker accepts a location starting with ``#``
#: without looking for a file
STANDIN_LOCATION = "#graphopt-stand-in"
_VALUE_FIELDS = (
    "float_data",
    "int32_data",
    "string_data",
    "int64_data",
    "double_data",
    "uint64_data",
)
#: element types the checker sizes differently (packed sub-byte) or does not allow in raw_data
_KEPT_TYPES = {
    getattr(onnx.TensorProto, name)
    for name in ("UNDEFINED", "STRING", "INT4", "UINT4", "INT2", "UINT2", "FLOAT4E2M1")
    if hasattr(onnx.TensorProto, name)
}


def check_without_weights(
    model: onnx.ModelProto,
    *,
    full_check: bool = False,
    data: bytes | None = None,
    written: tuple[Path, list[int | None] | None] | None = None,
    external: bool = False,
) -> None:
    """``onnx.checker.check_model(model, full_check)`` without serializing and re-parsing the
    weights: the checker reads a copy of the model whose large inline tensors are stand-ins
    (:func:`skeleton`).  It reports every error it reports on the whole model: a tensor whose
    data the checker would refuse is kept as it is, and an error about external data when
    stand-ins were made (shape inference asked for a stand-in's values) is settled on the whole
    model (``data``: its bytes when the caller has them, else serialized here; not checked when
    it cannot be one message, as ``check_model`` cannot either).  ``written``: (the file the
    model was written whole to, the raw_data length of each top-level initializer in it): the
    whole model is checked from that file, and the lengths stand for the header scan of ``data``.
    ``external``: tensors whose data is in external files (which :func:`load_model` validated:
    inside the model's folder, within their file) are stand-ins too, so that a model held in
    memory, changed since it was read, is checked without a file to resolve them against.
    Raises what check_model raises."""

    def check_whole() -> bool:
        if written is not None:
            onnx.checker.check_model(str(written[0]), full_check=full_check)
            return True
        whole = data if data is not None else serialize(model)
        if whole is not None:
            onnx.checker.check_model(whole, full_check=full_check)
        return whole is not None

    if external:
        stripped, _ = skeleton(model, data, None, external=True)
        onnx.checker.check_model(stripped.SerializeToString(), full_check=full_check)
        return
    left = any(is_in_place(t) for t in model.graph.initializer)  # not in the message: stand in
    if not left and not _stand_ins_pay(model) and check_whole():
        return
    stripped, replaced = skeleton(model, data, written[1] if written is not None else None)
    try:
        onnx.checker.check_model(stripped.SerializeToString(), full_check=full_check)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        if not replaced or not about_external_data(e):
            raise
        check_whole()


def about_external_data(error: Exception) -> bool:
    """Whether a checker error is about external data files (they resolve beside the model
    file, which a checker given the model's bytes does not know: it looks in the working
    directory)."""
    text = str(error)
    return "external" in text.lower() or "should be stored in" in text


#: a skeleton is made when the weights hold at least this many elements per node and
#: initializer: making one costs about what checking 8 KiB of weights costs (tens of
#: microseconds per node or tensor walked, a few nanoseconds per byte parsed and copied)
STANDIN_PAYS_PER_ELEMENT = 2048


def _stand_ins_pay(model: onnx.ModelProto) -> bool:
    """Whether checking a skeleton is cheaper than checking the whole model: many weights in
    few nodes (BERT-base: 110 M elements in 1,454), not a graph of many small constants."""
    graph = model.graph
    elements = sum(math.prod(t.dims) for t in graph.initializer)
    return elements >= STANDIN_PAYS_PER_ELEMENT * (len(graph.node) + len(graph.initializer))


def skeleton(
    model: onnx.ModelProto,
    data: bytes | None = None,
    lengths: list[int | None] | None = None,
    *,
    external: bool = False,
) -> tuple[onnx.ModelProto, int]:
    """(a copy of ``model`` whose inline tensors of at least :data:`STANDIN_BYTES` are stand-ins,
    how many).  A stand-in keeps every field but the values and says they are stored at
    :data:`STANDIN_LOCATION`; only a tensor whose data the checker accepts becomes one (raw
    bytes only, exactly as many as its dims and type need, a type the checker sizes plainly).
    ``data``: the model's own bytes, when the caller has them, to read the top-level weights'
    sizes from their field headers instead of copying each weight out of the message;
    ``lengths``: those sizes, when the caller knows them already; ``external``: tensors whose
    data is in external files become stand-ins too."""
    if lengths is None and data is not None:
        lengths = _raw_lengths(data)
    if lengths is not None and len(lengths) != len(model.graph.initializer):
        lengths = None
    replaced = 0

    def stored(tensor: onnx.TensorProto) -> bool:
        return external and external_data_helper.uses_external_data(tensor)

    def put(i: int, tensor: onnx.TensorProto, initializers) -> None:
        nonlocal replaced
        if stored(tensor) or _stands_in(tensor, lengths[i] if lengths is not None else None):
            _make_stand_in(tensor, initializers.add())
            replaced += 1
        else:
            initializers.append(tensor)

    out = copy_with_initializers(model, put)
    for tensor in _all_tensors(out):  # in Constant nodes, subgraphs and functions: copies
        if stored(tensor) and not _is_stand_in(tensor):
            del tensor.external_data[:]
            _mark_stand_in(tensor)
            replaced += 1
        elif _stands_in(tensor, None):
            if is_in_place(tensor):  # (a weight left in its file that a pass moved in there)
                del tensor.external_data[:]
            tensor.ClearField("raw_data")
            _mark_stand_in(tensor)
            replaced += 1
    return out, replaced


def _is_repeated(desc) -> bool:
    repeated = getattr(desc, "is_repeated", None)
    return desc.label == desc.LABEL_REPEATED if repeated is None else bool(repeated)


def _copy_field(dst, desc, value) -> None:
    if _is_repeated(desc):
        getattr(dst, desc.name).extend(value)
    elif desc.message_type is not None:
        getattr(dst, desc.name).CopyFrom(value)
    else:
        setattr(dst, desc.name, value)


def _stands_in(tensor: onnx.TensorProto, raw_length: int | None) -> bool:
    """Whether the checker's verdict on ``tensor`` is the same with a stand-in: raw data of the
    exact size (``raw_length`` when known, else measured), nothing else holding values; a
    weight left in its file was left only if it is such a tensor."""
    if is_in_place(tensor):
        return True
    if (
        not tensor.HasField("raw_data")
        or tensor.data_type in _KEPT_TYPES
        or tensor.data_location != onnx.TensorProto.DEFAULT
        or len(tensor.external_data)
        or (size := tensor_nbytes(tensor)) < STANDIN_BYTES
        or any(len(getattr(tensor, name)) for name in _VALUE_FIELDS)
    ):
        return False
    return (raw_length if raw_length is not None else len(tensor.raw_data)) == size


def copy_with_initializers(model: onnx.ModelProto, put) -> onnx.ModelProto:
    """A copy of ``model`` field by field, but for its top-level initializers: for each,
    ``put(index, tensor, the copy's initializers)`` adds what stands for it."""
    out = onnx.ModelProto()
    for desc, value in model.ListFields():
        if desc.name != "graph":
            _copy_field(out, desc, value)
            continue
        for graph_desc, graph_value in value.ListFields():
            if graph_desc.name != "initializer":
                _copy_field(out.graph, graph_desc, graph_value)
                continue
            for i, tensor in enumerate(graph_value):
                put(i, tensor, out.graph.initializer)
    return out


def copy_without_data(src: onnx.TensorProto, dst: onnx.TensorProto) -> None:
    """``dst`` becomes ``src`` without its raw bytes (never copied out) nor where they are
    stored (a weight left in its file)."""
    for desc in src.DESCRIPTOR.fields:
        if desc.name in ("raw_data", "external_data", "data_location"):
            continue
        if _is_repeated(desc):
            if len(value := getattr(src, desc.name)):
                getattr(dst, desc.name).extend(value)
        elif src.HasField(desc.name):
            _copy_field(dst, desc, getattr(src, desc.name))


def _make_stand_in(src: onnx.TensorProto, dst: onnx.TensorProto) -> None:
    """``dst`` becomes ``src`` without its raw bytes, marked a stand-in."""
    copy_without_data(src, dst)
    _mark_stand_in(dst)


def _is_stand_in(tensor: onnx.TensorProto) -> bool:
    return any(e.key == "location" and e.value == STANDIN_LOCATION for e in tensor.external_data)


def _mark_stand_in(tensor: onnx.TensorProto) -> None:
    tensor.data_location = onnx.TensorProto.EXTERNAL
    tensor.external_data.add(key="location", value=STANDIN_LOCATION)


def _raw_lengths(data: bytes) -> list[int | None] | None:
    """The raw_data length of every top-level initializer (None: it has none), in order, read
    from the field headers of the serialized model ``data``; None when they cannot be read (a
    graph given in more than one piece, malformed bytes)."""
    try:
        graphs = [
            (a, b) for num, wire, a, b in _fields(data, 0, len(data)) if num == 7 and wire == 2
        ]
        if len(graphs) != 1:
            return None
        lengths: list[int | None] = []
        for num, wire, a, b in _fields(data, *graphs[0]):
            if num == 5 and wire == 2:  # GraphProto.initializer
                raw = None
                for field, kind, start, end in _fields(data, a, b):
                    if field == 9 and kind == 2:  # TensorProto.raw_data: the last one counts
                        raw = end - start
                lengths.append(raw)
        return lengths
    except _Malformed:
        return None


def needs_external_data(model: onnx.ModelProto) -> bool:
    """Large weights, or weights still referenced from an external file, go to external data.
    Sizes come from the tensors' metadata: no weight is read or copied to decide."""
    if has_data_files(model):
        return True
    return sum(tensor_nbytes(t) for t in model.graph.initializer) > EXTERNAL_THRESHOLD


def external_region(tensor: onnx.TensorProto, base_dir: str | os.PathLike) -> tuple[Path, int, int]:
    """(file, offset, length) of an external tensor, resolved under ``base_dir`` (a weight
    left in its model file: in that file)."""
    if is_in_place(tensor):
        return in_place_region(tensor)
    info = {e.key: e.value for e in tensor.external_data}
    rel = Path(info["location"])
    if rel.is_absolute() or ".." in rel.parts:
        raise ModelLoadError(f"tensor '{tensor.name}': external data location escapes its folder")
    path = Path(base_dir) / rel
    offset = int(info.get("offset", 0) or 0)
    length = int(info["length"]) if info.get("length") else path.stat().st_size - offset
    return path, offset, length


def save_model(
    model: onnx.ModelProto,
    path: str | os.PathLike,
    *,
    external: bool | None = None,
    base_dir: str | os.PathLike | None = None,
) -> None:
    """Write ``model`` to ``path`` atomically; weights go to ``<name>.data`` when large."""
    path = Path(path)
    if external is None:
        external = needs_external_data(model)
    parent = path.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        sweep_stale(path)
        tmpdir = Path(tempfile.mkdtemp(prefix=temp_prefix(path, "tmp"), dir=parent))
    except OSError as e:
        raise ModelSaveError(f"cannot write to {parent}: {e.strerror or e}") from None
    try:
        write_model_files(model, tmpdir / path.name, external=external, base_dir=base_dir)
        items = sorted(tmpdir.iterdir(), key=lambda p: p.suffix == ".onnx")
        for item in items:  # nothing but a regular file is replaced
            check_regular_target(parent / item.name)
        for item in items:
            os.replace(item, parent / item.name)
    except OSError as e:
        raise ModelSaveError(f"cannot write {path}: {e.strerror or e}") from None
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def write_model_files(
    model: onnx.ModelProto,
    path: Path,
    *,
    external: bool,
    base_dir: str | os.PathLike | None = None,
    serialized: bytes | None = None,
    spooled: Path | None = None,
    spooled_sha256: str | None = None,
) -> dict[str, str]:
    """Serialize into ``path`` (a fresh location); external data goes to ``<name>.data`` beside
    it.  Tensors still referenced from the input's external file (``base_dir``) are copied into
    the new file in chunks, never loaded whole; the result references only its own file.
    ``serialized``: the model's own bytes when the caller has them (``model.SerializeToString()``
    of this model as it is now), written as they are when the model is written whole;
    ``spooled``: a file already holding exactly those bytes, and its ``spooled_sha256``, moved
    into place instead (copied where it is on another file system).

    Returns the sha256 of every file written (file name → hex digest), taken while writing:
    nothing needs to read the files back to know it."""
    hashes: dict[str, str] = {}
    if external:
        to_write = onnx.ModelProto()
        to_write.CopyFrom(model)
        hashes[path.name + ".data"] = _stream_external(to_write, path, base_dir)
        data = to_write.SerializeToString()
        del to_write
        hashes[path.name] = _write_hashed(path, data)
    else:
        if spooled is not None and not has_data_files(model):
            _move_file(spooled, path)
            hashes[path.name] = spooled_sha256 or file_sha256(path) or ""
            return hashes
        if has_external_data(model):
            model, serialized = _materialized(model, base_dir), None
        data = serialized if serialized is not None else serialize(model)
        if data is None:
            raise ModelSaveError(
                f"{path.name}: model is over 2 GB and cannot be saved without external data"
            )
        hashes[path.name] = _write_hashed(path, data)
    return hashes


def _move_file(src: Path, dst: Path) -> None:
    """Rename ``src`` to the fresh path ``dst`` (a copy by the kernel where they lie on different
    file systems), with the permissions a new file gets."""
    try:
        os.replace(src, dst)
    except OSError:
        with open(src, "rb") as f, open(dst, "wb") as out:
            size = os.fstat(f.fileno()).st_size
            done = _kernel_copy(f.fileno(), out.fileno(), 0, 0, size)
            f.seek(done)
            out.seek(done)
            for block in _blocks(f, size - done, f"{src.name}"):
                out.write(block)
        os.unlink(src)
    os.chmod(dst, 0o666 & ~_umask())


def _write_hashed(path: Path, data: bytes) -> str:
    """Write ``data`` into ``path``; its sha256, taken on a thread while the bytes are written
    (both let go of the GIL: BERT-base's 438 MB, 0.78x the time of one after the other)."""
    with ThreadPoolExecutor(1) as pool:
        digest = pool.submit(lambda: hashlib.sha256(data).hexdigest())
        with open(path, "wb") as f:
            f.write(data)
        return digest.result()


class _Hashing:
    """A binary file being written and the sha256 of everything written to it."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.sha = f, hashlib.sha256()

    def write(self, data: bytes) -> None:
        self.f.write(data)
        self.sha.update(data)

    def tell(self) -> int:
        return self.f.tell()

    def copy(self, src: Path, offset: int, length: int, name: str) -> None:
        """Append ``length`` bytes of ``src`` from ``offset``: copied by the kernel
        (copy_file_range: no pass through Python) while a thread hashes the same bytes, read
        back from the page cache; plain reads and writes where the kernel cannot copy."""
        self.f.flush()
        start = self.f.tell()
        with open(src, "rb") as f:
            hasher = threading.Thread(target=self._hash_region, args=(src, offset, length))
            hasher.start()
            try:
                done = _kernel_copy(f.fileno(), self.f.fileno(), offset, start, length)
            finally:
                hasher.join()
            if self._hash_error is not None:
                raise self._hash_error
            if done < length:  # the kernel copied part or none of it: the rest by hand
                f.seek(offset + done)
                self.f.seek(start + done)
                for block in _blocks(f, length - done, f"external data of '{name}'"):
                    self.f.write(block)
        self.f.seek(start + length)

    _hash_error: Exception | None = None

    def _hash_region(self, src: Path, offset: int, length: int) -> None:
        try:
            with open(src, "rb") as f:
                f.seek(offset)
                for block in _blocks(f, length, f"{src.name}: external data"):
                    self.sha.update(block)
        except (OSError, ModelSaveError) as e:
            self._hash_error = e


def _blocks(f: BinaryIO, length: int, what: str) -> Iterator[memoryview]:
    """``length`` bytes of ``f`` from where it stands, in blocks of :data:`HASH_BLOCK` read into
    one buffer (each block is valid until the next is asked for: no allocation per read);
    ModelSaveError if it ends first (``what`` names the data)."""
    buf = bytearray(min(HASH_BLOCK, length))
    view = memoryview(buf)
    while length:
        n = f.readinto(view[: min(len(buf), length)])
        if not n:
            raise ModelSaveError(f"{what} is truncated")
        yield view[:n]
        length -= n


def _kernel_copy(src_fd: int, dst_fd: int, offset: int, start: int, length: int) -> int:
    """Bytes copied by copy_file_range from ``src_fd`` at ``offset`` to ``dst_fd`` at ``start``
    (stops early where the kernel or the file system cannot, or at the source's end)."""
    copy = getattr(os, "copy_file_range", None)
    done = 0
    while copy is not None and done < length:
        try:
            n = copy(src_fd, dst_fd, length - done, offset + done, start + done)
        except OSError:
            break
        if n <= 0:
            break
        done += n
    return done


ALIGN = 4096
CHUNK = 16 << 20


def _stream_external(model: onnx.ModelProto, path: Path, base_dir) -> str:
    """Move every large or external tensor into ``<name>.data``; its sha256."""
    data_name = path.name + ".data"
    with open(path.with_name(data_name), "wb") as sink:
        out = _Hashing(sink)
        for tensor in _all_tensors(model):
            raw = b""
            if external_data_helper.uses_external_data(tensor):
                if base_dir is None:
                    raise ModelSaveError(
                        f"tensor '{tensor.name}' references external data but "
                        "the model's folder is unknown"
                    )
                src, offset, length = external_region(tensor, base_dir)
            elif tensor.HasField("raw_data") and tensor_nbytes(tensor) >= 1024:
                raw = tensor.raw_data  # one copy out of the message, not one per use
                src, offset, length = None, 0, len(raw)
            else:
                continue
            pad = (-out.tell()) % ALIGN
            out.write(b"\0" * pad)
            start = out.tell()
            if src is None:
                out.write(raw)
                del raw
                tensor.ClearField("raw_data")
            else:
                out.copy(src, offset, length, tensor.name)
            del tensor.external_data[:]
            tensor.data_location = onnx.TensorProto.EXTERNAL
            for key, value in (
                ("location", data_name),
                ("offset", str(start)),
                ("length", str(length)),
            ):
                tensor.external_data.add(key=key, value=value)
    return out.sha.hexdigest()


def _materialized(model: onnx.ModelProto, base_dir) -> onnx.ModelProto:
    """A copy whose external tensors carry their bytes inline (for small models only)."""
    if base_dir is None:
        raise ModelSaveError("the model references external data but its folder is unknown")
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for tensor in _all_tensors(copy):
        if external_data_helper.uses_external_data(tensor):
            left = is_in_place(tensor)
            src, offset, length = external_region(tensor, base_dir)
            with open(src, "rb") as f:
                f.seek(offset)
                tensor.raw_data = f.read(length)
            del tensor.external_data[:]
            if left:  # back as it was read: no data_location field
                tensor.ClearField("data_location")
            else:
                tensor.data_location = onnx.TensorProto.DEFAULT
    return copy


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# ------------------------------------------------------------------ temporaries beside outputs
# Every temporary graphopt puts beside an output is named ``.<name>.graphopt-<kind>-<pid>-<rand>``
# so that one left by a killed run (its process gone) is recognized and removed by the next run.
TEMP_KINDS = ("staging", "old", "tmp")
_TEMP_NAME = re.compile(r"\.(?P<name>.+)\.graphopt-(?P<kind>staging|old|tmp)-(?P<pid>\d+)-")


def temp_prefix(final: Path, kind: str) -> str:
    """The name prefix of a temporary of ``final`` (a sibling; see above)."""
    return f".{final.name}.graphopt-{kind}-{os.getpid()}-"


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def sweep_stale(final: Path) -> list[Path]:
    """Remove temporaries of ``final`` left by graphopt runs whose process is gone (ours only:
    our name pattern, our user).  Returns what was removed."""
    removed: list[Path] = []
    try:
        entries = list(final.parent.iterdir())
    except OSError:
        return removed
    for entry in entries:
        m = _TEMP_NAME.match(entry.name)
        if not m or m["name"] != final.name or _pid_alive(int(m["pid"])):
            continue
        try:
            if entry.lstat().st_uid != os.geteuid():
                continue
            remove_path(entry)
            removed.append(entry)
        except OSError:
            continue
    return removed


def _make_writable(func, path, _exc) -> None:
    """rmtree error handler: a read-only folder blocks deleting its entries; open it, retry."""
    parent = os.path.dirname(path)
    try:
        os.chmod(parent, os.stat(parent).st_mode | stat.S_IWUSR | stat.S_IXUSR)
        if os.path.isdir(path) and not os.path.islink(path):
            os.chmod(path, os.stat(path).st_mode | stat.S_IRWXU)
        func(path)
    except FileNotFoundError:
        pass


def remove_path(path: Path) -> None:
    """Delete a file, link or whole folder (read-only folders included); raise OSError when
    something is left."""
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
        return
    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=_make_writable)
    else:
        shutil.rmtree(path, onerror=_make_writable)
    if os.path.lexists(path):
        raise OSError(f"could not remove {path}")


def discard(path: Path) -> None:
    """Remove a temporary file or folder if it exists; a failure is a warning, never an error."""
    if os.path.lexists(path):
        try:
            remove_path(path)
        except OSError as e:
            warnings.warn(f"could not remove {path}: {e}", stacklevel=3)


def staging_dir(final: Path) -> Path:
    """A fresh directory beside ``final`` to write into, with normal (umask) permissions; stale
    staging folders of ``final`` from killed runs are removed first."""
    final.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale(final)
    staging = Path(tempfile.mkdtemp(prefix=temp_prefix(final, "staging"), dir=final.parent))
    os.chmod(staging, 0o777 & ~_umask())
    return staging


#: what a path that is not a regular file is, by its file type
_FILE_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
)


def non_regular_kind(path: str | os.PathLike) -> str | None:
    """What ``path`` (symlinks followed) is when it exists and is not a regular file (``"a
    character device"``...); None for a regular file or nothing (a dangling link: nothing)."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return None
    if stat.S_ISREG(mode):
        return None
    return next((kind for test, kind in _FILE_KINDS if test(mode)), "not a regular file")


def check_regular_target(path: str | os.PathLike, flag: str | None = None) -> None:
    """A file output may create a regular file or replace one, nothing else: anything else at
    ``path`` (symlinks followed) — a device such as /dev/null, a FIFO, a socket, a folder — is a
    UsageError naming the path and what it is (a rename would replace it)."""
    kind = non_regular_kind(path)
    if kind is not None:
        where = f"{flag} {path}" if flag else str(path)
        if os.path.islink(path):
            where += f" (a link to {os.path.realpath(path)})"
        raise UsageError(
            f"{where} is {kind}: an output file may only create or replace a regular file"
        )


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> None:
    """Call ``write`` on a temporary sibling of ``path``, then rename it into place, with normal
    permissions; the temporary never survives a failure.  ``path`` must be a regular file or
    nothing (:func:`check_regular_target`, before writing and again just before the rename)."""
    given = path
    path = Path(path).resolve()
    check_regular_target(given)
    sweep_stale(path)
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path, "tmp"), dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.chmod(tmp, 0o666 & ~_umask())
        check_regular_target(given)  # what appeared there while writing is not replaced either
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """Write a text file via a temporary sibling and a rename, with normal permissions; an
    OSError is a ModelSaveError (one line: the path and why)."""
    try:
        atomic_write(path, lambda f: f.write(text.encode()))
    except OSError as e:
        raise ModelSaveError(f"cannot write {path}: {e.strerror or e}") from None


def replace_dir(staging: Path, final: Path) -> None:
    """Move a fully written staging directory onto ``final``, replacing any old one (the caller
    has checked that the old one is ours to replace and deletable).  The old copy is moved aside
    and deleted; a copy that still cannot be deleted is a ModelSaveError naming it."""
    if not final.exists():
        os.replace(staging, final)
        return
    old = Path(tempfile.mkdtemp(prefix=temp_prefix(final, "old"), dir=final.parent))
    os.rmdir(old)
    os.replace(final, old)
    try:
        os.replace(staging, final)
    except OSError:
        os.replace(old, final)
        raise
    try:
        remove_path(old)
    except OSError as e:
        raise ModelSaveError(
            f"wrote {final}, but the previous copy moved to {old} could not be deleted ({e})"
        ) from None


# ------------------------------------------------------------------ where outputs may go
@dataclass(frozen=True)
class OutputDirKind:
    """A folder graphopt writes whole and may replace: recognized by a marker file carrying a
    schema, and holding only entries matching ``owned`` (fnmatch patterns of relative paths)."""

    what: str
    marker: str
    schema: str
    owned: tuple[str, ...]


def _resolved(path: Path) -> Path:
    """``path`` absolute, symlinks followed (as far as they go: a loop is left as it is)."""
    try:
        return Path(os.path.abspath(path)).resolve()
    except (OSError, RuntimeError):  # a symlink loop
        return Path(os.path.realpath(os.path.abspath(path)))


def _check_parents(path: Path, flag: str) -> None:
    """The nearest existing ancestor must be a writable folder."""
    for parent in path.parents:
        if os.path.lexists(parent):
            if not parent.is_dir():
                raise UsageError(f"{flag} {path}: {parent} is not a directory")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise ModelSaveError(f"{flag} {path}: cannot write to {parent} (permission denied)")
            return


#: what a temporary's name adds to its output's: ``.`` NAME ``.graphopt-staging-PID-`` and
#: mkdtemp's 8 characters (a pid of up to 7 digits)
TEMP_NAME_OVERHEAD = len(".") + len(".graphopt-staging-") + 7 + len("-") + 8


def _name_max(path: Path) -> tuple[int, int]:
    """(longest file name, longest path) the file system holding ``path`` (its nearest existing
    ancestor) allows; 255 and 4096 where it does not say."""
    for parent in path.parents:
        if os.path.isdir(parent):
            try:
                return os.pathconf(parent, "PC_NAME_MAX"), os.pathconf(parent, "PC_PATH_MAX")
            except (OSError, ValueError):
                break
    return 255, 4096


def _check_name_length(path: Path, flag: str) -> None:
    """An output's path that the file system cannot hold is a UsageError (one line, not
    ENAMETOOLONG when it is written): every part at most the longest name it allows, the last
    part short enough for its temporaries' names, the whole at most its longest path."""
    name_max, path_max = _name_max(path)
    for part in path.parts[1:-1]:
        if len(os.fsencode(part)) > name_max:
            raise UsageError(
                f"{flag}: the folder name {part[:40]}... is {len(os.fsencode(part))} bytes, "
                f"more than the {name_max} this file system allows"
            )
    size, room = len(os.fsencode(path.name)), name_max - TEMP_NAME_OVERHEAD
    if size > room:
        raise UsageError(
            f"{flag}: the name {path.name[:40]}... is {size} bytes; an output's name may be at "
            f"most {room} (this file system allows {name_max}, and its temporaries add "
            f"{TEMP_NAME_OVERHEAD})"
        )
    if len(os.fsencode(str(path))) >= path_max:
        raise UsageError(
            f"{flag}: the path is {len(os.fsencode(str(path)))} bytes, more than the "
            f"{path_max - 1} this file system allows"
        )


def _is_kind(path: Path, kind: OutputDirKind) -> bool:
    try:
        data = json.loads((path / kind.marker).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("schema") == kind.schema


def _foreign_entries(path: Path, kind: OutputDirKind) -> list[str]:
    foreign: list[str] = []
    for root, dirs, files in os.walk(path):
        for name in sorted(dirs) + sorted(files):
            rel = Path(root, name).relative_to(path).as_posix()
            if not any(fnmatch.fnmatchcase(rel, pat) for pat in kind.owned):
                foreign.append(rel)
        dirs[:] = [d for d in dirs if not Path(root, d).is_symlink()]
    return foreign


def _unwritable_dirs(path: Path) -> list[str]:
    """Folders whose entries we could not delete: not writable and not ours to chmod."""
    found = [path] + [Path(root, d) for root, dirs, _files in os.walk(path) for d in dirs]
    return [
        str(d)
        for d in found
        if not d.is_symlink()
        and not os.access(d, os.W_OK | os.X_OK)
        and d.stat().st_uid != os.geteuid()
    ]


def check_output_dir(
    dest: Path, kind: OutputDirKind, protected: Sequence[Path] = (), flag: str = "-o"
) -> Path:
    """Where a ``kind`` folder may be written: returns ``dest`` resolved (through a symlink).

    Refused (UsageError): a path under a regular file, a dangling link, a folder that would
    contain or be one of the ``protected`` files (the input model, its external data), an
    existing file, and an existing non-empty folder that is not a ``kind`` folder or that holds
    anything such a folder does not write (which replacing it would delete)."""
    dest = Path(os.path.abspath(dest))
    _check_name_length(dest, flag)
    if dest.is_symlink() and not dest.exists():
        raise UsageError(f"{flag} {dest}: a dangling symbolic link")
    real = _resolved(dest)
    _check_parents(real, flag)
    _check_name_length(real, flag)  # where the link leads
    for p in protected:
        rp = _resolved(p)
        if rp == real or real in rp.parents:
            raise UsageError(f"output directory {real} would contain or replace the input {rp}")
    if not os.path.lexists(real):
        return real
    if not real.is_dir():
        raise UsageError(f"output {real} exists and is not a directory")
    if not any(real.iterdir()):
        return real
    if not _is_kind(real, kind):
        raise UsageError(
            f"output directory {real} exists and is not a {kind.what} (no {kind.marker} with "
            f"schema {kind.schema}); refusing to replace it"
        )
    foreign = _foreign_entries(real, kind)
    if foreign:
        more = f" (+{len(foreign) - 3} more)" if len(foreign) > 3 else ""
        shown = ", ".join(foreign[:3]) + more
        raise UsageError(
            f"output directory {real} is a {kind.what} but also holds files graphopt did not "
            f"write ({shown}); refusing to replace it"
        )
    unwritable = _unwritable_dirs(real)
    if unwritable:
        raise ModelSaveError(f"cannot replace {real}: {unwritable[0]} is not writable")
    return real


def external_data_files(model_path: Path) -> list[Path]:
    """The external-data files a model file references, read without loading the weights: a
    file :func:`load_model` read, unchanged since, is not read again; a file larger than
    :data:`SCAN_ABOVE` (its inline weights) is scanned, its weights never read; a smaller one is
    parsed."""
    key = _file_key(model_path)
    if key is not None and key in _EXTERNAL_FILES:
        return list(_EXTERNAL_FILES[key])
    if key is not None and key[1] <= SCAN_ABOVE and not _mentions(model_path, b"location"):
        return []  # every external reference holds the key "location": none in the file
    if key is not None and key[1] > SCAN_ABOVE:
        try:
            return _located(external_locations(model_path), model_path)
        except (OSError, ValueError, _Malformed):
            pass  # parsed below, which reports nothing for a file that is not a model
    try:
        proto = onnx.load_model(str(model_path), load_external_data=False)
    except Exception:  # noqa: BLE001 - unreadable models are reported by load_model
        return []
    return _referenced_files(proto, model_path)


def _mentions(path: Path, word: bytes, chunk: int = 1 << 20) -> bool:
    """Whether the bytes ``word`` occur in the file (True when it cannot be read).  Read in
    chunks, not mapped: the pages of a map would count in the process's memory."""
    try:
        with open(path, "rb", buffering=0) as f:
            tail = b""
            while block := f.read(chunk):
                if word in tail + block[: len(word) - 1] or word in block:
                    return True
                tail = block[-(len(word) - 1) :]
    except OSError:
        return True
    return False


#: files above this size are scanned for external references rather than parsed: protobuf
#: parses a small file faster than a Python scan walks it; a large file is mostly weights,
#: which a scan skips and a parse copies
SCAN_ABOVE = 64 << 20


def external_locations(model_path: str | os.PathLike) -> list[str]:
    """The ``location`` of every tensor the model file stores externally (initializers, Constant
    and other tensor attributes, in subgraphs and functions too), read from the protobuf field
    headers of a memory map: the pages of the weights skipped are never read.  Raises
    _Malformed on bytes that are not a protobuf message."""
    with open(model_path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return []
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            found: list[str] = []
            _scan_message(buf, 0, len(buf), _MODEL, found)
            return found


#: the fields that lead to tensors, per message kind: field number → the kind it holds
_MODEL, _GRAPH, _FUNCTION, _NODE, _ATTRIBUTE, _TENSOR = range(6)
_LEADS = {
    _MODEL: {7: _GRAPH, 25: _FUNCTION},  # ModelProto.graph, .functions
    _GRAPH: {1: _NODE, 5: _TENSOR},  # GraphProto.node, .initializer
    _FUNCTION: {7: _NODE},  # FunctionProto.node
    _NODE: {5: _ATTRIBUTE},  # NodeProto.attribute
    _ATTRIBUTE: {5: _TENSOR, 10: _TENSOR, 6: _GRAPH, 11: _GRAPH},  # .t, .tensors, .g, .graphs
}


def _scan_message(buf, start: int, end: int, kind: int, found: list[str]) -> None:
    if kind == _TENSOR:
        location = _external_location(buf, start, end)
        if location:
            found.append(location)
        return
    leads = _LEADS[kind]
    for num, wire, a, b in _fields(buf, start, end):
        if wire == 2 and num in leads:
            _scan_message(buf, a, b, leads[num], found)


def _external_location(buf, start: int, end: int) -> str | None:
    """A TensorProto's external location, as :func:`_referenced_files` reads it from a parsed
    one: stored externally (data_location, field 14), the last ``location`` entry (field 13)."""
    external, location = False, None
    for num, wire, a, b in _fields(buf, start, end):
        if num == 14 and wire == 0:
            external = a == onnx.TensorProto.EXTERNAL
        elif num == 13 and wire == 2:
            key, value = "", ""
            for field, kind, p, q in _fields(buf, a, b):
                if kind == 2 and field in (1, 2):
                    text = bytes(buf[p:q]).decode("utf-8", "surrogateescape")
                    key, value = (text, value) if field == 1 else (key, text)
            if key == "location":
                location = value
    return location if external else None


def _located(locations: list[str], model_path: Path) -> list[Path]:
    base = _resolved(model_path).parent
    return sorted({_resolved(base / loc) for loc in locations if loc})


class _Malformed(ValueError):
    """Bytes that are not a well-formed protobuf message."""


def _varint(buf, i: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= end or shift > 63:
            raise _Malformed("truncated varint")
        byte = buf[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i
        shift += 7


def _spans(buf, start: int, end: int):
    """(field number, wire type, where its tag starts, a, where it ends) of each field of the
    message in ``buf[start:end]``: a length-delimited field's bytes at ``buf[a:end]``, a varint's
    value in ``a``, a fixed-width field's bytes at ``buf[a:end]``."""
    i = start
    while i < end:
        tag = i
        key, i = _varint(buf, i, end)
        num, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i, end)
            yield num, wire, tag, value, i
        elif wire == 2:
            length, i = _varint(buf, i, end)
            a, i = i, i + length
            if i > end:
                raise _Malformed("field past the end of its message")
            yield num, wire, tag, a, i
        elif wire in (1, 5):
            a, i = i, i + (8 if wire == 1 else 4)
            if i > end:
                raise _Malformed("field past the end of its message")
            yield num, wire, tag, a, i
        else:
            raise _Malformed(f"wire type {wire}")
    if i != end:
        raise _Malformed("field past the end of its message")


def _fields(buf, start: int, end: int):
    """(field number, wire type, a, b) of each field of the message in ``buf[start:end]``: a
    varint's value in ``a``; a length-delimited field's bytes at ``buf[a:b]`` (not read);
    fixed-width fields are skipped (see :func:`_spans`)."""
    for num, wire, _tag, a, b in _spans(buf, start, end):
        if wire in (0, 2):
            yield num, wire, a, b


#: (resolved path, size, mtime) of a model file → the external-data files it references
_EXTERNAL_FILES: dict[tuple, list[Path]] = {}


def _file_key(path: Path) -> tuple | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (_resolved(path), st.st_size, st.st_mtime_ns, st.st_ino)


def _referenced_files(proto: onnx.ModelProto, model_path: Path) -> list[Path]:
    locations = [
        _location(tensor)
        for tensor in _all_tensors(proto)
        if external_data_helper.uses_external_data(tensor)
    ]
    return _located(locations, model_path)


def _location(tensor: onnx.TensorProto) -> str:
    return {e.key: e.value for e in tensor.external_data}.get("location", "")


def check_side_outputs(
    outputs: dict[str, str | os.PathLike | None],
    *,
    models: Sequence[Path] = (),
    files: Sequence[Path] = (),
    dirs: Sequence[Path] = (),
) -> None:
    """Refuse (UsageError) any file output (``{flag: path}``) that resolves, symlinks followed,
    to one of the input ``models`` or their external-data files, to one of the other input
    ``files``, to a path inside one of ``dirs`` (the output folder being written, an input
    bundle), or to another output; or that lies under a regular file; or whose path holds
    anything but a regular file (a device, FIFO, socket or folder: :func:`check_regular_target`)."""
    seen: dict[Path, str] = {}
    ext_cache: dict[Path, list[Path]] = {}
    for flag, given in outputs.items():
        if given is None:
            continue
        path = Path(given)
        _check_name_length(Path(os.path.abspath(path)), flag)
        real = _resolved(path)
        _check_parents(real, flag)
        _check_name_length(real, flag)  # where a link leads
        check_regular_target(path, flag)
        if real in seen:
            raise UsageError(f"{flag} {path}: the same file as {seen[real]}")
        seen[real] = flag
        for d in dirs:
            rd = _resolved(d)
            if real == rd or rd in real.parents:
                raise UsageError(f"{flag} {path}: inside {rd}, which graphopt reads or writes")
        for f in list(models) + list(files):
            if real == _resolved(f) or _same_file(real, f):
                raise UsageError(f"{flag} {path}: would overwrite the input {f}")
        for m in models:
            rm = _resolved(m)
            if not os.path.lexists(real) or rm.parent not in real.parents:
                continue  # external data must exist, inside the model's folder
            ext = ext_cache.setdefault(rm, external_data_files(rm))
            if real in ext:
                raise UsageError(f"{flag} {path}: would overwrite external data of the input {m}")


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
