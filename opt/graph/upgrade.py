"""Opset upgrade before optimizing (``--opset N``).

Some fusions exist as standard ops only in newer opsets: RMSNormalization (23), Gelu (20),
LayerNormalization (17), Attention (23).  A model exported at an older opset can be lifted with
onnx's version converter first; the converted model is what the pipeline optimizes, while parity
still compares the result with the original file, so a faulty conversion fails the run like a
faulty rewrite would.  Only the default domain moves; the model is never downgraded.

The converter does not carry model-local functions (it drops them, leaving dangling calls), so
a model whose graph calls them is inlined first (:func:`graphopt.opt.graph.compat.inline_functions`,
which the IR would do anyway); functions it never calls are put back verbatim after conversion
(each keeps its own opset imports).  A model whose functions cannot be inlined is refused.
"""

from __future__ import annotations

import onnx
from onnx import version_converter

from ..errors import UsageError
from .compat import called_functions, inline_functions
from .domains import is_default


def default_opset(model: onnx.ModelProto) -> int:
    return next((i.version for i in model.opset_import if is_default(i.domain)), 1)


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
    source = _without_function_calls(model, version)
    try:
        converted = version_converter.convert_version(source, version)
    except Exception as e:  # the converter raises RuntimeError / ValidationError / C++ errors
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(
            f"cannot upgrade the model from opset {before} to {version}: {first}"
        ) from None
    if len(source.functions) and not len(converted.functions):
        converted.functions.extend(source.functions)
    return converted, before


def _without_function_calls(model: onnx.ModelProto, version: int) -> onnx.ModelProto:
    """``model`` with its calls to model-local functions inlined, or UsageError."""
    if not called_functions(model):
        return model
    inlined, notes = inline_functions(model)
    if called_functions(inlined):
        why = notes[0].message if notes else "the inliner left calls"
        raise UsageError(
            f"--opset {version}: the model calls model-local functions that cannot be inlined "
            f"before the version converter, which drops them ({why})"
        )
    return inlined
