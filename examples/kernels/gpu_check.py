"""Run a cuda bundle's generated kernels on a GPU and record timings (the one prepared device
check of issue 8).  NOT RUN YET: written on a machine without a GPU; needs onnxruntime-gpu.

    python examples/kernels/gpu_check.py BUNDLE.cuda.graphopt [--out result.json]

1. loads the bundle with ``load_session`` on CUDAExecutionProvider (registers
   ``kernels/cuda/libgraphopt_fused_cuda.so``) and compares with the golden outputs;
2. times the whole model on the device (I/O bound to the GPU, median of 200 runs);
3. writes JSON listing the bundle's generated kernels.  Per-kernel GPU timing against the
   unfused chain is not implemented yet.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from graphopt.targets.bundle import _golden, load_session, read_bundle


def timed(sess, feeds, runs=200):
    binding = sess.io_binding()
    for k, v in feeds.items():
        binding.bind_ortvalue_input(k, ort.OrtValue.ortvalue_from_numpy(v, "cuda", 0))
    for o in sess.get_outputs():
        binding.bind_output(o.name, "cuda")
    for _ in range(10):
        sess.run_with_iobinding(binding)
    t = []
    for _ in range(runs):
        t0 = time.perf_counter()
        sess.run_with_iobinding(binding)
        binding.synchronize_outputs()
        t.append(time.perf_counter() - t0)
    return statistics.median(t) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("--out", default="gpu_check.json")
    args = ap.parse_args()
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        print("no CUDAExecutionProvider here (install onnxruntime-gpu on a GPU machine)")
        return 2
    path, manifest, _ = read_bundle(args.bundle)
    sess = load_session(path, providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    feeds, expected = _golden(path)
    names = [o.name for o in sess.get_outputs()]
    got = sess.run(names, feeds)
    err = {n: float(np.max(np.abs(g.astype(np.float64) - expected[n]))) for n, g in zip(names, got)}
    result = {
        "bundle": str(path),
        "providers": sess.get_providers(),
        "golden_max_abs": err,
        "model_us": timed(sess, feeds),
        "kernels": [],
    }
    for k in (manifest.get("kernels") or {}).get("kernels", []):
        result["kernels"].append({"op_type": k["op_type"], "expr": k["expr"]})
    Path(args.out).write_text(json.dumps(result, indent=2, sort_keys=True))
    print(json.dumps(result, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
