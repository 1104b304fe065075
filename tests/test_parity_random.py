"""A model that draws random numbers (an op without a seed: onnxruntime takes one from where the
node stands, which any rewrite moves) is compared with both models drawing alike: parity seeds
the copies it runs, by node name, and the optimized model keeps its ops unseeded."""

import numpy as np
from onnx import helper

import graphopt
from conftest import const, model, vi
from graphopt.opt.verify.parity import with_seeded_randomness


def noisy():
    nodes = [
        helper.make_node("Identity", ["x"], ["x1"]),
        helper.make_node("Add", ["x1", "zero"], ["x2"]),
        helper.make_node("RandomUniformLike", ["x2"], ["noise"], name="noise"),
        helper.make_node("Mul", ["noise", "x"], ["y"]),
    ]
    return model(nodes, [vi("x", [4, 8])], [vi("y", [4, 8])], [const("zero", np.zeros(1))])


def test_rewrites_around_a_random_op_pass_parity_and_keep_it_unseeded():
    out, report = graphopt.optimize(noisy(), target="cpu")
    assert report.parity.ran and report.parity.ok, report.parity
    assert not [r for r in report.remarks if r.pass_name == "safety-net"]  # nothing reverted
    ops = [n.op_type for n in out.graph.node]
    assert ops == ["RandomUniformLike", "Mul"], ops
    assert not [a for n in out.graph.node for a in n.attribute if a.name == "seed"]


def test_seeds_come_from_node_names_and_seeded_ops_are_left_alone():
    m = noisy()
    a, b = with_seeded_randomness(m), with_seeded_randomness(m)
    seeds = [[x.f for n in g.graph.node for x in n.attribute if x.name == "seed"] for g in (a, b)]
    assert seeds[0] == seeds[1] and len(seeds[0]) == 1
    assert not [x for n in m.graph.node for x in n.attribute if x.name == "seed"]  # a copy
    assert with_seeded_randomness(a) is None
