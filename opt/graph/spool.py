"""A model written whole to a file one weight at a time, and loaded back from that file.

The validity check has to serialize the optimized model (onnxruntime loads bytes or a file) and
the bundle has to write it: :func:`spool` does both at once.  It writes the very bytes of
``model.SerializeToString()`` into a fresh file, but builds them piece by piece: each top-level
field alone, each initializer alone, so that at most the largest weight is ever copied in memory
(BERT-base: 438 MB written, ~90 MB held; and faster than one whole-message serialization, which
grows one 438 MB buffer).  The file is hashed while it is written and the place of every
initializer's raw bytes in it is recorded, so that onnxruntime can load the model from a skeleton
whose weights are external data pointing into the spooled file (:func:`session_skeleton`): the
pages stay in the page cache, mapped, not copied (session creation 0.04 s and +10 MB instead of
0.7 s and +650 MB on BERT-base).  The bundle then moves the file into place.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import onnx
from google.protobuf import unknown_fields

from ..errors import ModelSaveError
from .io import (
    PROTOBUF_LIMIT,
    STANDIN_BYTES,
    _all_tensors,
    _copy_field,
    _fields,
    _is_repeated,
    _Malformed,
    copy_with_initializers,
    copy_without_data,
    has_data_files,
    in_place_region,
    is_in_place,
    remove_path,
    temp_prefix,
)

#: wire-format tags: ModelProto.graph (7), GraphProto.initializer (5), both length-delimited
_GRAPH_TAG = bytes([7 << 3 | 2])
_INITIALIZER_TAG = bytes([5 << 3 | 2])
_RAW_DATA = 9  # TensorProto.raw_data
_RAW_TAG = bytes([_RAW_DATA << 3 | 2])
#: what makes a weight left in its model file a reference: not written (it is written inline)
_REFERENCE_FIELDS = ("external_data", "data_location")
#: bytes written (and hashed, on a thread) at a time
SLICE = 16 << 20
#: pieces smaller than this are hashed where they are written: handing each of a model's many
#: small fields and tensors to the hashing thread costs more than hashing it (ESRGAN, 2472
#: pieces: 0.2 s of spooling, 0.1 s of it waiting on the thread)
INLINE_HASH = 1 << 20
#: bytes of a weight left in its model file copied at a time, through two buffers used in turn
#: (one being hashed on the thread while the other is read): no allocation per read.  A read of
#: many MiB each time (a fresh mapping, still held by the hashing thread while the next is
#: read) raised BERT-base's `--no-check` peak by 32 MB
COPY_BLOCK = 2 << 20


@dataclass
class Spooled:
    """A model written whole into ``path``: the file's sha256 and size, and where the raw bytes
    of each top-level initializer lie in it (``(offset, length)``, or None where it has none)."""

    path: Path
    sha256: str
    size: int
    spans: list[tuple[int, int] | None] = field(default_factory=list)

    def raw_lengths(self) -> list[int | None]:
        return [None if s is None else s[1] for s in self.spans]


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _alone(cls, desc, value) -> bytes:
    """The wire bytes of one field of a message: a message of ``cls`` holding only it."""
    holder = cls()
    _copy_field(holder, desc, value)
    return holder.SerializeToString()


def _unknown(message) -> bool:
    return len(unknown_fields.UnknownFieldSet(message)) > 0


def _pieces(model: onnx.ModelProto):
    """(model fields before the graph, graph fields before the initializers, initializers,
    graph fields after them, model fields after the graph), each field as its wire bytes; None
    when the model cannot be written piece by piece (no graph, unknown fields, external data)."""
    if not model.HasField("graph") or has_data_files(model):
        return None
    if _unknown(model) or _unknown(model.graph):
        return None  # serialized after the known fields: not where a piece would put them
    if sum(map(is_in_place, _all_tensors(model))) != sum(map(is_in_place, model.graph.initializer)):
        return None  # a weight left in its file moved into a node or subgraph: not a piece
    before, after, seen = [], [], False
    for desc, value in model.ListFields():  # in field-number order, as they are serialized
        if desc.name == "graph":
            seen = True
        else:
            (after if seen else before).append(_alone(onnx.ModelProto, desc, value))
    g_before, g_after, tensors = [], [], None
    for desc, value in model.graph.ListFields():
        if desc.name == "initializer":
            tensors = list(value)
        else:
            (g_after if tensors is not None else g_before).append(
                _alone(onnx.GraphProto, desc, value)
            )
    return before, g_before, tensors or [], g_after, after


def spool(model: onnx.ModelProto, directory: str | os.PathLike) -> Spooled | None:
    """Write ``model`` whole into a fresh file in ``directory``, one piece at a time (see the
    module docstring); None, and nothing left behind, when it cannot be written that way (over
    2 GiB, external data, unknown fields): the caller serializes it whole instead."""
    parts = _pieces(model)
    if parts is None:
        return None
    before, g_before, tensors, g_after, after = parts
    splits = [_split(t) for t in tensors]
    sizes = [_split_size(t, split) for t, split in zip(tensors, splits)]
    graph_len = (
        sum(map(len, g_before))
        + sum(map(len, g_after))
        + sum(1 + len(_varint(n)) + n for n in sizes)
    )
    head = b"".join(before) + _GRAPH_TAG + _varint(graph_len) + b"".join(g_before)
    total = len(head) + graph_len - sum(map(len, g_before)) + sum(map(len, after))
    if total > PROTOBUF_LIMIT:
        return None
    try:
        fd, name = tempfile.mkstemp(prefix="model-", suffix=".onnx", dir=directory)
    except OSError as e:
        raise _cannot_write(directory, e) from None
    path = Path(name)
    sha = hashlib.sha256()
    spans: list[tuple[int, int] | None] = []
    buffers, turn = (bytearray(COPY_BLOCK), bytearray(COPY_BLOCK)), 0
    try:
        with os.fdopen(fd, "wb") as f, ThreadPoolExecutor(1) as hasher:
            pending = None

            def emit(chunk: bytes | memoryview) -> int:
                nonlocal pending
                view = memoryview(chunk)
                for start in range(0, len(view), SLICE):
                    piece = view[start : start + SLICE]
                    f.write(piece)
                    if pending is not None:
                        pending.result()  # one slice hashed behind the one written
                        pending = None
                    if len(piece) < INLINE_HASH:
                        sha.update(piece)
                        continue
                    if start + SLICE >= len(view) > SLICE:
                        piece = bytes(piece)  # the last slice of a weight, so it can go
                    pending = hasher.submit(sha.update, piece)
                return len(view)

            offset = emit(head)
            for tensor, split, size in zip(tensors, splits, sizes):
                offset += emit(_INITIALIZER_TAG + _varint(size))
                start, span = offset, None
                if split is None:  # written whole: its raw bytes found by their header
                    data = tensor.SerializeToString()
                    span = _raw_span(data, offset)
                    offset += emit(data)
                    del data
                else:
                    fields_before, _, fields_after = split
                    offset += emit(fields_before)
                    if is_in_place(tensor):  # from the model file it was left in
                        src, at, length = in_place_region(tensor)
                        offset += emit(_RAW_TAG + _varint(length))
                        span = (offset, length)
                        with open(src, "rb", buffering=0) as source:
                            source.seek(at)
                            while length:
                                # the other buffer's bytes may still be hashing: emit waits
                                # for one slice's hash only once the next is written
                                block = memoryview(buffers[turn])[: min(COPY_BLOCK, length)]
                                n = source.readinto(block)
                                if not n:
                                    raise _Malformed(f"'{src.name}' is shorter than it was")
                                offset += emit(block[:n])
                                length -= n
                                turn ^= 1
                    elif tensor.HasField("raw_data"):
                        data = tensor.raw_data  # out of the message once, for the file
                        offset += emit(_RAW_TAG + _varint(len(data)))
                        span = (offset, len(data))
                        offset += emit(data)
                        del data
                    offset += emit(fields_after)
                spans.append(span)
                if offset - start != size:
                    raise _Malformed(f"tensor '{tensor.name}' is not the size it said")
            for chunk in (*g_after, *after):
                offset += emit(chunk)
            if pending is not None:
                pending.result()
        if offset != total:
            raise _Malformed("the pieces do not add up to the model")
    except _Malformed:
        remove_path(path)
        return None  # the caller serializes the model whole
    except OSError as e:  # a full disk, a folder gone: nothing is left half-written
        remove_path(path)
        raise _cannot_write(directory, e) from None
    except BaseException:
        remove_path(path)
        raise
    return Spooled(path, sha.hexdigest(), total, spans)


def _split(tensor: onnx.TensorProto) -> tuple[bytes, int | None, bytes] | None:
    """(the wire bytes of a tensor's fields before raw_data, the length of its raw bytes or
    None, the wire bytes of its fields after it); None where it holds fields this onnx does not
    know.  The raw bytes are copied out of the message only to be measured: asking the message
    its ByteSize() would encode it whole into a growing buffer, twice the weight's size."""
    if _unknown(tensor):
        return None
    in_place = is_in_place(tensor)
    before, after = onnx.TensorProto(), onnx.TensorProto()
    for desc in tensor.DESCRIPTOR.fields:  # raw_data is never read by a walk of its fields
        if desc.number == _RAW_DATA or (in_place and desc.name in _REFERENCE_FIELDS):
            continue
        holder = before if desc.number < _RAW_DATA else after
        if _is_repeated(desc):
            if len(value := getattr(tensor, desc.name)):
                getattr(holder, desc.name).extend(value)
        elif tensor.HasField(desc.name):
            _copy_field(holder, desc, getattr(tensor, desc.name))
    if in_place:  # its bytes, written inline as they were read
        raw = in_place_region(tensor)[2]
    else:
        raw = len(tensor.raw_data) if tensor.HasField("raw_data") else None
    return before.SerializeToString(), raw, after.SerializeToString()


def _split_size(tensor: onnx.TensorProto, split) -> int:
    if split is None:
        return tensor.ByteSize()
    head, raw, tail = split
    return len(head) + (0 if raw is None else 1 + len(_varint(raw)) + raw) + len(tail)


def _cannot_write(directory, error: OSError) -> ModelSaveError:
    return ModelSaveError(
        f"cannot write the optimized model in {directory}: {error.strerror or error}"
    )


def _raw_span(data: bytes, offset: int) -> tuple[int, int] | None:
    """Where the raw bytes of the tensor serialized as ``data`` lie once ``data`` is written at
    ``offset`` (the last raw_data field counts, as for a parser), or None."""
    span = None
    for num, wire, a, b in _fields(data, 0, len(data)):
        if num == _RAW_DATA and wire == 2:
            span = (offset + a, b - a)
    return span


def session_skeleton(model: onnx.ModelProto, spooled: Spooled) -> onnx.ModelProto:
    """A copy of ``model`` (which was spooled) whose top-level initializers of at least
    :data:`~graphopt.opt.graph.io.STANDIN_BYTES` raw bytes are external data in the spooled file: an
    onnxruntime session made from it with the file's folder as its external-data folder loads
    exactly the model written, its weights mapped from the file."""
    location = spooled.path.name

    def put(i: int, tensor: onnx.TensorProto, initializers) -> None:
        span = spooled.spans[i]
        if span is None or span[1] < STANDIN_BYTES:
            initializers.append(tensor)
            return
        ref = initializers.add()
        copy_without_data(tensor, ref)
        ref.data_location = onnx.TensorProto.EXTERNAL
        offset, length = span
        for key, text in (("location", location), ("offset", str(offset)), ("length", str(length))):
            ref.external_data.add(key=key, value=text)

    return copy_with_initializers(model, put)


def _remove_spool(path: Path, made: tuple[Path, ...]) -> None:
    remove_path(path)
    _remove_empty(made)


def _remove_empty(folders: tuple[Path, ...]) -> None:
    """Remove ``folders`` (deepest first) that are still empty."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:  # not empty (the output was written there), or gone
            return


class SpoolDir:
    """A private folder for spooled models, removed with what is left in it on :meth:`cleanup`,
    at the end of a ``with`` block, when this object is collected or when the process exits;
    ``parent``: where it is made, default the system's temporary folder."""

    def __init__(
        self,
        parent: str | os.PathLike | None = None,
        prefix: str = "graphopt-spool-",
        made: tuple[Path, ...] = (),
    ):
        self.path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
        self._finalizer = weakref.finalize(self, _remove_spool, self.path, made)

    @classmethod
    def beside(cls, final: str | os.PathLike) -> SpoolDir:
        """A folder beside the output ``final`` (named as that output's temporaries, so that a
        killed run's is swept by the next write of it): the bundle renames the spooled model
        into place, on the same file system (not a copy from the temporary folder's).  The
        output's missing parent folders are made for it, as writing the output makes them,
        and removed again on cleanup while they are empty.  In the temporary folder where
        one cannot be made there."""
        final = Path(final).absolute()
        made = tuple(p for p in final.parents if not os.path.lexists(p))
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            return cls(final.parent, temp_prefix(final, "tmp"), made)
        except OSError:
            _remove_empty(made)
            return cls()

    def cleanup(self) -> None:
        self._finalizer()

    def __enter__(self) -> SpoolDir:
        return self

    def __exit__(self, *_exc) -> None:
        self.cleanup()
