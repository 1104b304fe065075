"""The ONNX backend node test cases (shipped in the onnx package) run through graphopt.

Two modes:
  * ``inputs``: the case as it is — the optimizer sees real graph inputs;
  * ``folded``: the case's inputs become initializers, so constant folding must compute every op.

A case counts only if onnxruntime itself passes it on the original model; it must still pass on
the optimized one.  Run as a script for the full table:

    python tests/backend_cases.py [--every N] [--mode inputs|folded|both]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper
from onnx.backend.test.case import node as node_cases

import graphopt


@dataclass
class Outcome:
    name: str
    mode: str
    status: str  # "pass", "fail", "skip"
    detail: str = ""
    nodes_after: int = -1


def cases(every: int = 1):
    all_cases = sorted(node_cases.collect_testcases(None), key=lambda c: c.name)
    return [c for i, c in enumerate(all_cases) if i % every == 0]


def _session(model: onnx.ModelProto):
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 4
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _run(model: onnx.ModelProto, feeds: dict) -> list:
    sess = _session(model)
    names = [o.name for o in sess.get_outputs()]
    return sess.run(
        names, {k: v for k, v in feeds.items() if k in {i.name for i in sess.get_inputs()}}
    )


def _close(expected: list, got: list, rtol: float, atol: float) -> bool:
    if len(expected) != len(got):
        return False
    for e, g in zip(expected, got):
        if isinstance(e, list) or isinstance(g, list):  # sequences
            if not isinstance(e, list) or not isinstance(g, list) or not _close(e, g, rtol, atol):
                return False
            continue
        if e is None or g is None:
            if (e is None) != (g is None):
                return False
            continue
        e, g = np.asarray(e), np.asarray(g)
        if e.shape != g.shape:
            return False
        if e.dtype.kind in "fc":
            if not np.allclose(
                e.astype(np.float64), g.astype(np.float64), rtol=rtol, atol=atol, equal_nan=True
            ):
                return False
        elif not np.array_equal(e, g):
            return False
    return True


def _fold_inputs(model: onnx.ModelProto, feeds: dict) -> onnx.ModelProto | None:
    """The same model with every (tensor) graph input turned into an initializer."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for inp in m.graph.input:
        value = feeds.get(inp.name)
        if value is None or isinstance(value, (list, dict)) or not inp.type.HasField("tensor_type"):
            return None
        try:
            m.graph.initializer.append(numpy_helper.from_array(np.asarray(value), inp.name))
        except (NotImplementedError, ValueError, TypeError):
            return None
    del m.graph.input[:]
    return m


def run_case(case, mode: str, level: int = 2, pipeline: str | None = None) -> Outcome:
    """The case through ``graphopt.optimize`` (``pipeline``: instead of the level's preset), its
    output run in a bare onnxruntime session against the case's expected outputs."""
    if not case.data_sets:
        return Outcome(case.name, mode, "skip", "no data")
    inputs, expected = case.data_sets[0]
    feeds = {i.name: v for i, v in zip(case.model.graph.input, inputs)}
    model = case.model
    if mode == "folded":
        model = _fold_inputs(model, feeds)
        if model is None:
            return Outcome(case.name, mode, "skip", "non-tensor inputs")
    try:
        ref = _run(model, feeds)
    except Exception as e:  # noqa: BLE001 - the runtime itself cannot run this case
        return Outcome(case.name, mode, "skip", f"onnxruntime: {str(e).splitlines()[0][:80]}")
    if not _close(list(expected), ref, case.rtol, case.atol):
        return Outcome(case.name, mode, "skip", "onnxruntime output differs from expected")
    try:
        optimized, _ = graphopt.optimize(model, level=level, pipeline=pipeline, check=False)
    except graphopt.GraphoptError as e:
        return Outcome(case.name, mode, "fail", f"graphopt error: {e}")
    try:
        got = _run(optimized, feeds)
    except Exception as e:  # noqa: BLE001
        return Outcome(case.name, mode, "fail", f"optimized model fails: {str(e).splitlines()[0]}")
    if not _close(list(expected), got, case.rtol, case.atol):
        return Outcome(case.name, mode, "fail", "outputs differ", len(optimized.graph.node))
    return Outcome(case.name, mode, "pass", "", len(optimized.graph.node))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--every", type=int, default=1, help="run every Nth case")
    ap.add_argument("--mode", choices=["inputs", "folded", "both"], default="both")
    ap.add_argument("--level", type=int, default=2)
    args = ap.parse_args(argv)
    modes = ["inputs", "folded"] if args.mode == "both" else [args.mode]
    selected = cases(args.every)
    failed = 0
    for mode in modes:
        t0 = time.perf_counter()
        results = [run_case(c, mode, args.level) for c in selected]
        ok = [r for r in results if r.status == "pass"]
        bad = [r for r in results if r.status == "fail"]
        skipped = [r for r in results if r.status == "skip"]
        zero = sum(1 for r in ok if r.nodes_after == 0)
        print(
            f"mode {mode}: {len(selected)} cases, onnxruntime passes {len(ok) + len(bad)}, "
            f"graphopt keeps {len(ok)} ({100 * len(ok) / max(len(ok) + len(bad), 1):.1f}%), "
            f"fails {len(bad)}, skipped {len(skipped)}; folded to zero nodes: {zero}; "
            f"{time.perf_counter() - t0:.0f}s"
        )
        for r in bad:
            print(f"  FAIL {r.name}: {r.detail}")
        failed += len(bad)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
