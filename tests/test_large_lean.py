"""Parity of models with large external weights runs lean: piece by piece, one piece's weights
in memory at a time, with the same results as one session of the whole model."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphopt
from conftest import EXAMPLES, const, model, vi
from graphopt.opt import optimizer
from graphopt.opt.errors import UsageError
from graphopt.opt.graph.io import load_model
from graphopt.opt.verify import parity
from graphopt.opt.verify.parity import (
    LEAN_CONFIG,
    Pieces,
    Session,
    check_parity,
    is_lean,
    make_inputs,
    open_session,
)
from graphopt.targets import bundle as bundle_mod

BUDGET = 100 << 10  # bytes: the tiny decoder below has ~0.7 MB of weights (wpe 256 KiB)


def _decoder(tmp_path, layers: int = 2):
    spec = importlib.util.spec_from_file_location(
        "make_gpt", EXAMPLES / "large/make_gpt_decoder.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    path = tmp_path / "dec" / "model.onnx"
    mod.build(path, layers=layers, hidden=64, heads=4, vocab=100, seed=0)
    return path


def _feeds(m):
    return make_inputs(Pieces(m).sess, {"input_ids": [1, 8]}, 0)


def test_pieces_compute_what_one_session_computes(tmp_path):
    path = _decoder(tmp_path)
    m = load_model(path, lazy_external=True)
    pieces = Pieces(m, base_dir=path.parent, budget=BUDGET)
    plan = pieces.plan({"logits"})
    assert len(plan) > 3
    # within the budget (small weights may overflow it by an eighth), or one larger weight
    wpe = 1024 * 64 * 4
    sizes = sorted(p.weights for p in plan)
    assert sizes[-2] <= BUDGET * 9 // 8 < wpe <= sizes[-1]
    assert [i for p in plan for i in p.nodes] == list(range(len(m.graph.node)))
    feeds = _feeds(m)
    every = [o for n in m.graph.node for o in n.output]
    whole = Session(parity._with_outputs(m, every), base_dir=path.parent, config=LEAN_CONFIG)
    expected = whole.run(feeds, every)
    got = Pieces(parity._with_outputs(m, every), base_dir=path.parent, budget=BUDGET).run(
        feeds, every
    )
    for name, a, b in zip(every, expected, got):
        assert np.array_equal(a, b), name  # bit for bit
    # asked for out of order, and a graph input among them
    logits, ids = pieces.run(feeds, ["logits", "input_ids"])
    assert np.array_equal(logits, expected[-1]) and np.array_equal(ids, feeds["input_ids"])


def test_optimize_runs_parity_of_a_large_model_in_pieces(tmp_path, monkeypatch):
    """Above the budget both sides run in pieces and no whole-model session is kept for parity:
    every session that runs holds at most the budget's weights, or one larger weight."""
    path = _decoder(tmp_path)
    monkeypatch.setenv("GRAPHOPT_PIECE_MB", str(BUDGET / 2**20))
    held = []
    real_init = Session.__init__

    def spy(self, m, *a, **kw):
        held.append((sum(parity.tensor_nbytes(t) for t in m.graph.initializer), kw.get("config")))
        real_init(self, m, *a, **kw)

    runs = []
    real_run = Pieces.run
    monkeypatch.setattr(Session, "__init__", spy)
    monkeypatch.setattr(Pieces, "run", lambda self, *a: runs.append(1) or real_run(self, *a))
    out, report = graphopt.optimize(path, target="cpu", shapes={"input_ids": [1, 8]})
    assert report.parity.ran and report.parity.ok, report.parity
    assert "com.microsoft.MultiHeadAttention" in report.ops_after
    assert len(runs) == 2  # the original, then the optimized model
    running = [w for w, config in held if config is not optimizer.CHECK_ONLY]
    assert running and max(running) == 1024 * 64 * 4  # wpe, the largest weight, alone
    assert not optimizer._LOADED


def test_lean_parity_localizes_in_pieces(tmp_path):
    path = _decoder(tmp_path)
    m = load_model(path, lazy_external=True)
    bad = onnx.ModelProto()
    bad.CopyFrom(m)
    for i, t in enumerate(bad.graph.initializer):
        if t.name == "l1_up_bias":
            w = numpy_helper.to_array(t, str(path.parent)) + 1.0
            bad.graph.initializer[i].CopyFrom(numpy_helper.from_array(w, t.name))
    monkey_budget = {"GRAPHOPT_PIECE_MB": str(BUDGET / 2**20)}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in monkey_budget.items():
            mp.setenv(k, v)
        assert is_lean(m)
        report = check_parity(m, bad, shapes={"input_ids": [1, 8]}, base_dir=path.parent)
    assert report.ran and not report.ok
    assert report.first_divergence["tensor"] == "l1_up_out"


def _if_model():
    """An If whose branches read an outer-scope weight and an outer value."""
    w = const("w", np.arange(4096, dtype=np.float32).reshape(64, 64) / 4096)
    w2 = const("w2", np.full((64, 64), 0.5, np.float32))
    then = helper.make_graph(
        [helper.make_node("MatMul", ["h", "w"], ["t"])], "then", [], [vi("t", [1, 64])]
    )
    other = helper.make_graph(
        [helper.make_node("Add", ["h", "h"], ["e"])], "else", [], [vi("e", [1, 64])]
    )
    nodes = [
        helper.make_node("MatMul", ["x", "w2"], ["h"]),
        helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
        helper.make_node("Greater", ["s", "zero"], ["c"]),
        helper.make_node("If", ["c"], ["y0"], then_branch=then, else_branch=other),
        helper.make_node("Relu", ["y0"], ["y"]),
    ]
    return model(
        nodes, [vi("x", [1, 64])], [vi("y", [1, 64])], [w, w2, const("zero", 0.0)], opset=17
    )


def test_pieces_carry_what_subgraphs_read_from_outside():
    m = _if_model()
    pieces = Pieces(m, budget=16 << 10)  # one 16 KiB weight per piece
    plan = pieces.plan({"y"})
    assert len(plan) == 2 and "h" in plan[1].inputs
    values = {"h": np.zeros((1, 64), np.float32), "c": np.array(True)}
    assert "w" in {t.name for t in pieces._model_of(plan[1], {}, values).graph.initializer}
    for sign in (1.0, -1.0):
        x = {"x": np.full((1, 64), sign, np.float32)}
        (expected,) = Session(m, config=LEAN_CONFIG).run(x, ["y"])
        (got,) = pieces.run(x, ["y"])
        assert np.array_equal(expected, got)


def test_a_graph_that_cannot_be_cut_runs_whole_and_lean():
    m = _if_model()
    nodes = list(m.graph.node)
    del m.graph.node[:]
    m.graph.node.extend(reversed(nodes))  # onnxruntime sorts it; pieces could not
    sess = open_session(m, lean=True, budget=16 << 10)
    assert isinstance(sess, Session) and sess.sess  # one session, weights not pre-packed
    assert isinstance(open_session(_if_model(), lean=True, budget=16 << 10), Pieces)
    # a piece holds about the largest tensor (16 KiB) when the budget is larger
    assert open_session(_if_model(), lean=True, budget=64 << 10).budget == 16 << 10
    assert open_session(_if_model(), lean=True, budget=256 << 10).budget == 64 << 10


def test_piece_budget_from_the_environment(monkeypatch):
    monkeypatch.setenv("GRAPHOPT_PIECE_MB", "2")
    assert parity.piece_bytes() == 2 << 20
    monkeypatch.setenv("GRAPHOPT_PIECE_MB", "lots")
    with pytest.raises(UsageError, match="GRAPHOPT_PIECE_MB"):
        parity.piece_bytes()
    monkeypatch.delenv("GRAPHOPT_PIECE_MB")
    assert parity.piece_bytes() == parity.PIECE_BYTES


def test_a_string_tensor_crosses_pieces():
    w = const("w", np.ones((32, 32), np.float32))
    nodes = [
        helper.make_node("Identity", ["s"], ["s1"]),
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("MatMul", ["h", "w"], ["y"]),
        helper.make_node("Identity", ["s1"], ["s2"]),
    ]
    m = model(
        nodes,
        [vi("x", [1, 32]), vi("s", [2], TensorProto.STRING)],
        [vi("y", [1, 32]), vi("s2", [2], TensorProto.STRING)],
        [w],
    )
    feeds = {"x": np.ones((1, 32), np.float32), "s": np.array(["a", "bc"], dtype=object)}
    y, s2 = Pieces(m, budget=1).run(feeds, ["y", "s2"])
    assert s2.tolist() == ["a", "bc"] and np.all(y == 32 * 32)


def test_peak_memory_of_lean_parity_is_one_piece(tmp_path):
    """A model with 4 x 16 MiB external weights: parity's peak RSS grows by about one piece,
    not by the model (measured in fresh processes)."""
    w = [const(f"w{i}", np.eye(2048, dtype=np.float32) * (i + 1)) for i in range(4)]
    nodes = [
        helper.make_node("MatMul", ["x" if i == 0 else f"h{i}", f"w{i}"], [f"h{i + 1}"])
        for i in range(4)
    ]
    m = model(nodes, [vi("x", [1, 2048])], [vi("h4", [1, 2048])], w)
    path = tmp_path / "big" / "model.onnx"
    path.parent.mkdir()
    onnx.save(m, str(path), save_as_external_data=True, location="model.data", size_threshold=1024)
    script = textwrap.dedent(
        f"""
        def peak():  # MiB; VmHWM, as ru_maxrss carries the parent's peak across exec
            with open("/proc/self/status") as f:
                return next(int(l.split()[1]) for l in f if l.startswith("VmHWM")) // 1024
        from graphopt.opt.graph.io import load_model
        from graphopt.opt.verify.parity import check_parity
        m = load_model({str(path)!r}, check=False, lazy_external=True)
        base = peak()
        r = check_parity(m, m, base_dir={str(path.parent)!r})
        assert r.ok, r
        print(peak() - base)
        """
    )

    def grown(budget_mb: str) -> int:
        env = {"GRAPHOPT_PIECE_MB": budget_mb, "PATH": "/usr/bin:/bin"}
        out = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr
        return int(out.stdout.split()[-1])

    lean, whole = grown("16"), grown("1024")
    assert lean < 40, lean  # MiB: one 16 MiB weight at a time (+ the runtime's own)
    assert whole > lean + 32, (whole, lean)


def test_a_model_too_large_for_one_session_is_checked_in_pieces_only(tmp_path, monkeypatch):
    """External weights over the budget: the performance net does not time it (it would hold
    both models whole), the bundle's written files are run in pieces against the golden outputs,
    and the memory plan measures its unknown shapes in pieces: no session ever holds more than
    one piece's weights."""
    path = _decoder(tmp_path)
    monkeypatch.setenv("GRAPHOPT_PIECE_MB", str(BUDGET / 2**20))
    monkeypatch.delenv("GRAPHOPT_NO_MEASURE", raising=False)
    m = load_model(path, lazy_external=True)
    assert parity.too_large(m) and "GRAPHOPT_PIECE_MB" in parity.too_large(m)
    ran, sessions = [], parity.ort.InferenceSession
    real_init, real_run = sessions.__init__, sessions.run

    def spy_init(self, source, so=None, *a, **kw):
        real_init(self, source, so, *a, **kw)
        proto = onnx.load_from_string(source) if isinstance(source, bytes) else None
        self.held = (
            sum(parity.tensor_nbytes(t) for t in proto.graph.initializer) if proto else source
        )

    def spy_run(self, *a, **kw):
        ran.append(self.held)
        return real_run(self, *a, **kw)

    monkeypatch.setattr(sessions, "__init__", spy_init)
    monkeypatch.setattr(sessions, "run", spy_run)
    out, report = graphopt.optimize(path, target="cpu", shapes={"input_ids": [1, 8]})
    assert report.parity.ok and report.parity.pieces > 3
    assert "GRAPHOPT_PIECE_MB" in report.performance["why"]
    assert report.parity.shapes and "logits" in report.parity.shapes
    assert "shapes" not in report.parity.to_dict()
    measured_again = []
    monkeypatch.setattr(bundle_mod, "measured_view", lambda *a: measured_again.append(a) or {})
    bundle = graphopt.write_bundle(out, report, tmp_path / "b")
    assert not measured_again  # parity's run of the model measured its shapes
    manifest = json.loads((bundle / "manifest.json").read_text())
    checked = manifest["verified"]["bundle_session"]
    assert checked["golden_ok"] and checked["pieces"] > 3
    assert checked["as_deployed"].startswith("not-run")
    assert manifest["latency"] is None and not manifest["fast_path"]["written"]
    plan = json.loads((bundle / "memory_plan.json").read_text())
    assert plan["measured_shapes"] > 0
    # every session that ran held one piece: wpe alone at most (the validity check only loads)
    assert ran and max(ran) == 1024 * 64 * 4, ran


def test_inline_weights_run_whole(tmp_path, monkeypatch):
    """Weights in memory already run in one session, whatever their size; the same weights in
    external data over the budget run lean."""
    m = _if_model()
    assert not is_lean(m, 1) and parity.too_large(m) is None
    assert isinstance(open_session(m, budget=1), Session)
    path = tmp_path / "ext" / "model.onnx"
    path.parent.mkdir()
    onnx.save(m, str(path), save_as_external_data=True, location="model.data", size_threshold=1024)
    lazy = load_model(path, lazy_external=True)
    assert is_lean(lazy, 16 << 10) and not is_lean(lazy, 1 << 20)
    monkeypatch.setenv("GRAPHOPT_PIECE_MB", str(16 / 1024))
    assert isinstance(open_session(lazy, path.parent), Pieces)
    assert not parity.too_large(lazy)  # held whole up to WHOLE_PIECES budgets
    monkeypatch.setenv("GRAPHOPT_PIECE_MB", str(16 / 1024 / parity.WHOLE_PIECES))
    assert parity.too_large(lazy) and isinstance(open_session(lazy, path.parent), Pieces)


def test_generation_check_of_a_large_decoder_runs_in_pieces(tmp_path, monkeypatch):
    """A decoder with a KV cache whose external weights are over the budget: the generation
    loop runs both models in pieces, step after step, with the same tokens and logits as whole
    sessions."""
    from test_generation import tiny_decoder

    from graphopt.opt.verify.generation import check_generation

    m = tiny_decoder()
    whole = check_generation(m, m, prefill=5, steps=3)
    path = tmp_path / "dec" / "model.onnx"
    path.parent.mkdir()
    onnx.save(m, str(path), save_as_external_data=True, location="model.data", size_threshold=64)
    lazy = load_model(path, lazy_external=True)
    monkeypatch.setenv("GRAPHOPT_PIECE_MB", str(1 / 1024))  # 1 KiB: a weight or so per piece
    assert parity.too_large(lazy)
    runs = []
    real_run = Pieces.run
    monkeypatch.setattr(Pieces, "run", lambda self, *a: runs.append(1) or real_run(self, *a))
    lean = check_generation(lazy, lazy, prefill=5, steps=3, base_dir=path.parent)
    assert lean.ran and lean.ok, lean
    assert len(runs) == 2 * 4  # both models, the prefill and three decode steps
    assert lean.tokens_original == whole.tokens_original
    assert lean.max_abs == 0.0


def test_check_reads_external_weights_beside_each_model_lazily(tmp_path, monkeypatch):
    """``graphopt check`` on two external-data models in different folders: their weights are
    not read in at load (parity maps them, in pieces above the budget), and each resolves
    beside its own model."""
    from cli_runner import CliRunner
    from graphopt.cli import app
    from graphopt.opt.graph import io

    path = _decoder(tmp_path)
    out, report = graphopt.optimize(path, target="cpu", shapes={"input_ids": [1, 8]})
    bundle = graphopt.write_bundle(out, report, tmp_path / "elsewhere")
    monkeypatch.setenv("GRAPHOPT_PIECE_MB", str(BUDGET / 2**20))
    read_in = []
    real = io.external_data_helper.load_external_data_for_model
    monkeypatch.setattr(
        io.external_data_helper,
        "load_external_data_for_model",
        lambda *a, **kw: read_in.append(a) or real(*a, **kw),
    )
    args = ["check", path, bundle / "model.onnx", "--shape", "input_ids=1,8", "--format", "json"]
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["ok"] and doc["pieces"] > 3
    assert not read_in


def test_pieces_of_an_ir3_model_whose_weights_are_inputs():
    """IR 3 lists every initializer among the graph inputs; a piece holds only some of them."""
    w = [const(f"w{i}", np.eye(32, dtype=np.float32) * (i + 2)) for i in range(3)]
    nodes = [
        helper.make_node("MatMul", ["x" if i == 0 else f"h{i}", f"w{i}"], [f"h{i + 1}"])
        for i in range(3)
    ]
    inputs = [vi("x", [1, 32])] + [vi(f"w{i}", [32, 32]) for i in range(3)]
    m = model(nodes, inputs, [vi("h3", [1, 32])], w, ir_version=3, opset=8)
    x = {"x": np.ones((1, 32), np.float32)}
    pieces = Pieces(m, budget=4096)
    assert len(pieces.plan({"h3"})) == 3 and [i.name for i in pieces.get_inputs()] == ["x"]
    (got,) = pieces.run(x, ["h3"])
    assert np.array_equal(got, Session(m).run(x, ["h3"])[0]) and got[0, 0] == 24


def test_a_tied_decoder_keeps_one_copy_of_its_embedding(tmp_path):
    """The example's ``--tied`` form (LM head ``MatMul(x, Transpose(wte))``, wte also read by
    the token Gather), weights in external data: the written model holds wte once and is not
    bigger than the input."""
    spec = importlib.util.spec_from_file_location(
        "make_gpt", EXAMPLES / "large/make_gpt_decoder.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    path = tmp_path / "dec" / "model.onnx"
    mod.build(path, layers=2, hidden=64, heads=4, vocab=100, seed=0, tied=True)
    out, report = graphopt.optimize(path, target="cpu", shapes={"input_ids": [1, 8]})
    assert report.parity.ran and report.parity.ok, report.parity
    dims = [sorted(t.dims) for t in out.graph.initializer]
    assert dims.count([64, 100]) == 1
    assert "com.microsoft.FusedMatMul" in report.ops_after
    assert sum(parity.tensor_nbytes(t) for t in out.graph.initializer) <= sum(
        parity.tensor_nbytes(t) for t in load_model(path, lazy_external=True).graph.initializer
    )


def _chain(n: int, op: str = "Sigmoid") -> onnx.ModelProto:
    spec = importlib.util.spec_from_file_location("make_chain", EXAMPLES / "scale/make_chain.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.chain(n, op)


def test_a_graph_longer_than_one_session_is_built_for_is_checked_in_pieces(tmp_path, monkeypatch):
    """More main-graph nodes than twice GRAPHOPT_PIECE_NODES: parity runs both models in pieces
    of at most that many nodes, and the bundle is verified lean, without a fast path, saying
    why (onnxruntime's session creation grows faster than the node count)."""
    monkeypatch.setenv("GRAPHOPT_PIECE_NODES", "100")
    m = _chain(450, "Softsign")
    assert parity.too_many_nodes(m) and is_lean(m) and parity.too_large(m)
    plan = Pieces(m).plan({"y"})
    assert len(plan) == 5 and max(len(p.nodes) for p in plan) == 100
    out, report = graphopt.optimize(m, level=2, target="cpu", measure=False)
    assert report.parity.ran and report.parity.ok and report.parity.pieces == 5
    written = tmp_path / "bundle"
    graphopt.write_bundle(out, report, written)
    manifest = json.loads((written / "manifest.json").read_text())
    assert manifest["verified"]["bundle_session"]["pieces"] == 5
    assert "450 nodes" in manifest["fast_path"]["why"] and not manifest["fast_path"]["written"]
    monkeypatch.setenv("GRAPHOPT_PIECE_NODES", "many")
    with pytest.raises(UsageError, match="GRAPHOPT_PIECE_NODES"):
        parity.piece_nodes()
    monkeypatch.delenv("GRAPHOPT_PIECE_NODES")
    assert not parity.too_many_nodes(m) and not is_lean(m)


def test_the_validity_check_of_a_long_graph_loads_it_piece_by_piece(monkeypatch):
    """Each piece gets a session (its inputs typed from value_info) and none is whole; a piece
    onnxruntime refuses is the invalid output's reason."""
    monkeypatch.setenv("GRAPHOPT_PIECE_NODES", "100")
    m = _chain(450)  # no value_info: the crossing values are typed by shape inference
    built = []
    monkeypatch.setattr(parity.Session, "__init__", _counting(parity.Session.__init__, built))
    assert optimizer._invalid(m) is None
    assert len(built) == 5 and all(len(b.graph.node) <= 100 for b in built)
    m.graph.node[300].op_type = "NoSuchOp"
    assert "NoSuchOp" in optimizer._invalid(m, checker=False)  # refused by its piece


def _counting(init, built):
    def wrapped(self, model, *args, **kw):
        built.append(model)
        return init(self, model, *args, **kw)

    return wrapped
