"""onnxruntime's offline optimizer on a model with external data: the baseline graphopt is timed
against in examples/large/README.md.

One InferenceSession at ORT_ENABLE_EXTENDED (CPU) with ``optimized_model_filepath``: onnxruntime
loads the model, applies its graph optimizations and writes the optimized model, its
initializers in one external-data file beside it.

    python examples/large/ort_offline.py MODEL.onnx OUT_DIR/model.onnx
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import onnxruntime as ort


def optimize_offline(model: Path, out: Path, level: str = "extended") -> float:
    """Write onnxruntime's optimized form of ``model`` to ``out`` (+ ``out.data``); seconds."""
    levels = {
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    so = ort.SessionOptions()
    so.graph_optimization_level = levels[level]
    so.optimized_model_filepath = str(out)
    so.add_session_config_entry(
        "session.optimized_model_external_initializers_file_name", out.name + ".data"
    )
    so.add_session_config_entry(
        "session.optimized_model_external_initializers_min_size_in_bytes", "1024"
    )
    session = ort.InferenceSession(str(model), so, providers=["CPUExecutionProvider"])
    del session
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("out", type=Path, help="the optimized model's path (.onnx)")
    ap.add_argument("--level", choices=("basic", "extended", "all"), default="extended")
    args = ap.parse_args()
    seconds = optimize_offline(args.model, args.out, args.level)
    print(f"{args.out}: onnxruntime {ort.__version__} {args.level} in {seconds:.1f}s")


if __name__ == "__main__":
    main()
