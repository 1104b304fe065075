"""Hostile and broken inputs: one clear line, a documented exit code, the input untouched,
nothing half-written.  Also a byte-mutation fuzz of a real model file."""

import os
import random

import numpy as np
import onnx
import pytest
from onnx import helper

from cli_runner import CliRunner
from conftest import EXAMPLES, const, model, vi
from graphopt.cli import app

runner = CliRunner()


def raw_model(nodes, inputs, outputs, inits=(), opsets=(("", 17),)):
    """A model built without validation (it is meant to be invalid)."""
    g = helper.make_graph(nodes, "hostile", inputs, outputs, list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])


X, Y = vi("x", [2]), vi("y", [2])
CASES = {
    "cycle": raw_model(
        [helper.make_node("Relu", ["b"], ["a"]), helper.make_node("Relu", ["a"], ["b"])],
        [X],
        [vi("b", [2])],
    ),
    "duplicate-names": raw_model(
        [helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Neg", ["x"], ["y"])], [X], [Y]
    ),
    "undefined-input": raw_model([helper.make_node("Add", ["x", "ghost"], ["y"])], [X], [Y]),
    "future-opset": raw_model(
        [helper.make_node("Relu", ["x"], ["y"])], [X], [Y], opsets=(("", 99),)
    ),
    "no-opset-for-domain": raw_model(
        [helper.make_node("Foo", ["x"], ["y"], domain="acme")], [X], [Y]
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_invalid_models_fail_cleanly(case, tmp_path):
    p = tmp_path / f"{case}.onnx"
    p.write_bytes(CASES[case].SerializeToString())
    before = p.read_bytes()
    res = runner.invoke(app, ["optimize", str(p), "-o", str(tmp_path / "out")])
    assert res.exit_code == 1, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), res.stderr
    assert "Traceback" not in res.output
    assert p.read_bytes() == before and not (tmp_path / "out").exists()
    assert sorted(x.name for x in tmp_path.iterdir()) == [p.name]


def test_unknown_domain_is_passed_through(tmp_path):
    m = raw_model(
        [
            helper.make_node("Relu", ["x"], ["r"]),
            helper.make_node("Identity", ["r"], ["i"]),
            helper.make_node("Foo", ["i"], ["y"], domain="acme"),
        ],
        [X],
        [Y],
        opsets=(("", 17), ("acme", 1)),
    )
    p = tmp_path / "custom.onnx"
    p.write_bytes(m.SerializeToString())
    res = runner.invoke(app, ["optimize", str(p), "-o", str(tmp_path / "o"), "--format", "json"])
    assert res.exit_code in (0, 4), res.output  # 4 when the target reports it cannot run it
    out = onnx.load(tmp_path / "o" / "model.onnx")
    foo = [n for n in out.graph.node if n.op_type == "Foo"]
    assert len(foo) == 1 and foo[0].domain == "acme" and foo[0].output[0] == "y"
    assert [n.op_type for n in out.graph.node] == ["Relu", "Foo"]


def test_unwritable_output_location(tmp_path):
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    res = runner.invoke(
        app, ["optimize", str(EXAMPLES / "mobilenet_bn.onnx"), "-o", str(blocker / "out")]
    )
    assert res.exit_code == 2 and len(res.stderr.strip().splitlines()) == 1


def test_output_equal_to_input(tmp_path):
    p = tmp_path / "m.onnx"
    p.write_bytes((EXAMPLES / "mobilenet_bn.onnx").read_bytes())
    res = runner.invoke(app, ["optimize", str(p), "-o", str(p)])
    assert res.exit_code == 2 and p.read_bytes() == (EXAMPLES / "mobilenet_bn.onnx").read_bytes()


def _mutations(data: bytes, n: int, seed: int):
    rng = random.Random(seed)
    for _ in range(n):
        b = bytearray(data)
        kind = rng.randrange(3)
        if kind == 0:  # flip bits
            for _ in range(rng.randint(1, 8)):
                i = rng.randrange(len(b))
                b[i] ^= 1 << rng.randrange(8)
        elif kind == 1:  # truncate
            b = b[: rng.randrange(len(b))]
        else:  # splice garbage
            i = rng.randrange(len(b))
            b[i:i] = os.urandom(rng.randint(1, 64))
        yield bytes(b)


MUTATIONS_PER_RUN = 300


def test_byte_mutation_fuzz_only_yields_clean_outcomes(tmp_path):
    """Mutated model files either optimize (exit 0/3/4) or fail with a clean one-line error."""
    src = _small_real_model()
    outcomes = {}
    for k, data in enumerate(_mutations(src.SerializeToString(), MUTATIONS_PER_RUN, seed=1234)):
        p = tmp_path / f"m{k}.onnx"
        p.write_bytes(data)
        res = runner.invoke(app, ["optimize", str(p), "-o", str(tmp_path / f"o{k}"), "-q"])
        assert res.exit_code in (0, 1, 2, 3, 4), (k, res.output)
        assert "internal error" not in res.stderr and "Traceback" not in res.output, (k, res.stderr)
        if res.exit_code == 1:
            assert len(res.stderr.strip().splitlines()) == 1, (k, res.stderr)
            assert not (tmp_path / f"o{k}").exists()
        assert p.read_bytes() == data
        outcomes[res.exit_code] = outcomes.get(res.exit_code, 0) + 1
    assert outcomes.get(1, 0) > 0


def _small_real_model():
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Conv", ["x", "W", "B"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("Flatten", ["r"], ["f"]),
        helper.make_node("MatMul", ["f", "M"], ["m"]),
        helper.make_node("Add", ["m", "b2"], ["y"]),
    ]
    return model(
        nodes,
        [vi("x", [1, 2, 4, 4])],
        [vi("y", [1, 3])],
        [
            const("W", rng.standard_normal((4, 2, 3, 3))),
            const("B", np.zeros(4)),
            const("M", rng.standard_normal((64, 3))),
            const("b2", np.ones(3)),
        ],
    )


def test_external_data_model_round_trip_through_cli(tmp_path):
    from graphopt.opt.graph.io import save_model

    src = tmp_path / "ext" / "m.onnx"
    save_model(_small_real_model(), src, external=True)
    res = runner.invoke(app, ["optimize", str(src), "-o", str(tmp_path / "o"), "-q"])
    assert res.exit_code == 0, res.output
    assert onnx.load(tmp_path / "o" / "model.onnx").graph.node


@pytest.mark.parametrize("where", ["initializer", "constant"])
def test_raw_data_of_the_wrong_size_is_one_line(tmp_path, where):
    """A weight whose raw bytes disagree with its dims (a mutated or hand-edited file) is refused
    at load with one line naming it, exit 1 — not an error from deep inside a pass."""
    w = onnx.numpy_helper.from_array(np.ones((2, 3), np.float32), "w")
    w.dims[:] = [1, 3]  # 24 bytes held, 12 declared (onnx's checker refuses only too few)
    if where == "initializer":
        nodes, inits = [helper.make_node("Add", ["x", "w"], ["y"])], [w]
    else:
        nodes = [
            helper.make_node("Constant", [], ["w"], value=w),
            helper.make_node("Add", ["x", "w"], ["y"]),
        ]
        inits = []
    p = tmp_path / "m.onnx"
    onnx.save(model(nodes, [vi("x", [4, 3])], [vi("y", [4, 3])], inits), p)
    res = runner.invoke(app, ["optimize", str(p), "-o", str(tmp_path / "o"), "-q"])
    assert res.exit_code == 1, res.output
    assert res.stderr.strip() == (
        f"error: {p}: tensor 'w' holds 24 bytes of raw data; its dims [1, 3] and type FLOAT need 12"
    )
    assert not (tmp_path / "o").exists()
