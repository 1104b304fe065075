"""Tied weights stay tied: a constant read by other nodes too is never folded into a copy.

A GPT-style decoder ties its LM head to the token embedding, ``MatMul(h, Transpose(wte))``
with ``wte`` also read by the token Gather.  Folding the Transpose would store the embedding
twice; instead fold-constants refuses (``tied-weight``, naming the Gather) and the LM head
reads the weight transposed in place.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import assert_optimized, codes, const, model, ops, run, vi

VOCAB, D = 2048, 256  # wte: 2 MiB of float32, past the default 1 MiB fold-size-limit


def _init_bytes(m) -> int:
    return sum(numpy_helper.to_array(t).nbytes for t in m.graph.initializer)


def _copies_of_wte(m) -> int:
    """Initializers holding the embedding's VOCAB x D values, either way round."""
    return sum(1 for t in m.graph.initializer if sorted(t.dims) == sorted([VOCAB, D]))


def _tied_decoder(rng, flat: bool = False):
    """Gather(wte, ids) → LayerNorm-ish scale and Tanh → MatMul(h, Transpose(wte)).  ``flat``:
    ids of rank 1, so that the LM head's A is 2-D."""
    ids_shape = [8] if flat else [1, 8]
    nodes = [
        helper.make_node("Gather", ["wte", "ids"], ["tok"], name="embed"),
        helper.make_node("Mul", ["tok", "g"], ["scaled"], name="scale"),
        helper.make_node("Tanh", ["scaled"], ["h"], name="act"),
        helper.make_node("Transpose", ["wte"], ["wte_t"], name="lm_head/transpose", perm=[1, 0]),
        helper.make_node("MatMul", ["h", "wte_t"], ["logits"], name="lm_head"),
    ]
    inits = [
        const("wte", rng.standard_normal((VOCAB, D)) * 0.02),
        const("g", rng.standard_normal(D)),
    ]
    return model(
        nodes,
        [vi("ids", ids_shape, TensorProto.INT64)],
        [vi("logits", [*ids_shape, VOCAB])],
        inits,
    )


def _ids(flat: bool) -> dict:
    ids = np.arange(8, dtype=np.int64) * 97 % VOCAB
    return {"ids": ids if flat else ids[None]}


@pytest.mark.parametrize(
    ("flat", "head"),
    [(False, "com.microsoft.FusedMatMul"), (True, "Gemm")],
    ids=["rank3-fused-matmul", "rank2-gemm"],
)
def test_tied_embedding_is_stored_once(rng, flat, head):
    m = _tied_decoder(rng, flat)
    out, report = assert_optimized(m, inputs=_ids(flat))
    assert _copies_of_wte(out) == 1
    assert _init_bytes(out) <= _init_bytes(m)
    got = ops(out)
    name = head.split(".")[-1]
    assert got.get(name) == 1 and "Transpose" not in got and "MatMul" not in got, got
    if name == "Gemm":
        gemm = next(n for n in out.graph.node if n.op_type == "Gemm")
        assert {a.name: a.i for a in gemm.attribute}.get("transB") == 1
    else:
        fused = next(n for n in out.graph.node if n.op_type == "FusedMatMul")
        assert fused.domain == "com.microsoft"
        assert {a.name: a.i for a in fused.attribute}.get("transB") == 1
    tied = [r for r in report.remarks if r.code == "tied-weight"]
    assert len(tied) == 1 and tied[0].kind == "missed" and tied[0].rule == "fold-constants"
    assert list(tied[0].nodes) == ["lm_head/transpose"]
    assert tied[0].args["weight"] == "wte" and tied[0].args["readers"] == ["Gather 'embed'"]
    assert "Gather 'embed'" in tied[0].message
    assert codes(report, "fuse-matmul-transpose", "passed") == ["fired"]


def test_tied_embedding_at_o1_keeps_the_transpose(rng):
    """Without the fusions the Transpose stays a node: the file still holds one copy."""
    m = _tied_decoder(rng)
    out, report = run(m, level=1, inputs=_ids(False))
    assert report.parity.ok
    assert _copies_of_wte(out) == 1 and _init_bytes(out) <= _init_bytes(m)
    assert ops(out).get("Transpose") == 1
    assert "tied-weight" in codes(report, "fold-constants")


def test_cast_of_a_shared_weight_is_not_copied(rng):
    """A Cast of a float16 weight another node reads (in float16) would store it twice."""
    w = (rng.standard_normal((1024, 1024)) * 0.02).astype(np.float16)  # 2 MiB
    nodes = [
        helper.make_node("Cast", ["w16"], ["w32"], name="upcast", to=TensorProto.FLOAT),
        helper.make_node("MatMul", ["x", "w32"], ["y"], name="mm32"),
        helper.make_node("MatMul", ["x16", "w16"], ["z"], name="mm16"),
    ]
    m = model(
        nodes,
        [vi("x", [2, 1024]), vi("x16", [2, 1024], TensorProto.FLOAT16)],
        [vi("y", [2, 1024]), vi("z", [2, 1024], TensorProto.FLOAT16)],
        [numpy_helper.from_array(w, "w16")],
    )
    out, report = run(m, level=1)
    assert report.parity.ok
    assert _init_bytes(out) <= _init_bytes(m) and ops(out).get("Cast") == 1
    tied = [r for r in report.remarks if r.code == "tied-weight"]
    assert tied and tied[0].args["readers"] == ["MatMul 'mm16'"]


def test_transpose_of_a_weight_read_once_still_folds(rng):
    """Nothing else reads W: its transposed copy replaces it (no growth), as before."""
    nodes = [
        helper.make_node("Transpose", ["W"], ["Wt"], name="t", perm=[1, 0]),
        helper.make_node("MatMul", ["x", "Wt"], ["y"], name="mm"),
    ]
    m = model(
        nodes, [vi("x", [1, 8, 512])], [vi("y", [1, 8, 1024])], [const("W", np.ones((1024, 512)))]
    )
    out, report = run(m, level=1)
    assert report.parity.ok and ops(out) == {"MatMul": 1}
    assert _init_bytes(out) == _init_bytes(m)
    assert "tied-weight" not in codes(report, "fold-constants")


def test_small_shared_copy_within_the_limit_folds(rng):
    """A copy no larger than --fold-size-limit is judged by the growth budget as before."""
    nodes = [
        helper.make_node("Transpose", ["W"], ["Wt"], name="t", perm=[1, 0]),
        helper.make_node("MatMul", ["x", "Wt"], ["y"], name="mm"),
        helper.make_node("Gather", ["W", "ids"], ["e"], name="embed"),
    ]
    m = model(
        nodes,
        [vi("x", [2, 16]), vi("ids", [2], TensorProto.INT64)],
        [vi("y", [2, 32]), vi("e", [2, 16])],
        [const("W", rng.standard_normal((32, 16)))],
    )
    out, report = run(m, level=1, inputs={"ids": np.array([1, 5], np.int64)})
    assert report.parity.ok and "Transpose" not in ops(out)
    assert "tied-weight" not in codes(report, "fold-constants")
