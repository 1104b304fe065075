"""A float64 reference of a model, for parity that fp16 overflow cannot hide from.

onnxruntime's CPU kernels compute many fp16 ops in fp32, so an fp16 model that overflows on a
GPU can look fine on a CPU.  The reference upcasts every floating-point initializer, constant,
Cast target, graph input and output to float64 and runs the model in onnxruntime.  Ops for which
the runtime has no float64 kernel (CPU Conv, for instance) are wrapped in Casts and computed in
float32 -- still far from fp16's 65504 ceiling.  Which ops need that is read from the target's
kernel table, not guessed.
"""

from __future__ import annotations

import os

import onnx
from onnx import TensorProto, helper, numpy_helper

from ..errors import GraphoptError
from ..graph.domains import is_default
from ..rewrite.target import Target

FLOATS = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16}
DOUBLE = TensorProto.DOUBLE


def _to_double(t: TensorProto, base_dir: str = "") -> TensorProto:
    return numpy_helper.from_array(numpy_helper.to_array(t, base_dir).astype("float64"), t.name)


def upcast_to_float64(
    model: onnx.ModelProto, target: Target, base_dir: str | os.PathLike | None = None
) -> onnx.ModelProto:
    """A copy of ``model`` computing in float64 wherever ``target`` has float64 kernels."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    if any(
        a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
        for n in g.node
        for a in n.attribute
    ):
        raise GraphoptError(
            "float64 reference: models with subgraphs (If/Loop/Scan) are not supported yet"
        )
    opset = next((o.version for o in m.opset_import if is_default(o.domain)), 0)
    float_types = _float_value_types(model)

    for i, init in enumerate(g.initializer):
        if init.data_type in FLOATS:
            g.initializer[i].CopyFrom(_to_double(init, str(base_dir or "")))
    for node in g.node:
        for attr in node.attribute:
            if node.op_type in ("Cast", "CastLike") and attr.name == "to" and attr.i in FLOATS:
                attr.i = DOUBLE
            elif attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type in FLOATS:
                attr.t.CopyFrom(_to_double(attr.t))
        if node.op_type == "Constant" and any(a.name == "value_float" for a in node.attribute):
            v = next(a.f for a in node.attribute if a.name == "value_float")
            del node.attribute[:]
            node.attribute.append(
                helper.make_attribute("value", helper.make_tensor("value", DOUBLE, [], [v]))
            )

    nodes: list[onnx.NodeProto] = []
    renamed: dict[str, str] = {}
    for inp in g.input:
        if inp.type.tensor_type.elem_type in FLOATS:
            new = f"{inp.name}__graphopt_f64"
            nodes.append(helper.make_node("Cast", [inp.name], [new], to=DOUBLE))
            renamed[inp.name] = new
    for k, node in enumerate(g.node):
        inputs = [renamed.get(x, x) for x in node.input]
        if not any(x in float_types for x in node.input) or target.has_kernel(
            node.op_type, node.domain, opset, "tensor(double)"
        ):
            node.ClearField("input")
            node.input.extend(inputs)
            nodes.append(node)
            continue
        # No float64 kernel: compute this node in float32.
        cast_in = []
        for x, orig in zip(inputs, node.input):
            if orig in float_types:
                y = f"{orig}__graphopt_f32_{k}"
                nodes.append(helper.make_node("Cast", [x], [y], to=TensorProto.FLOAT))
                cast_in.append(y)
            else:
                cast_in.append(x)
        outs = []
        for o in node.output:
            if o in float_types:
                tmp = f"{o}__graphopt_f32"
                outs.append(tmp)
            else:
                outs.append(o)
        inner = onnx.NodeProto()
        inner.CopyFrom(node)
        inner.ClearField("input")
        inner.input.extend(cast_in)
        inner.ClearField("output")
        inner.output.extend(outs)
        nodes.append(inner)
        for o, tmp in zip(node.output, outs):
            if tmp != o:
                nodes.append(helper.make_node("Cast", [tmp], [o], to=DOUBLE))
    del g.node[:]
    g.node.extend(nodes)
    for out in g.output:
        if out.type.tensor_type.elem_type in FLOATS:
            out.type.tensor_type.elem_type = DOUBLE
    del g.value_info[:]
    return m


def _float_value_types(model: onnx.ModelProto) -> set[str]:
    """Names of every floating-point tensor in the original model (by shape inference)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except (onnx.shape_inference.InferenceError, ValueError) as e:
        raise GraphoptError(f"float64 reference: shape inference failed: {e}") from None
    g = inferred.graph
    infos = list(g.input) + list(g.output) + list(g.value_info)
    names = {v.name for v in infos if v.type.tensor_type.elem_type in FLOATS}
    names |= {t.name for t in g.initializer if t.data_type in FLOATS}
    return names
