"""What would crash or exhaust the machine if onnxruntime ran the model is said, not run."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import graphopt
from conftest import const, model, vi
from graphopt.opt.errors import GraphoptError
from graphopt.opt.verify import hazards
from graphopt.opt.verify.parity import Session


def int_div(a, b):
    return model(
        [helper.make_node("Div", ["a", "b"], ["q"]), helper.make_node("Add", ["q", "x"], ["y"])],
        [vi("x", [1], TensorProto.INT32)],
        [vi("y", [1], TensorProto.INT32)],
        [const("a", [a], np.int32), const("b", [b], np.int32)],
    )


def range_bomb(limit: int):
    return model(
        [
            helper.make_node("Range", ["s", "l", "d"], ["r"], name="bomb"),
            helper.make_node("Cast", ["r"], ["rf"], to=TensorProto.FLOAT),
            helper.make_node("Slice", ["rf", "st", "en"], ["sl"]),
            helper.make_node("Add", ["sl", "x"], ["y"]),
        ],
        [vi("x", [4])],
        [vi("y", [4])],
        [
            const("s", 0, np.int64),
            const("l", limit, np.int64),
            const("d", 1, np.int64),
            const("st", [0], np.int64),
            const("en", [4], np.int64),
        ],
    )


@pytest.mark.parametrize("a,b,words", [(-(2**31), -1, "divides -2147483648 by -1"), (7, 0, "zero")])
def test_trapping_integer_division_is_never_run(a, b, words):
    m = int_div(a, b)
    assert words in hazards.runtime_hazard(m)
    # (onnxruntime refuses a constant zero divisor itself when it loads the model)
    with pytest.raises(GraphoptError, match="SIGFPE|division by zero"):
        Session(m).run({"x": np.ones(1, np.int32)})
    _, report = graphopt.optimize(m, level=1)  # parity says why it could not run
    assert not report.parity.ran
    assert "SIGFPE" in report.parity.error or "division by zero" in report.parity.error


def test_a_safe_division_runs():
    assert hazards.runtime_hazard(int_div(7, 2)) is None


def test_a_range_bomb_is_neither_propagated_nor_run():
    """10^13 elements: shape inference does not compute them, parity does not run them."""
    m = range_bomb(10**13)
    assert "Range 'bomb'" in hazards.runtime_hazard(m)
    _, report = graphopt.optimize(m, level=1)
    assert not report.parity.ran and "GiB" in report.parity.error
    assert hazards.runtime_hazard(range_bomb(64)) is None


def scan_bomb(trips: int):
    """A Loop stacking a 4 MiB constant ``trips`` times as its scan output."""
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            helper.make_node("Identity", ["big"], ["scan"]),
        ],
        "body",
        [vi("i", [], TensorProto.INT64), vi("cond_in", [], TensorProto.BOOL)],
        [vi("cond_out", [], TensorProto.BOOL), vi("scan", [1024, 1024])],
        [const("big", np.zeros((1024, 1024)))],
    )
    return model(
        [
            helper.make_node("Loop", ["n", ""], ["s"], body=body, name="stack"),
            helper.make_node("ReduceSum", ["s"], ["r"], keepdims=0),
            helper.make_node("Add", ["r", "x"], ["y"]),
        ],
        [vi("x", [])],
        [vi("y", [])],
        [const("n", trips, np.int64)],
    )


def test_a_loop_stacking_scan_outputs_past_the_bound_is_not_run():
    """10^5 trips of 4 MiB: 391 GiB of scan outputs, said instead of run (the run would fill
    the memory); 4 trips run."""
    why = hazards.runtime_hazard(scan_bomb(100_000))
    assert "Loop 'stack' stacks 391 GiB of scan outputs" in why
    _, report = graphopt.optimize(scan_bomb(100_000), level=1)
    assert not report.parity.ran and "scan outputs" in report.parity.error
    assert hazards.runtime_hazard(scan_bomb(4)) is None


def test_a_run_past_its_time_is_cut_short(monkeypatch):
    monkeypatch.setenv("GRAPHOPT_RUN_SECONDS", "0")
    m = model([helper.make_node("Relu", ["x"], ["y"])], [vi("x", [4])], [vi("y", [4])])
    with pytest.raises(GraphoptError, match="did not end within"):
        Session(m).run({"x": np.ones(4, np.float32)})


def _graphopt(args, env, tmp_path):
    import os
    import subprocess
    import sys

    code = "import sys; from graphopt.cli import console; sys.argv[1:] = sys.argv[1:]; console()"
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )


def test_a_run_past_its_time_budget_ends_naming_the_pass(tmp_path):
    from conftest import EXAMPLES

    src = str(EXAMPLES / "mobilenet_bn.onnx")
    out = _graphopt(["optimize", src, "-o", "b", "-q"], {"GRAPHOPT_TIME_BUDGET": "0"}, tmp_path)
    assert out.returncode == 1, out.stderr
    assert "time budget of 0 s" in out.stderr and "fixpoint(" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and not (tmp_path / "b").exists()


def test_a_run_past_its_memory_cap_ends_with_one_line(tmp_path):
    from conftest import EXAMPLES

    src = str(EXAMPLES / "esrgan_tiny.onnx")
    out = _graphopt(["optimize", src, "-o", "b", "-q"], {"GRAPHOPT_MEMORY_MB": "150"}, tmp_path)
    assert out.returncode == 1, out.stderr
    assert "memory" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "b").exists()


def constant_bomb(op: str, n: int, **attrs):
    """``op`` of constants only whose output has about n*n elements, reduced and added to x."""
    operands = {
        "Einsum": (["v", "v"], [const("v", np.ones(n))]),
        "Expand": (["one", "s"], [const("one", [1.0]), const("s", [n, n], np.int64)]),
        "Tile": (["v2", "r"], [const("v2", np.ones((1, n))), const("r", [n, 1], np.int64)]),
        "Pad": (["one2", "p"], [const("one2", [[1.0]]), const("p", [0, 0, n, n], np.int64)]),
        "Resize": (
            ["one4", "", "sc"],
            [const("one4", np.ones((1, 1, 1, 1))), const("sc", [1, 1, n, n])],
        ),
    }[op]
    return model(
        [
            helper.make_node(op, operands[0], ["big"], name="bomb", **attrs),
            helper.make_node("ReduceMax", ["big"], ["m"], keepdims=0),
            helper.make_node("Add", ["x", "m"], ["y"]),
        ],
        [vi("x", [4])],
        [vi("y", [4])],
        operands[1],
    )


@pytest.mark.parametrize(
    "op,attrs",
    [
        ("Einsum", {"equation": "i,j->ij"}),
        ("Expand", {}),
        ("Tile", {}),
        ("Pad", {}),
        ("Resize", {}),
    ],
)
def test_a_node_of_constants_past_the_bound_is_not_run(op, attrs):
    """60,000² float32 elements (13.4 GiB) from a few KB, whatever the inputs: said instead of
    run (the run would fill the memory); 64² run."""
    why = hazards.runtime_hazard(constant_bomb(op, 60_000, **attrs))
    assert why is not None and f"{op} 'bomb' of constants makes 3.6e+09 elements" in why
    assert hazards.runtime_hazard(constant_bomb(op, 64, **attrs)) is None
    with pytest.raises(hazards.HazardError, match="the model is not run"):
        Session(constant_bomb(op, 60_000, **attrs)).run({"x": np.ones(4, np.float32)})
