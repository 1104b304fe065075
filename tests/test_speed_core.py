"""The optimizer's fast paths give the results of the slow ones: the pattern prefilter of the
rule driver, the topological sort of an already ordered graph, and the flat-graph sweep of dce."""

import os
import random
import sys
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import helper, numpy_helper

from conftest import check_parity, const, model, vi
from graphopt.opt.graph import ir as ir_module
from graphopt.opt.graph.domains import norm_domain
from graphopt.opt.graph.io import external_data_files, load_model, save_model
from graphopt.opt.graph.ir import ModelIR, toposort
from graphopt.opt.rewrite.context import PassContext
from graphopt.opt.rewrite.engine import Const, Op, Rule
from graphopt.opt.rewrite.manager import RULES, RuleSetPass, run_pass
from graphopt.opt.rewrite.patterns import Alt, Var, feasible, match
from graphopt.opt.rewrite.target import get_target
from graphopt.passes.dce import DeadCodeElimination, sweep


def _chain_model():
    """y = Relu(Add(Mul(x, c), x)) + Sqrt(x) (a commutable Add, a constant, a second branch)."""
    nodes = [
        helper.make_node("Mul", ["x", "c"], ["m"], name="mul"),
        helper.make_node("Add", ["x", "m"], ["a"], name="add"),
        helper.make_node("Relu", ["a"], ["r"], name="relu"),
        helper.make_node("Sqrt", ["x"], ["s"], name="sqrt"),
        helper.make_node("Sub", ["r", "s"], ["y"], name="sub"),
    ]
    m = model(nodes, [vi("x", [4])], [vi("y", None)], [const("c", [2.0] * 4)])
    return m, ModelIR(m)


PATTERNS = [
    Op("Relu", Op("Add", Op("Mul", "x", Const("c")), "x", commute=True)),
    Op("Relu", Op("Add", "x", Op("Mul", "x", Const("c")))),
    Op("Relu", Op("Add", Op("Mul", "x", Const("c")), "x")),  # written order only: no match
    Op("Relu", Op("Add", Op("Div", "x", "c"), "x", commute=True)),
    Op("Sub", Op("Relu", "r"), Op("Sqrt", "x")),
    Op("Sub", Op("Relu", "r"), Const("s")),
    Op("Sub", "a"),  # too few inputs named
    Op("Mul", "x", Op("Identity", "c")),
    Op("Mul", Const("c"), "x", commute=True),
]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_feasible_is_never_false_where_match_yields(pattern):
    _, ir = _chain_model()
    for node in ir.graph.nodes:
        if not feasible(pattern, node):
            assert not list(match(pattern, node)), (pattern, node.name)


def test_feasible_rejects_on_structure_alone():
    _, ir = _chain_model()
    relu = next(n for n in ir.graph.nodes if n.name == "relu")
    assert feasible(PATTERNS[0], relu) and list(match(PATTERNS[0], relu))
    assert not feasible(PATTERNS[3], relu)  # the Add reads a Mul, not a Div
    sub = next(n for n in ir.graph.nodes if n.name == "sub")
    assert not feasible(PATTERNS[5], sub)  # a computed tensor where a constant is named
    assert not feasible(PATTERNS[6], sub)  # more inputs than the pattern names


def _reference_feasible(p, node) -> bool:
    """The prefilter's contract read plainly off the pattern, walked at every call."""
    if isinstance(p, Alt):
        return any(_reference_feasible(o, node) for o in p.options)
    if node.op not in p.ops or norm_domain(node.domain) not in p._domains:
        return False
    ins = [
        None if t is None or (isinstance(t, gs.Variable) and not t.name) else t for t in node.inputs
    ]
    if len(ins) > len(p.inputs) and not p.extra_inputs:
        return False
    ins += [None] * (len(p.inputs) - len(ins))
    free = p._free
    fixed = all(_reference_tensor(q, ins[i]) for i, q in enumerate(p.inputs) if i not in free)
    pool = [ins[i] for i in free]
    return fixed and all(any(_reference_tensor(p.inputs[i], t) for t in pool) for i in free)


def _reference_tensor(p, t) -> bool:
    if isinstance(p, Var):
        return t is not None or p.optional
    if isinstance(p, Const):
        return isinstance(t, gs.Constant) if t is not None else p.optional
    if isinstance(p, Alt):
        return any(_reference_tensor(o, t) for o in p.options)
    if not isinstance(t, gs.Variable) or not t.inputs or t.inputs[0].outputs[0] is not t:
        return False
    return _reference_feasible(p, t.inputs[0])


def _mixed_graph_nodes() -> list:
    """Nodes of a synthetic transformer block model, an optional-input model and the chain."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "scale"))
    import make_synthetic

    nodes = list(ModelIR(make_synthetic.build(120)).graph.nodes)
    clip = [
        helper.make_node("Clip", ["x", "", "hi"], ["c"], name="clip"),
        helper.make_node("Dropout", ["c"], ["d"], name="drop"),
        helper.make_node("Relu", ["d"], ["y"], name="relu"),
    ]
    m = model(clip, [vi("x", [4])], [vi("y", None)], [const("hi", 6.0)])
    return nodes + list(ModelIR(m).graph.nodes) + list(_chain_model()[1].graph.nodes)


def test_compiled_prefilter_agrees_with_the_plain_walk_for_every_rule():
    nodes = _mixed_graph_nodes()
    patterns = [r.pattern for r in RULES.values() if r.pattern is not None] + PATTERNS
    assert len(patterns) > 40
    fits = 0
    for pattern in patterns:
        for node in nodes:
            want = _reference_feasible(pattern, node)
            assert feasible(pattern, node) == want, (pattern, node.name)
            fits += want
    assert fits > 100  # the models exercise the patterns, not only their root ops


class _Counting(Rule):
    name = "test-counting"
    pattern = Op("Relu", Op("Add", Op("Div", "x", "c"), "x", commute=True))
    tried = 0

    def candidates(self, node, cx):
        type(self).tried += 1
        yield from super().candidates(node, cx)

    def rewrite(self, m, b):
        raise AssertionError("never matches")


def test_driver_builds_no_candidate_where_the_pattern_cannot_fit():
    _, ir = _chain_model()
    cx = PassContext(target=get_target("cpu"), level=2, ir=ir)
    _Counting.tried = 0
    run_pass(RuleSetPass([_Counting()]), ir, cx)
    assert _Counting.tried == 0
    assert cx.stats["test-counting"].attempts == 0


def _graph(n_layers: int = 30) -> gs.Graph:
    nodes, prev = [], "x"
    for i in range(n_layers):
        nodes.append(helper.make_node("Relu", [prev], [f"r{i}"], name=f"relu{i}"))
        nodes.append(helper.make_node("Add", [f"r{i}", prev], [f"a{i}"], name=f"add{i}"))
        prev = f"a{i}"
    nodes.append(helper.make_node("Identity", [prev], ["y"], name="out"))
    m = model(nodes, [vi("x", [2])], [vi("y", None)])
    return ModelIR(m).graph


def _reference_toposort(nodes: list) -> list:
    """Kahn's algorithm taking the earliest ready node by current position, written plainly."""
    position = {id(n): i for i, n in enumerate(nodes)}
    producer = {id(t): n for n in nodes for t in n.outputs}
    done: set[int] = set()
    order = []
    while len(order) < len(nodes):
        ready = [
            n
            for n in nodes
            if id(n) not in done
            and all(
                id(producer[id(t)]) in done or producer[id(t)] is n
                for t in n.inputs
                if id(t) in producer
            )
        ]
        first = min(ready, key=lambda n: position[id(n)])
        done.add(id(first))
        order.append(first)
    return order


def test_toposort_keeps_an_ordered_graph_and_sorts_any_shuffle_as_kahn_does():
    g = _graph()
    ordered = list(g.nodes)
    toposort(g)
    assert all(a is b for a, b in zip(g.nodes, ordered))
    rng = random.Random(0)
    for _ in range(5):
        shuffled = list(ordered)
        rng.shuffle(shuffled)
        g.nodes = list(shuffled)
        toposort(g)
        assert [n.name for n in g.nodes] == [n.name for n in _reference_toposort(shuffled)]


def test_toposort_refuses_a_cycle():
    g = _graph(2)
    first, last = g.nodes[0], g.nodes[-1]
    first.inputs[0] = last.outputs[0]
    with pytest.raises(ValueError, match="cycle"):
        ir_module.toposort(g)


def test_dce_sweep_drops_what_reaches_no_output_and_keeps_the_order():
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Neg", ["r"], ["dead1"], name="neg"),
        helper.make_node("Abs", ["dead1"], ["dead2"], name="abs"),
        helper.make_node("Sqrt", ["r"], ["s"], name="sqrt"),
        helper.make_node("Add", ["r", "s"], ["y"], name="add"),
    ]
    m = model(nodes, [vi("x", [3]), vi("unused", [1])], [vi("y", None)])
    ir = ModelIR(m)
    dead = [n for n in ir.graph.nodes if n.name in ("neg", "abs")]
    assert sweep(ir.graph) == 2
    assert [n.name for n in ir.graph.nodes] == ["relu", "sqrt", "add"]
    assert all(not n.inputs and not n.outputs for n in dead)
    assert [t.name for t in ir.graph.inputs] == ["x", "unused"]
    assert sweep(ir.graph) == 0
    out = ir.to_onnx()
    assert check_parity(m, out, seed=0).ok


def test_dce_inside_a_body_keeps_what_the_body_reads_from_outside():
    then_g = helper.make_graph(
        [helper.make_node("Mul", ["t", "t"], ["o"], name="sq")], "then", [], [vi("o", [2])]
    )
    else_g = helper.make_graph(
        [helper.make_node("Identity", ["t"], ["e"], name="id")], "else", [], [vi("e", [2])]
    )
    nodes = [
        helper.make_node("Relu", ["x"], ["t"], name="relu"),
        helper.make_node("Neg", ["x"], ["dead"], name="neg"),
        helper.make_node("If", ["c"], ["y"], name="if", then_branch=then_g, else_branch=else_g),
    ]
    m = model(
        nodes,
        [vi("x", [2]), vi("c", [], elem=9)],
        [vi("y", [2])],
    )
    ir = ModelIR(m)
    cx = PassContext(target=get_target("cpu"), level=1, ir=ir)
    assert run_pass(DeadCodeElimination(), ir, cx)
    assert [n.name for n in ir.graph.nodes] == ["relu", "if"]
    feeds = {"x": np.array([1.0, -2.0], np.float32), "c": np.array(True)}
    assert check_parity(m, ir.to_onnx(), inputs=feeds, seed=0).ok


def _external_model(tmp_path, values):
    nodes = [helper.make_node("Add", ["x", "w"], ["y"], name="add")]
    m = model(nodes, [vi("x", [64, 64])], [vi("y", None)], [const("w", values)])
    path = tmp_path / "m.onnx"
    save_model(m, path, external=True)
    return path


def test_external_files_of_a_model_just_read_are_not_parsed_again(tmp_path, monkeypatch):
    path = _external_model(tmp_path, np.ones((64, 64)))
    load_model(path, lazy_external=True)
    expected = sorted(p.resolve() for p in tmp_path.iterdir() if p.name != "m.onnx")
    assert expected
    parsed = []
    real_load = onnx.load_model
    monkeypatch.setattr(onnx, "load_model", lambda *a, **k: parsed.append(a) or real_load(*a, **k))
    assert external_data_files(path) == expected
    assert not parsed
    # the file changed since it was read: parsed again
    other = tmp_path / "other"
    other.mkdir()
    moved = _external_model(other, np.full((64, 64), 2.0))
    os.replace(moved, path)
    external_data_files(path)
    assert parsed


def test_the_validity_session_loads_without_copying_weights(monkeypatch):
    """Parity reuses it and runs it once: pre-packing the weights would cost more than it saves
    (the sessions parity makes itself are built the same way)."""
    from graphopt.opt import optimizer
    from graphopt.opt.verify import parity

    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")]
    w = np.random.default_rng(0).random((16, 16)).astype(np.float32)
    m = model(nodes, [vi("x", [4, 16])], [vi("y", None)], [const("w", w)])
    made = []
    real = optimizer.Session

    def recorded(*args, config=None, **kw):
        made.append(config)
        return real(*args, config=config, **kw)

    monkeypatch.setattr(optimizer, "Session", recorded)
    optimizer.optimize(m, check=False)
    assert made == [optimizer.CHECK_ONLY]
    assert optimizer.CHECK_ONLY["session.disable_prepacking"] == "1"
    made.clear()
    _, report = optimizer.optimize(m, check=True)
    assert report.parity.ok
    assert made[0] == optimizer.CHECK_ONLY == parity.LEAN_CONFIG  # as parity builds its own


def test_export_keeps_the_exported_graph_and_restores_the_model_fields(monkeypatch):
    nodes = [helper.make_node("Relu", ["x"], ["y"], name="relu")]
    m = model(nodes, [vi("x", [2])], [vi("y", None)])
    m.producer_name, m.doc_string = "exporter", "the model"
    m.metadata_props.add(key="k", value="v")
    ir = ModelIR(m)
    made = []
    real = ir_module.export_model
    monkeypatch.setattr(ir_module, "export_model", lambda *a: made.append(real(*a)) or made[-1])
    out = ir.to_onnx()
    assert out is made[0]  # no copy of the graph (and of every inline weight in it)
    assert (out.producer_name, out.doc_string) == ("exporter", "the model")
    assert [(p.key, p.value) for p in out.metadata_props] == [("k", "v")]
    assert [(o.domain, o.version) for o in out.opset_import] == [("", 17)]
    assert out.graph.name == m.graph.name


def _custom_domain_model(imported: bool) -> onnx.ModelProto:
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Gelu", ["r"], ["g"], name="gelu", domain="com.microsoft"),
        helper.make_node("Neg", ["g"], ["y"], name="neg"),
    ]
    g = helper.make_graph(nodes, "g", [vi("x", [2, 3])], [vi("y", [2, 3])])
    opsets = [helper.make_opsetid("", 17)]
    if imported:
        opsets.append(helper.make_opsetid("com.microsoft", 1))
    return helper.make_model(g, opset_imports=opsets)


@pytest.mark.parametrize("imported", [False, True])
def test_shape_inference_of_an_unimported_custom_domain_fails_without_exporting(
    imported, monkeypatch
):
    from graphopt.opt.graph import analysis

    m = _custom_domain_model(imported)
    try:
        onnx.shape_inference.infer_shapes(m, check_type=False, strict_mode=False)
        onnx_ok = True
    except onnx.shape_inference.InferenceError:
        onnx_ok = False
    assert onnx_ok == imported  # onnx itself refuses the unimported domain
    ir = ModelIR(m)
    ir.graph.nodes[1].outputs[0].shape = None  # as a rule leaves a contrib output untyped
    ir.graph.nodes[0].name = "relu2"  # a node the inference has to export
    exported = []
    real = analysis.OnnxExporter.export_node
    monkeypatch.setattr(
        analysis.OnnxExporter, "export_node", lambda n: exported.append(n.name) or real(n)
    )
    assert analysis.infer_shapes(ir) == imported
    assert exported == (["relu2"] if imported else [])


def _shape_of_import(graph: gs.Graph) -> list:
    """Everything an imported graph is made of, objects named by their first-seen position."""
    ids: dict[int, int] = {}

    def ref(obj) -> int:
        return ids.setdefault(id(obj), len(ids))

    def tensor(t) -> tuple:
        kind = type(t).__name__
        return (
            ref(t),
            kind,
            t.name,
            str(t.dtype),
            t.shape,
            [ref(n) for n in t.inputs],
            [ref(n) for n in t.outputs],
            [(k, v) for k, v in vars(t).items() if k not in ("_values", "inputs", "outputs")],
            type(getattr(t, "_values", None)).__name__,
        )

    out = [[tensor(t) for t in graph.inputs], [tensor(t) for t in graph.outputs]]
    for n in graph.nodes:
        attrs = {
            k: _shape_of_import(v) if isinstance(v, gs.Graph) else repr(v)
            for k, v in n.attrs.items()
        }
        out.append(
            (
                ref(n),
                n.op,
                n.name,
                n.domain,
                attrs,
                list(vars(n)),
                [tensor(t) for t in n.inputs],
                [tensor(t) for t in n.outputs],
            )
        )
    return out


def test_nodes_and_initializers_import_as_graphsurgeon_builds_them(monkeypatch):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "scale"))
    import make_synthetic
    from onnx_graphsurgeon.importers.onnx_importer import OnnxImporter

    then_g = helper.make_graph(
        [helper.make_node("Add", ["r", "undefined"], ["o"], name="inner")],
        "then",
        [],
        [vi("o", [2])],
    )
    else_g = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["e"], name="id")], "else", [], [vi("e", [2])]
    )
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu", domain="ai.onnx"),
        helper.make_node("Clip", ["r", "", "hi"], ["c"], name="clip"),
        helper.make_node("Constant", [], ["k"], name="k", value=const("v", [1.0, 2.0])),
        helper.make_node("Add", ["c", "k"], ["s"], name="add"),
        helper.make_node("If", ["cond"], ["y"], name="if", then_branch=then_g, else_branch=else_g),
        helper.make_node("Resize", ["s", "", "sc"], ["z"], name="rs", mode="nearest"),
    ]
    m = helper.make_model(
        helper.make_graph(
            nodes,
            "g",
            [vi("x", [2]), vi("cond", [], elem=onnx.TensorProto.BOOL)],
            [vi("y", [2]), vi("z", None)],
            [const("hi", 6.0), const("sc", [2.0])],
        ),
        opset_imports=[helper.make_opsetid("", 18)],
    )
    for case in (m, make_synthetic.build(200)):
        fast = _shape_of_import(gs.import_onnx(case))
        monkeypatch.setattr(OnnxImporter, "import_node", staticmethod(ir_module._gs_import_node))
        monkeypatch.setattr(
            OnnxImporter, "import_tensor", staticmethod(ir_module._gs_import_tensor)
        )
        slow = _shape_of_import(gs.import_onnx(case))
        monkeypatch.undo()
        assert fast == slow


def test_match_nodes_follow_stashes_and_stay_the_callers():
    from graphopt.opt.rewrite.engine import Match

    _, ir = _chain_model()
    mul, add, relu = ir.graph.nodes[:3]
    m = Match(relu, {"Relu": relu, "x": relu.inputs[0], "Add": add})
    assert m.nodes() == [relu, add]
    m.nodes().append(mul)  # the caller's own list
    assert m.nodes() == [relu, add]
    m.stash(Mul=mul, scale=2.0)
    assert m.nodes() == [relu, add, mul]


def test_first_shape_inference_reuses_the_protos_read_unless_a_node_changed(monkeypatch):
    from graphopt.opt.graph import analysis

    nodes = [
        helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0], name="tr"),
        helper.make_node("Relu", ["t"], ["r"], name="relu"),
        helper.make_node("Unsqueeze", ["r", "ax"], ["y"], name="unsq"),
    ]
    m = model(nodes, [vi("x", [2, 3])], [vi("y", None)], [const("ax", [0], np.int64)])
    exported = []
    real = analysis.OnnxExporter.export_node
    monkeypatch.setattr(
        analysis.OnnxExporter, "export_node", lambda n: exported.append(n.name) or real(n)
    )
    ir = ModelIR(m)
    assert analysis.infer_shapes(ir) and not exported
    assert [n.outputs[0].shape for n in ir.graph.nodes[:2]] == [[3, 2], [3, 2]]
    changed = ModelIR(m)
    changed.graph.nodes[0].attrs["perm"][:] = [0, 1]  # edited in place before any inference
    assert analysis.infer_shapes(changed) and exported == ["tr"]
    assert [n.outputs[0].shape for n in changed.graph.nodes[:2]] == [[2, 3], [2, 3]]


def test_fresh_names_avoid_every_name_the_graph_uses():
    then_g = helper.make_graph(
        [helper.make_node("Neg", ["x"], ["o"], name="inner")], "then", [], [vi("o", [2])]
    )
    nodes = [
        helper.make_node("Clip", ["x", "", "hi"], ["c"], name="clip"),
        helper.make_node("If", ["cond"], ["y"], name="if", then_branch=then_g, else_branch=then_g),
        helper.make_node("Add", ["c", "y"], ["z"], name="add"),
    ]
    m = helper.make_model(
        helper.make_graph(
            nodes,
            "g",
            [vi("x", [2]), vi("cond", [], elem=onnx.TensorProto.BOOL), vi("unused", [1])],
            [vi("z", [2])],
            [const("hi", 6.0)],
        ),
        opset_imports=[helper.make_opsetid("", 18)],
    )
    ir = ModelIR(m)
    tensors = set(ir.graph.tensors())
    # both branches are the same body: the second one's node gets its body's name in front
    assert ir._names.used == tensors | {"clip", "if", "add", "inner", "then/inner"}
    assert "" not in ir._names.used and "unused" in tensors
    assert ir.fresh_name("clip") == "clip_0" and ir.fresh_name("inner") == "inner_1"


@pytest.mark.parametrize("rel", [0.0, 1e-3])
@pytest.mark.parametrize(
    "values",
    [[1.0], [1.0005], [0.999], [np.nan], [np.inf], [1.0, 1.0], [1.0, 1.01], [True], [1], [-1.0]],
)
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, np.int64, np.bool_])
def test_value_leaf_of_one_element_reads_as_the_array_check(values, dtype, rel):
    if dtype is np.bool_ and not all(v in (0, 1, True) for v in values):
        return
    with np.errstate(invalid="ignore"):
        arr = np.array(values).astype(dtype)
    leaf = Const("c", value=1.0, rel=rel)
    t = gs.Constant("c", arr)
    whole = leaf._near(arr.flat[0]) and leaf._near(arr)
    assert leaf.accepts(t) == bool(whole)


def test_export_in_place_is_graphsurgeons_export_byte_for_byte():
    """export_model builds the message gs.export_onnx builds (each weight copied once): a graph
    with an If (subgraphs), a local function, a sparse initializer, value_info and doc strings."""
    rng = np.random.default_rng(0)
    branch = lambda name, op: helper.make_graph(  # noqa: E731
        [helper.make_node(op, ["r"], [f"{name}_out"], name=f"{name}_n")],
        name,
        [],
        [vi(f"{name}_out", [2, 3])],
    )
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu", doc_string="a relu"),
        helper.make_node("Greater", ["s", "zero"], ["c"], name="gt"),
        helper.make_node(
            "If",
            ["c"],
            ["i"],
            name="if",
            then_branch=branch("t", "Neg"),
            else_branch=branch("e", "Abs"),
        ),
        helper.make_node("Twice", ["i"], ["f"], name="fn", domain="local"),
        helper.make_node("Add", ["f", "W"], ["a"], name="add"),
        helper.make_node("MatMul", ["a", "S"], ["y"], name="mm"),
    ]
    fn = helper.make_function(
        "local",
        "Twice",
        ["u"],
        ["v"],
        [helper.make_node("Add", ["u", "u"], ["v"])],
        [helper.make_opsetid("", 17)],
    )
    sparse = helper.make_sparse_tensor(
        numpy_helper.from_array(np.array([1.0, 2.0], np.float32), "S"),
        numpy_helper.from_array(np.array([0, 4], np.int64), "S_idx"),
        [3, 2],
    )
    g = helper.make_graph(
        nodes,
        "g",
        [vi("x", [2, 3]), vi("s", [])],
        [vi("y", [2, 2])],
        [const("W", rng.standard_normal((2, 3))), const("zero", np.zeros((), np.float32))],
        doc_string="the graph",
        value_info=[vi("r", [2, 3])],
        sparse_initializer=[sparse],
    )
    m = helper.make_model(
        g,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("local", 1)],
        functions=[fn],
    )
    root = gs.import_onnx(m)  # graphsurgeon's own import keeps the function and the sparse one
    a = gs.export_onnx(root, do_type_check=False)
    b = ir_module.export_model(root)
    assert len(b.graph.node) == 6 and len(b.functions) == 1 and len(b.graph.sparse_initializer) == 1
    assert a.SerializeToString() == b.SerializeToString()


def _down(n: int) -> int:
    return 0 if n == 0 else 1 + _down(n - 1)


def test_analyses_may_go_deeper_than_the_default_recursion_limit():
    """GPT-2 in fp16 (a Cast around every op) took dim analyses over 2,000 calls deep: an
    internal error before the optimizer raised the interpreter's limit while it runs."""
    from graphopt.opt.optimizer import RECURSION_LIMIT, deep_recursion

    limit = sys.getrecursionlimit()
    with pytest.raises(RecursionError):
        _down(max(limit, 1000) + 100)
    with deep_recursion():
        assert _down(RECURSION_LIMIT // 2) == RECURSION_LIMIT // 2
    assert sys.getrecursionlimit() == limit  # restored


def test_an_analysis_too_deep_for_the_limit_leaves_the_rewrite_with_a_remark():
    from graphopt.opt.rewrite import engine as rewrite

    class Deep:
        exclusive = False
        quantization_aware = True

        def check(self, m, cx):
            _down(sys.getrecursionlimit() + 10)

    with pytest.raises(rewrite.NoMatch) as e:
        rewrite._guards(None, Deep(), None, None)
    assert e.value.code == "analysis-too-deep" and not e.value.structural


def test_domains_a_rewrite_adds_are_imported_in_the_same_order_in_every_process(tmp_path):
    """The exporter gathers used domains in a set, whose order follows the string hash seed of
    the process: the output's bytes changed from run to run when two domains were added."""
    import subprocess

    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="r"),
        helper.make_node("Custom", ["a"], ["b"], domain="zz.custom", name="z"),
        helper.make_node("Custom", ["b"], ["y"], domain="aa.custom", name="a"),
    ]
    graph = helper.make_graph(nodes, "g", [vi("x", [4])], [vi("y", [4])])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    # (the custom domains are not imported: the export adds them, as for a rewrite's new ops)
    src = tmp_path / "m.onnx"
    onnx.save(m, src)
    code = (
        "import onnx, sys; from graphopt.opt.graph.ir import ModelIR; "
        "m = ModelIR(onnx.load(sys.argv[1])).to_onnx(); "
        "print([o.domain for o in m.opset_import])"
    )
    runs = {
        subprocess.run(
            [sys.executable, "-c", code, str(src)],
            env={**os.environ, "PYTHONHASHSEED": str(seed)},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in range(6)
    }
    assert runs == {"['', 'aa.custom', 'zz.custom']\n"}
