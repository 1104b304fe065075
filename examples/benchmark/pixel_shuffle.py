#!/usr/bin/env python3
"""Which PixelShuffle spelling is faster on onnxruntime's CPU provider: DepthToSpace, or
Reshape→Transpose→Reshape?  The answer sets ``prefers["pixel-shuffle"]`` of the cpu profile
(targets/data/profiles.json).

Measured as the rest of the benchmarks are: 1 intra-op thread, ORT_ENABLE_ALL, every variant of
one case in the same process, runs interleaved (A, B, A, B, ...) so machine noise hits both
alike; the table gives medians and the ratio DepthToSpace / Reshape-form.

Cases: the op pair alone at several sizes (both CRD and DCR), and the whole
examples/esrgan_tiny.onnx with its pixel shuffle in each spelling.

    python examples/benchmark/pixel_shuffle.py [--runs 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

REPO = Path(__file__).resolve().parents[2]

PERMS = {"CRD": (0, 1, 4, 2, 5, 3), "DCR": (0, 3, 4, 1, 5, 2)}


def _reshape_form(n, c, h, w, r, mode):
    first = (n, c, r, r, h, w) if mode == "CRD" else (n, r, r, c, h, w)
    nodes = [
        helper.make_node("Reshape", ["x", "s1"], ["a"]),
        helper.make_node("Transpose", ["a"], ["b"], perm=list(PERMS[mode])),
        helper.make_node("Reshape", ["b", "s2"], ["y"]),
    ]
    inits = [
        numpy_helper.from_array(np.array(first, np.int64), "s1"),
        numpy_helper.from_array(np.array((n, c, h * r, w * r), np.int64), "s2"),
    ]
    return nodes, inits


def op_models(n, c, h, w, r, mode):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [n, c * r * r, h, w])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [n, c, h * r, w * r])
    nodes, inits = _reshape_form(n, c, h, w, r, mode)
    rt = helper.make_model(
        helper.make_graph(nodes, "rtr", [x], [y], inits),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    d2s = helper.make_model(
        helper.make_graph(
            [helper.make_node("DepthToSpace", ["x"], ["y"], blocksize=r, mode=mode)],
            "d2s",
            [x],
            [y],
        ),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    return d2s, rt, {"x": np.random.default_rng(0).standard_normal((n, c * r * r, h, w), "f")}


def esrgan_models():
    """esrgan_tiny as shipped (Reshape form) and with its pixel shuffle as DepthToSpace."""
    rt = onnx.load(REPO / "examples" / "esrgan_tiny.onnx")
    d2s = onnx.ModelProto()
    d2s.CopyFrom(rt)
    g = d2s.graph
    nodes = list(g.node)
    for n in nodes:
        if n.op_type == "Transpose" and list(n.attribute[0].ints) == list(PERMS["CRD"]):
            first = next(m for m in nodes if m.output[0] == n.input[0])
            last = next(m for m in nodes if n.output[0] in m.input)
            shape = next(
                numpy_helper.to_array(m.attribute[0].t)
                for m in nodes
                if m.output[0] == first.input[1]
            )
            r = int(shape[2])
            new = helper.make_node(
                "DepthToSpace", [first.input[0]], [last.output[0]], blocksize=r, mode="CRD"
            )
            kept = [m for m in nodes if m not in (first, n, last)]
            kept.insert(kept.index(next(m for m in kept if last.output[0] in m.input)), new)
            del g.node[:]
            g.node.extend(kept)
            break
    onnx.checker.check_model(d2s)
    feeds = {"input": np.random.default_rng(0).standard_normal((1, 3, 32, 32), "f")}
    return d2s, rt, feeds


def session(model):
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.log_severity_level = 4
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def interleaved(models, feeds, runs):
    sessions = [session(m) for m in models]
    outs = [s.run(None, feeds)[0] for s in sessions]
    assert all(np.array_equal(outs[0], o) for o in outs[1:]), "variants disagree"
    for s in sessions:  # warm up
        for _ in range(5):
            s.run(None, feeds)
    times = [[] for _ in sessions]
    for _ in range(runs):
        for i, s in enumerate(sessions):
            t0 = time.perf_counter()
            s.run(None, feeds)
            times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) * 1e6 for t in times]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    cases = []
    for n, c, h, w, r in [
        (1, 32, 32, 32, 2),
        (1, 64, 64, 64, 2),
        (1, 16, 128, 128, 2),
        (1, 64, 64, 64, 4),
        (4, 64, 64, 64, 2),
    ]:
        for mode in ("CRD", "DCR"):
            cases.append(
                (f"{mode} x=[{n},{c * r * r},{h},{w}] r={r}", *op_models(n, c, h, w, r, mode))
            )
    cases.append(("esrgan_tiny (CRD, [1,128,32,32] r=2 inside)", *esrgan_models()))
    rows = []
    print(
        f"onnxruntime {ort.__version__}, CPU, 1 thread, ORT_ENABLE_ALL, "
        f"{args.runs} interleaved runs"
    )
    print(f"{'case':48} {'DepthToSpace us':>16} {'Reshape form us':>16} {'D2S/RTR':>8}")
    for name, d2s, rt, feeds in cases:
        a, b = interleaved([d2s, rt], feeds, args.runs)
        rows.append({"case": name, "depth_to_space_us": a, "reshape_form_us": b, "ratio": a / b})
        print(f"{name:48} {a:16.1f} {b:16.1f} {a / b:8.2f}")
    if args.json:
        args.json.write_text(json.dumps({"onnxruntime": ort.__version__, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
