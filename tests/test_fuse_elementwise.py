"""fuse-elementwise: regions, gates (numerics, vectorization, benchmark), remarks, the no-compiler
path, injection safety, the cuda flavour and the bundle's kernels/."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

from cli_runner import CliRunner
from conftest import const, model, ops, run, vi
from graphopt.cli import app
from graphopt.opt.graph import io, ir
from graphopt.opt.rewrite.pipeline import preset, with_kernels
from graphopt.targets.bundle import load_session
from graphopt.targets.codegen import gates
from graphopt.targets.codegen.library import cpu_library
from graphopt.targets.codegen.spec import specs_of
from graphopt.targets.codegen.toolchain import find_compiler

pytestmark = pytest.mark.skipif(find_compiler("cc") is None, reason="no gcc")
HAVE_NVCC = find_compiler("nvcc") is not None
FUSED = "graphopt.fused"
PIPE = with_kernels(preset(2))


@pytest.fixture(scope="module", autouse=True)
def kernel_cache(tmp_path_factory):
    old = os.environ.get("GRAPHOPT_KERNEL_CACHE")
    os.environ["GRAPHOPT_KERNEL_CACHE"] = str(tmp_path_factory.getbasetemp() / "kernel-cache")
    yield
    if old is None:
        os.environ.pop("GRAPHOPT_KERNEL_CACHE", None)
    else:
        os.environ["GRAPHOPT_KERNEL_CACHE"] = old


def masm(c=8, hw=8, names=None, opset=17):
    """x·σ(x·s+t) with per-channel s, t ([C,1,1]) after a Conv (the Conv output feeds two
    nodes, so onnxruntime and graphopt's Conv folds leave the four nodes alone)."""
    n = names or {}
    rng = np.random.default_rng(0)
    inits = [
        const(n.get("W", "W"), rng.standard_normal((c, c, 1, 1)) * 0.3),
        const(n.get("s", "s"), rng.standard_normal((c, 1, 1))),
        const(n.get("t", "t"), rng.standard_normal((c, 1, 1))),
    ]
    x, cv, m, a, g, y = (n.get(k, k) for k in ("x", "c", "m", "a", "g", "y"))
    nodes = [
        helper.make_node("Conv", [x, inits[0].name], [cv], name=n.get("conv", "conv")),
        helper.make_node("Mul", [cv, inits[1].name], [m], name=n.get("mul", "mul_s")),
        helper.make_node("Add", [m, inits[2].name], [a], name=n.get("add", "add_t")),
        helper.make_node("Sigmoid", [a], [g], name=n.get("sig", "sig")),
        helper.make_node("Mul", [cv, g], [y], name=n.get("gate", "gate")),
    ]
    return model(nodes, [vi(x, [1, c, hw, hw])], [vi(y, [1, c, hw, hw])], inits, opset=opset)


@pytest.fixture
def faster(monkeypatch):
    """Tests of structure do not depend on timing (DESIGN §10): the benchmark gate passes."""

    def fake(unfused, fused, feeds, library, **kw):
        return gates.GateResult(True, numbers={"fused_us": 1.0, "unfused_us": 2.0, "speedup": 2.0})

    monkeypatch.setattr(gates, "benchmark", fake)


def remarks(report, kind=None):
    return [r for r in report.remarks if r.rule == "fuse-elementwise" and kind in (None, r.kind)]


def fused_ops(m):
    return [n for n in m.graph.node if n.domain == FUSED]


def attrs(node):
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


# --------------------------------------------------------------------------- fires
def test_fuses_masm_with_gates_and_parity(faster):
    out, report = run(masm(), pipeline=PIPE)
    assert [n.op_type for n in out.graph.node if n.domain != FUSED] == ["Conv"]
    (node,) = fused_ops(out)
    assert report.parity.ran and report.parity.ok, report.parity
    assert report.legal
    (passed,) = remarks(report, "passed")
    g = passed.args["gates"]
    assert g["vectorized"] is True
    assert g["numerics"]["max_abs_vs_float64"] < 1e-4
    assert g["benchmark"]["speedup"] == 2.0
    assert attrs(node)["expr"] == b"mul(x0,sigmoid(add(mul(x0,p0),p1)))"
    assert attrs(node)["channel_axis"] == -3
    # idempotent: the fused node is not an element-wise op
    again, second = run(out, pipeline=PIPE)
    assert ops(again) == ops(out) and not remarks(second, "passed")


def test_real_benchmark_records_its_numbers():
    """The real gate: fired or refused as slower, either way with onnxruntime's numbers."""
    out, report = run(masm(), pipeline=PIPE)
    (r,) = remarks(report, "passed") or remarks(report, "missed")
    assert r.code in ("fired", "slower-in-context", "slower")
    b = r.args["gates"]["benchmark"]
    assert r.args["gates"]["in_context"]["neighbours"] == ["Conv"]
    assert b["fused_us"] > 0 and b["unfused_us"] > 0 and b["threads"] == 1
    assert b["onnxruntime_ops"] == ["Mul", "Add", "Sigmoid", "Mul"]  # ORT fuses none of it
    assert bool(fused_ops(out)) == (r.code == "fired")


def test_readers_reading_each_other_in_the_context_model():
    """A dense block: the chain's output feeds a Conv and a Concat that also reads that Conv's
    output; the context model makes the Conv's output, it is not fed as an input too."""
    m = masm()
    c = 8
    w2 = const("W2", np.random.default_rng(1).standard_normal((c, c, 1, 1)) * 0.3)
    m.graph.initializer.append(w2)
    m.graph.node.extend(
        [
            helper.make_node("Conv", ["y", "W2"], ["z"], name="conv2"),
            helper.make_node("Concat", ["y", "z"], ["cat"], name="cat", axis=1),
        ]
    )
    del m.graph.output[:]
    m.graph.output.append(vi("cat", [1, 2 * c, 8, 8]))
    out, report = run(m, pipeline=PIPE)
    (r,) = remarks(report, "passed") or remarks(report, "missed")
    assert sorted(r.args["gates"]["in_context"]["neighbours"]) == ["Concat", "Conv", "Conv"]
    assert report.parity.ran and report.parity.ok, report.parity


def test_a_gate_that_cannot_run_leaves_the_chain_unfused(monkeypatch):
    def broken(*a, **kw):
        raise RuntimeError("onnxruntime refused the gate's model\nsecond line")

    monkeypatch.setattr(gates, "benchmark", broken)
    out, report = run(masm(), pipeline=PIPE)
    (r,) = remarks(report, "missed")
    assert r.code == "gate-failed" and "refused the gate's model)" in r.message
    assert not fused_ops(out) and report.parity.ok


def test_output_names_kept_and_second_runtime_input(faster):
    """A residual add reads a second runtime tensor of the same shape (a gated layer-scale tail;
    without the Tanh the scale would fold into W: fold-linear-scale)."""
    rng = np.random.default_rng(1)
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"], name="fc"),
        helper.make_node("Add", ["h", "b"], ["hb"], name="bias"),
        helper.make_node("Tanh", ["hb"], ["ht"], name="gate"),
        helper.make_node("Mul", ["ht", "gamma"], ["hs"], name="scale"),
        helper.make_node("Add", ["x", "hs"], ["y"], name="residual"),
    ]
    inits = [
        const("W", rng.standard_normal((16, 16)) * 0.2),
        const("b", rng.standard_normal(16)),
        const("gamma", rng.standard_normal(16) * 1e-2),
    ]
    # a symbolic sequence: on cpu a static one would put the bias into a flat Gemm
    m = model(nodes, [vi("x", [1, "seq", 16])], [vi("y", [1, "seq", 16])], inits)
    out, report = run(m, pipeline=PIPE)
    assert [o.name for o in out.graph.output] == ["y"]
    (node,) = fused_ops(out)
    assert len(node.input) == 4  # h, x, b, gamma
    assert report.parity.ok


def yolo_decode(n=8400):
    """YOLOv8's box decode after the DFL: (anchor − lt, anchor + rb) → centre and size, times
    the stride; anchors [2, n] and strides [1, n] broadcast over the [1, 2, n] distances."""
    rng = np.random.default_rng(2)
    inits = [
        const("anchors", rng.uniform(0, 80, (2, n))),
        const("strides", rng.choice([8.0, 16.0, 32.0], (1, n))),
        const("two", 2.0),
    ]
    nodes = [
        helper.make_node("Sub", ["anchors", "lt"], ["x1y1"], name="x1y1"),
        helper.make_node("Add", ["anchors", "rb"], ["x2y2"], name="x2y2"),
        helper.make_node("Add", ["x1y1", "x2y2"], ["s"], name="sum"),
        helper.make_node("Div", ["s", "two"], ["c"], name="centre"),
        helper.make_node("Mul", ["c", "strides"], ["y"], name="scale"),
    ]
    shape = [1, 2, n]
    return model(nodes, [vi("lt", shape), vi("rb", shape)], [vi("y", shape)], inits)


def test_broadcast_constants_are_expanded_into_inputs(faster):
    """A constant that is neither a scalar nor per-channel (YOLO's anchor grid) is expanded to
    the static output shape and read as one more input of the kernel."""
    out, report = run(yolo_decode(), pipeline=PIPE)
    (node,) = fused_ops(out)
    assert ops(out) == {node.op_type: 1}
    assert len(node.input) == 4  # lt, rb, the expanded anchors, the strides along the last axis
    init = {t.name: t for t in out.graph.initializer}
    assert [list(init[i].dims) for i in node.input if i in init] == [[1, 2, 8400], [8400]]
    assert attrs(node)["channel_axis"] == -1
    assert report.parity.ran and report.parity.ok, report.parity


def test_broadcast_constant_needs_a_static_shape():
    m = yolo_decode(16)
    for t in (m.graph.input[0], m.graph.input[1], m.graph.output[0]):
        t.type.tensor_type.shape.dim[0].dim_param = "batch"
    out, report = run(m, pipeline=PIPE)
    # The anchors cannot be expanded to a symbolic batch: Sub/Add reading them stay unfused (the
    # Add/Div/Mul tail may fuse or not, as its timing gate decides on this machine).
    assert {"Sub": 1} == {k: v for k, v in ops(out).items() if k == "Sub"}
    assert all("anchors" not in n.input for n in fused_ops(out))


def test_short_chains_are_left_alone():
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Neg", ["r"], ["y"], name="neg"),
    ]
    m = model(nodes, [vi("x", [1, 4, 8])], [vi("y", [1, 4, 8])])
    out, report = run(m, pipeline="fuse-elementwise")
    assert not fused_ops(out) and not remarks(report)


def test_two_node_gate_that_is_one_kernel_is_left_to_onnxruntime():
    """x·σ(x) is two nodes reading x twice, but onnxruntime runs it as QuickGelu."""
    nodes = [
        helper.make_node("Sigmoid", ["x"], ["s"], name="sig"),
        helper.make_node("Mul", ["x", "s"], ["y"], name="silu"),
    ]
    m = model(nodes, [vi("x", [1, 4, 8])], [vi("y", [1, 4, 8])])
    out, report = run(m, pipeline="fuse-elementwise")
    assert not fused_ops(out)
    assert [r.code for r in remarks(report)] == ["target-has-kernel"]


def test_paddle_hard_swish_two_nodes_fuse_before_opset_14(faster):
    """Paddle writes HardSwish as x·HardSigmoid(x, ⅙, ½) at opset 11: no single kernel there."""
    nodes = [
        helper.make_node("HardSigmoid", ["x"], ["g"], alpha=1 / 6, beta=0.5, name="gate"),
        helper.make_node("Mul", ["x", "g"], ["y"], name="hswish"),
    ]
    m = model(nodes, [vi("x", [1, 8, 16, 16])], [vi("y", [1, 8, 16, 16])], opset=11)
    out, report = run(m, pipeline="fuse-elementwise")
    (node,) = fused_ops(out)
    assert attrs(node)["expr"] == b"mul(x0,hardsigmoid(x0,0.16666667,0.5))"
    assert report.parity.ok


def test_shared_intermediate_splits_regions():
    """'a' also feeds a graph output: it leaves the region, so the rest is only 2 nodes."""
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Add", ["r", "one"], ["a"], name="add"),
        helper.make_node("Tanh", ["a"], ["t"], name="tanh"),
        helper.make_node("Mul", ["t", "two"], ["y"], name="mul"),
    ]
    inits = [const("one", 1.0), const("two", 2.0)]
    m = model(nodes, [vi("x", [2, 8])], [vi("y", [2, 8]), vi("a", [2, 8])], inits)
    out, _ = run(m, pipeline="fuse-elementwise")
    assert not fused_ops(out)


def test_mixed_channel_axes_refused():
    rng = np.random.default_rng(2)
    nodes = [
        helper.make_node("Mul", ["x", "s"], ["m"], name="mul"),
        helper.make_node("Add", ["m", "t"], ["a"], name="add"),
        helper.make_node("Relu", ["a"], ["y"], name="relu"),
    ]
    inits = [const("s", rng.standard_normal((4, 1, 1))), const("t", rng.standard_normal(8))]
    m = model(nodes, [vi("x", [1, 4, 8, 8])], [vi("y", [1, 4, 8, 8])], inits)
    out, report = run(m, pipeline="fuse-elementwise")
    assert not fused_ops(out)
    assert [r.code for r in remarks(report, "missed")] == ["mixed-channel-axes"]


def _hardswish(opset):
    nodes = [
        helper.make_node("Add", ["x", "three"], ["a"], name="add3"),
        helper.make_node("Clip", ["a", "zero", "six"], ["c"], name="clip"),
        helper.make_node("Mul", ["x", "c"], ["m"], name="mul"),
        helper.make_node("Div", ["m", "six"], ["y"], name="div6"),
    ]
    inits = [const("three", 3.0), const("zero", 0.0), const("six", 6.0)]
    return model(nodes, [vi("x", [1, 8, 4, 4])], [vi("y", [1, 8, 4, 4])], inits, opset=opset)


def test_chain_the_target_runs_as_one_kernel_is_refused():
    """erf GELU spelled out: onnxruntime's CPU provider has com.microsoft.Gelu (the O2 rules
    would fuse it first; here only fuse-elementwise runs)."""
    nodes = [
        helper.make_node("Div", ["x", "sqrt2"], ["d"], name="div"),
        helper.make_node("Erf", ["d"], ["e"], name="erf"),
        helper.make_node("Add", ["e", "one"], ["a"], name="add"),
        helper.make_node("Mul", ["x", "a"], ["m"], name="mul"),
        helper.make_node("Mul", ["m", "half"], ["y"], name="half"),
    ]
    inits = [const("sqrt2", np.sqrt(2.0)), const("one", 1.0), const("half", 0.5)]
    m = model(nodes, [vi("x", [2, 16])], [vi("y", [2, 16])], inits)
    out, report = run(m, pipeline="fuse-elementwise")
    assert not fused_ops(out)
    (missed,) = remarks(report, "missed")
    assert missed.code == "target-has-kernel" and "com.microsoft Gelu" in missed.message


@pytest.mark.parametrize("opset", [11, 14])
def test_paddle_hardswish_is_fused(faster, opset):
    """HardSwish spelled Add/Clip/Mul/Div (Paddle exports below opset 14): onnxruntime's CPU
    provider has no HardSwish kernel at any opset (it runs the function body: HardSigmoid,
    Mul), so the chain is a candidate either way."""
    out, report = run(_hardswish(opset), pipeline="fuse-elementwise")
    (node,) = fused_ops(out)
    assert helper.get_attribute_value(node.attribute[0]) in (b"div(mul(x0,clip(add(x0,3),0,6)),6)",)
    assert report.parity.ok


# --------------------------------------------------------------------------- gates
def test_same_neighbour_kernels():
    """The chain's own benchmark decides only where onnxruntime runs exactly the same kernels
    around it with and without the fusion."""
    nchwc = "com.microsoft.nchwc:Conv"
    around = [nchwc, "com.microsoft.nchwc:ReorderOutput", "Add", "Mul", "Add", "Concat"]
    fused = [nchwc, "com.microsoft.nchwc:ReorderOutput", "graphopt.fused:K", "Concat"]
    chain = ["Add", "Mul", "Add"]
    assert gates.same_neighbour_kernels(around, fused, chain, "graphopt.fused:K")
    # a chain op onnxruntime fused into a neighbour (the Add into the Conv): lost by fusing
    assert not gates.same_neighbour_kernels(
        [nchwc, "Mul", "Add", "Concat"],
        [nchwc, "graphopt.fused:K", "Concat"],
        chain,
        "graphopt.fused:K",
    )
    # the fused model runs a neighbour differently (a reorder more, a plain Conv)
    assert not gates.same_neighbour_kernels(
        around, fused + ["com.microsoft.nchwc:ReorderInput"], chain, "graphopt.fused:K"
    )
    assert not gates.same_neighbour_kernels(around, ["Conv"] + fused[1:], chain, "graphopt.fused:K")
    assert not gates.same_neighbour_kernels([], fused, chain, "graphopt.fused:K")


def test_same_neighbour_kernels_leave_the_decision_to_the_chain(monkeypatch):
    """Where the neighbours run the same kernels either way, the chain is not timed with them:
    its own benchmark decides, and the remark says so."""
    calls = []

    def timed(unfused, fused, feeds, library, **kw):
        calls.append(len(unfused.graph.node))
        return gates.GateResult(True, numbers={"fused_us": 2.0, "unfused_us": 4.0, "speedup": 2.0})

    monkeypatch.setattr(gates, "benchmark", timed)
    monkeypatch.setattr(gates, "same_neighbour_kernels", lambda *a: True)
    out, report = run(masm(), pipeline=PIPE)
    (passed,) = remarks(report, "passed")
    assert len(calls) == 1 and fused_ops(out)
    c = passed.args["gates"]["in_context"]
    assert c["timed"] is False and c["neighbours"] == ["Conv"]
    assert "same kernels around it either way" in passed.message
    assert report.parity.ok


def test_slower_kernel_is_rejected_with_numbers(monkeypatch):
    def slower(unfused, fused, feeds, library, **kw):
        return gates.GateResult(
            False,
            "slower",
            "generated kernel 9.0 us vs 4.0 us",
            {"fused_us": 9.0, "unfused_us": 4.0},
        )

    monkeypatch.setattr(gates, "benchmark", slower)
    m = masm()
    out, report = run(m, pipeline=PIPE)
    assert not fused_ops(out) and ops(out)["Sigmoid"] == 1
    (missed,) = remarks(report, "missed")
    # the Conv producing x is the chain's neighbour: the in-context benchmark decides
    assert missed.code == "slower-in-context" and "9.0 us vs 4.0 us" in missed.message
    assert missed.args["gates"]["benchmark"]["fused_us"] == 9.0
    assert missed.args["gates"]["in_context"]["neighbours"] == ["Conv"]
    assert missed.args["gates"]["numerics"]["max_abs_vs_onnxruntime"] < 1e-4


def test_numerics_gate_rejects(monkeypatch):
    real = gates.numerics

    def strict(spec, unfused, fused, feeds, params, library, tolerances):
        return real(spec, unfused, fused, feeds, params, library, {"float32": (0.0, 0.0)})

    monkeypatch.setattr(gates, "numerics", strict)
    out, report = run(masm(), pipeline=PIPE)
    assert not fused_ops(out)
    assert [r.code for r in remarks(report, "missed")] == ["numerics"]


def test_no_compiler_is_a_remark_not_an_error(monkeypatch):
    monkeypatch.setenv("GRAPHOPT_NO_COMPILER", "1")
    out, report = run(masm(), pipeline=PIPE)
    assert not fused_ops(out)
    (missed,) = remarks(report, "missed")
    assert missed.code == "no-compiler"
    assert report.parity.ok and report.legal


# ------------------------------------------------------------------------- safety
HOSTILE = '*/ #include "/etc/passwd"\n system("rm -rf /"); /* %s \\ `x` ${HOME}'


def test_hostile_names_never_reach_the_source(faster):
    names = {
        k: f"{k}{HOSTILE}"
        for k in ("x", "c", "m", "a", "g", "y", "conv", "mul", "add", "sig", "gate", "s", "t", "W")
    }
    out, report = run(masm(names=names), pipeline=PIPE)
    assert report.parity.ok
    (node,) = fused_ops(out)
    assert re.fullmatch(r"Elementwise_[0-9a-f]{16}", node.op_type)
    lib = cpu_library(specs_of(out))
    source = (lib.build.dir / "graphopt_fused.c").read_text()
    for fragment in ("passwd", "rm -rf", "system(", "${HOME}", "`x`", "gate", "conv", "mul_s"):
        assert fragment not in source
    assert lib.vectorized[node.op_type]


# -------------------------------------------------------------------------- cuda
@pytest.mark.skipif(not HAVE_NVCC, reason="no nvcc")
def test_cuda_target_compiles_and_checks_resources():  # no benchmark without a GPU
    out, report = run(masm(), target="cuda", pipeline=PIPE)
    assert fused_ops(out)
    assert report.parity.ok  # the CPU build of the same expressions
    (passed,) = remarks(report, "passed")
    res = passed.args["gates"]["cuda_resources"]
    assert set(res) == {"float32", "float16"}
    assert passed.args["gates"]["device"] == "not-run"
    assert any(r.code == "device-not-run" for r in remarks(report, "analysis"))


# ------------------------------------------------------------------------- bundle
def test_cli_kernels_bundle(tmp_path, faster):
    src = tmp_path / "masm.onnx"
    onnx.save(masm(), src)
    out = tmp_path / "b"
    res = CliRunner().invoke(app, ["optimize", str(src), "--kernels", "-o", str(out), "-q"])
    assert res.exit_code == 0, res.output
    k = out / "kernels" / "cpu"
    for f in (
        "graphopt_fused.c",
        "graphopt_ort_abi.h",
        "build.sh",
        "libgraphopt_fused.so",
        "build.log",
    ):
        assert (k / f).is_file(), f
    # the library is the build cache's; the bundle's build.sh makes the same one again
    rebuilt = tmp_path / "rebuilt"
    shutil.copytree(k, rebuilt)
    (rebuilt / "libgraphopt_fused.so").unlink()
    subprocess.run(["bash", "build.sh"], cwd=rebuilt, check=True, capture_output=True)
    assert (rebuilt / "libgraphopt_fused.so").read_bytes() == (
        k / "libgraphopt_fused.so"
    ).read_bytes()
    config = json.loads((out / "session_config.json").read_text())
    assert config["custom_op_libraries"] == {
        "CPUExecutionProvider": "kernels/cpu/libgraphopt_fused.so"
    }
    manifest = json.loads((out / "manifest.json").read_text())
    (kernel,) = manifest["kernels"]["kernels"]
    assert kernel["cpu"]["vectorized"] and kernel["nodes"] == ["gate"]
    assert kernel["gates"]["benchmark"]["speedup"] == 2.0
    assert manifest["kernels"]["ort_api_version"] == 16
    assert manifest["verified"]["bundle_session"]["golden_ok"] is True
    fused = [n for n in manifest["nodes"] if n["domain"] == FUSED]
    assert fused[0]["kernel"]["kind"] == "generated" and fused[0]["latency_us"] > 0
    sess = load_session(out)
    x = np.random.default_rng(0).standard_normal((1, 8, 8, 8)).astype(np.float32)
    assert sess.run(None, {"x": x})[0].shape == (1, 8, 8, 8)
    # without --kernels: no kernels/
    plain = tmp_path / "p"
    res = CliRunner().invoke(app, ["optimize", str(src), "-o", str(plain), "-q"])
    assert res.exit_code == 0 and not (plain / "kernels").exists()


def test_with_kernels_pipeline_text():
    assert with_kernels("") == "fuse-elementwise"
    assert with_kernels("fold-constants,legalize") == "fold-constants,fuse-elementwise,legalize"
    assert with_kernels("fold-constants") == "fold-constants,fuse-elementwise"
    assert with_kernels(PIPE) == PIPE
    assert "fuse-elementwise" not in preset(3)


@pytest.mark.skipif(not HAVE_NVCC, reason="no nvcc")
def test_cuda_target_fuses_float16_chains():
    nodes = [
        helper.make_node("Mul", ["x", "s"], ["m"], name="mul"),
        helper.make_node("Add", ["m", "t"], ["a"], name="add"),
        helper.make_node("Tanh", ["a"], ["y"], name="tanh"),
    ]
    inits = [const("s", 1.5, np.float16), const("t", 0.25, np.float16)]
    m = model(
        nodes,
        [vi("x", [2, 64], onnx.TensorProto.FLOAT16)],
        [vi("y", [2, 64], onnx.TensorProto.FLOAT16)],
        inits,
    )
    out, report = run(m, target="cuda", pipeline="fuse-elementwise")
    (node,) = fused_ops(out)
    assert attrs(node)["dtype"] == b"float16"
    assert report.parity.ok
    cpu_out, cpu_report = run(m, pipeline="fuse-elementwise")  # cpu fuses float32 only
    assert not fused_ops(cpu_out) and not remarks(cpu_report)


def test_consecutive_regions_both_fused(faster):
    """Region B reads region A's output (and so does another node): B's input is rewired to
    A's fused node, never left dangling (onnxruntime would reject the model)."""
    rng = np.random.default_rng(3)
    nodes, inits, cur = [], [], "x"
    for b in range(2):
        p = f"b{b}"
        nodes += [
            helper.make_node("MatMul", [cur, f"{p}.w"], [f"{p}.h"], name=f"{p}/fc"),
            helper.make_node("Add", [f"{p}.h", f"{p}.bias"], [f"{p}.hb"], name=f"{p}/bias"),
            helper.make_node("Tanh", [f"{p}.hb"], [f"{p}.ht"], name=f"{p}/gate"),
            helper.make_node("Mul", [f"{p}.ht", f"{p}.g"], [f"{p}.hs"], name=f"{p}/scale"),
            helper.make_node("Add", [cur, f"{p}.hs"], [f"{p}.out"], name=f"{p}/res"),
        ]
        inits += [
            const(f"{p}.w", rng.standard_normal((8, 8)) * 0.3),
            const(f"{p}.bias", rng.standard_normal(8)),
            const(f"{p}.g", rng.standard_normal(8)),
        ]
        cur = f"{p}.out"
    m = model(nodes, [vi("x", [1, "seq", 8])], [vi(cur, [1, "seq", 8])], inits)
    out, report = run(m, pipeline=PIPE)
    assert len(fused_ops(out)) == 2
    assert not [r for r in report.remarks if r.kind == "failure"]
    assert report.parity.ok


def test_a_scalar_runtime_input_is_fed_as_an_array():
    """A 0-d runtime input (a dynamic quantizer's scale) reaches the gates' feeds as a 0-d array,
    not a numpy scalar onnxruntime refuses."""
    rng = np.random.default_rng(3)
    inits = [const("W", rng.standard_normal((8, 8, 1, 1)) * 0.3), const("t", rng.random((8, 1, 1)))]
    nodes = [
        helper.make_node("Conv", ["x", "W"], ["c"], name="conv"),
        helper.make_node("Mul", ["c", "s"], ["m"], name="mul_s"),
        helper.make_node("Add", ["m", "t"], ["a"], name="add_t"),
        helper.make_node("Sigmoid", ["a"], ["g"], name="sig"),
        helper.make_node("Mul", ["c", "g"], ["y"], name="gate"),
    ]
    m = model(nodes, [vi("x", [1, 8, 8, 8]), vi("s", [])], [vi("y", [1, 8, 8, 8])], inits)
    out, report = run(m, pipeline=PIPE)
    assert report.parity.ran and report.parity.ok


def test_gates_of_a_model_whose_weights_stay_in_its_file(tmp_path, monkeypatch):
    """A large model's weights are left in its file (opt/graph/io.py): the gate's context model,
    loaded from bytes, carries the neighbour Conv's weight itself, not a reference to that
    file (onnxruntime would look for it beside the working directory and refuse the model)."""
    loaded = []

    def loads(unfused, fused, feeds, library, **kw):  # the gate's models load; timing faked
        for m in (unfused, fused):
            so = ort.SessionOptions()
            so.register_custom_ops_library(library)
            ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
        loaded.append(len(unfused.graph.initializer))
        return gates.GateResult(True, numbers={"fused_us": 1.0, "unfused_us": 2.0, "speedup": 2.0})

    monkeypatch.setattr(gates, "benchmark", loads)
    monkeypatch.setenv("GRAPHOPT_IN_PLACE_ABOVE", "0")
    monkeypatch.setattr(io, "IN_PLACE_BYTES", 1024)
    monkeypatch.setattr(ir, "UNCACHED_BYTES", 1024)  # a rule reading W does not keep it
    src = tmp_path / "masm.onnx"
    onnx.save(masm(c=32), src)  # the Conv weight: 4 KiB, left in the file
    monkeypatch.chdir(tmp_path.parent)
    out = tmp_path / "b"
    res = CliRunner().invoke(app, ["optimize", str(src), "--kernels", "-o", str(out), "-q"])
    assert res.exit_code == 0, res.output
    report = json.loads((out / "report.json").read_text())
    codes = [r["code"] for r in report["remarks"] if r["rule"] == "fuse-elementwise"]
    assert "fired" in codes and "gate-failed" not in codes, codes
    assert 3 in loaded  # the context model: the Conv's weight and the chain's two constants


def test_the_benchmark_stops_once_its_rounds_decide():
    """A clear win, a clear loss and a tie within 3 % settle after the minimum pairs; rounds
    that swing both ways beyond the tie go on (to the budget)."""
    n = gates.BENCH_MIN_PAIRS
    unfused = [1.0 + 0.01 * (k % 3) for k in range(n)]
    assert not gates.decided(unfused[:-1], [0.5 * u for u in unfused[:-1]])  # too few pairs
    assert gates.decided(unfused, [0.5 * u * (1 + 0.01 * (k % 2)) for k, u in enumerate(unfused)])
    assert gates.decided(unfused, [1.5 * u * (1 + 0.01 * (k % 2)) for k, u in enumerate(unfused)])
    assert gates.decided(unfused, [u * (1 + 0.004 * (-1) ** k) for k, u in enumerate(unfused)])
    swings = [u * (1.0 + 0.2 * (-1) ** k) for k, u in enumerate(unfused)]
    assert not gates.decided(unfused, swings)
