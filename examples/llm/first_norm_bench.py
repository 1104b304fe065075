#!/usr/bin/env python3
"""The first RMSNorm of a Llama-style decoder (no residual in front): which spelling is valid
and fastest on onnxruntime's CPU provider.

    python examples/llm/first_norm_bench.py [--rounds 30] [--hidden 256,2048] [--tokens 1,128]

One RMSNorm ``x / sqrt(mean(x², -1) + eps) · w`` over [1, tokens, hidden] float32, written as:

- ``decomposed``: Pow, ReduceMean, Add, Sqrt, Div, Mul (opset 17), as the exporters write it;
- ``RMSNormalization-23``: the ONNX op (the model at opset 23);
- ``SimplifiedLayerNormalization (ai.onnx)``: onnxruntime's own schema in the default domain,
  which it registers on the CPU provider (version 1) — onnx.checker rejects the model;
- ``SkipSimplifiedLayerNormalization + zero skip``: com.microsoft's skip norm with a skip of
  zeros built at run time (ConstantOfShape(Shape(x))), the only com.microsoft CPU RMS kernel.

Each is checked with onnx.checker (the verdict is printed), against numpy, and for the ops
onnxruntime runs after its own session-time fusions, then timed at
ORT_ENABLE_ALL with one intra-op thread: the median of per-round ratios to ``decomposed``
over interleaved rounds (every variant once per round, the order rotated), p10-p90 in
brackets. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

EPS = 1e-6


def _model(nodes, inits, opset: int, ms: bool = False) -> onnx.ModelProto:
    hidden = int(numpy_helper.to_array(inits[0]).shape[0])  # the weight
    g = helper.make_graph(
        nodes,
        "first_norm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "tokens", hidden])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "tokens", hidden])],
        inits,
    )
    imports = [helper.make_opsetid("", opset)] + ([helper.make_opsetid("com.microsoft", 1)] * ms)
    m = helper.make_model(g, opset_imports=imports)
    m.ir_version = 10
    return m


def variants(w: np.ndarray) -> dict[str, onnx.ModelProto]:
    weight = numpy_helper.from_array(w, "w")
    two = numpy_helper.from_array(np.array(2.0, np.float32), "two")
    eps = numpy_helper.from_array(np.array(EPS, np.float32), "eps")
    mk = helper.make_node
    decomposed = [
        mk("Pow", ["x", "two"], ["sq"]),
        mk("ReduceMean", ["sq"], ["ms"], axes=[-1], keepdims=1),
        mk("Add", ["ms", "eps"], ["me"]),
        mk("Sqrt", ["me"], ["rms"]),
        mk("Div", ["x", "rms"], ["nx"]),
        mk("Mul", ["nx", "w"], ["y"]),
    ]
    zero = helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0])
    return {
        "decomposed": _model(decomposed, [weight, two, eps], 17),
        "RMSNormalization-23": _model(
            [mk("RMSNormalization", ["x", "w"], ["y"], axis=-1, epsilon=EPS)], [weight], 23
        ),
        "SimplifiedLayerNormalization (ai.onnx)": _model(
            [mk("SimplifiedLayerNormalization", ["x", "w"], ["y"], axis=-1, epsilon=EPS)],
            [weight],
            17,
        ),
        "SkipSimplifiedLayerNormalization + zero skip": _model(
            [
                mk("Shape", ["x"], ["shape"]),
                mk("ConstantOfShape", ["shape"], ["skip"], value=zero),
                mk(
                    "SkipSimplifiedLayerNormalization",
                    ["x", "skip", "w"],
                    ["y"],
                    domain="com.microsoft",
                    epsilon=EPS,
                ),
            ],
            [weight],
            17,
            ms=True,
        ),
    }


def checker_verdict(m: onnx.ModelProto) -> str:
    try:
        onnx.checker.check_model(m, full_check=True)
        return "valid"
    except Exception as e:  # noqa: BLE001 - the verdict is the message
        return "rejected: " + str(e).splitlines()[0][:70]


def session(m: onnx.ModelProto) -> tuple[ort.InferenceSession, str]:
    """The session, and the ops onnxruntime runs after its own graph optimizations."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = 1
    so.log_severity_level = 3  # saving the optimized model warns that it is machine-specific
    with tempfile.TemporaryDirectory() as tmp:
        so.optimized_model_filepath = os.path.join(tmp, "optimized.onnx")
        sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
        runs = onnx.load(so.optimized_model_filepath)
    ops = sorted({n.op_type for n in runs.graph.node} - {"Shape", "ConstantOfShape"})
    return sess, "+".join(ops)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--hidden", default="256,2048")
    ap.add_argument("--tokens", default="1,128")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print(f"onnxruntime {ort.__version__}, CPU, ORT_ENABLE_ALL, 1 thread, {args.rounds} rounds")
    print()
    print(
        "| spelling | onnx.checker | onnxruntime runs | hidden | tokens | max abs error "
        "| time / decomposed |"
    )
    print("|---|---|---|---|---|---|---|")
    for hidden in [int(h) for h in args.hidden.split(",")]:
        w = (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
        models = variants(w)
        made = {k: session(m) for k, m in models.items()}
        sessions = {k: sm[0] for k, sm in made.items()}
        for tokens in [int(t) for t in args.tokens.split(",")]:
            x = rng.standard_normal((1, tokens, hidden)).astype(np.float32)
            want = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + EPS) * w
            errs = {
                k: float(np.abs(s.run(None, {"x": x})[0] - want).max()) for k, s in sessions.items()
            }
            reps = max(1, 20000 // tokens)
            times: dict[str, list[float]] = {k: [] for k in sessions}
            names = list(sessions)
            for r in range(args.rounds):
                for k in names[r % len(names) :] + names[: r % len(names)]:
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        sessions[k].run(None, {"x": x})
                    times[k].append(time.perf_counter() - t0)
            base = np.array(times["decomposed"])
            for k in names:
                ratio = np.array(times[k]) / base
                p10, p50, p90 = np.percentile(ratio, [10, 50, 90])
                print(
                    f"| {k} | {checker_verdict(models[k])} | {made[k][1]} | {hidden} | {tokens} | "
                    f"{errs[k]:.1e} | {p50:.3f} [{p10:.2f}-{p90:.2f}] |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
