"""Decoder latency: graphopt's output against the plain export, onnxruntime's transformers
optimizer and onnxruntime-genai's model builder, on onnxruntime CPU.

    python examples/llm/bench_llm.py --models models/llm [--only llama,qwen2] [--work DIR]
        [--hf models/llm_hf] [--genai models/llm_genai] [--max-seconds 30] [--json out.json]

For each decoder NAME.onnx of ``--models`` (examples/make_llms.py: ``input_ids``,
``attention_mask``, ``position_ids``, ``past_key_values.N.key|value`` → ``logits``,
``present.N.key|value``, every dim that varies symbolic) it makes the variants

* ``plain``: the export itself;
* ``graphopt``: ``graphopt optimize NAME.onnx --target cpu -O2 -o WORK/NAME.graphopt
  --no-measure`` with the parity shapes of NAME.json (8 new tokens after 16 cached: the
  model needs consistent sizes to run, and the output keeps every dynamic dim, so one model
  serves prefill and decode); the bundle's ``model.onnx`` with its session config's disabled
  optimizers and custom-op libraries;
* ``graphopt-generate``: the same through the Python API with ``options={"decoder_steps":
  "generate"}`` (every step given a past has one new token or a batch of 1, as a generation
  loop runs; GroupQueryAttention also where the batch is symbolic), written by
  ``graphopt.write_bundle``;
* ``ort-transformers``: ``onnxruntime.transformers.optimizer.optimize_model`` with the model
  type that fits the family (:data:`MODEL_TYPES`; when it fails, the reason is kept and the
  next type is tried), ``num_heads`` and ``hidden_size`` from the Hugging Face config in
  ``--hf DIR/NAME`` when there is one, else hidden = the embedding's width and heads =
  hidden / the cache's head size;
* ``onnxscript``: ``onnxscript.optimizer.optimize`` then onnxscript's
  ``rewriter.ort_fusions.optimize_for_ort`` (its onnxruntime fusions: SDPA → MultiHeadAttention
  / GroupQueryAttention, rotary, RMSNorm, skip norms);
* ``genai``: onnxruntime-genai's model builder output for the same config and weights, when
  ``--genai DIR/NAME/model.onnx`` exists (examples/llm/save_hf.py, then
  ``python -m onnxruntime_genai.models.builder -i HF/NAME -o DIR/NAME -p fp32 -e cpu``).
  Its interface differs: no ``position_ids`` (GroupQueryAttention derives positions from the
  mask's length), presents in another order. :func:`adapt_feeds` feeds it the same tokens,
  mask and cache; run through ``InferenceSession.run`` its presents are past + new (the
  runtime's shared past/present buffer is an onnxruntime-genai generator feature, not used).

Then two scenarios, batch 1: ``prefill`` (``--prefill`` new tokens, empty cache) and
``decode`` (one new token after a ``--past``-token cache). Every variant runs at
ORT_ENABLE_ALL with one intra-op thread on the same feeds; its logits (and presents, by name)
are compared with the plain export's, and argmax tokens per position. Timing: paired rounds,
each running every variant once in an order rotated every round (each run repeated so that it
lasts at least ``--min-run-ms``); per round, each variant's time over the plain export's; the
median over rounds with its bootstrap 95 % interval (``graphopt.opt.verify.perf.ratio_interval``),
until ``--rounds`` and ``--min-seconds`` are reached and every interval is narrower than
``--precision``, or ``--max-seconds``. Prints a markdown table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import types
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from graphopt.opt.verify.customops import register_libraries
from graphopt.opt.verify.perf import ratio_interval

#: onnxruntime.transformers model types to try per family, in order. None of its types is a
#: Llama-style decoder; its own Llama/Mistral/Qwen export scripts optimize with "gpt2" (rotary,
#: RMSNorm, skip-RMSNorm fusions live in its BERT/GPT-2 fusion set). "phi" is its Phi type.
MODEL_TYPES = {
    "llama": ["gpt2"],
    "qwen2": ["qwen3", "gpt2"],
    "mistral": ["gpt2"],
    "phi3": ["phi", "gpt2"],
    "gemma": ["gpt2"],
    "qwen3": ["qwen3", "gpt2"],
    "gpt_neox": ["gpt_neox", "gpt2"],
    "phi2": ["phi", "gpt2"],
    "falcon": ["gpt2"],
}
VARIANTS = ["plain", "graphopt", "graphopt-generate", "ort-transformers", "onnxscript", "genai"]
#: contrib ops worth naming in the table (what each variant fused)
KEY_OPS = [
    "GroupQueryAttention",
    "MultiHeadAttention",
    "Attention",
    "RotaryEmbedding",
    "SkipSimplifiedLayerNormalization",
    "SimplifiedLayerNormalization",
    "RMSNormalization",
    "generated kernels",  # graphopt.fused nodes (fuse-elementwise)
]


# ------------------------------------------------------------------------------ the decoder
@dataclass(frozen=True)
class Decoder:
    """What a bench needs to know of a decoder export's interface."""

    layers: int
    kv_heads: int
    head_dim: int
    vocab: int
    hidden: int

    @property
    def past_names(self) -> list[str]:
        return [f"past_key_values.{i}.{kv}" for i in range(self.layers) for kv in ("key", "value")]


def _dims(vi: onnx.ValueInfoProto) -> list[int | str]:
    return [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]


def read_decoder(model: onnx.ModelProto) -> Decoder:
    """Layers, cache heads and head size from the past inputs, vocabulary from ``logits``,
    hidden size from the token embedding (the initializer that ``input_ids`` gathers from)."""
    g = model.graph
    pasts = {i.name: _dims(i) for i in g.input if i.name.startswith("past_key_values.")}
    if not pasts or "input_ids" not in {i.name for i in g.input}:
        raise ValueError("not a decoder with a KV cache (input_ids, past_key_values.N.key)")
    layers = len({n.split(".")[1] for n in pasts})
    shape = pasts["past_key_values.0.key"]
    kv_heads, head_dim = shape[1], shape[3]
    if not isinstance(kv_heads, int) or not isinstance(head_dim, int):
        raise ValueError(f"past_key_values.0.key has symbolic heads or head size: {shape}")
    logits = next(o for o in g.output if o.name == "logits")
    vocab = _dims(logits)[-1]
    inits = {t.name: t for t in g.initializer}
    hidden = 0
    for node in g.node:
        if node.op_type == "Gather" and len(node.input) > 1 and node.input[1] == "input_ids":
            if node.input[0] in inits:
                hidden = int(inits[node.input[0]].dims[-1])
                vocab = vocab if isinstance(vocab, int) else int(inits[node.input[0]].dims[0])
    if not isinstance(vocab, int):
        raise ValueError("the vocabulary size is neither in logits' shape nor the embedding's")
    return Decoder(layers, kv_heads, head_dim, vocab, hidden)


def make_feeds(dec: Decoder, new: int, past: int, seed: int = 0, batch: int = 1) -> dict:
    """The plain export's feeds: random tokens, an all-ones mask over past + new, positions
    past … past + new − 1, a random cache of ``past`` rows (empty when 0)."""
    rng = np.random.default_rng(seed)
    feeds: dict[str, np.ndarray] = {
        "input_ids": rng.integers(0, dec.vocab, (batch, new), dtype=np.int64),
        "attention_mask": np.ones((batch, past + new), dtype=np.int64),
        "position_ids": np.tile(np.arange(past, past + new, dtype=np.int64), (batch, 1)),
    }
    for name in dec.past_names:
        feeds[name] = rng.standard_normal((batch, dec.kv_heads, past, dec.head_dim)).astype(
            np.float32
        )
    return feeds


def adapt_feeds(inputs: list[Any], feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The plain export's feeds for a session whose inputs are ``inputs`` (``NodeArg``-like:
    ``name``, ``type``): a subset of the names (onnxruntime-genai's graph has no
    ``position_ids``: its GroupQueryAttention places the new tokens after the mask's past, the
    same positions), each cast to the input's element type. Any other input is an error."""
    out = {}
    for arg in inputs:
        if arg.name not in feeds:
            raise ValueError(f"cannot feed input {arg.name!r}: the plain export has no such input")
        value = feeds[arg.name]
        want = _numpy_type(arg.type)
        out[arg.name] = value.astype(want) if want is not None and value.dtype != want else value
    dropped = sorted(set(feeds) - set(out))
    if set(dropped) - {"position_ids"}:
        raise ValueError(f"the model does not take {dropped}: not the same computation")
    return out


def _numpy_type(ort_type: str) -> type | None:
    table = {
        "tensor(int64)": np.int64,
        "tensor(int32)": np.int32,
        "tensor(float)": np.float32,
        "tensor(float16)": np.float16,
    }
    return table.get(ort_type)


def compare(ref: dict[str, np.ndarray], got: dict[str, np.ndarray]) -> dict[str, Any]:
    """Logits and presents (by name) against the plain export's: max abs difference, the same
    over the largest |logit|, and whether every position's argmax token is the same."""
    a, b = ref["logits"].astype(np.float64), got["logits"].astype(np.float64)
    if a.shape != b.shape:
        return {"ok": False, "why": f"logits shape {list(b.shape)} != {list(a.shape)}"}
    scale = float(np.abs(a).max()) or 1.0
    logits_abs = float(np.abs(a - b).max())
    present = 0.0
    for name, r in ref.items():
        if name.startswith("present.") and name in got:
            if got[name].shape != r.shape:
                return {"ok": False, "why": f"{name} shape {list(got[name].shape)}"}
            present = max(present, float(np.abs(got[name].astype(np.float64) - r).max()))
    tokens = bool((a.argmax(-1) == b.argmax(-1)).all())
    rel = logits_abs / scale
    return {
        "ok": tokens and rel <= 1e-4,
        "logits_max_abs": logits_abs,
        "logits_max_rel": rel,
        "present_max_abs": present,
        "tokens_same": tokens,
    }


# ------------------------------------------------------------------------------ variants
@dataclass
class Variant:
    name: str
    path: Path | None = None
    disabled_optimizers: list[str] = field(default_factory=list)
    why: str | None = None  # why there is no model (failure, not asked for)
    notes: list[str] = field(default_factory=list)
    ops: dict[str, int] = field(default_factory=dict)
    nodes: int = 0


def op_counts(path: Path) -> tuple[int, dict[str, int]]:
    model = onnx.load(str(path), load_external_data=False)
    counts: dict[str, int] = {}
    for node in model.graph.node:
        op = "generated kernels" if node.domain == "graphopt.fused" else node.op_type
        counts[op] = counts.get(op, 0) + 1
    return len(model.graph.node), counts


def graphopt_variant(src: Path, out: Path, shapes: dict[str, list[int]], cmd: list[str]) -> Variant:
    """``graphopt optimize`` with parity at ``shapes``; the bundle's portable model."""
    args = [*cmd, "optimize", str(src), "--target", "cpu", "-O2", "-o", str(out)]
    args += ["--no-measure", "--format", "json", "--quiet"]
    for name, dims in shapes.items():
        args += ["--shape", f"{name}={','.join(map(str, dims))}"]
    p = subprocess.run(args, capture_output=True, text=True)
    if p.returncode != 0:
        line = (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1]
        return Variant("graphopt", why=f"graphopt exit {p.returncode}: {line[:300]}")
    report = json.loads(p.stdout)
    config = json.loads((out / "session_config.json").read_text())
    v = Variant("graphopt", out / "model.onnx", list(config.get("disabled_optimizers") or []))
    gen = report.get("generation") or {}
    v.notes.append(
        f"graphopt parity {'ok' if report['parity'].get('ok') else 'FAILED'}, "
        f"generation {'ok' if gen.get('ok') else gen.get('why') or 'FAILED'}"
    )
    return v


def graphopt_generate_variant(src: Path, out: Path, shapes: dict[str, list[int]]) -> Variant:
    """graphopt's API with ``options={"decoder_steps": "generate"}`` (every step given a past
    has one new token or a batch of 1, as a generation loop runs): GroupQueryAttention also
    where the batch is symbolic. The bundle is written as the CLI writes it."""
    import graphopt

    name = "graphopt-generate"
    try:
        model, report = graphopt.optimize(
            str(src),
            target="cpu",
            level=2,
            shapes=shapes,
            measure=False,
            options={"decoder_steps": "generate"},
        )
        graphopt.write_bundle(model, report, out)
    except Exception as e:  # noqa: BLE001 - reported in the table, the other variants go on
        return Variant(name, why=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
    config = json.loads((out / "session_config.json").read_text())
    v = Variant(name, out / "model.onnx", list(config.get("disabled_optimizers") or []))
    gen = report.generation or {}
    v.notes.append(
        f"graphopt parity {'ok' if report.parity.ok else 'FAILED'}, "
        f"generation {'ok' if gen.get('ok') else gen.get('why') or 'FAILED'}"
    )
    return v


def ort_transformers_variant(src: Path, out: Path, family: str, heads: int, hidden: int) -> Variant:
    """onnxruntime's transformers optimizer, each model type of the family in turn."""
    if "torch" not in sys.modules:
        try:
            import torch  # noqa: F401
        except ImportError:  # it reads torch.version only for GPUs: a stub keeps torch out
            stub = types.ModuleType("torch")
            stub.version = types.SimpleNamespace(hip=None, cuda=None)  # type: ignore[attr-defined]
            sys.modules["torch"] = stub
    from onnxruntime.transformers.optimizer import optimize_model

    failures = []
    for model_type in MODEL_TYPES.get(family, ["gpt2"]):
        try:
            m = optimize_model(
                str(src), model_type=model_type, num_heads=heads, hidden_size=hidden, use_gpu=False
            )
            m.save_model_to_file(str(out))
        except Exception as e:  # noqa: BLE001 - reported per model type, the next is tried
            first = (str(e).strip().splitlines() or [""])[0][:200]
            failures.append(f"model_type={model_type} failed: {type(e).__name__}: {first}")
            continue
        return Variant("ort-transformers", out, notes=[*failures, f"model_type={model_type}"])
    return Variant("ort-transformers", why="; ".join(failures), notes=failures)


def onnxscript_variant(src: Path, out: Path) -> Variant:
    """onnxscript's optimizer, then its onnxruntime fusions."""
    import onnx_ir as ir
    import onnxscript.optimizer
    from onnxscript.rewriter.ort_fusions import optimize_for_ort

    model = onnxscript.optimizer.optimize(ir.load(str(src)))
    res = optimize_for_ort(model)
    model, fused = res if isinstance(res, tuple) else (res, {})
    onnx.save(ir.serde.serialize_model(model), str(out))
    counts = {k: v for k, v in (fused or {}).items() if v}
    return Variant("onnxscript", out, notes=[f"ort_fusions: {counts}"])


MAKERS: dict[str, Callable[..., Variant]] = {}


def isolated(kind: str, *params: Any) -> Variant:
    """Make a variant in a child process (``bench_llm.py _variant KIND PARAMS-JSON``): one
    tool's global state (onnxruntime's transformers optimizer, graphopt's loader) cannot reach
    another's, and a crash costs one variant."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "_variant", kind, json.dumps(params)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0 or not p.stdout.strip():
        line = (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1]
        return Variant(kind, why=f"crashed (exit {p.returncode}): {line[:300]}")
    data = json.loads(p.stdout.strip().splitlines()[-1])
    data["path"] = Path(data["path"]) if data["path"] else None
    return Variant(**data)


def _variant_main(kind: str, params: str) -> int:
    """The child of :func:`isolated`: the variant as one JSON line on stdout."""
    args = json.loads(params)
    v = MAKERS[kind](Path(args[0]), Path(args[1]), *args[2:])
    print(json.dumps({**asdict(v), "path": str(v.path) if v.path else None}))
    return 0


def family_of(name: str) -> str:
    """The family of NAME (``gpt_neox_dynamo`` → ``gpt_neox``, ``falcon_gqa`` → ``falcon``)."""
    known = sorted(MODEL_TYPES, key=len, reverse=True)
    return next((f for f in known if name == f or name.startswith(f + "_")), name.split("_")[0])


def heads_hidden(dec: Decoder, hf: Path | None) -> tuple[int, int, str]:
    """(num_heads, hidden_size, where from): the HF config when there is one, else the graph."""
    if hf is not None and (hf / "config.json").exists():
        cfg = json.loads((hf / "config.json").read_text())
        return int(cfg["num_attention_heads"]), int(cfg["hidden_size"]), "config.json"
    return dec.hidden // dec.head_dim, dec.hidden, "graph (hidden / head size)"


MAKERS.update(
    {
        "graphopt-generate": graphopt_generate_variant,
        "ort-transformers": ort_transformers_variant,
        "onnxscript": onnxscript_variant,
    }
)


# ------------------------------------------------------------------------------ timing
def make_session(variant: Variant, threads: int = 1) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    register_libraries(so, onnx.load(str(variant.path), load_external_data=False))
    return ort.InferenceSession(
        str(variant.path),
        so,
        providers=["CPUExecutionProvider"],
        disabled_optimizers=variant.disabled_optimizers,
    )


def paired_rounds(
    runs: dict[str, Callable[[], None]],
    base: str,
    *,
    rounds: int,
    min_seconds: float,
    max_seconds: float,
    precision: float,
) -> dict[str, dict[str, float]]:
    """Every variant once per round, the order rotated each round; per variant: the median of
    per-round t(variant) / t(base) with its interval, and its median time."""
    names = list(runs)
    times: dict[str, list[float]] = {n: [] for n in names}
    start = time.perf_counter()
    r = 0
    while True:
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            t0 = time.perf_counter()
            runs[n]()
            times[n].append(time.perf_counter() - t0)
        r += 1
        elapsed = time.perf_counter() - start
        if r < 3 or (elapsed < max_seconds and (r < rounds or elapsed < min_seconds)):
            continue
        stats = _stats(times, base)
        wide = any(s["high"] / s["low"] - 1 > precision for s in stats.values())
        if elapsed >= max_seconds or not wide:
            for s in stats.values():
                s["seconds"] = round(elapsed, 1)
            return stats


def _stats(times: dict[str, list[float]], base: str) -> dict[str, dict[str, float]]:
    ref = np.asarray(times[base])
    out = {}
    for n, t in times.items():
        ratio, low, high = ratio_interval(np.asarray(t) / ref)
        out[n] = {
            "ms": float(np.median(t)) * 1000,
            "ratio": ratio,
            "low": low,
            "high": high,
            "rounds": len(t),
        }
    return out


def repeat(sess: ort.InferenceSession, feeds: dict, reps: int) -> Callable[[], None]:
    def run() -> None:
        for _ in range(reps):
            sess.run(None, feeds)

    return run


# ------------------------------------------------------------------------------ one model
def bench_model(src: Path, args: argparse.Namespace) -> dict[str, Any]:
    name = src.stem
    family = family_of(name)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    dec = read_decoder(onnx.load(str(src), load_external_data=False))
    hf = Path(args.hf) / family if args.hf else None
    heads, hidden, where = heads_hidden(dec, hf)
    row: dict[str, Any] = {"model": name, "decoder": asdict(dec), "heads": heads, "notes": []}
    row["notes"].append(f"num_heads {heads}, hidden_size {hidden} from {where}")
    variants = [Variant("plain", src)]
    wanted = set(args.variants.split(","))
    sidecar = src.with_suffix(".json")
    shapes = json.loads(sidecar.read_text())["inputs"] if sidecar.exists() else {}
    if "graphopt" in wanted:
        variants.append(graphopt_variant(src, work / f"{name}.graphopt", shapes, args.graphopt))
    if "graphopt-generate" in wanted:
        out = work / f"{name}.generate.graphopt"
        variants.append(isolated("graphopt-generate", str(src), str(out), shapes))
    if "ort-transformers" in wanted:
        out = work / f"{name}.ort_transformers.onnx"
        variants.append(isolated("ort-transformers", str(src), str(out), family, heads, hidden))
    if "onnxscript" in wanted:
        out = work / f"{name}.onnxscript.onnx"
        variants.append(isolated("onnxscript", str(src), str(out)))
    if "genai" in wanted and args.genai and "_" not in name:
        path = Path(args.genai) / family / "model.onnx"
        variants.append(
            Variant("genai", path) if path.exists() else Variant("genai", why=f"no {path}")
        )
    for v in variants:
        if v.path is not None and not v.ops:
            v.nodes, v.ops = op_counts(v.path)
    row["variants"] = {
        v.name: {
            "why": v.why,
            "notes": v.notes,
            "nodes": v.nodes,
            "key_ops": {k: v.ops[k] for k in KEY_OPS if k in v.ops},
        }
        for v in variants
    }
    live = [v for v in variants if v.path is not None]
    sessions = {v.name: make_session(v) for v in live}
    row["scenarios"] = {}
    for scenario, new, past in (("prefill", args.prefill, 0), ("decode", 1, args.past)):
        row["scenarios"][scenario] = bench_scenario(sessions, dec, new, past, args)
    return row


def bench_scenario(
    sessions: dict[str, ort.InferenceSession],
    dec: Decoder,
    new: int,
    past: int,
    args: argparse.Namespace,
) -> dict[str, Any]:
    feeds = make_feeds(dec, new, past, seed=args.seed)
    per = {}
    ref: dict[str, np.ndarray] = {}
    runs: dict[str, Callable[[], None]] = {}
    for name, sess in sessions.items():
        f = adapt_feeds(sess.get_inputs(), feeds)
        outs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, f)))
        if name == "plain":
            ref = outs
        per[name] = {"parity": compare(ref, outs) if name != "plain" else None}
        t0 = time.perf_counter()
        sess.run(None, f)
        once = time.perf_counter() - t0
        per[name]["reps"] = max(1, int(args.min_run_ms / 1000 / max(once, 1e-7)))
        runs[name] = (sess, f)  # type: ignore[assignment]
    reps = max(p["reps"] for p in per.values())  # the same count for all, set by the fastest
    calls = {n: repeat(s, f, reps) for n, (s, f) in runs.items()}  # type: ignore[misc]
    for call in calls.values():  # warm-up
        call()
    stats = paired_rounds(
        calls,
        "plain",
        rounds=args.rounds,
        min_seconds=args.min_seconds,
        max_seconds=args.max_seconds,
        precision=args.precision,
    )
    for name in per:
        per[name].update(stats[name])
        per[name]["ms"] = stats[name]["ms"] / reps
        per[name]["reps"] = reps
    return {"new_tokens": new, "past": past, "variants": per}


# ------------------------------------------------------------------------------ report
def markdown(rows: list[dict[str, Any]]) -> str:
    head = (
        "| model | variant | key ops | prefill ms | prefill ratio [95 % CI] | decode ms "
        "| decode ratio [95 % CI] | logits max abs (prefill / decode) | tokens |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for row in rows:
        for vname, info in row["variants"].items():
            ops = ", ".join(f"{k} {n}" for k, n in info["key_ops"].items()) or "-"
            if info["why"]:
                lines.append(f"| {row['model']} | {vname} | - | n/a: {info['why']} |||||")
                continue
            cells = [row["model"], vname, ops]
            pars = []
            for sc in ("prefill", "decode"):
                v = row["scenarios"][sc]["variants"][vname]
                cells += [f"{v['ms']:.2f}", f"{v['ratio']:.3f} [{v['low']:.3f}, {v['high']:.3f}]"]
                pars.append(v["parity"])
            if pars[0] is None:
                cells += ["(reference)", "-"]
            else:
                cells.append(" / ".join(_parity_cell(p) for p in pars))
                cells.append("same" if all(p.get("tokens_same") for p in pars) else "DIFFER")
            lines.append("| " + " | ".join(cells) + " |")
    return head + "\n".join(lines)


def _parity_cell(p: dict[str, Any]) -> str:
    return f"{p['logits_max_abs']:.1e}" if "logits_max_abs" in p else p.get("why", "?")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_variant"] and len(argv) == 3:
        return _variant_main(argv[1], argv[2])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", required=True, help="folder of NAME.onnx (+ NAME.json)")
    ap.add_argument("--only", default="", help="comma-separated model names (default: all)")
    ap.add_argument("--work", default="bench_llm.work", help="folder for the variants")
    ap.add_argument("--hf", help="folder of HF folders per family (num_heads, hidden_size)")
    ap.add_argument("--genai", help="folder of onnxruntime-genai builder outputs per family")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--graphopt", nargs="+", default=["graphopt"], help="the graphopt command")
    ap.add_argument("--prefill", type=int, default=128, help="new tokens of the prefill")
    ap.add_argument("--past", type=int, default=128, help="cached tokens of the decode step")
    ap.add_argument("--rounds", type=int, default=20, help="at least this many paired rounds")
    ap.add_argument("--min-seconds", type=float, default=5.0)
    ap.add_argument("--max-seconds", type=float, default=30.0, help="per model and scenario")
    ap.add_argument("--precision", type=float, default=0.04, help="stop at this interval width")
    ap.add_argument("--min-run-ms", type=float, default=2.0, help="repeat short runs to this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    wanted = [s for s in args.only.split(",") if s]
    models = sorted(Path(args.models).glob("*.onnx"))
    models = [m for m in models if not wanted or m.stem in wanted]
    if not models:
        print(f"error: no model in {args.models} matches {args.only!r}", file=sys.stderr)
        return 2
    rows = []
    for src in models:
        print(f"{time.strftime('%H:%M:%S')} {src.stem}", file=sys.stderr, flush=True)
        try:
            rows.append(bench_model(src, args))
        except Exception as e:  # noqa: BLE001 - reported per model, the others go on
            print(f"error: {src.stem}: {type(e).__name__}: {e}", file=sys.stderr)
            rows.append({"model": src.stem, "error": f"{type(e).__name__}: {e}"})
    good = [r for r in rows if "error" not in r]
    meta = {"onnxruntime": ort.__version__, "threads": 1, "level": "ORT_ENABLE_ALL"}
    print(
        f"onnxruntime {ort.__version__}, ORT_ENABLE_ALL, 1 thread, batch 1; prefill "
        f"{args.prefill} tokens (empty cache), decode 1 token after {args.past}\n"
    )
    print(markdown(good))
    for r in rows:
        for note in [*r.get("notes", []), *([r["error"]] if "error" in r else [])]:
            print(f"- {r['model']}: {note}")
        for vname, info in r.get("variants", {}).items():
            for note in info["notes"]:
                print(f"- {r['model']} {vname}: {note}")
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return 1 if len(good) < len(rows) else 0


if __name__ == "__main__":
    sys.exit(main())
