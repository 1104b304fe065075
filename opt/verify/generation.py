"""The generation check: greedy decoding with a KV cache, original against optimized.

Parity compares one run on one set of inputs; a decoder is deployed in a loop that feeds its
own ``present`` outputs back as the next step's ``past`` inputs.  :func:`check_generation` runs
that loop on both models: a prefill of ``prefill`` tokens with an empty cache, then ``steps``
decode steps of one token, each model on its own cache.  Both models are fed the original's
greedy token (so their logits stay comparable after a disagreement); at every step the
optimized model's own greedy choice is compared with the original's.

A decoder is recognized from its interface (:func:`decoder_interface`): an integer
``input_ids`` input, float inputs named ``past_key_values.N.key`` / ``.value`` (or ``past.N.*``,
``past_key.N`` / ``past_value.N``) whose ``past`` → ``present`` renamed outputs exist, and a
``logits`` output (else the first output).  ``attention_mask`` (all ones over every token
seen, as transformers and onnxruntime's GroupQueryAttention take it; for a cache that keeps
fewer rows, a sliding window, over its rows and the new tokens when the model refuses the
former) and ``position_ids`` (the tokens' positions in the whole sequence) are fed when the
model has them; cache tensors are
(batch, kv_heads, past_sequence, head_dim) with static heads and head_dim.

The result (:class:`GenerationResult`) says whether it ran (and why not), the largest logits
difference per step and overall (absolute, and relative to the largest original logit), the
greedy tokens of both, and ``ok``: same tokens and every step's logits within
``atol + rtol·max|original|`` (parity's tolerances for the logits' dtype, or for the model's
weights' dtype when looser: float32 logits of an fp16 model carry fp16 error, as parity
holds).  onnxruntime runs both on CPU with graph optimizations disabled, as parity does.

With weights quantized (opt-in int4: ``measured-error`` remarks) the logits are held to
the int4 error limit instead of parity's tolerance; the tokens must still be the same.

``verdict`` is ``ok``, ``failed`` (it ran and the optimized model generated other tokens or
logits out of tolerance, or it failed at a step where the original ran) or ``not-run`` (not a
decoder this loop can drive, a model onnxruntime could not load, over 2 GB).  A failed check is
a failed verification, like failed parity: :func:`failure_line` gives its one line (the CLI
exits 3 with it) and the report keeps the numbers.
"""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from .customops import register_libraries
from .parity import DEFAULT_TOLERANCES, LEAN_CONFIG, compute_dtype, open_session, too_large

_PAST = re.compile(r"^(past_key_values|past)\.(\d+)\.(key|value)$|^past_(key|value)[._](\d+)$")
_NP_TYPES = {
    onnx.TensorProto.FLOAT: np.float32,
    onnx.TensorProto.FLOAT16: np.float16,
    onnx.TensorProto.DOUBLE: np.float64,
    onnx.TensorProto.INT64: np.int64,
    onnx.TensorProto.INT32: np.int32,
}


@dataclass
class Interface:
    """How to drive a decoder: its inputs, cache tensors and logits output."""

    input_ids: str
    ids_dtype: type
    logits: str
    #: past input name → (present output name, dtype, kv_heads, head_dim)
    cache: dict[str, tuple[str, type, int, int]]
    attention_mask: tuple[str, type] | None = None
    position_ids: tuple[str, type] | None = None
    vocab: int | None = None


@dataclass
class GenerationResult:
    """One greedy-generation comparison; ``to_dict`` is report.json's ``generation``."""

    ran: bool
    ok: bool
    why: str | None = None
    prefill: int = 0
    steps: int = 0
    batch: int = 1
    max_abs: float = 0.0
    max_rel: float = 0.0
    tolerance: tuple[float, float] | None = None
    tokens_match: bool = False
    first_mismatch: int | None = None
    tokens_original: list[list[int]] = field(default_factory=list)
    tokens_optimized: list[list[int]] = field(default_factory=list)
    per_step: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    #: the optimized model failed at a step where the original ran (a failure, not a skip)
    crashed: bool = False

    @classmethod
    def not_run(cls, why: str, crashed: bool = False) -> GenerationResult:
        return cls(ran=False, ok=False, why=why, crashed=crashed)

    @property
    def verdict(self) -> str:
        if self.ran:
            return "ok" if self.ok else "failed"
        return "failed" if self.crashed else "not-run"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["tolerance"] = list(self.tolerance) if self.tolerance else None
        d["verdict"] = self.verdict
        return d


# ----------------------------------------------------------------------------- interface
def _elem(vi: onnx.ValueInfoProto) -> int:
    return vi.type.tensor_type.elem_type


def _dims(vi: onnx.ValueInfoProto) -> list[int | str | None]:
    out: list[int | str | None] = []
    for d in vi.type.tensor_type.shape.dim:
        out.append(d.dim_value if d.HasField("dim_value") else (d.dim_param or None))
    return out


def _present_name(past: str) -> list[str]:
    """The output names a past input's present may have."""
    m = _PAST.match(past)
    if m is None:
        return []
    if m.group(1):
        return [
            f"present.{m.group(2)}.{m.group(3)}",
            f"present_key_values.{m.group(2)}.{m.group(3)}",
        ]
    return [f"present_{m.group(4)}.{m.group(5)}", f"present_{m.group(4)}_{m.group(5)}"]


def decoder_interface(model: onnx.ModelProto) -> Interface | str:
    """The decoder's interface, or a sentence saying why it is not a decoder with a KV cache."""
    graph = model.graph
    inits = {i.name for i in graph.initializer}
    ins = {i.name: i for i in graph.input if i.name not in inits}
    outs = {o.name: o for o in graph.output}
    ids = ins.get("input_ids")
    if ids is None or _elem(ids) not in (onnx.TensorProto.INT64, onnx.TensorProto.INT32):
        return "no integer input_ids input"
    cache: dict[str, tuple[str, type, int, int]] = {}
    for name, vi in ins.items():
        if not _PAST.match(name):
            continue
        present = next((p for p in _present_name(name) if p in outs), None)
        if present is None:
            return f"cache input '{name}' has no present output"
        dims = _dims(vi)
        if len(dims) != 4 or not all(isinstance(d, int) and d > 0 for d in dims[1:2] + dims[3:]):
            return f"cache input '{name}' is not (batch, heads, past, head_dim) with static heads"
        if _elem(vi) not in _NP_TYPES:
            return f"cache input '{name}' has an unsupported element type"
        cache[name] = (present, _NP_TYPES[_elem(vi)], int(dims[1]), int(dims[3]))
    if not cache:
        return "no past_key_values.* inputs (not a decoder with a KV cache)"
    logits_vi = outs.get("logits") or graph.output[0]
    vocab = _dims(logits_vi)[-1] if _dims(logits_vi) else None
    extra = {}
    for key in ("attention_mask", "position_ids"):
        vi = ins.get(key)
        if vi is not None:
            if _elem(vi) not in _NP_TYPES:
                return f"input '{key}' has an unsupported element type"
            extra[key] = (key, _NP_TYPES[_elem(vi)])
    known = {"input_ids", *cache, *extra}
    unknown = sorted(set(ins) - known)
    if unknown:
        return f"inputs the generation loop cannot feed: {', '.join(unknown[:4])}"
    return Interface(
        input_ids="input_ids",
        ids_dtype=_NP_TYPES[_elem(ids)],
        logits=logits_vi.name,
        cache=cache,
        vocab=vocab if isinstance(vocab, int) and vocab > 0 else None,
        **extra,
    )


# ------------------------------------------------------------------------------ running
def _session(model: onnx.ModelProto | str, base_dir=None):
    """A CPU session on ``model`` (a proto or a file) with the custom-op libraries of its
    generated kernels, weights not pre-packed (:data:`~graphopt.opt.verify.parity.LEAN_CONFIG`, as
    parity runs); a model too large for one session (:func:`~graphopt.opt.verify.parity.too_large`)
    runs in pieces, as parity runs it.  ``base_dir``: where a proto's external weights resolve."""
    if isinstance(model, onnx.ModelProto) and too_large(model):
        return _InPieces(open_session(model, base_dir, lean=True))
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    for key, value in LEAN_CONFIG.items():
        so.add_session_config_entry(key, value)
    if base_dir is not None:
        so.add_session_config_entry(
            "session.model_external_initializers_file_folder_path", str(base_dir)
        )
    header = model if not isinstance(model, str) else onnx.load(model, load_external_data=False)
    register_libraries(so, header)
    source = model if isinstance(model, str) else model.SerializeToString()
    return ort.InferenceSession(source, so, providers=["CPUExecutionProvider"])


class _InPieces:
    """A lean parity session (:class:`~graphopt.opt.verify.parity.Pieces`) run as onnxruntime's."""

    def __init__(self, session) -> None:
        self.session = session

    def run(self, names: list[str], feeds: dict[str, np.ndarray]) -> list:
        return self.session.run(feeds, names)


class _Decoder:
    """One model with its own cache."""

    def __init__(self, model: onnx.ModelProto | str, spec: Interface, batch: int, base_dir=None):
        self.sess = _session(model, base_dir)
        self.spec = spec
        self.outputs = [spec.logits] + [p for p, *_ in spec.cache.values()]
        self.past = {
            name: np.zeros((batch, heads, 0, dim), dtype)
            for name, (_, dtype, heads, dim) in spec.cache.items()
        }
        self.length = 0

    def step(self, ids: np.ndarray) -> np.ndarray:
        """Run ``ids`` (batch, new) after the cache; keep the presents; return the logits."""
        spec, (batch, new) = self.spec, ids.shape
        feeds: dict[str, np.ndarray] = {spec.input_ids: ids.astype(spec.ids_dtype), **self.past}
        if spec.position_ids:
            name, dtype = spec.position_ids
            pos = np.arange(self.length, self.length + new, dtype=dtype)
            feeds[name] = np.tile(pos, (batch, 1))
        lengths = [self.length + new]  # the mask over every token seen ...
        cached = next(iter(self.past.values())).shape[2]
        if cached != self.length:  # ... or over the rows a sliding-window cache kept
            lengths.append(cached + new)
        for i, length in enumerate(lengths if spec.attention_mask else [0]):
            if spec.attention_mask:
                name, dtype = spec.attention_mask
                feeds[name] = np.ones((batch, length), dtype)
            try:
                got = self.sess.run(self.outputs, feeds)
                break
            except Exception:  # noqa: BLE001 - onnxruntime raises many unrelated types
                if i + 1 == len(lengths) or not spec.attention_mask:
                    raise
        self.past = dict(zip(spec.cache, got[1:]))
        self.length += new
        return got[0]


class _Ran:
    """A call made now, read as a future's result (raises what the call raised)."""

    def __init__(self, fn, *args) -> None:
        try:
            self.value, self.error = fn(*args), None
        except Exception as e:  # noqa: BLE001 - raised again by result()
            self.value, self.error = None, e

    def result(self):
        if self.error is not None:
            raise self.error
        return self.value


def check_generation(
    original: onnx.ModelProto | str,
    optimized: onnx.ModelProto | str,
    *,
    prefill: int = 8,
    steps: int = 8,
    batch: int = 1,
    seed: int = 0,
    tolerances: dict[str, tuple[float, float]] | None = None,
    base_dir=None,
    written: tuple[onnx.ModelProto, str | os.PathLike] | None = None,
) -> GenerationResult:
    """Greedy generation of ``steps`` tokens after a ``prefill``-token prompt on both models
    (``base_dir``: where the protos' external weights resolve; ``written``: ``optimized`` as
    written, a copy whose weights are external data in files of a folder, run instead: its
    weights mapped from them, not serialized again)."""
    import time

    t0 = time.perf_counter()
    header = (
        original
        if isinstance(original, onnx.ModelProto)
        else onnx.load(original, load_external_data=False)
    )
    spec = decoder_interface(header)
    if isinstance(spec, str):
        return GenerationResult.not_run(spec)
    try:
        ref = _Decoder(original, spec, batch, base_dir)
        if written is not None:
            opt = _Decoder(written[0], spec, batch, written[1])
        else:
            opt = _Decoder(optimized, spec, batch, base_dir)
    except Exception as e:  # noqa: BLE001 - onnxruntime raises many unrelated types
        return GenerationResult.not_run(f"onnxruntime could not load a model: {_line(e)}")
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, spec.vocab or 100, size=(batch, prefill))
    table = dict(tolerances or DEFAULT_TOLERANCES)
    narrow = compute_dtype(header)  # float32 logits of an fp16 model carry fp16 error
    if narrow in table:
        table = {k: max(v, table[narrow]) for k, v in table.items()}
    result = GenerationResult(ran=True, ok=False, prefill=prefill, steps=steps, batch=batch)
    tokens_ref: list[np.ndarray] = []
    tokens_opt: list[np.ndarray] = []
    worst_ok = True
    # each step of the two models at once, the original's on a thread (onnxruntime runs
    # without the GIL): a decoding step mostly reads weights, and two read faster than one
    # (GPT-2 with a cache, 9 steps: 0.69 -> 0.51 s); the same values, as each has its session.
    # Not for models run in pieces: memory holds one piece at a time
    apart = isinstance(ref.sess, _InPieces) or isinstance(opt.sess, _InPieces)
    pool = ThreadPoolExecutor(1, thread_name_prefix="graphopt-generation")
    try:
        for step in range(steps + 1):
            theirs = _Ran(ref.step, ids) if apart else pool.submit(ref.step, ids)
            try:
                got = opt.step(ids)
                failed = None
            except Exception as e:  # noqa: BLE001
                got, failed = None, e
            try:
                want = theirs.result()
            except Exception as e:  # noqa: BLE001
                return GenerationResult.not_run(
                    f"step {step} failed in onnxruntime on the original: {_line(e)}"
                )
            if failed is not None:
                return GenerationResult.not_run(
                    f"step {step} failed in onnxruntime on the optimized model (the original "
                    f"ran): {_line(failed)}",
                    crashed=True,
                )
            rtol, atol = table.get(want.dtype.name, (1e-4, 1e-6))
            result.tolerance = (rtol, atol)
            diff = float(np.max(np.abs(got.astype(np.float64) - want))) if want.size else 0.0
            scale = float(np.max(np.abs(want))) if want.size else 0.0
            within = diff <= atol + rtol * scale and bool(np.isfinite(got).all())
            worst_ok = worst_ok and within
            tokens_ref.append(np.argmax(want[:, -1], axis=-1))
            tokens_opt.append(np.argmax(got[:, -1], axis=-1))
            result.per_step.append(
                {
                    "step": step,
                    "tokens": int(ids.shape[1]),
                    "max_abs": diff,
                    "max_rel": diff / scale if scale else 0.0,
                    "same_token": bool(np.array_equal(tokens_ref[-1], tokens_opt[-1])),
                    "ok": within,
                }
            )
            ids = tokens_ref[-1][:, None]  # both models continue with the original's token
    finally:
        pool.shutdown(wait=True)
    result.tokens_original = np.stack(tokens_ref, axis=1).tolist()
    result.tokens_optimized = np.stack(tokens_opt, axis=1).tolist()
    same = [s["same_token"] for s in result.per_step]
    result.tokens_match = all(same)
    result.first_mismatch = None if all(same) else same.index(False)
    result.max_abs = max(s["max_abs"] for s in result.per_step)
    result.max_rel = max(s["max_rel"] for s in result.per_step)
    result.ok = worst_ok and result.tokens_match
    result.seconds = round(time.perf_counter() - t0, 3)
    return result


def report_generation(
    report,
    context: dict[str, Any],
    optimized: onnx.ModelProto,
    written: tuple[onnx.ModelProto, str | os.PathLike] | None = None,
) -> dict[str, Any] | None:
    """report.json's ``generation``: the check's result for a decoder with a KV cache; None for
    any other model, or when parity did not run (``--no-check``) or the original is not at hand.
    ``report`` is :class:`graphopt.opt.report.schema.Report`; ``context`` the run's
    (:class:`graphopt.opt.optimizer.Run`: it holds the original);
    ``written``: ``optimized`` as the bundle wrote it (see :func:`check_generation`)."""
    original = context.get("original")
    if original is None or not report.parity.ran:
        return None
    header = (
        original
        if isinstance(original, onnx.ModelProto)
        else onnx.load(str(original), load_external_data=False)
    )
    if isinstance(decoder_interface(header), str):
        return None
    if written is None and optimized.ByteSize() >= 2**31 - 2**20:
        return GenerationResult.not_run("the optimized model is over 2 GB in memory").to_dict()
    source = original if isinstance(original, onnx.ModelProto) else str(original)
    return check_generation(
        source,
        optimized,
        tolerances=_quantized_tolerances(report),
        base_dir=context.get("base_dir"),
        written=written,
    ).to_dict()


def _quantized_tolerances(report) -> dict[str, tuple[float, float]] | None:
    """With weights quantized (opt-in int4), the logits are held to the error limit the
    quantization was measured against (``max |Δ| ≤ limit × max |original|`` per step) instead
    of parity's fp32 tolerance; the greedy tokens must still be the same."""
    limits = [
        float(r.args["limit"])
        for r in report.remarks
        if r.rule == "quantize-weights-int4" and r.code == "measured-error" and "limit" in r.args
    ]
    if not limits:
        return None
    return {dt: (max(limits), 0.0) for dt in ("float32", "float16", "bfloat16", "float64")}


def failure_line(generation: dict[str, Any] | None) -> str | None:
    """One line when report.json's ``generation`` says the check failed, else None."""
    if not generation or generation.get("verdict") != "failed":
        return None
    head = "generation check failed"
    if not generation.get("ran"):
        return f"{head}: {generation.get('why')}"
    steps = generation.get("per_step") or []
    tol = generation.get("tolerance") or [0.0, 0.0]
    where = f"max |Δlogits| {generation['max_abs']:.3g} ({generation['max_rel']:.3g} of the "
    where += f"largest logit; tolerance rtol {tol[0]:g}, atol {tol[1]:g})"
    first = generation.get("first_mismatch")
    if first is not None:
        pairs = zip(generation["tokens_original"], generation["tokens_optimized"])
        ref, got = next((r[first], o[first]) for r, o in pairs if r[first] != o[first])
        tokens = f"greedy tokens differ from {_step(first, len(steps))} (original {ref}, "
        tokens += f"optimized {got})"
        return f"{head}: {tokens}; {where}"
    bad = next((s["step"] for s in steps if not s["ok"]), 0)
    return f"{head}: logits out of tolerance from {_step(bad, len(steps))}; {where}"


def _step(step: int, count: int) -> str:
    return "the prefill" if step == 0 else f"decode step {step} of {count - 1}"


def _line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else repr(e)


__all__ = [
    "GenerationResult",
    "Interface",
    "check_generation",
    "decoder_interface",
    "failure_line",
    "report_generation",
]
