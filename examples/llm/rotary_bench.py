"""RotaryEmbedding against the rotation as transformers exports it, on onnxruntime CPU.

    python examples/llm/rotary_bench.py [--rounds 30]

For each shape (batch, heads, sequence, head_dim): q and k rotated with one cos/sin computed
from position_ids (transformers 5's spelling: Unsqueeze·inv_freq, Concat(f, f), Cos/Sin,
Unsqueeze over the heads, x·cos + Concat(−x2, x1)·sin), optimized by graphopt -O2 (which
fuses both rotations into RotaryEmbedding). Both models run at ORT_ENABLE_ALL with one thread,
in paired rounds alternating which runs first, each round repeating the run to ≥ 2 ms; prints
the median fused/unfused ratio with its quartiles.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import graphopt

SHAPES = [(1, 32, 1, 128), (1, 32, 128, 128), (1, 8, 512, 64), (4, 16, 64, 64)]


def _const(name: str, value, dtype=np.float32) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value, dtype=dtype), name)


def rope_model(batch: int, heads: int, seq: int, dim: int) -> onnx.ModelProto:
    inv_freq = 1.0 / 10000.0 ** (np.arange(0, dim, 2) / dim)
    n = helper.make_node
    nodes = [
        n("Unsqueeze", ["position_ids", "ax_m1"], ["pos3"]),
        n("Cast", ["pos3"], ["posf"], to=TensorProto.FLOAT),
        n("Mul", ["posf", "inv_freq"], ["freqs"]),
        n("Concat", ["freqs", "freqs"], ["emb"], axis=-1),
        n("Cos", ["emb"], ["cos3"]),
        n("Sin", ["emb"], ["sin3"]),
        n("Unsqueeze", ["cos3", "ax_1"], ["cos"]),
        n("Unsqueeze", ["sin3", "ax_1"], ["sin"]),
    ]
    inits = [
        _const("ax_m1", [-1], np.int64),
        _const("ax_1", [1], np.int64),
        _const("inv_freq", inv_freq),
        _const("half", [dim // 2], np.int64),
        _const("zero", [0], np.int64),
        _const("end", [2**62], np.int64),
        _const("ax_3", [3], np.int64),
    ]
    for x in ("q", "k"):
        nodes += [
            n("Slice", [x, "half", "end", "ax_3"], [f"{x}_hi"]),
            n("Slice", [x, "zero", "half", "ax_3"], [f"{x}_lo"]),
            n("Neg", [f"{x}_hi"], [f"{x}_nhi"]),
            n("Concat", [f"{x}_nhi", f"{x}_lo"], [f"{x}_rot"], axis=-1),
            n("Mul", [x, "cos"], [f"{x}_c"]),
            n("Mul", [f"{x}_rot", "sin"], [f"{x}_s"]),
            n("Add", [f"{x}_c", f"{x}_s"], [f"{x}_out"]),
        ]
    shape = [batch, heads, seq, dim]
    graph = helper.make_graph(
        nodes,
        "rope",
        [
            helper.make_tensor_value_info("q", TensorProto.FLOAT, shape),
            helper.make_tensor_value_info("k", TensorProto.FLOAT, shape),
            helper.make_tensor_value_info("position_ids", TensorProto.INT64, [batch, seq]),
        ],
        [helper.make_tensor_value_info(f"{x}_out", TensorProto.FLOAT, shape) for x in "qk"],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def timed(sess: ort.InferenceSession, feeds: dict, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        sess.run(None, feeds)
    return (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print(f"onnxruntime {ort.__version__}, 1 thread, ORT_ENABLE_ALL, {args.rounds} paired rounds")
    for shape in SHAPES:
        model = rope_model(*shape)
        fused, report = graphopt.optimize(model, target="cpu", level=2, measure=False)
        count = report.ops_after.get("com.microsoft.RotaryEmbedding", 0)
        a, b = session(model), session(fused)
        feeds = {
            "q": rng.standard_normal(shape).astype(np.float32),
            "k": rng.standard_normal(shape).astype(np.float32),
            "position_ids": np.tile(np.arange(100, 100 + shape[2]), (shape[0], 1)),
        }
        once = timed(a, feeds, 3)
        reps = max(1, int(0.002 / max(once, 1e-7)))
        ratios, base = [], []
        for r in range(args.rounds):
            if r % 2:
                ta, tb = timed(a, feeds, reps), timed(b, feeds, reps)
            else:
                tb, ta = timed(b, feeds, reps), timed(a, feeds, reps)
            ratios.append(tb / ta)
            base.append(ta)
        q1, med, q3 = np.percentile(ratios, [25, 50, 75])
        print(
            f"{shape}: RotaryEmbedding x{count}, unfused {np.median(base) * 1e6:.0f} us, "
            f"fused/unfused median {med:.3f} (quartiles {q1:.3f}-{q3:.3f})"
        )


if __name__ == "__main__":
    main()
