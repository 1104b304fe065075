"""Generated fused kernels (issue 8) on the models of its closing note, measured.

Builds three small models with long element-wise chains that onnxruntime leaves unfused, runs
``graphopt.optimize`` with ``fuse-elementwise`` (what ``optimize --kernels`` does), writes the
cpu bundle (and the cuda one when nvcc is present) and prints:

* per kernel: the gate's numbers (generated kernel vs the unfused chain in onnxruntime at
  ORT_ENABLE_ALL, 1 thread; numerics), plus the same expression built with libm calls with and
  without -ffast-math (gcc 12 vectorizes expf/erff only with it);
* per model: latency of the original at ORT_ENABLE_ALL, of graphopt -O2 without kernels and of
  the bundle with kernels (interleaved, medians), 1 and 2 threads;
* x·σ(x) (SiLU) alone: onnxruntime fuses it into QuickGelu itself; the generated kernel against
  that.

    .venv/bin/python examples/kernels/demo.py [--out DIR] [--quick]

Results: ``examples/kernels/results/demo.json`` and the markdown printed (README.md holds one run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import graphopt
from graphopt.opt.rewrite.pipeline import preset, with_kernels
from graphopt.targets.bundle import write_bundle_files
from graphopt.targets.codegen import gates
from graphopt.targets.codegen.expr import parse
from graphopt.targets.codegen.library import cpu_library
from graphopt.targets.codegen.spec import DOMAIN, KernelSpec, specs_of
from graphopt.targets.codegen.toolchain import find_compiler

RNG = np.random.default_rng(0)


def _c(name, value):
    return numpy_helper.from_array(np.asarray(value, np.float32), name)


def _model(nodes, inputs, outputs, inits, opset=17):
    g = helper.make_graph(nodes, "demo", inputs, outputs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return onnx.shape_inference.infer_shapes(m)


def masm(c: int, hw: int) -> onnx.ModelProto:
    """Conv -> x·σ(x·s+t) with per-channel s, t (a BN'd SiLU gate, YOLO-neck sizes)."""
    nodes = [
        helper.make_node("Conv", ["x", "W"], ["c"], name="conv"),
        helper.make_node("Mul", ["c", "s"], ["m"], name="mul_s"),
        helper.make_node("Add", ["m", "t"], ["a"], name="add_t"),
        helper.make_node("Sigmoid", ["a"], ["g"], name="sigmoid"),
        helper.make_node("Mul", ["c", "g"], ["y"], name="gate"),
    ]
    inits = [
        _c("W", RNG.standard_normal((c, c, 1, 1)) * (1 / np.sqrt(c))),
        _c("s", RNG.standard_normal((c, 1, 1))),
        _c("t", RNG.standard_normal((c, 1, 1))),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, hw, hw])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, c, hw, hw])
    return _model(nodes, [x], [y], inits)


def paddle_lcnet() -> onnx.ModelProto:
    """PP-LCNet-like stem and blocks, exported Paddle-style at opset 11: every HardSwish spelled
    ``x * Clip(x + 3, 0, 6) / 6`` (Add, Clip, Mul, Div), depthwise 3x3 + pointwise 1x1 convs."""
    nodes, inits = [], [_c("three", 3.0), _c("zero", 0.0), _c("six", 6.0)]
    cur, ch, k = "x", 3, 0

    def hswish(inp):
        nonlocal k
        k += 1
        names = [f"hs{k}_{s}" for s in ("a", "c", "m", "y")]
        nodes.extend(
            [
                helper.make_node("Add", [inp, "three"], [names[0]], name=f"hs{k}/add"),
                helper.make_node("Clip", [names[0], "zero", "six"], [names[1]], name=f"hs{k}/clip"),
                helper.make_node("Mul", [inp, names[1]], [names[2]], name=f"hs{k}/mul"),
                helper.make_node("Div", [names[2], "six"], [names[3]], name=f"hs{k}/div"),
            ]
        )
        return names[3]

    def conv(inp, cin, cout, ksize, stride, group):
        nonlocal k
        k += 1
        w, b, o = f"w{k}", f"b{k}", f"conv{k}"
        inits.append(_c(w, RNG.standard_normal((cout, cin // group, ksize, ksize)) * 0.2))
        inits.append(_c(b, RNG.standard_normal(cout) * 0.1))
        nodes.append(
            helper.make_node(
                "Conv",
                [inp, w, b],
                [o],
                name=o,
                strides=[stride, stride],
                pads=[ksize // 2] * 4,
                group=group,
            )
        )
        return o

    cur, ch = hswish(conv(cur, 3, 16, 3, 2, 1)), 16
    for cout, stride in ((32, 1), (64, 2), (64, 1), (128, 2), (128, 1), (256, 2)):
        cur = hswish(conv(cur, ch, ch, 3, stride, ch))  # depthwise
        cur = hswish(conv(cur, ch, cout, 1, 1, 1))  # pointwise
        ch = cout
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 224, 224])
    y = helper.make_tensor_value_info(cur, TensorProto.FLOAT, None)
    return _model(nodes, [x], [y], inits, opset=11)


def layerscale_tail(tokens: int = 3136, dim: int = 96, blocks: int = 2) -> onnx.ModelProto:
    """ConvNeXt/Swin-style MLP block in channels-last: LN -> MatMul+b -> GELU(erf) -> MatMul+b
    -> ·gamma (layer scale) -> + residual.  graphopt's rules make the GELU a BiasGelu; the tail
    Add(b2), Mul(gamma), Add(residual) is the chain."""
    nodes, inits, cur = [], [], "x"

    def n(p, op, i, o, **kw):
        return helper.make_node(op, i, [f"{p}/{o}"], name=f"{p}/{o}", **kw)

    for b in range(blocks):
        p = f"blk{b}"
        inits += [
            _c(f"{p}.ln_w", 1 + 0.1 * RNG.standard_normal(dim)),
            _c(f"{p}.ln_b", 0.1 * RNG.standard_normal(dim)),
            _c(f"{p}.w1", RNG.standard_normal((dim, 4 * dim)) / np.sqrt(dim)),
            _c(f"{p}.b1", 0.1 * RNG.standard_normal(4 * dim)),
            _c(f"{p}.w2", RNG.standard_normal((4 * dim, dim)) / np.sqrt(4 * dim)),
            _c(f"{p}.b2", 0.1 * RNG.standard_normal(dim)),
            _c(f"{p}.gamma", 1e-1 * RNG.standard_normal(dim)),
            _c(f"{p}.sqrt2", np.sqrt(2.0)),
            _c(f"{p}.one", 1.0),
            _c(f"{p}.half", 0.5),
        ]

        def t(s, p=p):
            return f"{p}/{s}"

        nodes += [
            n(p, "LayerNormalization", [cur, f"{p}.ln_w", f"{p}.ln_b"], "ln", axis=-1),
            n(p, "MatMul", [t("ln"), f"{p}.w1"], "fc1"),
            n(p, "Add", [t("fc1"), f"{p}.b1"], "fc1b"),
            n(p, "Div", [t("fc1b"), f"{p}.sqrt2"], "gdiv"),
            n(p, "Erf", [t("gdiv")], "gerf"),
            n(p, "Add", [t("gerf"), f"{p}.one"], "gadd"),
            n(p, "Mul", [t("fc1b"), t("gadd")], "gmul"),
            n(p, "Mul", [t("gmul"), f"{p}.half"], "gelu"),
            n(p, "MatMul", [t("gelu"), f"{p}.w2"], "fc2"),
            n(p, "Add", [t("fc2"), f"{p}.b2"], "fc2b"),
            n(p, "Mul", [t("fc2b"), f"{p}.gamma"], "ls"),
            n(p, "Add", [cur, t("ls")], "out"),
        ]
        cur = t("out")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, tokens, dim])
    y = helper.make_tensor_value_info(cur, TensorProto.FLOAT, [1, tokens, dim])
    return _model(nodes, [x], [y], inits)


# ----------------------------------------------------------------------------- timing
def session(
    model: onnx.ModelProto, threads: int, library: str | None = None, kernel_threads: int = 1
):
    """ORT_ENABLE_ALL with ``threads`` intra-op threads; generated kernels with
    ``kernel_threads`` OpenMP threads (the bundle's default is 1)."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 4
    if library:
        so.register_custom_ops_library(library)
        with gates.kernel_threads(kernel_threads):
            return ort.InferenceSession(model.SerializeToString(), so, ["CPUExecutionProvider"])
    return ort.InferenceSession(model.SerializeToString(), so, ["CPUExecutionProvider"])


def interleaved(sessions, feeds, seconds: float) -> list[float]:
    for s in sessions:
        for _ in range(3):
            s.run(None, feeds)
    times = [[] for _ in sessions]
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end or len(times[0]) < 10:
        for k, s in enumerate(sessions):
            t0 = time.perf_counter()
            s.run(None, feeds)
            times[k].append(time.perf_counter() - t0)
    return [statistics.median(t) * 1e3 for t in times]


def math_variants(spec: KernelSpec, feeds: dict, shape, params, seconds: float) -> dict:
    """The same kernel with own polynomials, libm + -ffast-math, and libm without it."""
    out = {}
    fused = _fused_model(spec, shape, params)
    libs = {m: cpu_library([spec], math=m) for m in ("own", "libm", "libm-strict")}
    sessions = [session(fused, 1, str(lib.path)) for lib in libs.values()]
    ms = interleaved(sessions, feeds, seconds)
    for (m, lib), t in zip(libs.items(), ms):
        out[m] = {"us": round(t * 1e3, 1), "vectorized": lib.vectorized[spec.op_type]}
    return out


def _fused_model(spec, shape, params):
    node = helper.make_node(
        spec.op_type,
        [f"x{i}" for i in range(spec.inputs)] + [f"p{j}" for j in range(spec.params)],
        ["y"],
        domain=DOMAIN,
        **spec.attrs(),
    )
    g = helper.make_graph(
        [node],
        "k",
        [
            helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, shape)
            for i in range(spec.inputs)
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
        [
            numpy_helper.from_array(p.reshape(-1).astype(np.float32), f"p{j}")
            for j, p in enumerate(params)
        ],
    )
    return helper.make_model(
        g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)]
    )


def silu_vs_quickgelu(shape, seconds) -> dict:
    x = helper.make_tensor_value_info("x0", TensorProto.FLOAT, shape)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)
    chain = _model(
        [helper.make_node("Sigmoid", ["x0"], ["s"]), helper.make_node("Mul", ["x0", "s"], ["y"])],
        [x],
        [y],
        [],
    )
    spec = KernelSpec(parse("mul(x0,sigmoid(x0))"), "float32", 0)
    lib = cpu_library([spec])
    feeds = {"x0": RNG.standard_normal(shape).astype(np.float32)}
    ms = interleaved(
        [session(chain, 1), session(_fused_model(spec, shape, []), 1, str(lib.path))],
        feeds,
        seconds,
    )
    return {
        "shape": shape,
        "onnxruntime_ops": [k.rpartition(":")[2] for k in gates.kernels_after_ort(chain)],
        "onnxruntime_us": round(ms[0] * 1e3, 1),
        "generated_us": round(ms[1] * 1e3, 1),
    }


# ---------------------------------------------------------------------------- driver
def run_model(
    name, model, out_dir: Path, seconds: float, cuda: bool, shapes: dict | None = None
) -> dict:
    row: dict = {"model": name, "nodes": len(model.graph.node)}
    t0 = time.perf_counter()
    optimized, report = graphopt.optimize(model, pipeline=with_kernels(preset(2)), shapes=shapes)
    row["optimize_s"] = round(time.perf_counter() - t0, 2)
    plain, _ = graphopt.optimize(model, level=2, check=False)
    row["parity_ok"] = report.parity.ok
    row["parity_max_rel"] = max((o.max_rel for o in report.parity.outputs), default=None)
    row["nodes_after"] = len(optimized.graph.node)
    row["fused_nodes"] = sum(1 for n in optimized.graph.node if n.domain == DOMAIN)
    kernels = []
    for r in report.remarks:
        if r.rule != "fuse-elementwise" or r.kind not in ("passed", "missed"):
            continue
        g = r.args.get("gates", {})
        b = g.get("benchmark", {})
        kernels.append(
            {
                "at": r.nodes[0],
                "outcome": r.code,
                "expr": r.args.get("expr"),
                "shape": g.get("shape"),
                "fused_us": b.get("fused_us"),
                "unfused_us": b.get("unfused_us"),
                "speedup": b.get("speedup"),
                "onnxruntime_ops": b.get("onnxruntime_ops"),
                "in_context": g.get("in_context"),
                "max_abs_vs_float64": (g.get("numerics") or {}).get("max_abs_vs_float64"),
                "message": r.message if r.kind == "missed" else None,
            }
        )
    row["kernels"] = kernels
    # the cpu bundle (kernels/cpu built by build.sh) and, with nvcc, the cuda one
    bundle = out_dir / f"{name}.cpu.graphopt"
    _write(bundle, optimized, report)
    row["bundle"] = str(bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    row["bundle_golden_ok"] = manifest["verified"].get("bundle_session", {}).get("golden_ok")
    if cuda:
        opt_cuda, rep_cuda = graphopt.optimize(
            model, target="cuda", pipeline=with_kernels(preset(2))
        )
        cb = out_dir / f"{name}.cuda.graphopt"
        _write(cb, opt_cuda, rep_cuda)
        cm = json.loads((cb / "manifest.json").read_text())
        row["cuda"] = {
            "fused_nodes": sum(1 for n in opt_cuda.graph.node if n.domain == DOMAIN),
            "resources": {
                k["op_type"]: {dt: v["resources"] for dt, v in k["cuda"]["variants"].items()}
                for k in (cm.get("kernels") or {}).get("kernels", [])
            },
            "device": "not-run",
        }
    # whole model: original (ORT_ENABLE_ALL) vs graphopt -O2 vs graphopt -O2 + kernels
    lib = str(bundle / "kernels" / "cpu" / "libgraphopt_fused.so") if row["fused_nodes"] else None
    feeds = {
        i.name: RNG.standard_normal(
            (shapes or {}).get(i.name) or [d.dim_value for d in i.type.tensor_type.shape.dim]
        ).astype(np.float32)
        for i in model.graph.input
    }
    for threads in (1, 2):
        sessions = [
            session(model, threads),
            session(plain, threads),
            session(optimized, threads, lib),
        ]
        ms = interleaved(sessions, feeds, seconds)
        row[f"latency_ms_t{threads}"] = {
            "original": round(ms[0], 3),
            "graphopt_O2": round(ms[1], 3),
            "graphopt_O2_kernels": round(ms[2], 3),
        }
    if lib:  # OpenMP team of the kernels: 1 (bundle default) vs 2, onnxruntime at 1 thread
        ms = interleaved(
            [session(optimized, 1, lib, 1), session(optimized, 1, lib, 2)], feeds, seconds
        )
        row["kernel_threads_ms"] = {"1": round(ms[0], 3), "2": round(ms[1], 3)}
    # math variants for the first fused kernel
    specs = specs_of(optimized)
    if specs:
        spec = specs[0]
        k = next(k for k in kernels if k["expr"] == spec.expr.text())
        shape = k["shape"]
        xs = {f"x{i}": RNG.standard_normal(shape).astype(np.float32) for i in range(spec.inputs)}
        params = [RNG.standard_normal(shape[spec.channel_axis]) for _ in range(spec.params)]
        row["math_variants"] = {
            "expr": spec.expr.text(),
            **math_variants(spec, xs, shape, params, seconds / 2),
        }
    return row


def _write(dest: Path, model, report):
    import shutil

    from graphopt.opt.graph.io import write_model_files

    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    write_model_files(model, dest / "model.onnx", external=False)
    write_bundle_files(dest, model, report)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="where the bundles go (default: a temp dir)")
    ap.add_argument("--quick", action="store_true", help="shorter timing loops")
    ap.add_argument(
        "--models",
        help="instead of the built-in models: every NAME.onnx of this folder with a NAME.json "
        'sidecar {"inputs": {name: shape}} (e.g. the output of make_yolo.py, make_paddle_ocr.py)',
    )
    ap.add_argument("--only", help="comma-separated model names of --models")
    ap.add_argument("--json", help="results file (default results/demo.json)")
    args = ap.parse_args()
    if find_compiler("cc") is None:
        print("no gcc: nothing to demonstrate (the pass would skip with a no-compiler remark)")
        return 1
    seconds = 1.0 if args.quick else 3.0
    out_dir = Path(args.out or tempfile.mkdtemp(prefix="graphopt-kernels-"))
    cuda = find_compiler("nvcc") is not None
    shapes: dict = {}
    if args.models:
        only = set(args.only.split(",")) if args.only else None
        models = {}
        for f in sorted(Path(args.models).glob("*.onnx")):
            side = f.with_suffix(".json")
            if side.exists() and (only is None or f.stem in only):
                models[f.stem] = onnx.load(f)
                shapes[f.stem] = json.loads(side.read_text())["inputs"]
    else:
        models = {
            "masm_64x80x80": masm(64, 80),
            "masm_32x320x320": masm(32, 320),
            "paddle_lcnet_opset11": paddle_lcnet(),
            "layerscale_tail_3136x96": layerscale_tail(),
        }
    rows = [run_model(n, m, out_dir, seconds, cuda, shapes.get(n)) for n, m in models.items()]
    silu = [silu_vs_quickgelu(s, seconds) for s in ([1, 64, 80, 80], [1, 32, 320, 320])]
    result = {
        "machine": os.uname().machine,
        "cpu": _cpu_name(),
        "onnxruntime": ort.__version__,
        "python": sys.version.split()[0],
        "models": rows,
        "silu_vs_onnxruntime_quickgelu": silu,
    }
    res_dir = Path(__file__).parent / "results"
    res_dir.mkdir(exist_ok=True)
    dest = Path(args.json) if args.json else res_dir / "demo.json"
    dest.write_text(json.dumps(result, indent=2, sort_keys=True))
    print(markdown(result))
    print(f"\nbundles in {out_dir}")
    return 0


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def _cell(mv: dict, m: str) -> str:
    return f"{mv[m]['us']} ({'yes' if mv[m]['vectorized'] else 'no'})"


def _row(*cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def markdown(r: dict) -> str:
    out = [f"onnxruntime {r['onnxruntime']} on {r['cpu']}\n"]
    out.append(
        _row("model", "chain at", "outcome", "shape", "generated µs", "onnxruntime µs", "ratio")
        + " with neighbours µs (generated vs onnxruntime) | max abs vs f64 |"
    )
    out.append("|---|---|---|---|---|---|---|---|---|")
    for row in r["models"]:
        seen = set()
        for k in row["kernels"]:
            key = (k["expr"], str(k["shape"]))
            if key in seen:
                continue
            seen.add(key)
            ratio = f"{k['unfused_us'] / k['fused_us']:.2f}x" if k["fused_us"] else "-"
            err = f"{k['max_abs_vs_float64']:.1e}" if k["max_abs_vs_float64"] is not None else "-"
            ort_ops = " + ".join(k["onnxruntime_ops"] or [])
            c = k.get("in_context") or {}
            if c and "fused_us" in c:
                ctx = f"{c['fused_us']} vs {c['unfused_us']} (+{', '.join(c['neighbours'])})"
            elif c:  # onnxruntime runs the same kernels around it either way: not timed
                ctx = f"same kernels around it (+{', '.join(c['neighbours'])})"
            else:
                ctx = "-"
            out.append(
                _row(row["model"], k["at"], k["outcome"], k["shape"], k["fused_us"])
                + f" {k['unfused_us']} ({ort_ops}) | {ratio} | {ctx} | {err} |"
            )
    out.append("")
    out.append(
        _row("model", "fused nodes", "ORT threads", "original ms", "graphopt -O2 ms")
        + " -O2 + kernels ms | kernels vs original |"
    )
    out.append("|---|---|---|---|---|---|---|")
    for row in r["models"]:
        for t in (1, 2):
            lat = row[f"latency_ms_t{t}"]
            ratio = lat["original"] / lat["graphopt_O2_kernels"]
            out.append(
                _row(row["model"], row["fused_nodes"], t, lat["original"], lat["graphopt_O2"])
                + f" {lat['graphopt_O2_kernels']} | {ratio:.2f}x |"
            )
    out.append("\n| model | kernels, 1 OpenMP thread ms | kernels, 2 OpenMP threads ms |")
    out.append("|---|---|---|")
    for row in r["models"]:
        if "kernel_threads_ms" in row:
            kt = row["kernel_threads_ms"]
            out.append(_row(row["model"], kt["1"], kt["2"]))
    out.append("")
    out.append(
        _row("model", "expression", "own polynomials µs (vectorized)", "libm -ffast-math µs")
        + " libm, no fast-math µs |"
    )
    out.append("|---|---|---|---|---|")
    for row in r["models"]:
        mv = row.get("math_variants")
        if mv:
            out.append(
                _row(row["model"], f"`{mv['expr']}`", _cell(mv, "own"), _cell(mv, "libm"))
                + f" {_cell(mv, 'libm-strict')} |"
            )
    out.append("\n| x·σ(x) at | onnxruntime runs | onnxruntime µs | generated µs |")
    out.append("|---|---|---|---|")
    for s in r["silu_vs_onnxruntime_quickgelu"]:
        ops = " + ".join(s["onnxruntime_ops"])
        out.append(_row(s["shape"], ops, s["onnxruntime_us"], s["generated_us"]))
    out.append("\n| cuda bundle | fused nodes | kernel | dtype | arch | registers | spills |")
    out.append("|---|---|---|---|---|---|---|")
    for row in r["models"]:
        c = row.get("cuda")
        if not c:
            continue
        for op, per_dtype in c["resources"].items():
            for dt, per_arch in per_dtype.items():
                for arch, res in per_arch.items():
                    spills = res.get("spill_stores", 0) + res.get("spill_loads", 0)
                    out.append(
                        _row(row["model"], c["fused_nodes"], op, dt, arch, res.get("registers"))
                        + f" {spills} |"
                    )
    return "\n".join(out)


if __name__ == "__main__":
    raise SystemExit(main())
