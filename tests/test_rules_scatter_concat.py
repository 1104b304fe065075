"""Slice assignment as torch.export spells it, and the Concat it is.

``k = x.new_empty(B, N, T, 24); k[..., :16] = a; k[..., 16:] = b`` exports as ConstantOfShape,
a Transpose bringing the last axis first, one ScatterND per assignment (indices [[0], …, [15]]
and [[16], …, [23]]) and a Transpose back: ``scatter-slices-to-concat`` turns the writes into a
Concat, ``concat-of-transposes`` moves the Transposes after it, where ``fuse-transposes``
cancels them.  Writes that leave a row unwritten, or write one twice, stay as they are."""

import numpy as np
import pytest
from onnx import helper

from conftest import assert_optimized, const, model, ops, vi

PERM = [3, 1, 2, 0]  # its own inverse: the last axis first, and back


def assigned(ranges: list[tuple[int, int]], width: int = 24):
    """``k`` [2,4,5,width] zeros, rows ``ranges`` of its last axis written from inputs."""
    nodes = [
        helper.make_node("ConstantOfShape", ["shape"], ["empty"]),
        helper.make_node("Transpose", ["empty"], ["t0"], perm=PERM),
    ]
    inputs, inits, last = [], [const("shape", [2, 4, 5, width], np.int64)], "t0"
    for i, (a, b) in enumerate(ranges):
        inputs.append(vi(f"u{i}", [2, 4, 5, b - a]))
        inits.append(const(f"rows{i}", np.arange(a, b).reshape(-1, 1), np.int64))
        nodes += [
            helper.make_node("Transpose", [f"u{i}"], [f"ut{i}"], perm=PERM),
            helper.make_node("ScatterND", [last, f"rows{i}", f"ut{i}"], [f"w{i}"]),
        ]
        last = f"w{i}"
    nodes.append(helper.make_node("Transpose", [last], ["k"], perm=PERM))
    return model(nodes, inputs, [vi("k", [2, 4, 5, width])], inits)


@pytest.mark.parametrize("ranges", [[(0, 16), (16, 24)], [(16, 24), (0, 10), (10, 16)]])
def test_writes_of_every_row_become_one_concat(ranges):
    out, report = assert_optimized(assigned(ranges), level=1)
    assert ops(out) == {"Concat": 1}, ops(out)
    (cat,) = out.graph.node
    assert helper.get_attribute_value(cat.attribute[0]) == 3
    order = sorted(range(len(ranges)), key=lambda i: ranges[i][0])
    assert list(cat.input) == [f"u{i}" for i in order]


@pytest.mark.parametrize("ranges", [[(0, 16), (17, 24)], [(0, 16), (8, 24)]], ids=["gap", "twice"])
def test_writes_that_do_not_tile_the_axis_stay(ranges):
    out, _ = assert_optimized(assigned(ranges), level=1)
    assert ops(out).get("ScatterND") == 2, ops(out)


def test_transposes_of_other_perms_are_not_moved():
    nodes = [
        helper.make_node("Transpose", ["a"], ["ta"], perm=[1, 0, 2]),
        helper.make_node("Transpose", ["b"], ["tb"], perm=[0, 2, 1]),
        helper.make_node("Concat", ["ta", "tb"], ["y"], axis=0),
    ]
    m = model(nodes, [vi("a", [3, 3, 3]), vi("b", [3, 3, 3])], [vi("y", None)])
    out, _ = assert_optimized(m, level=1)
    assert ops(out) == {"Transpose": 2, "Concat": 1}
