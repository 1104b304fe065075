#!/usr/bin/env python3
"""Side-by-side benchmark: graphopt against the rival ONNX optimizers.

For every model (NAME.onnx with a NAME.json sidecar {"inputs": {name: shape}}) and every tool,
record the optimizer's cost (wall time, peak RSS, success), the output's size (main-graph nodes,
bytes), its onnxruntime CPU latency (1 thread, ORT_DISABLE_ALL and ORT_ENABLE_ALL, all variants of
one model measured interleaved in one process, reported as ratios to the original in the same
run), session-creation time at ENABLE_ALL and parity against the original.

Every optimizer runs in its own process under a small wrapper process that measures its wall time
and peak RSS (getrusage(RUSAGE_CHILDREN)) and kills it after --timeout seconds. The latency of one
model's variants is measured in one separate process (so a crash or an OOM costs one model, and
the orchestrator stays small).

    python examples/benchmark/bench.py --quick                 # three small models, ~1 min
    python examples/benchmark/bench.py                         # every model in models
    python examples/benchmark/bench.py --only resnet50,gpt2 --tools none,graphopt-O2,onnxsim
    python examples/benchmark/bench.py --speed --only bert_base   # optimize time and RSS only

See README.md next to this file.
"""

from __future__ import annotations

import argparse
import compileall
import datetime as _dt
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
#: the corpus folder: $GRAPHOPT_MODELS, else models/ at the repository root (git-ignored)
DEFAULT_MODELS = Path(os.environ.get("GRAPHOPT_MODELS", REPO / "models"))
QUICK_MODELS = REPO / "examples"

# Order in which known models are run (others follow alphabetically).
MODEL_ORDER = [
    "mobilenet_bn",
    "esrgan_tiny",
    "bert_tiny",
    "resnet50",
    "mobilenet_v3_large",
    "efficientnet_b0",
    "convnext_tiny",
    "vit_b_16",
    "swin_t",
    "bert_base",
    "distilbert",
    "gpt2",
    "t5_small",
    "vit_hf",
    "whisper_tiny_encoder",
    "esrgan",
    "resnet50_fp16",
    "bert_base_fp16",
    "gpt2_fp16",
    "resnet50_dynamo",
    "bert_base_dynamo",
    "resnet50_kiai",
    "bert_base_kiai",
]

ALL_TOOLS = [
    "none",
    "graphopt-O2",
    "graphopt-O2-bundle",  # the same model, run with the bundle's session_config.json
    "graphopt-O1",
    "onnxsim",
    "onnxslim",
    "onnxoptimizer",
    "onnxscript",
    "onnxscript-ort",  # onnxscript.optimizer + onnxscript ort_fusions (not in the default set)
    "ort-basic",
    "ort-extended",
    "ort-transformers",
]
DEFAULT_TOOLS = [t for t in ALL_TOOLS if t != "onnxscript-ort"]

# onnxruntime.transformers.optimizer settings for transformer models (model_type, num_heads,
# hidden_size). Looked up by model name, then by the name without a _fp16/_dynamo/_kiai suffix.
# A sidecar may override with keys "model_type", "num_heads", "hidden_size". Models not listed
# here (CNNs, ESRGAN) are not transformer models: the ort-transformers row says "n/a".
TRANSFORMER_CONFIGS = {
    "bert_tiny": ("bert", 2, 128),
    "bert_base": ("bert", 12, 768),
    "distilbert": ("bert", 12, 768),
    "gpt2": ("gpt2", 12, 768),
    "t5_small": ("t5", 8, 512),
    "vit_hf": ("vit", 12, 768),
    "vit_b_16": ("vit", 12, 768),
    "swin_t": ("swin", 0, 0),  # heads differ per stage (3/6/12/24): let it detect
    "whisper_tiny_encoder": ("bert", 6, 384),
}
VARIANT_SUFFIXES = ("_fp16", "_dynamo", "_kiai")

TWO_GB = 2**31 - 1


# --------------------------------------------------------------------------------------------
# small helpers


def _first_error_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in lines:
        if ln.startswith("BENCH-ERROR: "):
            return ln[len("BENCH-ERROR: ") :][:300]
    # a Python traceback ends with the exception line; a CLI prints one line
    for ln in reversed(lines):
        if not ln.startswith(("Traceback", "File ", "warnings.warn", "^")):
            return ln[:300]
    return "(no message)"


def _transformer_config(name: str, sidecar: dict):
    base = name
    cfg = TRANSFORMER_CONFIGS.get(base)
    if cfg is None:
        for suf in VARIANT_SUFFIXES:
            if base.endswith(suf):
                cfg = TRANSFORMER_CONFIGS.get(base[: -len(suf)])
                break
    if "model_type" in sidecar:
        cfg = (
            sidecar["model_type"],
            int(sidecar.get("num_heads", 0)),
            int(sidecar.get("hidden_size", 0)),
        )
    return cfg


def _save_proto(model, out: Path) -> None:
    import onnx

    out.parent.mkdir(parents=True, exist_ok=True)
    if model.ByteSize() > TWO_GB:
        onnx.save_model(
            model,
            str(out),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=out.name + ".data",
        )
    else:
        onnx.save_model(model, str(out))


def _model_bytes(path: Path, m=None) -> int:
    """Size of the model file plus the external data files it references."""
    import onnx
    from onnx.external_data_helper import _get_all_tensors

    total = path.stat().st_size
    if m is None:
        try:
            m = onnx.load(str(path), load_external_data=False)
        except Exception:  # noqa: BLE001
            return total
    seen = set()
    for t in _get_all_tensors(m):
        if t.data_location == onnx.TensorProto.EXTERNAL:
            for e in t.external_data:
                if e.key == "location" and e.value not in seen:
                    seen.add(e.value)
                    f = path.parent / e.value
                    if f.exists():
                        total += f.stat().st_size
    return total


# --------------------------------------------------------------------------------------------
# worker: run one optimizer in-process (invoked as `bench.py _optimize TOOL IN OUT CFG_JSON`)


def _worker_optimize(tool: str, src: str, dst: str, cfg_json: str) -> int:
    cfg = json.loads(cfg_json)
    out = Path(dst)
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        if tool == "none":
            shutil.copyfile(src, out)
        elif tool == "onnxsim":
            import onnx
            import onnxsim

            model = onnx.load(src)
            model, _ = onnxsim.simplify(model)
            _save_proto(model, out)
        elif tool == "onnxslim":
            import onnx
            import onnxslim

            model = onnxslim.slim(onnx.load(src))
            _save_proto(model, out)
        elif tool == "onnxoptimizer":
            import onnx
            import onnxoptimizer

            model = onnxoptimizer.optimize(onnx.load(src))  # default: fuse+elimination passes
            _save_proto(model, out)
        elif tool in ("onnxscript", "onnxscript-ort"):
            import onnx_ir as ir
            import onnxscript.optimizer

            model = ir.load(src)
            model = onnxscript.optimizer.optimize(model)
            if tool == "onnxscript-ort":
                from onnxscript.rewriter.ort_fusions import optimize_for_ort

                res = optimize_for_ort(model)
                model = res[0] if isinstance(res, tuple) else res
            proto = ir.serde.serialize_model(model)
            _save_proto(proto, out)
        elif tool in ("ort-basic", "ort-extended"):
            import onnxruntime as ort

            so = ort.SessionOptions()
            so.graph_optimization_level = (
                ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
                if tool == "ort-basic"
                else ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
            )
            so.optimized_model_filepath = str(out)
            so.intra_op_num_threads = 1
            if os.path.getsize(src) > TWO_GB:
                so.add_session_config_entry(
                    "session.optimized_model_external_initializers_file_name",
                    out.name + ".data",
                )
            ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])
        elif tool == "ort-transformers":
            try:
                import torch  # noqa: F401
            except ImportError:
                # optimize_by_onnxruntime() imports torch only to read torch.version.hip when
                # use_gpu=True; a stub keeps torch (GBs) out of the bench venv and changes nothing
                # on CPU.
                import types

                stub = types.ModuleType("torch")
                stub.version = types.SimpleNamespace(hip=None, cuda=None)
                sys.modules["torch"] = stub
            from onnxruntime.transformers.optimizer import optimize_model

            if not cfg.get("transformer"):
                raise RuntimeError("n/a")
            model_type, heads, hidden = cfg["transformer"]
            m = optimize_model(
                src,
                model_type=model_type,
                num_heads=heads,
                hidden_size=hidden,
                use_gpu=False,
            )
            m.save_model_to_file(str(out), use_external_data_format=m.model.ByteSize() > TWO_GB)
        else:
            raise RuntimeError(f"unknown tool {tool}")
    except Exception as e:  # noqa: BLE001 - report any failure as one line
        import traceback

        traceback.print_exc()
        msg = f"{type(e).__name__}: {e}".splitlines()[0] if str(e) else type(e).__name__
        print(f"BENCH-ERROR: {msg}", file=sys.stderr)
        return 1
    print(json.dumps({"inner_s": time.perf_counter() - t0}))
    return 0


# --------------------------------------------------------------------------------------------
# wrapper: run a command, measure wall time and peak RSS of its process tree
# (invoked as `bench.py _measure TIMEOUT RESULT_JSON -- CMD...`)


def _worker_measure(timeout: float, result: str, cmd: list[str]) -> int:
    import resource

    t0 = time.perf_counter()
    rec: dict = {"cmd": cmd}
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        rec["rc"] = p.returncode
        rec["stdout"] = p.stdout[-4000:]
        rec["stderr"] = p.stderr[-8000:]
        if p.returncode != 0:
            if p.returncode < 0:
                rec["error"] = f"killed by signal {-p.returncode}" + (
                    " (out of memory?)" if p.returncode == -9 else ""
                )
            else:
                rec["error"] = f"exit {p.returncode}: {_first_error_line(p.stderr)}"
    except subprocess.TimeoutExpired as e:
        rec["rc"] = None
        rec["error"] = f"timeout after {timeout:.0f} s"
        rec["stderr"] = (
            (e.stderr or b"")[-4000:].decode("utf-8", "replace")
            if isinstance(e.stderr, bytes)
            else (e.stderr or "")[-4000:]
        )
    rec["wall_s"] = time.perf_counter() - t0
    # Linux: ru_maxrss of children = peak RSS of the largest waited-for descendant, in KiB
    rec["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024.0
    Path(result).write_text(json.dumps(rec))
    return 0


# --------------------------------------------------------------------------------------------
# worker: latency, session creation, parity and graph stats of all variants of one model
# (invoked as `bench.py _latency SPEC_JSON RESULT_JSON`)


def _make_feed(sess, shapes: dict, seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    np_types = {
        "tensor(float)": np.float32,
        "tensor(float16)": np.float16,
        "tensor(double)": np.float64,
        "tensor(int64)": np.int64,
        "tensor(int32)": np.int32,
        "tensor(bool)": np.bool_,
    }
    feed = {}
    for i in sess.get_inputs():
        shape = shapes.get(i.name)
        if shape is None:
            shape = [d if isinstance(d, int) and d > 0 else 1 for d in i.shape]
        dt = np_types.get(i.type)
        if dt is None:
            raise RuntimeError(f"input {i.name}: unsupported type {i.type}")
        lname = i.name.lower()
        if dt in (np.int64, np.int32):
            if "mask" in lname:
                a = np.ones(shape, dtype=dt)
            elif "token_type" in lname:
                a = np.zeros(shape, dtype=dt)
            else:
                a = rng.integers(0, 100, size=shape).astype(dt)
        elif dt is np.bool_:
            a = np.ones(shape, dtype=dt)
        else:
            a = rng.standard_normal(shape).astype(dt)
        feed[i.name] = a
    return feed


def _load_session_ms(bundle: str, reps: int) -> dict:
    """Session creation through graphopt.load_session (median of ``reps``, at most ~3 s): its
    integrity check and, on the machine that wrote the bundle, its fast path."""
    import gc

    import graphopt

    try:
        samples, how = [], {}
        while len(samples) < max(1, reps) and sum(samples) < 3000:
            t0 = time.perf_counter()
            _, how = graphopt.open_session(bundle)
            samples.append((time.perf_counter() - t0) * 1e3)
            gc.collect()
    except Exception as e:  # noqa: BLE001
        return {"load_session_error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
    return {
        "load_session_ms": statistics.median(samples),
        "load_session_model": how.get("model"),
        "load_session_why": how.get("why"),
    }


def _parity(ref_names, ref_outs, names, outs, fp16_model: bool = False) -> dict:
    """Every output vs the original's: ok when max|err| <= tol * max|ref|, tol 1e-4, or 1e-2 when
    the output is fp16 or the model computes in fp16 (fp16 weights behind fp32 I/O)."""
    import numpy as np

    if len(outs) != len(ref_outs):
        return {
            "ok": False,
            "error": f"{len(outs)} outputs, original has {len(ref_outs)}",
        }
    by_name = dict(zip(names, outs))
    worst = 0.0
    per_output = []
    first_error = None
    for rn, r, o_pos in zip(ref_names, ref_outs, outs):
        o = by_name.get(rn, o_pos)
        r = np.asarray(r)
        o = np.asarray(o)
        if r.shape != o.shape:
            return {
                "ok": False,
                "error": f"output {rn}: shape {list(o.shape)} vs {list(r.shape)}",
            }
        if r.dtype.kind in "iub":
            if not np.array_equal(r, o):
                return {"ok": False, "error": f"output {rn}: integer values differ"}
            continue
        rf = r.astype(np.float64)
        of = o.astype(np.float64)
        if not np.array_equal(np.isnan(rf), np.isnan(of)):
            return {"ok": False, "error": f"output {rn}: NaN pattern differs"}
        finite = ~np.isnan(rf)
        scale = float(np.max(np.abs(rf[finite]))) if finite.any() else 0.0
        err = float(np.max(np.abs(rf[finite] - of[finite]))) if finite.any() else 0.0
        tol = 1e-2 if fp16_model or r.dtype == np.float16 or o.dtype == np.float16 else 1e-4
        rel = err / max(scale, 1e-6)
        per_output.append({"name": rn, "max_abs": err, "scale": scale, "rel": rel, "tol": tol})
        if rel > tol and first_error is None:
            first_error = (
                f"output {rn}: max abs err {err:.3g} = {rel:.2g}x scale {scale:.3g} (tol {tol:g})"
            )
        worst = max(worst, rel)
    res = {"ok": first_error is None, "rel_err": worst, "outputs": per_output}
    if first_error:
        res["error"] = first_error
    return res


def _worker_latency(spec_path: str, result_path: str) -> int:
    import gc

    import numpy as np
    import onnx
    import onnxruntime as ort

    spec = json.loads(Path(spec_path).read_text())
    if spec.get("cpu") is not None:
        try:
            os.sched_setaffinity(0, {spec["cpu"]})
        except (AttributeError, OSError):
            pass
    variants = spec["variants"]  # [{"tool", "path"}], variants[0] is the original
    shapes = spec["shapes"]
    runs, warmup = spec["runs"], spec["warmup"]
    res: dict = {t["tool"]: {} for t in variants}

    def save():
        Path(result_path).write_text(json.dumps(res, indent=1))

    # graph stats
    fp16_model = False
    for v in variants:
        try:
            m = onnx.load(v["path"], load_external_data=False)
            ops: dict[str, int] = {}
            for n in m.graph.node:
                k = n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}.{n.op_type}"
                ops[k] = ops.get(k, 0) + 1
            res[v["tool"]].update(
                nodes=len(m.graph.node),
                ops=dict(sorted(ops.items())),
                opset={o.domain or "ai.onnx": o.version for o in m.opset_import},
                bytes=_model_bytes(Path(v["path"]), m),
            )
            if v is variants[0]:
                fp16 = any(t.data_type == onnx.TensorProto.FLOAT16 for t in m.graph.initializer)
                fp16 = fp16 or any(
                    n.op_type == "Cast"
                    and any(a.name == "to" and a.i == onnx.TensorProto.FLOAT16 for a in n.attribute)
                    for n in m.graph.node
                )
                res[v["tool"]]["fp16_model"] = fp16_model = fp16
            del m
        except Exception as e:  # noqa: BLE001
            res[v["tool"]]["stats_error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
    gc.collect()
    save()

    levels = {
        "DISABLE_ALL": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "ENABLE_ALL": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }

    def options(level):
        so = ort.SessionOptions()
        so.graph_optimization_level = levels[level]
        so.intra_op_num_threads = 1
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.log_severity_level = 3
        return so

    def create(v, level):
        so = options(level)
        for key, value in v.get("session_config", {}).items():
            so.add_session_config_entry(key, value)
        return ort.InferenceSession(v["path"], so, providers=["CPUExecutionProvider"])

    feed = None
    ref = None  # (names, outputs) of the original at DISABLE_ALL
    for level in ("DISABLE_ALL", "ENABLE_ALL"):
        for group in spec["groups"]:  # lists of variant indices, each starting with 0
            sessions: dict[int, object] = {}
            feeds: dict[int, dict] = {}
            for i in group:
                v = variants[i]
                key = "create_ms_" + level
                try:
                    samples = []
                    t_spent = 0.0
                    while True:
                        t0 = time.perf_counter()
                        s = create(v, level)
                        dt = time.perf_counter() - t0
                        samples.append(dt * 1e3)
                        t_spent += dt
                        reps = spec["create_reps"] if level == "ENABLE_ALL" else 1
                        if len(samples) >= reps or t_spent > 3.0:
                            break
                        del s
                        gc.collect()
                    res[v["tool"]][key] = statistics.median(samples)
                    if level == "ENABLE_ALL" and v.get("bundle"):
                        res[v["tool"]].update(_load_session_ms(v["bundle"], spec["create_reps"]))
                    if feed is None:
                        feed = _make_feed(s, shapes)
                    names = {x.name for x in s.get_inputs()}
                    missing = names - set(feed)
                    if missing:
                        raise RuntimeError(
                            f"requires inputs not in the original: {sorted(missing)}"
                        )
                    f = {k: a for k, a in feed.items() if k in names}
                    outs = s.run(None, f)  # first run: also warm-up
                    onames = [o.name for o in s.get_outputs()]
                    if level == "DISABLE_ALL":
                        if i == 0:
                            ref = (onames, outs)
                            res[v["tool"]]["parity"] = {"ok": True, "rel_err": 0.0}
                        elif ref is not None:
                            res[v["tool"]]["parity"] = _parity(
                                ref[0], ref[1], onames, outs, fp16_model
                            )
                    elif ref is not None and i != 0:
                        res[v["tool"]]["parity_enable_all"] = _parity(
                            ref[0], ref[1], onames, outs, fp16_model
                        )
                    del outs
                    sessions[i] = s
                    feeds[i] = f
                except Exception as e:  # noqa: BLE001
                    msg = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                    res[v["tool"]]["session_error_" + level] = msg
                    if level == "DISABLE_ALL" and "parity" not in res[v["tool"]]:
                        res[v["tool"]]["parity"] = {"ok": False, "error": msg}
            if 0 not in sessions:
                save()
                continue
            order = [i for i in group if i in sessions]
            warm: list[float] = []
            for _ in range(max(warmup - 1, 1)):
                for i in order:
                    t0 = time.perf_counter()
                    sessions[i].run(None, feeds[i])
                    if i == 0:
                        warm.append((time.perf_counter() - t0) * 1e3)
            # small models: more rounds, so that each variant gets >= min_time_s of timed runs
            n_runs = runs
            est = min(warm)
            if est > 0:
                n_runs = max(
                    runs,
                    min(spec["max_runs"], math.ceil(spec["min_time_s"] * 1e3 / est)),
                )
            times: dict[int, list[float]] = {i: [] for i in order}
            # where onnxruntime's buffers land moves a session's speed by a few % for its
            # life (the original against itself: 0.986-1.029 over four session pairs of
            # MobileNetV3): at ENABLE_ALL the rounds are split over ``generations`` of fresh
            # sessions, created in a rotated order, so the estimate and its interval see it
            gens = max(1, spec.get("generations", 1)) if level == "ENABLE_ALL" else 1
            per_gen = math.ceil(n_runs / gens)
            gen_rounds: list[int] = []
            for g in range(gens):
                if g:
                    _recreate(sessions, order, g, lambda i, lv=level: create(variants[i], lv))
                    for _ in range(max(warmup - 1, 1)):
                        for i in order:
                            sessions[i].run(None, feeds[i])
                for r in range(per_gen):
                    k = r % len(order)
                    for i in order[k:] + order[:k]:  # rotate the start: no fixed neighbour
                        t0 = time.perf_counter()
                        sessions[i].run(None, feeds[i])
                        times[i].append((time.perf_counter() - t0) * 1e3)
                gen_rounds.append(per_gen)
            base = statistics.median(times[0])
            for i in order:
                ts = times[i]
                med = statistics.median(ts)
                p90 = float(np.percentile(ts, 90))
                # paired estimate: the variant and the original ran in the same round, so their
                # ratio cancels load that drifts between rounds (other processes, thermal)
                paired = [a / b for a, b in zip(ts, times[0])]
                res[variants[i]["tool"]][level] = {
                    "median_ms": med,
                    "p90_ms": p90,
                    "runs": len(ts),
                    "ratio": statistics.median(paired),
                    "ratio_of_medians": med / base,
                    "ratio_p10_p90": [
                        float(np.percentile(paired, 10)),
                        float(np.percentile(paired, 90)),
                    ],
                    "ratio_ci95": list(_ratio_ci95(paired, gen_rounds)),
                    "generations": gen_rounds,
                    "base_median_ms": base,
                    "times_ms": [round(t, 3) for t in ts],
                }
            del sessions, feeds
            gc.collect()
            save()
    duel = _duel_pair(res)
    if duel and spec.get("duel_s", 0) > 0 and feed is not None:
        by_tool = {v["tool"]: v for v in variants}
        try:
            res["_duel"] = _duel(
                lambda i: create(by_tool[duel[i]], "ENABLE_ALL"), feed, spec, *duel
            )
        except Exception as e:  # noqa: BLE001
            res["_duel"] = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
    save()
    return 0


def _recreate(sessions: dict, order: list[int], g: int, make) -> None:
    """Fresh sessions for ``order``'s variants, all dropped first, created starting at the
    ``g``-th (rotated each generation)."""
    import gc

    for i in order:
        sessions[i] = None
    gc.collect()
    k = g % len(order)
    for i in order[k:] + order[:k]:
        sessions[i] = make(i)


def _ratio_ci95(paired: list[float], gen_rounds: list[int], resamples: int = 2000):
    """Bootstrap 95 % interval of the median per-round ratio, resampling the session
    generations (with replacement) and then the rounds within each: a session's own offset
    widens the interval instead of hiding in it.  One generation: the rounds alone."""
    import numpy as np

    x = np.asarray(paired, dtype=float)
    if x.size < 2:
        return (float(x[0]), float(x[0])) if x.size else (None, None)
    rng = np.random.default_rng(0)
    bounds = np.cumsum([0] + list(gen_rounds))
    blocks = [x[a:b] for a, b in zip(bounds[:-1], bounds[1:]) if b > a] or [x]
    meds = np.empty(resamples)
    for j in range(resamples):
        picked = rng.integers(0, len(blocks), len(blocks)) if len(blocks) > 1 else [0]
        parts = [blocks[b][rng.integers(0, blocks[b].size, blocks[b].size)] for b in picked]
        meds[j] = np.median(np.concatenate(parts))
    low, high = np.percentile(meds, [2.5, 97.5])
    return float(low), float(high)


def _duel_pair(res: dict) -> tuple[str, str] | None:
    """(graphopt's variant, the fastest rival at ENABLE_ALL among those that matched)."""

    def ratio(t):
        r = res.get(t, {})
        ok = r.get("parity", {}).get("ok") and not r.get("session_error_ENABLE_ALL")
        return r.get("ENABLE_ALL", {}).get("ratio") if ok else None

    mine = next((t for t in ("graphopt-O2-bundle", "graphopt-O2") if ratio(t)), None)
    rivals = [(ratio(t), t) for t in res if not t.startswith(("graphopt", "none", "_"))]
    rivals = [x for x in rivals if x[0]]
    return (mine, min(rivals)[1]) if mine and rivals else None


def _duel(make, feed: dict, spec: dict, mine: str, rival: str) -> dict:
    """Just the two, alternating (the order flips every round) for ``duel_s`` seconds each:
    the median of per-round ratios t(mine) / t(rival) with a bootstrap 95 % interval
    (``graphopt.opt.verify.perf.ratio_interval``, the performance safety net's estimate).

    The session created first runs measurably slower here (about 0.5-1 %: where onnxruntime's
    buffers land), so half the rounds run on sessions created mine first, half rival first."""
    import gc

    import numpy as np

    from graphopt.opt.verify.perf import ratio_interval, verdict

    ratios, halves, rounds = [], [], 0
    for first in (0, 1):
        sessions: list = [None, None]
        for i in (first, 1 - first):
            sessions[i] = make(i)
        feeds = [
            {k: a for k, a in feed.items() if k in {x.name for x in s.get_inputs()}}
            for s in sessions
        ]
        for _ in range(3):
            for s, f in zip(sessions, feeds):
                s.run(None, f)
        times: list[list[float]] = [[], []]
        t_end = time.perf_counter() + spec["duel_s"]
        r = 0
        while r < 15 or (time.perf_counter() < t_end and r < spec["max_runs"] // 2):
            for i in (0, 1) if r % 2 == 0 else (1, 0):
                t0 = time.perf_counter()
                sessions[i].run(None, feeds[i])
                times[i].append(time.perf_counter() - t0)
            r += 1
        half = np.array(times[0]) / np.array(times[1])
        ratios.append(half)
        halves.append(float(np.median(half)))
        rounds += r
        del sessions, feeds
        gc.collect()
    ratio, lo, hi = ratio_interval(np.concatenate(ratios))
    return {
        "mine": mine,
        "rival": rival,
        "rounds": rounds,
        "ratio": ratio,
        "ci95": [lo, hi],
        "ratio_mine_created_first": halves[0],
        "ratio_rival_created_first": halves[1],
        "verdict": verdict(lo, hi),
    }


# --------------------------------------------------------------------------------------------
# orchestration


def _discover(models_dir: Path, only: list[str] | None, min_age_s: float = 20.0):
    found = []
    now = time.time()
    for p in sorted(models_dir.glob("*.onnx")):
        name = p.stem
        if only and name not in only:
            continue
        side = p.with_suffix(".json")
        if not side.exists():
            found.append((name, p, None))
            continue
        if now - p.stat().st_mtime < min_age_s or now - side.stat().st_mtime < min_age_s:
            continue  # still being written
        found.append((name, p, side))
    rank = {n: i for i, n in enumerate(MODEL_ORDER)}
    found.sort(key=lambda x: (rank.get(x[0], len(rank)), x[0]))
    return found


GRAPHOPT_PYTHONPATH: str | None = None  # set by --graphopt-source snapshot


def _snapshot_graphopt(dest: Path) -> Path:
    """Copy graphopt's package files (the layout pyproject maps: the repository root is the
    package) so that one run sees one graphopt even while the checkout is being edited."""
    pkg = dest / "graphopt"
    shutil.rmtree(dest, ignore_errors=True)
    pkg.mkdir(parents=True)
    for f in REPO.glob("*.py"):
        shutil.copy2(f, pkg / f.name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for d in ("opt", "passes", "rules", "targets"):
        if (REPO / d).is_dir():
            shutil.copytree(REPO / d, pkg / d, ignore=ignore)
    # compiled as `pip install` (not editable) compiles an installed package, as the rivals'
    # are in site-packages: no run pays for compiling graphopt's sources, whatever
    # PYTHONDONTWRITEBYTECODE says (it only stops Python from writing them as it imports)
    compileall.compile_dir(pkg, quiet=1)
    return dest


def _shape_flags(inputs: dict | None) -> list[str]:
    """``--shape name=d0,d1,...`` for each input of a sidecar's ``inputs``."""
    flags: list[str] = []
    for name, shape in (inputs or {}).items():
        flags += ["--shape", f"{name}={','.join(str(d) for d in shape)}"]
    return flags


def _optimize_cmd(tool: str, src: Path, out_dir: Path, cfg: dict) -> tuple[list[str], Path]:
    py = sys.executable
    if tool.startswith("graphopt-O"):
        level = tool[len("graphopt-O") :]
        exe = Path(py).parent / "graphopt"
        if GRAPHOPT_PYTHONPATH or not exe.exists():
            base = [py, "-m", "graphopt.cli"]
        else:
            base = [str(exe)]
        return (
            base
            + [
                "optimize",
                str(src),
                "-o",
                str(out_dir),
                "--target",
                "cpu",
                "-O",
                level,
                # parity on, as users run it (the bundle's golden inputs and its verified
                # machine-specific fast path need it); the safety net's timing off: this
                # script measures latency itself
                "--no-measure",
                *_shape_flags(cfg.get("inputs")),
                "--quiet",
                "--no-kernels",  # the latency sessions here register no custom-op library
            ],
            out_dir / "model.onnx",
        )
    out = out_dir / "model.onnx"
    return [
        py,
        str(Path(__file__).resolve()),
        "_optimize",
        tool,
        str(src),
        str(out),
        json.dumps(cfg),
    ], out


def _run_measured(cmd: list[str], timeout: float) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        rpath = f.name
    try:
        wrapper = [
            sys.executable,
            str(Path(__file__).resolve()),
            "_measure",
            str(timeout),
            rpath,
            "--",
        ] + cmd
        env = None
        if GRAPHOPT_PYTHONPATH:
            env = dict(os.environ, PYTHONPATH=GRAPHOPT_PYTHONPATH)
        subprocess.run(wrapper, timeout=timeout + 120, env=env)
        return json.loads(Path(rpath).read_text())
    except Exception as e:  # noqa: BLE001
        return {
            "rc": None,
            "error": f"wrapper failed: {type(e).__name__}: {e}",
            "cmd": cmd,
        }
    finally:
        Path(rpath).unlink(missing_ok=True)


def _groups(n_variants: int, model_bytes: int, mem_factor: float) -> list[list[int]]:
    """Split variants into groups that fit in memory; each group contains the original (0)."""
    try:
        import psutil

        avail = psutil.virtual_memory().available
    except Exception:  # noqa: BLE001
        avail = 8 * 2**30
    per = max(model_bytes, 1) * mem_factor
    fit = max(2, int(0.6 * avail // per))
    others = list(range(1, n_variants))
    if n_variants <= fit:
        return [list(range(n_variants))]
    k = fit - 1
    return [[0] + others[j : j + k] for j in range(0, len(others), k)]


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in [
        "graphopt",
        "onnx",
        "onnxruntime",
        "onnx-graphsurgeon",
        "onnxsim",
        "onnxslim",
        "onnxoptimizer",
        "onnxscript",
        "onnx-ir",
        "numpy",
        "psutil",
    ]:
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def _git_state() -> str:
    """graphopt's checkout: commit and number of modified/untracked files (read-only git)."""
    try:
        head = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.splitlines()
        return f"{head}" + (f" + {len(dirty)} uncommitted files" if dirty else " (clean)")
    except Exception as e:  # noqa: BLE001
        return f"unknown ({type(e).__name__})"


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for ln in Path("/proc/cpuinfo").read_text().splitlines():
            if ln.startswith("model name"):
                cpu = ln.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        import psutil

        mem = f", {psutil.virtual_memory().total / 2**30:.0f} GiB RAM"
    except Exception:  # noqa: BLE001
        pass
    return f"{cpu}, {os.cpu_count()} logical CPUs{mem}, {platform.system()} {platform.release()}"


def _fmt(x, spec="{:.2f}", empty="—"):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return empty
    return spec.format(x)


def _geomean(xs):
    xs = [x for x in xs if x and x > 0]
    if not xs:
        return None
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def _rows_for(model_res: dict, tools: list[str]):
    for t in tools:
        r = model_res["tools"].get(t)
        if r is not None:
            yield t, r


def _status(r: dict) -> str:
    if r.get("na"):
        return "n/a"
    if r.get("opt_error"):
        return "FAIL: " + r["opt_error"]
    p = r.get("parity")
    if p is None:
        return "—"
    if p.get("ok"):
        return f"ok ({p.get('rel_err', 0):.1e})"
    if r.get("session_error_DISABLE_ALL"):
        return "FAIL in onnxruntime: " + r["session_error_DISABLE_ALL"]
    return "MISMATCH: " + p.get("error", "")


def _ratio_cell(lat: dict) -> str:
    if not lat:
        return "—"
    cell = f"{lat['ratio']:.3f}"
    ci = lat.get("ratio_ci95")
    spread = lat.get("ratio_p10_p90")
    if ci and ci[0] is not None and lat["ratio"] != 1.0:
        cell += f" [{ci[0]:.3f}, {ci[1]:.3f}]"
    elif spread and lat["ratio"] != 1.0:
        cell += f" [{spread[0]:.2f}, {spread[1]:.2f}]"
    return cell


def _slower_beyond_interval(results: dict, tool: str) -> tuple[list[str], int]:
    """(models where ``tool``'s output, matching, runs slower than the original at
    ENABLE_ALL beyond its 95 % interval, as "name ratio [low, high]"; models with an
    interval)."""
    slow, n = [], 0
    for name, mres in results.items():
        r = mres["tools"].get(tool, {})
        e = r.get("ENABLE_ALL", {})
        ci = e.get("ratio_ci95")
        if not _usable(r) or not ci or ci[0] is None:
            continue
        n += 1
        if ci[0] > 1.0:
            slow.append(f"{name} {e['ratio']:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]")
    return slow, n


def render_model(name: str, mres: dict, tools: list[str]) -> str:
    lines = []
    orig = mres["tools"].get("none", {})
    dis = orig.get("DISABLE_ALL", {})
    ena = orig.get("ENABLE_ALL", {})
    lines.append(f"### {name}\n")
    info = f"`{mres['path']}`, {mres['bytes'] / 1e6:.1f} MB, inputs " + ", ".join(
        f"{k}={v}" for k, v in mres["shapes"].items()
    )
    if dis or ena:
        info += (
            f"; original: DISABLE_ALL {_fmt(dis.get('median_ms'), '{:.1f}')} ms "
            f"(p90 {_fmt(dis.get('p90_ms'), '{:.1f}')}), ENABLE_ALL "
            f"{_fmt(ena.get('median_ms'), '{:.1f}')} ms "
            f"(p90 {_fmt(ena.get('p90_ms'), '{:.1f}')})"
            f", {ena.get('runs', dis.get('runs', 0))} interleaved runs per variant"
        )
    if len(mres.get("groups", [])) > 1:
        info += f"; measured in {len(mres['groups'])} memory groups, each with the original"
    lines.append(info + "\n")
    lines.append(
        "| tool | nodes | size MB | optimize s | peak RSS MB | latency ratio DISABLE_ALL "
        "| latency ratio ENABLE_ALL | ENABLE_ALL med / p90 ms | session-create ms "
        "| load_session ms | parity |"
    )
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for t, r in _rows_for(mres, tools):
        if r.get("na"):
            lines.append(f"| {t} | | | | | | | | | | n/a (not a transformer model) |")
            continue
        d = r.get("DISABLE_ALL", {})
        e = r.get("ENABLE_ALL", {})
        ratio_d = _ratio_cell(d)
        ratio_e = _ratio_cell(e)
        if r.get("session_error_DISABLE_ALL") and not d:
            ratio_d = "error"
        if r.get("session_error_ENABLE_ALL") and not e:
            ratio_e = "error"
        med = f"{e['median_ms']:.1f} / {e['p90_ms']:.1f}" if e else "—"
        status = _status(r)
        if r.get("session_error_ENABLE_ALL") and r.get("parity", {}).get("ok"):
            status += "; ENABLE_ALL: " + r["session_error_ENABLE_ALL"]
        pa = r.get("parity_enable_all")
        if pa is not None and not pa.get("ok") and r.get("parity", {}).get("ok"):
            status += "; at ENABLE_ALL: " + pa.get("error", "mismatch")
        status = status.replace("|", "\\|")
        size = r["bytes"] / 1e6 if r.get("bytes") else None
        lines.append(
            f"| {t} | {_fmt(r.get('nodes'), '{:d}')} | {_fmt(size, '{:.1f}')}"
            f" | {_fmt(r.get('opt_s'), '{:.2f}') if t != 'none' else ''}"
            f" | {_fmt(r.get('peak_rss_mb'), '{:.0f}') if t != 'none' else ''}"
            f" | {ratio_d} | {ratio_e} | {med} | {_fmt(r.get('create_ms_ENABLE_ALL'), '{:.0f}')}"
            f" | {_load_session_cell(r)} | {status} |"
        )
    lines.append("")
    return "\n".join(lines)


def _load_session_cell(r: dict) -> str:
    """load_session's creation time, and which model file it loaded."""
    if r.get("load_session_error"):
        return "error"
    if r.get("load_session_ms") is None:
        return ""
    fast = r.get("load_session_model") == "model.machine.onnx"
    return f"{r['load_session_ms']:.0f} ({'fast path' if fast else 'portable'})"


def _usable(r: dict) -> bool:
    return not r.get("na") and not r.get("opt_error") and r.get("parity", {}).get("ok", False)


def render_summary(results: dict, tools: list[str]) -> str:
    lines = ["## Summary\n"]
    lines.append(
        "Geo-mean of latency ratios (optimized/original, same run) over the models where "
        "the tool's output ran and matched; median node reduction (1 − nodes/original); "
        "`n` = models counted.\n"
    )
    lines.append(
        "| tool | n | geo-mean ratio DISABLE_ALL | geo-mean ratio ENABLE_ALL "
        "| median node reduction | median optimize s | max peak RSS MB "
        "| fewest nodes (models) | fastest ENABLE_ALL (models) | failures |"
    )
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    best_nodes: dict[str, int] = {}
    best_lat: dict[str, int] = {}
    for mres in results.values():
        cands = [(t, r) for t, r in mres["tools"].items() if t in tools and _usable(r)]
        if cands:
            mn = min(r.get("nodes", 10**9) for _, r in cands)
            for t, r in cands:
                if r.get("nodes") == mn:
                    best_nodes[t] = best_nodes.get(t, 0) + 1
            lat = [(r["ENABLE_ALL"]["ratio"], t) for t, r in cands if "ENABLE_ALL" in r]
            if lat:
                t = min(lat)[1]
                best_lat[t] = best_lat.get(t, 0) + 1
    for t in tools:
        rd, re_, red, opt_s, rss, fails, n = [], [], [], [], [], 0, 0
        for mres in results.values():
            r = mres["tools"].get(t)
            if r is None or r.get("na"):
                continue
            if not _usable(r) or r.get("session_error_ENABLE_ALL"):
                fails += 1
            if not _usable(r):
                continue
            n += 1
            if "DISABLE_ALL" in r:
                rd.append(r["DISABLE_ALL"]["ratio"])
            if "ENABLE_ALL" in r:
                re_.append(r["ENABLE_ALL"]["ratio"])
            on = mres["tools"].get("none", {}).get("nodes")
            if on and r.get("nodes") is not None:
                red.append(1 - r["nodes"] / on)
            if r.get("opt_s") is not None:
                opt_s.append(r["opt_s"])
            if r.get("peak_rss_mb") is not None:
                rss.append(r["peak_rss_mb"])
        lines.append(
            f"| {t} | {n} | {_fmt(_geomean(rd), '{:.3f}')} | {_fmt(_geomean(re_), '{:.3f}')}"
            f" | {_fmt(statistics.median(red) * 100 if red else None, '{:.1f} %')}"
            f" | {_fmt(statistics.median(opt_s) if opt_s and t != 'none' else None, '{:.2f}')}"
            f" | {_fmt(max(rss) if rss and t != 'none' else None, '{:.0f}')}"
            f" | {best_nodes.get(t, 0)} | {best_lat.get(t, 0)} | {fails} |"
        )
    lines.append("")
    lines.append(
        "Ties in node count credit every tied tool; “fastest” is the single lowest "
        "ENABLE_ALL ratio (differences within ±2–3 % are noise).\n"
    )
    for t in ("graphopt-O2-bundle", "graphopt-O2"):
        if t in tools:
            slow, n = _slower_beyond_interval(results, t)
            if n:
                lines.append(
                    f"{t} slower than the original at ENABLE_ALL beyond its 95 % interval: "
                    f"{len(slow)} of {n} models" + (": " + "; ".join(slow) if slow else "") + "\n"
                )
            break
    fails = []
    for name, mres in results.items():
        for t, r in mres["tools"].items():
            if t not in tools or r.get("na"):
                continue
            if r.get("opt_error"):
                fails.append(f"- {name} / {t}: optimize failed: {r['opt_error']}")
            elif r.get("session_error_DISABLE_ALL"):
                fails.append(
                    f"- {name} / {t}: output fails in onnxruntime: {r['session_error_DISABLE_ALL']}"
                )
            elif r.get("parity") and not r["parity"].get("ok"):
                fails.append(f"- {name} / {t}: output does not match: {r['parity'].get('error')}")
            if (
                r.get("session_error_ENABLE_ALL")
                and not r.get("opt_error")
                and not r.get("session_error_DISABLE_ALL")
            ):
                fails.append(
                    f"- {name} / {t}: session at ENABLE_ALL failed: {r['session_error_ENABLE_ALL']}"
                )
        if mres.get("error"):
            fails.append(f"- {name}: {mres['error']}")
    duels = [(name, mres["duel"]) for name, mres in results.items() if mres.get("duel")]
    if duels:
        lines.append(_render_duels(duels))
    lines.append("### Failures\n")
    lines.extend(fails or ["none"])
    lines.append("")
    return "\n".join(lines)


def _render_duels(duels: list[tuple[str, dict]]) -> str:
    lines = [
        "### Head to head: graphopt against the fastest rival\n",
        "Per model, graphopt's output and the rival whose output matched with the lowest "
        "ENABLE_ALL ratio above, measured again alone: two sessions at ORT_ENABLE_ALL, "
        "alternating with the order flipped every round (`--duel-time`), half of the rounds on "
        "sessions created graphopt first, half rival first (the session created first runs "
        "0.5-1 % slower here). Ratio = median over rounds of t(graphopt) / t(rival), with a "
        "bootstrap 95 % interval; *faster* or *slower* only when the interval excludes 1.\n",
        "| model | graphopt | rival | rounds | graphopt / rival [95 % interval] "
        "| created graphopt first / rival first | verdict |",
        "|---|---|---|---:|---|---|---|",
    ]
    tally: dict[str, int] = {}
    for name, d in duels:
        if d.get("error"):
            lines.append(f"| {name} | | | | error: {d['error']} | |")
            continue
        lo, hi = d["ci95"]
        tally[d["verdict"]] = tally.get(d["verdict"], 0) + 1
        halves = (
            f"{d['ratio_mine_created_first']:.3f} / {d['ratio_rival_created_first']:.3f}"
            if "ratio_mine_created_first" in d
            else "— (graphopt first only)"
        )
        lines.append(
            f"| {name} | {d['mine']} | {d['rival']} | {d['rounds']} "
            f"| {d['ratio']:.3f} [{lo:.3f}, {hi:.3f}] | {halves} | {d['verdict']} |"
        )
    lines.append("")
    lines.append(", ".join(f"{k}: {v}" for k, v in sorted(tally.items())) + "\n")
    return "\n".join(lines)


def render_ops(results: dict) -> str:
    """Per model: op types whose counts differ between graphopt-O2 and the other outputs."""
    lines = [
        "## Op histograms (main graph) where outputs differ from graphopt-O2\n",
        "Counts per op type; only op types whose count differs between the columns.\n",
    ]
    for name, mres in results.items():
        tr = mres["tools"]
        g = tr.get("graphopt-O2")
        if not g or "ops" not in g:
            continue
        cols = [t for t, r in tr.items() if "ops" in r and _usable(r) or t == "graphopt-O2"]
        keys = sorted(set().union(*(tr[t]["ops"].keys() for t in cols if "ops" in tr[t])))
        keys = [k for k in keys if len({tr[t].get("ops", {}).get(k, 0) for t in cols}) > 1]
        if not keys:
            continue
        lines.append(f"### {name}\n")
        lines.append("| op | " + " | ".join(cols) + " |")
        lines.append("|---|" + "---:|" * len(cols))
        for k in keys:
            lines.append(
                f"| {k} | " + " | ".join(str(tr[t].get("ops", {}).get(k, 0)) for t in cols) + " |"
            )
        lines.append("")
    return "\n".join(lines)


def render_report(meta: dict, results: dict, tools: list[str]) -> str:
    out = [f"# graphopt side-by-side benchmark — {meta['date']}\n"]
    out.append(f"- command: `{meta['command']}`")
    out.append(f"- machine: {meta['machine']}")
    if meta.get("graphopt_checkout_start"):
        end = meta.get("graphopt_checkout_end")
        out.append(
            f"- graphopt checkout (editable install): {meta['graphopt_checkout_start']} at "
            f"start"
            + (f", {end} at the end" if end and end != meta["graphopt_checkout_start"] else "")
            + (f"; ran: {meta['graphopt_source']}" if meta.get("graphopt_source") else "")
        )
    out.append("- versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()))
    out.append(f"- models: `{meta['models_dir']}` ({len(results)}); tools: {', '.join(tools)}")
    out.append(
        f"- latency: onnxruntime CPUExecutionProvider, intra_op_num_threads=1, "
        f">= {meta['runs']} interleaved rounds (round-robin, rotating start; fast models get "
        f"more rounds, >= {meta.get('min_time', 0):g} s per variant) after "
        f"{meta['warmup']} warm-up runs, at ORT_DISABLE_ALL (the graph as written) and "
        f"ORT_ENABLE_ALL; ratio = median over rounds of t(variant) / t(original) of the same "
        f"round, in brackets its bootstrap 95 % interval"
        + (
            f" (at ENABLE_ALL the rounds are split over {meta['generations']} generations of "
            "fresh sessions created in a rotated order, and the bootstrap resamples the "
            "generations, then the rounds within each)"
            if meta.get("generations", 1) > 1
            else ""
        )
        + " (results written before the interval was kept: [p10, p90] of the per-round ratios)"
    )
    out.append(
        "- optimize s: wall time of the tool's process (interpreter start + imports + "
        "load + optimize + save); peak RSS: getrusage(RUSAGE_CHILDREN).ru_maxrss of that "
        f"process; timeout {meta['timeout']:.0f} s"
    )
    out.append(
        "- parity: outputs on the same inputs vs the original at ORT_DISABLE_ALL; ok when "
        "max|err| <= 1e-4 x max|reference| (1e-2 for fp16 outputs and for models that "
        "compute in fp16); integer ids in "
        "[0, 100), masks ones, token types zeros, floats standard normal (seed 0)"
    )
    out.append(f"- total wall time: {meta.get('total_s', 0) / 60:.1f} min")
    if meta.get("notes"):
        for n in meta["notes"]:
            out.append(f"- note: {n}")
    out.append("")
    out.append(render_summary(results, tools))
    out.append("## Per model\n")
    for name, mres in results.items():
        out.append(render_model(name, mres, tools))
    out.append(render_ops(results))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--models",
        type=Path,
        default=None,
        help=f"folder of NAME.onnx + NAME.json (default {DEFAULT_MODELS}; --quick: {QUICK_MODELS})",
    )
    ap.add_argument("--only", default=None, help="comma-separated model names")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="the small example models of the repository (mobilenet_bn, esrgan_tiny, bert_tiny)",
    )
    ap.add_argument(
        "--tools",
        default=",".join(DEFAULT_TOOLS),
        help=f"comma-separated, from: {', '.join(ALL_TOOLS)} (none is always run)",
    )
    ap.add_argument("--runs", type=int, default=30, help="timed runs per variant and level")
    ap.add_argument("--warmup", type=int, default=2, help="warm-up runs per variant and level")
    ap.add_argument(
        "--min-time",
        type=float,
        default=2.0,
        help="fast models get more rounds than --runs, so that each variant is timed "
        "for at least this many seconds per level (up to --max-runs)",
    )
    ap.add_argument("--max-runs", type=int, default=1000, help="cap for --min-time")
    ap.add_argument(
        "--generations",
        type=int,
        default=3,
        help="fresh sessions per variant at ENABLE_ALL, the rounds split between them (a "
        "session's placement moves its speed by a few %%: this averages it and the interval "
        "sees it)",
    )
    ap.add_argument(
        "--duel-time",
        type=float,
        default=10.0,
        help="then graphopt's output against the fastest matching rival alone, alternating, "
        "for this many seconds each (>= 30 rounds) at ENABLE_ALL, for a ratio with a 95 %% "
        "interval; 0: skip",
    )
    ap.add_argument(
        "--create-reps",
        type=int,
        default=3,
        help="session creations per variant at ENABLE_ALL (median; capped at ~3 s)",
    )
    ap.add_argument("--timeout", type=float, default=600.0, help="per-tool optimize timeout, s")
    ap.add_argument(
        "--latency-timeout",
        type=float,
        default=3600.0,
        help="timeout for one model's latency process, s",
    )
    ap.add_argument(
        "--mem-factor",
        type=float,
        default=2.0,
        help="assumed memory per loaded session, as a multiple of the model size",
    )
    ap.add_argument(
        "--cpu",
        type=int,
        default=None,
        help="pin the latency process to this CPU (default: the last one)",
    )
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="results markdown (default examples/benchmark/results/"
        "RESULTS-<date>[-quick].md); raw JSON is written next to it",
    )
    ap.add_argument(
        "--work",
        type=Path,
        default=Path(tempfile.gettempdir()) / "graphopt-bench",
        help="scratch folder for optimized models",
    )
    ap.add_argument("--keep", action="store_true", help="keep the optimized models")
    ap.add_argument(
        "--no-rescan",
        action="store_true",
        help="do not pick up models that appear in --models during the run",
    )
    ap.add_argument(
        "--graphopt-source",
        default="snapshot",
        help="snapshot (default): copy graphopt's sources into --work at start and run that copy "
        "for the whole run; installed: run whatever graphopt the venv imports at each call; "
        "DIR: an existing snapshot (DIR/graphopt), e.g. to rerun some models with the same code",
    )
    ap.add_argument(
        "--render",
        type=Path,
        nargs="+",
        default=None,
        metavar="RESULTS.json",
        help="only re-render the markdown from raw results files (to --out, default next to the "
        "first); with several, later files replace earlier ones model by model, and their "
        "commands are listed as notes; the merged JSON is written next to --out",
    )
    ap.add_argument(
        "--speed",
        action="store_true",
        help="only the optimizers' wall time and peak RSS per model: graphopt --no-check, "
        "graphopt's default run and every rival, with ratios (speed.py; results/SPEED-<date>.md)",
    )
    ap.add_argument(
        "--speed-rounds", type=int, default=1, help="--speed: interleaved rounds per tool"
    )
    ap.add_argument(
        "--speed-tools",
        help="--speed: only these tools, comma-separated as the table names them (e.g. "
        "'graphopt --no-check,graphopt (default run)')",
    )
    args = ap.parse_args(argv)
    if args.render:
        data = json.loads(args.render[0].read_text())
        for extra in args.render[1:]:
            more = json.loads(extra.read_text())
            data["results"].update(more["results"])
            data["meta"].setdefault("notes", []).append(
                f"rerun of {', '.join(more['results'])} merged from {extra.name}: "
                f"`{more['meta']['command']}` ({more['meta']['date']}; graphopt "
                f"{more['meta'].get('graphopt_source', '?')})"
            )
        tools = ["none"] + [
            t
            for t in ALL_TOOLS
            if t != "none" and any(t in m["tools"] for m in data["results"].values())
        ]
        out_md = args.out or args.render[0].with_suffix(".md")
        out_md.write_text(render_report(data["meta"], data["results"], tools))
        if len(args.render) > 1:
            out_md.with_suffix(".json").write_text(json.dumps(data, indent=1))
        print(f"wrote {out_md}")
        return 0

    t_start = time.perf_counter()
    models_dir = args.models or (QUICK_MODELS if args.quick else DEFAULT_MODELS)
    only = [s.strip() for s in args.only.split(",")] if args.only else None
    if args.speed:
        from speed import run_speed

        return run_speed(args, models_dir, only)
    tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    bad = [t for t in tools if t not in ALL_TOOLS]
    if bad:
        ap.error(f"unknown tools {bad}; choose from {ALL_TOOLS}")
    if "none" in tools:
        tools.remove("none")
    tools = ["none"] + tools
    date = _dt.datetime.now().strftime("%Y-%m-%d")
    out_md = args.out or (HERE / "results" / f"RESULTS-{date}{'-quick' if args.quick else ''}.md")
    out_json = out_md.with_suffix(".json")
    cpu = args.cpu if args.cpu is not None else (os.cpu_count() or 1) - 1

    meta = {
        "date": _dt.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "command": " ".join(  # the interpreter by name: results name no machine's folders
            ["python", "examples/benchmark/bench.py"] + (argv if argv is not None else sys.argv[1:])
        ),
        "machine": _machine(),
        "versions": _versions(),
        "models_dir": _shown(models_dir),
        "graphopt_checkout_start": _git_state(),
        "runs": args.runs,
        "min_time": args.min_time,
        "generations": args.generations,
        "warmup": args.warmup,
        "timeout": args.timeout,
        "notes": [],
    }
    global GRAPHOPT_PYTHONPATH
    if args.graphopt_source == "snapshot" and any(t.startswith("graphopt") for t in tools):
        snap = _snapshot_graphopt(args.work / "_graphopt_snapshot")
        GRAPHOPT_PYTHONPATH = str(snap)
        meta["graphopt_source"] = f"snapshot of {REPO} taken at start, in {snap}/graphopt"
    elif args.graphopt_source not in ("snapshot", "installed"):
        snap = Path(args.graphopt_source).resolve()
        if not (snap / "graphopt" / "cli.py").exists():
            ap.error(f"--graphopt-source {snap}: no graphopt/cli.py there")
        GRAPHOPT_PYTHONPATH = str(snap)
        meta["graphopt_source"] = f"existing snapshot {snap}/graphopt"
    else:
        meta["graphopt_source"] = "installed (imported at each call)"
    results: dict[str, dict] = {}
    done: set[str] = set()
    skipped: list[str] = []

    def write():
        meta["total_s"] = time.perf_counter() - t_start
        meta["graphopt_checkout_end"] = _git_state()
        out_md.parent.mkdir(parents=True, exist_ok=True)
        out_md.write_text(render_report(meta, results, tools))
        out_json.write_text(json.dumps({"meta": meta, "results": results}, indent=1))

    queue = _discover(models_dir, only)
    if not queue:
        print(f"no models found in {models_dir}", file=sys.stderr)
        return 1
    while queue:
        name, path, side = queue.pop(0)
        done.add(name)
        if side is None:
            skipped.append(name)
            meta["notes"].append(f"{name}: skipped, no {name}.json sidecar with input shapes")
            print(f"[skip] {name}: no sidecar", flush=True)
        else:
            results[name] = bench_model(name, path, side, tools, args, cpu)
            write()
        if not args.no_rescan:
            known = done | {q[0] for q in queue}
            for item in _discover(models_dir, only):
                if item[0] not in known:
                    queue.append(item)
                elif item[0] in skipped and item[2] is not None:  # its sidecar appeared
                    skipped.remove(item[0])
                    done.discard(item[0])
                    meta["notes"] = [n for n in meta["notes"] if not n.startswith(item[0] + ":")]
                    queue.append(item)
    write()
    text = out_md.read_text()
    summary = text[text.find("## Summary") : text.find("## Per model")]
    print("\n" + summary)
    print(f"results: {out_md}\nraw:     {out_json}")
    return 0


def bench_model(name: str, path: Path, side: Path, tools: list[str], args, cpu: int) -> dict:
    sidecar = json.loads(side.read_text())
    shapes = sidecar.get("inputs", {})
    tcfg = _transformer_config(name, sidecar)
    mres: dict = {
        "path": str(path),
        "bytes": path.stat().st_size,
        "shapes": shapes,
        "tools": {},
    }
    work = args.work / name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    print(f"== {name} ({path.stat().st_size / 1e6:.1f} MB)", flush=True)
    variants = []
    for tool in tools:
        r: dict = {}
        mres["tools"][tool] = r
        if tool == "ort-transformers" and tcfg is None:
            r["na"] = True
            continue
        if tool == "none":
            variants.append({"tool": tool, "path": str(path)})
            continue
        if tool == "graphopt-O2-bundle":  # graphopt-O2's model under its bundle's session config
            base = next((v for v in variants if v["tool"] == "graphopt-O2"), None)
            cfg_path = work / "graphopt-O2" / "session_config.json"
            if base is None or not cfg_path.exists():
                r["opt_error"] = "needs a graphopt-O2 bundle in the same run"
                continue
            entries = json.loads(cfg_path.read_text()).get("session_config_entries", {})
            r.update(same_model_as="graphopt-O2", session_config=entries)
            bundle = str(cfg_path.parent)  # also timed through graphopt.load_session
            variants.append(
                {"tool": tool, "path": base["path"], "session_config": entries, "bundle": bundle}
            )
            continue
        cfg = {"transformer": list(tcfg) if tcfg else None, "inputs": sidecar.get("inputs")}
        if tool == "ort-transformers":
            r["config"] = {
                "model_type": tcfg[0],
                "num_heads": tcfg[1],
                "hidden_size": tcfg[2],
            }
        cmd, out = _optimize_cmd(tool, path, work / tool, cfg)
        m = _run_measured(cmd, args.timeout)
        r["opt_s"] = m.get("wall_s")
        r["peak_rss_mb"] = m.get("peak_rss_mb")
        r["cmd"] = " ".join(cmd)
        if m.get("error") is None and not out.exists():
            m["error"] = "no output written"
        if m.get("error"):
            rep_path = work / tool / "report.json"
            if tool.startswith("graphopt") and rep_path.exists():
                # graphopt writes its report even when it exits non-zero (--quiet: no message)
                try:
                    rep = json.loads(rep_path.read_text())
                    if rep.get("converged") is False:
                        m["error"] += (
                            f" [report.json: pipeline did not converge, "
                            f"{rep.get('nodes_before')} -> {rep.get('nodes_after')} nodes]"
                        )
                except Exception:  # noqa: BLE001
                    pass
            r["opt_error"] = m["error"]
            r["stderr_tail"] = m.get("stderr", "")[-2000:]
            print(f"  {tool:17s} FAIL {m['error']}", flush=True)
            continue
        try:
            r["inner_s"] = json.loads(m.get("stdout", "").strip().splitlines()[-1])["inner_s"]
        except Exception:  # noqa: BLE001
            pass
        if tool.startswith("graphopt"):
            try:
                rep = json.loads((work / tool / "report.json").read_text())
                r["inner_s"] = rep.get("seconds", {}).get("total")
            except Exception:  # noqa: BLE001
                pass
        print(f"  {tool:17s} {r['opt_s']:7.2f} s  {r['peak_rss_mb']:7.0f} MB", flush=True)
        variants.append({"tool": tool, "path": str(out)})

    groups = _groups(len(variants), path.stat().st_size, args.mem_factor)
    mres["groups"] = [[variants[i]["tool"] for i in g] for g in groups]
    spec = {
        "variants": variants,
        "shapes": shapes,
        "runs": args.runs,
        "warmup": args.warmup,
        "create_reps": args.create_reps,
        "groups": groups,
        "cpu": cpu,
        "min_time_s": args.min_time,
        "max_runs": args.max_runs,
        "generations": args.generations,
        "duel_s": args.duel_time,
    }
    spec_path = work / "spec.json"
    res_path = work / "latency.json"
    spec_path.write_text(json.dumps(spec))
    t0 = time.perf_counter()
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "_latency",
        str(spec_path),
        str(res_path),
    ]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.latency_timeout)
        if p.returncode != 0:
            mres["error"] = (
                f"latency process exit {p.returncode}"
                + (" (killed: out of memory?)" if p.returncode == -9 else "")
                + f": {_first_error_line(p.stderr)}"
            )
    except subprocess.TimeoutExpired:
        mres["error"] = f"latency process timed out after {args.latency_timeout:.0f} s"
    mres["latency_s"] = time.perf_counter() - t0
    if res_path.exists():
        lat = json.loads(res_path.read_text())
        if "_duel" in lat:
            mres["duel"] = lat.pop("_duel")
        for tool, vals in lat.items():
            mres["tools"][tool].update(vals)
    if mres.get("error"):
        print(f"  ERROR {mres['error']}", flush=True)
    o = mres["tools"]["none"]
    for tool, r in mres["tools"].items():
        if r.get("na") or r.get("opt_error"):
            continue
        d = r.get("DISABLE_ALL", {}).get("ratio")
        e = r.get("ENABLE_ALL", {}).get("ratio")
        print(
            f"  {tool:17s} nodes {r.get('nodes', '?')!s:>6} (orig {o.get('nodes', '?')})  "
            f"DIS {_fmt(d, '{:.3f}')}  ALL {_fmt(e, '{:.3f}')}  {_status(r)}",
            flush=True,
        )
    print(f"  latency phase {mres['latency_s']:.0f} s", flush=True)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return mres


def _shown(path: Path) -> str:
    """A folder as results show it: relative to the repository when inside it, else its name."""
    path = Path(path).resolve()
    try:
        return path.relative_to(REPO).as_posix()
    except ValueError:
        return path.name


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_optimize":
        sys.exit(_worker_optimize(*sys.argv[2:6]))
    if len(sys.argv) > 1 and sys.argv[1] == "_measure":
        i = sys.argv.index("--")
        sys.exit(_worker_measure(float(sys.argv[2]), sys.argv[3], sys.argv[i + 1 :]))
    if len(sys.argv) > 1 and sys.argv[1] == "_latency":
        sys.exit(_worker_latency(sys.argv[2], sys.argv[3]))
    sys.exit(main())
