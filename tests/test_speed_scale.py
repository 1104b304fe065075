"""The scaling speedups decide what the code they replace decided: graphsurgeon's LazyValues
and tensor map, onnx's walk over a model's tensors for external data, the per-value parse of
inferred types, node keys, domain checks, the distinct bindings of a pattern and the shape view
written with its nodes spliced in, each against the old code."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from google.protobuf.internal.encoder import _VarintBytes
from onnx import TensorProto, helper
from onnx_graphsurgeon.ir.tensor import LazyValues

from conftest import const, model, vi
from graphopt.opt.graph import analysis, ir
from graphopt.opt.graph import ir as irmod
from graphopt.opt.graph.domains import norm_domain
from graphopt.opt.graph.ir import ModelIR, Variable
from graphopt.opt.rewrite.engine import MAX_CANDIDATES, Rule
from graphopt.opt.rewrite.patterns import Const, Op, feasible, match


@pytest.mark.parametrize(
    "dtype",
    [
        TensorProto.FLOAT,
        TensorProto.FLOAT16,
        TensorProto.BFLOAT16,
        TensorProto.INT64,
        TensorProto.INT8,
        TensorProto.BOOL,
        TensorProto.DOUBLE,
        TensorProto.STRING,
        TensorProto.FLOAT8E4M3FN,
        TensorProto.INT4,
    ],
)
def test_lazy_values_are_graphsurgeons(dtype):
    for dims in ([], [0], [3, 2], [1, 1, 5]):
        t = helper.make_tensor("t", dtype, dims, [], raw=False) if 0 in dims else None
        if t is None:
            t = TensorProto(name="t", data_type=dtype, dims=dims)
        ours, theirs = irmod._lazy_values(t), LazyValues(t)
        assert ours.tensor is theirs.tensor
        assert list(ours.shape) == list(theirs.shape)
        assert ours.dtype == theirs.dtype and ours.nbytes == theirs.nbytes


def _old_has_external(m: onnx.ModelProto) -> bool:
    from onnx import external_data_helper

    return any(
        t.data_location == TensorProto.EXTERNAL for t in external_data_helper._get_all_tensors(m)
    )


def _external(name: str) -> TensorProto:
    t = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=[1])
    t.data_location = TensorProto.EXTERNAL
    t.external_data.add(key="location", value="w.bin")
    return t


def _unchecked(nodes, inputs, outputs, inits=()) -> onnx.ModelProto:
    """A model whose external references point nowhere (the checker would refuse it)."""
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def _models_with_external_somewhere():
    plain = TensorProto(name="p", data_type=TensorProto.FLOAT, dims=[1], float_data=[1.0])
    body_init = helper.make_graph(
        [helper.make_node("Identity", ["e"], ["o"])], "b", [], [vi("o", [1])], [_external("e")]
    )
    body_attr = helper.make_graph(
        [helper.make_node("Constant", [], ["o"], value=_external("k"))], "b", [], [vi("o", [1])]
    )
    body_plain = helper.make_graph(
        [helper.make_node("Constant", [], ["o"], value=plain)], "b", [], [vi("o", [1])]
    )

    def with_if(body):
        node = helper.make_node("If", ["c"], ["y"], then_branch=body, else_branch=body)
        return _unchecked([node], [vi("c", [], TensorProto.BOOL)], [vi("y", [1])])

    yield _unchecked(
        [helper.make_node("Identity", ["w"], ["y"])], [], [vi("y", [1])], [_external("w")]
    )
    yield _unchecked(
        [helper.make_node("Constant", [], ["y"], value=_external("k"))], [], [vi("y", [1])]
    )
    yield _unchecked(
        [
            helper.make_node(
                "Constant",
                [],
                ["y"],
                sparse_value=helper.make_sparse_tensor(
                    _external("v"),
                    TensorProto(name="i", data_type=TensorProto.INT64, dims=[1], int64_data=[0]),
                    [1],
                ),
            )
        ],
        [],
        [vi("y", [1])],
    )
    yield with_if(body_init)
    yield with_if(body_attr)
    yield with_if(body_plain)
    for body in (body_attr, body_plain):  # in a model-local function, at any depth
        m = _unchecked([helper.make_node("Identity", ["x"], ["y"])], [vi("x", [1])], [vi("y", [1])])
        inner = helper.make_node("If", ["c"], ["o"], then_branch=body, else_branch=body)
        m.functions.append(
            helper.make_function("f", "g", ["c"], ["o"], [inner], [helper.make_opsetid("", 18)])
        )
        yield m
        direct = helper.make_node("Constant", [], ["o"], value=body.node[0].attribute[0].t)
        m2 = _unchecked(
            [helper.make_node("Identity", ["x"], ["y"])], [vi("x", [1])], [vi("y", [1])]
        )
        m2.functions.append(
            helper.make_function("f", "g", [], ["o"], [direct], [helper.make_opsetid("", 18)])
        )
        yield m2
    yield _unchecked([helper.make_node("Identity", ["p"], ["y"])], [], [vi("y", [1])], [plain])


def test_has_external_finds_what_onnx_walk_finds():
    found = []
    for m in _models_with_external_somewhere():
        assert irmod._has_external(m) == _old_has_external(m)
        found.append(_old_has_external(m))
    assert True in found and False in found


def _old_apply_type(t, type_proto) -> None:
    if t.dtype is not None and t.shape is not None and all(isinstance(d, int) for d in t.shape):
        return
    if not type_proto.HasField("tensor_type"):
        return
    tt = type_proto.tensor_type
    if tt.elem_type and t.dtype is None:
        try:
            t.dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)
        except KeyError:
            return
    if tt.HasField("shape"):
        dims = []
        for d in tt.shape.dim:
            if d.HasField("dim_value"):
                dims.append(int(d.dim_value))
            elif d.HasField("dim_param"):
                dims.append(d.dim_param)
            else:
                dims.append(None)
        old = t.shape
        if old is None or analysis._more_static(dims, old):
            t.shape = dims


def _types():
    yield helper.make_tensor_type_proto(TensorProto.FLOAT, ["B", "S", 8])
    yield helper.make_tensor_type_proto(TensorProto.FLOAT, [2, 3, 8])
    yield helper.make_tensor_type_proto(TensorProto.INT64, [None, 4])
    yield helper.make_tensor_type_proto(TensorProto.FLOAT16, None)
    yield helper.make_tensor_type_proto(0, ["N"])
    yield helper.make_tensor_type_proto(TensorProto.STRING, [1])
    yield helper.make_sequence_type_proto(helper.make_tensor_type_proto(TensorProto.FLOAT, [1]))


def test_inferred_types_are_applied_as_before():
    starts = [
        (None, None),
        (np.float32, None),
        (np.float32, ["B", "S", 8]),
        (None, [2, None, 8]),
        (np.float32, [2, 3, 8]),
        (np.int64, [None, 4]),
        (np.float32, ["B", 3]),
    ]
    for type_proto in _types():
        for dtype, shape in starts:
            old = Variable("t", dtype=dtype, shape=None if shape is None else list(shape))
            new = Variable("t", dtype=dtype, shape=None if shape is None else list(shape))
            _old_apply_type(old, type_proto)
            done = (
                new.dtype is not None
                and new.shape is not None
                and all(isinstance(d, int) for d in new.shape)
            )
            parsed = None if done else analysis._read_type(type_proto)
            if parsed is not None:
                analysis._set_type(new, *parsed)
            assert (new.dtype, new.shape) == (old.dtype, old.shape)


def test_shape_inference_on_a_graph_with_repeated_types_matches_fresh_parsing():
    nodes, x = [], "x"
    for i in range(6):
        nodes.append(helper.make_node("Relu", [x], [f"r{i}"]))
        nodes.append(helper.make_node("Add", [f"r{i}", "c"], [f"a{i}"]))
        x = f"a{i}"
    m = model(nodes, [vi("x", ["B", 4])], [vi(x, None)], [const("c", np.ones(4))])
    ir = ModelIR(m)
    assert analysis.infer_shapes(ir)
    inferred = onnx.shape_inference.infer_shapes(m, data_prop=True)
    want = {v.name: v.type for v in inferred.graph.value_info}
    for n in ir.graph.nodes:
        for t in n.outputs:
            if t.name in want:
                ref = Variable(t.name)
                _old_apply_type(ref, want[t.name])
                assert (t.dtype, t.shape) == (ref.dtype, ref.shape)


def _old_node_key(n) -> tuple | None:
    attrs = []
    for k, v in n.attrs.items():
        if isinstance(v, ir._PLAIN):
            attrs.append((k, type(v), v))
        elif isinstance(v, list) and all(isinstance(x, ir._PLAIN) for x in v):
            attrs.append((k, list, tuple([(type(x), x) for x in v])))
        else:
            return None
    return (
        n.op,
        n.domain,
        n.name,
        tuple([t.name for t in n.inputs]),
        tuple([t.name for t in n.outputs]),
        tuple(attrs),
        getattr(n, irmod._ATTR_ATTR, None),
        getattr(n, irmod._NOTE_ATTR, None),
    )


def _keyed_nodes() -> list:
    """Nodes that differ in one thing each (and some equal ones)."""
    a, b, c = Variable("a"), Variable("b"), Variable("c")

    def node(op="Relu", name="n", ins=(a,), outs=(b,), attrs=None, domain=None):
        return gs.Node(op, name, attrs=attrs, inputs=list(ins), outputs=list(outs), domain=domain)

    nodes = [
        node(),
        node(),
        node(op="Sigmoid"),
        node(name="m"),
        node(domain=""),
        node(domain="com.x"),
        node(ins=(a, b)),
        node(ins=(), outs=(a, b)),
        node(ins=(a,), outs=(b, c)),
        node(ins=(a, b), outs=(c,)),
        node(ins=(a, b, c), outs=()),
        node(attrs={"perm": [1, 0]}),
        node(attrs={"perm": [1, 0]}),
        node(attrs={"perm": [0, 1]}),
        node(attrs={"perm": (1, 0)}),
        node(attrs={"axis": 1}),
        node(attrs={"axis": 1.0}),
        node(attrs={"axis": True}),
        node(attrs={"axis": "1"}),
        node(attrs={"axis": 1, "keepdims": 0}),
        node(attrs={"keepdims": 0, "axis": 1}),
        node(attrs={"f": 1.5, "s": "x", "i": 2}, domain="com.x"),
        node(attrs={"t": np.ones(2)}),
        node(attrs={"l": [1, "a", 2.0]}),
        node(attrs={"l": [1, "a", 2]}),
        node(attrs={"nan": float("nan")}),
    ]
    noted = node()
    setattr(noted, irmod._NOTE_ATTR, onnx.NodeProto(doc_string="d"))
    return [*nodes, noted]


def test_node_keys_tell_apart_what_the_old_ones_did():
    nodes = _keyed_nodes()
    new = [ir._node_key(n) for n in nodes]
    old = [_old_node_key(n) for n in nodes]
    for i in range(len(nodes)):
        assert (new[i] is None) == (old[i] is None)
        for j in range(len(nodes)):
            if old[i] is not None and old[j] is not None:
                assert (new[i] == new[j]) == (old[i] == old[j]), (i, j)
    assert new[0] == new[1] and new[0] != new[2]


@pytest.mark.parametrize("domain", [None, "", "ai.onnx", "com.microsoft", "com.other"])
def test_domain_checks_are_the_normalized_ones(domain):
    x, c = Variable("x"), gs.Constant("c", np.zeros(1, np.float32))
    node = gs.Node("Add", inputs=[x, c], outputs=[Variable("y")], domain=domain)
    for want in ("", "ai.onnx", "com.microsoft", ("", "com.microsoft"), "com.x"):
        p = Op("Add", "a", Const("k"), domain=want)
        wants = (want,) if isinstance(want, str) else want
        fits = norm_domain(domain) in {norm_domain(d) for d in wants}
        assert feasible(p, node) == fits
        assert bool(list(match(p, node))) == fits


def _old_candidates(rule, node):
    from itertools import islice

    seen, out = set(), []
    for bindings in islice(match(rule.pattern, node), MAX_CANDIDATES):
        key = frozenset([(k, id(v)) for k, v in bindings.items()])
        if key in seen:
            continue
        seen.add(key)
        out.append(bindings)
    return out


def test_each_binding_is_a_candidate_once_as_before():
    class Both(Rule):
        name = "test-both"
        pattern = Op("Add", "a", "b", commute=True)

    class Three(Rule):
        name = "test-three"
        pattern = Op("Sum", "a", "b", "c", commute=True)

    x, y = Variable("x"), Variable("y")
    cases = [
        (Both(), gs.Node("Add", inputs=[x, x], outputs=[Variable("o1")])),
        (Both(), gs.Node("Add", inputs=[x, y], outputs=[Variable("o2")])),
        (Three(), gs.Node("Sum", inputs=[x, x, y], outputs=[Variable("o3")])),
        (Three(), gs.Node("Sum", inputs=[x, x, x], outputs=[Variable("o4")])),
    ]
    for rule, node in cases:
        got = [m.bindings for m in rule.candidates(node, None)]
        assert got == _old_candidates(rule, node)


def test_named_tensors_are_graphsurgeons_tensor_map():
    from graphopt.passes.fold_constants import _all_tensors

    x, y = Variable("x", np.float32, [2]), Variable("y", np.float32, [2])
    w, w2 = gs.Constant("w", np.ones(2, np.float32)), gs.Constant("w", np.zeros(2, np.float32))
    mid, empty, dangling = Variable("mid"), Variable.empty(), Variable("dangling")
    nodes = [
        gs.Node("Add", inputs=[x, w], outputs=[mid]),
        gs.Node("Dropout", inputs=[mid, empty], outputs=[y, Variable.empty()]),
        gs.Node("Mul", inputs=[mid, w2], outputs=[Variable("m2")]),  # a second "w"
    ]
    g = gs.Graph(nodes=nodes, inputs=[x, dangling], outputs=[y])
    assert list(_all_tensors(g)) == list(g.tensors().values())
    ir = ModelIR(model([], [vi("a", [1])], [vi("a", [1])]))
    assert list(_all_tensors(ir.root)) == list(ir.root.tensors().values())


def test_a_model_written_with_its_nodes_spliced_in_reads_back_as_the_whole_model():
    nodes = [helper.make_node("Relu", [f"x{i}"], [f"x{i + 1}"], name=f"r{i}") for i in range(300)]
    nodes.append(
        helper.make_node(
            "Constant",
            [],
            ["k"],
            value=onnx.helper.make_tensor("v", TensorProto.FLOAT, [40], np.arange(40.0)),
        )
    )
    inputs, outputs = [vi("x0", ["B", 4])], [vi("x300", None)]
    inits = [const("c", np.ones(4))]

    def shell(with_nodes):
        g = helper.make_graph(nodes if with_nodes else [], "v", inputs, outputs, inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
        m.functions.append(
            helper.make_function(
                "f",
                "g",
                ["a"],
                ["b"],
                [helper.make_node("Relu", ["a"], ["b"])],
                [helper.make_opsetid("", 18)],
            )
        )
        return m

    serialized = [n.SerializeToString() for n in nodes]
    whole = onnx.ModelProto.FromString(analysis._with_nodes(shell(False), serialized))
    assert whole == shell(True)
    for n in (0, 1, 127, 128, 300, 16383, 16384, 2**21 + 5, 2**35):
        assert analysis._varint(n) == _VarintBytes(n)


def _console(*args: str):
    import subprocess
    import sys

    code = (
        "import atexit, gc, sys; "
        "atexit.register(lambda: print('frozen', gc.get_freeze_count() > 0)); "
        f"sys.argv = ['graphopt', *{list(args)!r}]; "
        "from graphopt.cli import console; console()"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)


def test_the_command_leaves_its_objects_frozen_to_the_exit_and_keeps_its_exit_code(tmp_path):
    done = _console("--version")
    assert done.returncode == 0 and "graphopt" in done.stdout and "frozen True" in done.stdout
    missing = _console("optimize", str(tmp_path / "missing.onnx"), "-o", str(tmp_path / "b"))
    assert missing.returncode not in (0, None) and "frozen True" in missing.stdout


def test_the_imported_graph_is_kept_apart_from_collections_only_while_it_is_optimized():
    import gc

    from graphopt.opt.optimizer import imported_apart, optimize

    assert gc.isenabled() and gc.get_freeze_count() == 0
    with imported_apart() as imported:
        assert not gc.isenabled()  # importing: no collections
        held = [[] for _ in range(10)]
        imported()
        assert gc.isenabled() and gc.get_freeze_count() > 0
    assert gc.isenabled() and gc.get_freeze_count() == 0 and held
    with pytest.raises(ValueError), imported_apart():
        raise ValueError("import failed")
    assert gc.isenabled() and gc.get_freeze_count() == 0
    gc.freeze()  # someone else's freeze is theirs: left as it is
    try:
        with imported_apart() as imported:
            assert gc.isenabled()
            imported()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
    gc.disable()  # nor is the collector turned on where it was off
    try:
        with imported_apart() as imported:
            imported()
        assert not gc.isenabled() and gc.get_freeze_count() == 0
    finally:
        gc.enable()
    m = model([helper.make_node("Relu", ["x"], ["y"])], [vi("x", [2])], [vi("y", [2])])
    optimize(m, check=False)
    assert gc.isenabled() and gc.get_freeze_count() == 0
