"""Loading, validating and atomically saving ONNX models, external data included.

Loading refuses, with one clear line, anything that is not a usable model: missing, empty,
truncated or non-ONNX files, external-data references that escape the model's directory
(absolute paths, ``..``, symlinks pointing outside) or point past the end of their file.
Saving never leaves a half-written file: everything goes to a temporary sibling first and is
renamed into place, and the input model is never written to.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError
from onnx import external_data_helper

from .compat import accept_on_load
from .errors import ModelLoadError, ModelSaveError

# Protobuf cannot serialize a message of 2 GiB or more; stay well below when deciding.
PROTOBUF_LIMIT = 2**31 - 1
EXTERNAL_THRESHOLD = 1_800_000_000


def load_model(
    path: str | os.PathLike, *, check: bool = True, lazy_external: bool = False
) -> onnx.ModelProto:
    """Read and validate a model file, with its external data resolved safely.

    With ``lazy_external`` the external data is validated but not read: the tensors keep their
    references (relative to the model's directory, which the caller passes on as ``base_dir``)
    and are memory-mapped only when a pass needs their values.
    """
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file")
    if path.is_dir():
        raise ModelLoadError(f"{path}: is a directory, expected an .onnx file")
    size = path.stat().st_size
    if size == 0:
        raise ModelLoadError(f"{path}: empty file, not an ONNX model")
    try:
        with open(path, "rb") as f:
            model = onnx.load_model_from_string(f.read())
    except (DecodeError, RuntimeError, ValueError) as e:
        raise ModelLoadError(
            f"{path}: not a valid ONNX model (protobuf parse failed: {e})"
        ) from None
    _check_structure(model, path)
    base = path.resolve().parent
    _check_external_data(model, base, path)
    if has_external_data(model) and not lazy_external:
        external_data_helper.load_external_data_for_model(model, str(base))
    accept_on_load(model)  # in memory: what onnxruntime runs and onnx's checker refuses
    if check:
        validate(model, path, by_path=has_external_data(model))
    return model


def validate(
    model: onnx.ModelProto, path: str | os.PathLike = "<model>", *, by_path: bool = False
) -> None:
    """onnx.checker on the model (on its file when external data must resolve beside it);
    raise ModelLoadError with the checker's first line."""
    try:
        if by_path:
            onnx.checker.check_model(str(path))
        elif model.ByteSize() < PROTOBUF_LIMIT:
            onnx.checker.check_model(model)
    except onnx.checker.ValidationError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(f"{path}: invalid ONNX model: {first}") from None


def _check_structure(model: onnx.ModelProto, path: Path) -> None:
    """Protobuf parses many random byte strings; require what every real model has."""
    if model.ir_version <= 0 or not model.HasField("graph"):
        raise ModelLoadError(f"{path}: not an ONNX model (no ir_version or graph)")
    if not model.opset_import:
        raise ModelLoadError(f"{path}: not an ONNX model (no opset_import)")
    newest = onnx.defs.onnx_opset_version()
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx") and imp.version > newest:
            raise ModelLoadError(
                f"{path}: default-domain opset {imp.version} is newer than this onnx supports "
                f"(up to {newest}); upgrade onnx/onnxruntime or re-export at a released opset"
            )
    if model.ir_version > onnx.IR_VERSION + 2:
        raise ModelLoadError(
            f"{path}: IR version {model.ir_version} is newer than this onnx supports "
            f"({onnx.IR_VERSION}); upgrade onnx or re-export the model"
        )


def _all_tensors(model: onnx.ModelProto):
    yield from external_data_helper._get_all_tensors(model)


def _check_external_data(model: onnx.ModelProto, base: Path, path: Path) -> None:
    """Every external reference must stay inside the model's directory and fit its file."""
    for tensor in _all_tensors(model):
        if not external_data_helper.uses_external_data(tensor):
            continue
        info = {e.key: e.value for e in tensor.external_data}
        location = info.get("location", "")
        if not location:
            raise ModelLoadError(
                f"{path}: tensor '{tensor.name}' has external data without a location"
            )
        rel = Path(location)
        if rel.is_absolute() or ".." in rel.parts:
            raise ModelLoadError(
                f"{path}: tensor '{tensor.name}' external data location '{location}' escapes the "
                "model directory (absolute paths and '..' are refused)"
            )
        target = (base / rel).resolve()
        if base not in target.parents:
            raise ModelLoadError(
                f"{path}: tensor '{tensor.name}' external data '{location}' resolves outside the "
                "model directory (symlink?)"
            )
        if not target.is_file():
            raise ModelLoadError(
                f"{path}: external data file '{location}' for tensor '{tensor.name}' is missing"
            )
        offset = int(info.get("offset", 0) or 0)
        length = info.get("length")
        end = offset + (int(length) if length else 0)
        if end > target.stat().st_size:
            raise ModelLoadError(
                f"{path}: external data for tensor '{tensor.name}' ends at byte {end} but "
                f"'{location}' has only {target.stat().st_size} bytes (truncated?)"
            )


def has_external_data(model: onnx.ModelProto) -> bool:
    return any(external_data_helper.uses_external_data(t) for t in _all_tensors(model))


def needs_external_data(model: onnx.ModelProto) -> bool:
    """Large weights, or weights still referenced from an external file, go to external data."""
    total = sum(len(t.raw_data) for t in model.graph.initializer)
    return total > EXTERNAL_THRESHOLD or has_external_data(model)


def external_region(tensor: onnx.TensorProto, base_dir: str | os.PathLike) -> tuple[Path, int, int]:
    """(file, offset, length) of an external tensor, resolved under ``base_dir``."""
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
        tmpdir = Path(tempfile.mkdtemp(prefix=".graphopt-", dir=parent))
    except OSError as e:
        raise ModelSaveError(f"cannot write to {parent}: {e.strerror or e}") from None
    try:
        write_model_files(model, tmpdir / path.name, external=external, base_dir=base_dir)
        for item in sorted(tmpdir.iterdir(), key=lambda p: p.suffix == ".onnx"):
            os.replace(item, parent / item.name)
    except OSError as e:
        raise ModelSaveError(f"cannot write {path}: {e.strerror or e}") from None
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def write_model_files(
    model: onnx.ModelProto, path: Path, *, external: bool, base_dir: str | os.PathLike | None = None
) -> None:
    """Serialize into ``path`` (a fresh location); external data goes to ``<name>.data`` beside
    it.  Tensors still referenced from the input's external file (``base_dir``) are copied into
    the new file in chunks, never loaded whole; the result references only its own file."""
    if external:
        to_write = onnx.ModelProto()
        to_write.CopyFrom(model)
        _stream_external(to_write, path, base_dir)
        with open(path, "wb") as f:
            f.write(to_write.SerializeToString())
    else:
        if has_external_data(model):
            model = _materialized(model, base_dir)
        if model.ByteSize() > PROTOBUF_LIMIT:
            raise ModelSaveError(
                f"{path.name}: model is over 2 GB and cannot be saved without external data"
            )
        with open(path, "wb") as f:
            f.write(model.SerializeToString())


ALIGN = 4096
CHUNK = 16 << 20


def _stream_external(model: onnx.ModelProto, path: Path, base_dir) -> None:
    data_name = path.name + ".data"
    with open(path.with_name(data_name), "wb") as out:
        for tensor in _all_tensors(model):
            if external_data_helper.uses_external_data(tensor):
                if base_dir is None:
                    raise ModelSaveError(
                        f"tensor '{tensor.name}' references external data but "
                        "the model's folder is unknown"
                    )
                src, offset, length = external_region(tensor, base_dir)
            elif tensor.HasField("raw_data") and len(tensor.raw_data) >= 1024:
                src, offset, length = None, 0, len(tensor.raw_data)
            else:
                continue
            pad = (-out.tell()) % ALIGN
            out.write(b"\0" * pad)
            start = out.tell()
            if src is None:
                out.write(tensor.raw_data)
                tensor.ClearField("raw_data")
            else:
                with open(src, "rb") as f:
                    f.seek(offset)
                    left = length
                    while left:
                        block = f.read(min(CHUNK, left))
                        if not block:
                            raise ModelSaveError(f"external data of '{tensor.name}' is truncated")
                        out.write(block)
                        left -= len(block)
            del tensor.external_data[:]
            tensor.data_location = onnx.TensorProto.EXTERNAL
            for key, value in (
                ("location", data_name),
                ("offset", str(start)),
                ("length", str(length)),
            ):
                tensor.external_data.add(key=key, value=value)


def _materialized(model: onnx.ModelProto, base_dir) -> onnx.ModelProto:
    """A copy whose external tensors carry their bytes inline (for small models only)."""
    if base_dir is None:
        raise ModelSaveError("the model references external data but its folder is unknown")
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for tensor in _all_tensors(copy):
        if external_data_helper.uses_external_data(tensor):
            src, offset, length = external_region(tensor, base_dir)
            with open(src, "rb") as f:
                f.seek(offset)
                tensor.raw_data = f.read(length)
            del tensor.external_data[:]
            tensor.data_location = onnx.TensorProto.DEFAULT
    return copy


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def staging_dir(final: Path) -> Path:
    """A fresh directory beside ``final`` to write into, with normal (umask) permissions."""
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    os.chmod(staging, 0o777 & ~_umask())
    return staging


def atomic_write_text(path: Path, text: str) -> None:
    """Write a text file via a temporary sibling and a rename, with normal permissions."""
    path = Path(path).resolve()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def replace_dir(staging: Path, final: Path) -> None:
    """Move a fully written staging directory onto ``final``, replacing any old one."""
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, old)
    os.replace(staging, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
