#!/usr/bin/env python3
"""Is com.microsoft.MultiHeadAttention faster than the attention exporters write, on
onnxruntime's CPU provider, at the shapes real models use?  The answer sets the cpu profile's
``MultiHeadAttention`` speed limits (targets/profiles.py), which ``fuse-attention`` obeys.

For each case, two models over the same q, k, v [B, S, N·H] inputs: the exporter's spelling
(Reshape, Transpose, MatMul, scale, bias Add, Softmax, MatMul, Transpose, Reshape; onnxruntime
applies its own fusions to it at ORT_ENABLE_ALL) and one MultiHeadAttention node.  1 intra-op
thread, ORT_ENABLE_ALL, runs interleaved (A, B, A, B, ...); the table gives medians and the
ratio fused / unfused, with the bootstrap 95 % interval of the median per-pair ratio.

    python examples/benchmark/attention_shapes.py [--runs 100] [--only TEXT] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

#: name, batch (windows × images), sequence, heads, head size, bias ("none" | "heads" [1,N,S,T]
#: | "keys" [B,1,1,T] | "full" [B,N,S,T], SAM's decomposed relative positions)
CASES = [
    ("Swin-T stage 1 (64 windows)", 64, 49, 3, 32, "heads"),
    ("Swin-T stage 2 (16 windows)", 16, 49, 6, 32, "heads"),
    ("Swin-T stage 3 (4 windows)", 4, 49, 12, 32, "heads"),
    ("Swin-T stage 4 (1 window)", 1, 49, 24, 32, "heads"),
    ("BERT-base, S=128", 1, 128, 12, 64, "keys"),
    ("BERT-base, batch 8", 8, 128, 12, 64, "keys"),
    ("ViT-B/16", 1, 197, 12, 64, "none"),
    ("T5-small, relative bias", 1, 128, 8, 64, "heads"),
    ("Whisper-tiny encoder", 1, 1500, 6, 64, "none"),
    ("short sequence, S=16", 1, 16, 12, 64, "keys"),
    ("Wav2Vec2/HuBERT-base, 49 frames", 1, 49, 12, 64, "none"),
    ("Wav2Vec2/HuBERT-base, 49 frames, batch 4", 4, 49, 12, 64, "none"),
    ("MobileViT-S stage 3 (256 patches)", 4, 256, 4, 36, "none"),
    ("MobileViT-S stage 4 (64 patches)", 4, 64, 4, 48, "none"),
    ("MobileViT-S stage 5 (16 patches)", 4, 16, 4, 60, "none"),
    ("Swin-T stage 1 shape, no bias", 64, 49, 3, 32, "none"),
    ("Swin-T stage 3 shape, no bias", 4, 49, 12, 32, "none"),
    ("short sequence, S=16, no mask", 1, 16, 12, 64, "none"),
    ("Wav2Vec2/HuBERT-base shape, padding mask", 1, 49, 12, 64, "keys"),
    ("Wav2Vec2/HuBERT-base shape, per-head bias", 1, 49, 12, 64, "heads"),
    ("SAM ViT-B windows (25 of 14x14), rel-pos bias", 25, 196, 12, 64, "full"),
    ("SAM ViT-B global at 32x32, rel-pos bias", 1, 1024, 12, 64, "full"),
    ("tiny SAM global (16x16, 2 heads of 32), rel-pos bias", 2, 256, 2, 32, "full"),
]


def _bias_shape(b, s, n, kind):
    return {"heads": [1, n, s, s], "keys": [b, 1, 1, s], "full": [b, n, s, s]}.get(kind)


def unfused(b, s, n, h, kind):
    d = n * h
    ins = [helper.make_tensor_value_info(x, TensorProto.FLOAT, [b, s, d]) for x in "qkv"]
    inits = [
        numpy_helper.from_array(np.array([b, s, n, h], np.int64), "heads"),
        numpy_helper.from_array(np.array([b, s, d], np.int64), "merge"),
        numpy_helper.from_array(np.array(math.sqrt(h), np.float32), "c"),
    ]
    nodes = [helper.make_node("Reshape", [x, "heads"], [x + "4"]) for x in "qkv"]
    nodes += [
        helper.make_node("Transpose", ["q4"], ["Q"], perm=[0, 2, 1, 3]),
        helper.make_node("Transpose", ["k4"], ["KT"], perm=[0, 2, 3, 1]),
        helper.make_node("Transpose", ["v4"], ["V"], perm=[0, 2, 1, 3]),
        helper.make_node("MatMul", ["Q", "KT"], ["s"]),
        helper.make_node("Div", ["s", "c"], ["z0"]),
    ]
    z = "z0"
    shape = _bias_shape(b, s, n, kind)
    if shape is not None:
        ins.append(helper.make_tensor_value_info("bias", TensorProto.FLOAT, shape))
        nodes.append(helper.make_node("Add", ["z0", "bias"], ["z1"]))
        z = "z1"
    nodes += [
        helper.make_node("Softmax", [z], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "V"], ["ctx"]),
        helper.make_node("Transpose", ["ctx"], ["ctxT"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["ctxT", "merge"], ["y"]),
    ]
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, [b, s, d])
    return helper.make_model(
        helper.make_graph(nodes, "unfused", ins, [out], inits),
        opset_imports=[helper.make_opsetid("", 17)],
    )


def fused(b, s, n, h, kind):
    d = n * h
    ins = [helper.make_tensor_value_info(x, TensorProto.FLOAT, [b, s, d]) for x in "qkv"]
    mha_in = ["q", "k", "v"]
    shape = _bias_shape(b, s, n, kind)
    if shape is not None:
        ins.append(helper.make_tensor_value_info("bias", TensorProto.FLOAT, shape))
        if kind == "keys":  # the kernel's attention_bias is [B|1, N|1, S, T]
            nodes = [helper.make_node("Expand", ["bias", "bshape"], ["bias4"])]
            mha_in += ["", "", "bias4"]
        else:
            nodes = []
            mha_in += ["", "", "bias"]
    else:
        nodes = []
    nodes.append(
        helper.make_node("MultiHeadAttention", mha_in, ["y"], domain="com.microsoft", num_heads=n)
    )
    inits = [numpy_helper.from_array(np.array([b, 1, s, s], np.int64), "bshape")]
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, [b, s, d])
    return helper.make_model(
        helper.make_graph(nodes, "fused", ins, [out], inits if kind == "keys" else []),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
    )


def session(m):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


def measure(case, runs):
    name, b, s, n, h, kind = case
    rng = np.random.default_rng(0)
    feed = {x: rng.standard_normal((b, s, n * h)).astype(np.float32) for x in "qkv"}
    shape = _bias_shape(b, s, n, kind)
    if shape is not None:
        feed["bias"] = (rng.standard_normal(shape) * 2).astype(np.float32)
    a, f = session(unfused(b, s, n, h, kind)), session(fused(b, s, n, h, kind))
    ref, got = a.run(None, feed)[0], f.run(None, feed)[0]
    err = float(np.abs(ref - got).max() / max(np.abs(ref).max(), 1e-30))
    ta, tf = [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        a.run(None, feed)
        t1 = time.perf_counter()
        f.run(None, feed)
        t2 = time.perf_counter()
        ta.append(t1 - t0)
        tf.append(t2 - t1)
    ua, uf = statistics.median(ta) * 1e6, statistics.median(tf) * 1e6
    lo, hi = ratio_interval(np.asarray(tf) / np.asarray(ta))
    return {
        "case": name,
        "B": b,
        "S": s,
        "N": n,
        "H": h,
        "bias": kind,
        "unfused_us": round(ua, 1),
        "fused_us": round(uf, 1),
        "ratio": round(uf / ua, 3),
        "pair_ratio_ci95": [round(lo, 3), round(hi, 3)],
        "max_rel_err": err,
    }


def ratio_interval(ratios: np.ndarray, resamples: int = 2000) -> tuple[float, float]:
    """Bootstrap 95 % interval of the median of the per-pair ratios (each pair: the two
    models run back to back)."""
    boot = np.random.default_rng(0).integers(0, ratios.size, (resamples, ratios.size))
    low, high = np.percentile(np.median(ratios[boot], axis=1), [2.5, 97.5])
    return float(low), float(high)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--json", help="also write the rows as JSON")
    ap.add_argument("--only", help="run only the cases whose name contains this text")
    args = ap.parse_args()
    print(f"onnxruntime {ort.__version__}, CPU, 1 thread, ORT_ENABLE_ALL, {args.runs} runs\n")
    print("| case | B | S | N | H | bias | unfused µs | MHA µs | MHA / unfused | 95 % |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for case in [c for c in CASES if not args.only or args.only.lower() in c[0].lower()]:
        r = measure(case, args.runs)
        rows.append(r)
        print(
            f"| {r['case']} | {r['B']} | {r['S']} | {r['N']} | {r['H']} | {r['bias']} | "
            f"{r['unfused_us']:.0f} | {r['fused_us']:.0f} | {r['ratio']:.3f} | "
            f"{r['pair_ratio_ci95'][0]:.3f}–{r['pair_ratio_ci95'][1]:.3f} |",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as fh:
            meta = {"onnxruntime": ort.__version__, "runs": args.runs}
            json.dump({**meta, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
