"""Residual Add + RMSNorm → com.microsoft.SkipSimplifiedLayerNormalization (both exporters'
spellings), its scale folded in, the residual sum read from its fourth output."""

import dataclasses

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import assert_optimized, codes, const, model, run, vi
from graphopt.opt.graph.ir import op_histogram
from graphopt.opt.rewrite.target import TARGETS
from graphopt.targets.profiles import CPU

D = 16
SSLN = "com.microsoft.SkipSimplifiedLayerNormalization"


def hist(m):
    return op_histogram(m.graph.node)


def rms_nodes(x, y, *, p, opset, div="one-over", gemma=False, casts=False, eps=1e-6):
    """RMSNorm of ``x`` into ``y`` as the exporters write it: Pow → ReduceMean → Add eps →
    Sqrt → Div(1, ·) (TorchScript) / Reciprocal (dynamo) / Div(x, ·) → Mul(w), Gemma's weight
    as (1 + w), the fp32 upcast Casts around it."""
    rng = np.random.default_rng(len(p))
    inits = [const(f"{p}two", 2.0), const(f"{p}eps", eps)]
    nodes = []
    src = x
    if casts:
        nodes.append(helper.make_node("Cast", [x], [f"{p}xf"], to=TensorProto.FLOAT))
        src = f"{p}xf"
    nodes.append(helper.make_node("Pow", [src, f"{p}two"], [f"{p}sq"]))
    if opset >= 18:
        inits.append(const(f"{p}axes", [-1], np.int64))
        nodes.append(helper.make_node("ReduceMean", [f"{p}sq", f"{p}axes"], [f"{p}ms"]))
    else:
        nodes.append(helper.make_node("ReduceMean", [f"{p}sq"], [f"{p}ms"], axes=[-1]))
    nodes += [
        helper.make_node("Add", [f"{p}ms", f"{p}eps"], [f"{p}mse"]),
        helper.make_node("Sqrt", [f"{p}mse"], [f"{p}rms"]),
    ]
    if div == "one-over":
        inits.append(const(f"{p}one", 1.0))
        nodes.append(helper.make_node("Div", [f"{p}one", f"{p}rms"], [f"{p}r"]))
        nodes.append(helper.make_node("Mul", [src, f"{p}r"], [f"{p}n"]))
    elif div == "reciprocal":
        nodes.append(helper.make_node("Reciprocal", [f"{p}rms"], [f"{p}r"]))
        nodes.append(helper.make_node("Mul", [src, f"{p}r"], [f"{p}n"]))
    else:
        nodes.append(helper.make_node("Div", [src, f"{p}rms"], [f"{p}n"]))
    n = f"{p}n"
    if casts:
        nodes.append(helper.make_node("Cast", [n], [f"{p}nc"], to=TensorProto.FLOAT))
        n = f"{p}nc"
    w = rng.random(D) * 0.5 + 0.5
    if gemma:
        inits += [const(f"{p}w0", w - 1.0), const(f"{p}onew", 1.0)]
        nodes.append(helper.make_node("Add", [f"{p}onew", f"{p}w0"], [f"{p}w"]))
    else:
        inits.append(const(f"{p}w", w))
    nodes.append(helper.make_node("Mul", [n, f"{p}w"], [y]))
    return nodes, inits


def decoder(*, layers=2, opset=17, residual_read=True, shapes=None, unnamed=False, **kw):
    """``layers`` blocks ``h = h + MatMul(RMSNorm(h))`` after ``h = a + b``; the last norm is
    the output (``residual_read=False``: no block reads the last sum again).  ``unnamed``: one
    input ``a`` with unnamed batch and sequence dims and ``b = Relu(a)`` (shape inference then
    names the dims ``unk__N``, which prove nothing, as after onnx's version converter)."""
    rng = np.random.default_rng(0)
    a_shape, b_shape = shapes or (["B", "S", D], ["B", "S", D])
    nodes = [helper.make_node("Add", ["a", "b"], ["h0"])]
    inits = []
    for i in range(layers):
        n, c = rms_nodes(f"h{i}", f"y{i}", p=f"l{i}_", opset=opset, **kw)
        nodes += n
        inits += c
        if i + 1 < layers or residual_read:
            inits.append(const(f"W{i}", rng.standard_normal((D, D)) * 0.2))
            nodes.append(helper.make_node("MatMul", [f"y{i}", f"W{i}"], [f"f{i}"]))
            nodes.append(helper.make_node("Add", [f"h{i}", f"f{i}"], [f"h{i + 1}"]))
    last = f"h{layers}" if residual_read else f"y{layers - 1}"
    graph_inputs = [vi("a", a_shape), vi("b", b_shape)]
    if unnamed:
        nodes.insert(0, helper.make_node("Relu", ["a"], ["b"]))
        graph_inputs = [vi("a", [None, None, D])]
    return model(
        nodes,
        graph_inputs,
        [vi(last, None)],
        inits,
        opset=opset,
        ir_version=10 if opset >= 23 else 8,
    )


def ssln_nodes(m):
    return [n for n in m.graph.node if n.op_type == "SkipSimplifiedLayerNormalization"]


@pytest.mark.parametrize("div", ["one-over", "reciprocal", "div"])
@pytest.mark.parametrize("opset", [17, 18])
def test_residual_rms_norms_fuse_in_both_spellings(div, opset):
    out, report = assert_optimized(decoder(div=div, opset=opset, shapes=None))
    assert hist(out) == {SSLN: 2, "MatMul": 2, "Add": 1}
    first, second = ssln_nodes(out)
    # the first sum feeds the next residual Add through the fourth output; the statistics are
    # not computed
    assert first.output[1] == first.output[2] == "" and first.output[3]
    assert len(second.output) == 4 and second.output[3]
    eps = next(a.f for a in first.attribute if a.name == "epsilon")
    assert eps == pytest.approx(1e-6)
    fired = sum(v["fired"] for k, v in report.rules.items() if k.startswith("fuse-skip-rms-norm"))
    assert fired == 2


def test_gemma_weight_and_upcast_casts_fold():
    out, _ = assert_optimized(decoder(gemma=True, casts=True, div="reciprocal", opset=18))
    assert hist(out) == {SSLN: 2, "MatMul": 2, "Add": 1}


def test_last_norm_without_a_later_reader_has_one_output():
    out, _ = assert_optimized(decoder(layers=2, residual_read=False))
    assert hist(out) == {SSLN: 2, "MatMul": 1}
    last = ssln_nodes(out)[-1]
    assert len(last.output) == 1


def test_on_cuda_too():
    out, _ = assert_optimized(decoder(), target="cuda")
    assert hist(out)[SSLN] == 2


def test_skip_norm_is_preferred_to_rms_normalization_at_opset_23():
    out, report = assert_optimized(decoder(opset=23))
    assert hist(out) == {SSLN: 2, "MatMul": 2, "Add": 1}
    assert not codes(report, "fuse-rms-norm-rcp", kind="passed")


def test_broadcast_residual_is_missed_and_the_plain_norm_remark_stays():
    out, report = run(decoder(layers=1, shapes=([1, "S", D], [2, "S", D])))
    assert report.parity.ok
    assert codes(report, "fuse-skip-rms-norm-rcp") == ["shape-mismatch"]
    # at opset 17 the norm alone has no kernel: the remark says which opset has one
    assert codes(report, "fuse-rms-norm-rcp") == ["opset-too-old"]
    (r,) = [r for r in report.remarks if r.rule == "fuse-rms-norm-rcp"]
    assert "--opset 23" in r.message


def test_norm_of_a_graph_input_is_not_a_skip_norm():
    nodes, inits = rms_nodes("x", "y", p="n_", opset=23)
    m = model(nodes, [vi("x", [2, 3, D])], [vi("y", None)], inits, opset=23, ir_version=10)
    out, report = assert_optimized(m)
    assert hist(out) == {"RMSNormalization": 1}
    assert not codes(report, "fuse-skip-rms-norm-rcp")


def test_residual_sum_as_graph_output_is_missed():
    nodes, inits = rms_nodes("h", "y", p="n_", opset=17)
    nodes.insert(0, helper.make_node("Add", ["a", "b"], ["h"]))
    m = model(
        nodes,
        [vi("a", [2, 3, D]), vi("b", [2, 3, D])],
        [vi("y", None), vi("h", None)],
        inits,
    )
    out, report = run(m)
    assert report.parity.ok
    assert codes(report, "fuse-skip-rms-norm-rcp") == ["shared-intermediate"]


def test_residual_whose_dims_come_from_a_previous_skip_norm():
    """The next residual adds the previous skip norm's sum (its fourth output) to a block's
    output computed from its normalized output (its first): both have the dims of the skip
    norm's input, proved without names from shape inference."""
    out, report = assert_optimized(decoder(layers=3, unnamed=True))
    assert hist(out)[SSLN] == 3, report.remarks


def as_fp16(m):
    """The model in float16: initializers, graph inputs and outputs, Cast targets."""
    for i, t in enumerate(m.graph.initializer):
        v = numpy_helper.to_array(t)
        if v.dtype == np.float32:
            m.graph.initializer[i].CopyFrom(numpy_helper.from_array(v.astype(np.float16), t.name))
    for v in [*m.graph.input, *m.graph.output]:
        if v.type.tensor_type.elem_type == TensorProto.FLOAT:
            v.type.tensor_type.elem_type = TensorProto.FLOAT16
    for node in m.graph.node:
        for a in node.attribute:
            if node.op_type == "Cast" and a.name == "to":
                a.i = TensorProto.FLOAT16
    del m.graph.value_info[:]
    return m


def test_fp16_fuses_where_the_target_declares_fp32_accumulation():
    m = as_fp16(decoder(div="reciprocal", opset=18, casts=True))
    out, report = assert_optimized(m)
    assert hist(out)[SSLN] == 2
    gamma = next(i for i in out.graph.initializer if i.name == ssln_nodes(out)[0].input[2])
    assert gamma.data_type == TensorProto.FLOAT16


def test_fp16_without_fp32_accumulation_is_missed(monkeypatch):
    tgt = dataclasses.replace(CPU, name="cpu-no-acc", fp32_accumulation={})
    monkeypatch.setitem(TARGETS, tgt.name, tgt)
    out, report = run(as_fp16(decoder()), target=tgt.name)
    assert SSLN not in hist(out)
    assert set(codes(report, "fuse-skip-rms-norm-rcp")) == {"precision-accumulation"}


def upcast_decoder(gemma: bool = False):
    """float16 residuals, each norm computed in float32 as transformers writes it:
    Cast(sum → float32), RMSNorm, then Cast back to float16 and the float16 weight (llama), or
    the float32 weight then the Cast back (``gemma``)."""
    rng = np.random.default_rng(0)
    f16 = TensorProto.FLOAT16
    nodes = [helper.make_node("Add", ["a", "b"], ["h0"])]
    inits = []
    for i in range(2):
        n, c = rms_nodes(f"h{i}f", f"n{i}", p=f"l{i}_", opset=18, div="reciprocal")
        n[-1].output[0] = f"n{i}"  # no weight Mul: the weight is placed below
        n[-1].input[1] = f"l{i}_one_w"
        c.append(const(f"l{i}_one_w", 1.0))
        w = rng.random(D) * 0.5 + 0.5
        cast_in = helper.make_node("Cast", [f"h{i}"], [f"h{i}f"], to=TensorProto.FLOAT)
        if gemma:
            c.append(const(f"w{i}", w))
            tail = [
                helper.make_node("Mul", [f"n{i}", f"w{i}"], [f"nw{i}"]),
                helper.make_node("Cast", [f"nw{i}"], [f"y{i}"], to=f16),
            ]
        else:
            c.append(const(f"w{i}", w, np.float16))
            tail = [
                helper.make_node("Cast", [f"n{i}"], [f"n16_{i}"], to=f16),
                helper.make_node("Mul", [f"n16_{i}", f"w{i}"], [f"y{i}"]),
            ]
        c.append(const(f"W{i}", rng.standard_normal((D, D)) * 0.2, np.float16))
        nodes += [cast_in, *n, *tail]
        nodes.append(helper.make_node("MatMul", [f"y{i}", f"W{i}"], [f"f{i}"]))
        nodes.append(helper.make_node("Add", [f"h{i}", f"f{i}"], [f"h{i + 1}"]))
        inits += c
    return model(
        nodes,
        [vi("a", ["B", "S", D], f16), vi("b", ["B", "S", D], f16)],
        [vi("h2", None, f16)],
        inits,
        opset=18,
    )


def test_fp16_sum_upcast_to_fp32_for_the_norm():
    out, report = assert_optimized(upcast_decoder())
    h = hist(out)
    assert h[SSLN] == 2 and "Cast" not in h and "Pow" not in h, h
    assert attr_type(out, ssln_nodes(out)[0].input[2]) == TensorProto.FLOAT16


def test_fp32_weight_before_the_cast_back_is_refused():
    out, report = run(upcast_decoder(gemma=True))
    assert report.parity.ok
    assert set(codes(report, "fuse-skip-rms-norm-rcp")) == {"precision-rounding"}


def attr_type(m, name):
    return next(i.data_type for i in m.graph.initializer if i.name == name)
