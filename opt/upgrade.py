"""Opset upgrade before optimizing (``--opset N``).

Some fusions exist as standard ops only in newer opsets: RMSNormalization (23), Gelu (20),
LayerNormalization (17), Attention (23).  A model exported at an older opset can be lifted with
onnx's version converter first; the converted model is what the pipeline optimizes, while parity
still compares the result with the original file, so a faulty conversion fails the run like a
faulty rewrite would.  Only the default domain moves; the model is never downgraded.
"""

from __future__ import annotations

import onnx
from onnx import version_converter

from .errors import UsageError


def default_opset(model: onnx.ModelProto) -> int:
    return next((i.version for i in model.opset_import if i.domain in ("", "ai.onnx")), 1)


def upgrade_opset(model: onnx.ModelProto, version: int) -> tuple[onnx.ModelProto, int]:
    """``model`` converted to default-domain opset ``version``, and the opset it had before.

    The input is not modified.  Raises UsageError for a downgrade, an opset newer than the
    installed onnx knows, or a model the converter cannot lift.
    """
    before = default_opset(model)
    newest = onnx.defs.onnx_opset_version()
    if version > newest:
        raise UsageError(f"--opset {version}: the installed onnx knows opsets up to {newest}")
    if version < before:
        raise UsageError(
            f"--opset {version} is below the model's opset {before}; graphopt does not downgrade"
        )
    if version == before:
        return model, before
    try:
        converted = version_converter.convert_version(model, version)
    except Exception as e:  # the converter raises RuntimeError / ValidationError / C++ errors
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(
            f"cannot upgrade the model from opset {before} to {version}: {first}"
        ) from None
    return converted, before
