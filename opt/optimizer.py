"""The whole job for one model: load → IR → pipeline for (level, target) → export → parity → report.

:func:`optimize` is the Python API the CLI mirrors.  It never modifies its input.
"""

from __future__ import annotations

import functools
import gc
import math
import os
import sys
import time
import weakref
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from .clock import Clock
from .errors import GraphoptError, UsageError
from .graph import compat
from .graph.io import (
    about_external_data,
    check_without_weights,
    load_model,
    remove_path,
    serialize,
    tensor_nbytes,
)
from .graph.ir import ModelIR, op_histogram
from .graph.spool import SpoolDir, Spooled, session_skeleton, spool
from .graph.upgrade import upgrade_opset
from .numerics.precision import quantized_weight_tolerances
from .numerics.reference import upcast_to_float64
from .remarks import Remark
from .report.schema import Report
from .rewrite.context import Original, PassContext
from .rewrite.manager import run_final_checks, run_pass
from .rewrite.pipeline import parse, preset, to_text
from .rewrite.target import get_target
from .verify import canary
from .verify.feeds import split_dims, validate_args
from .verify.parity import (
    ParityReport,
    Pieces,
    ReferenceRun,
    Session,
    check_parity,
    is_lean,
    measure_ranges,
    too_large,
    too_many_nodes,
)

Progress = Callable[[str], None]

#: options that declare how the model is run (not tuning knobs): a rewrite that relies on one
#: says so in a remark, and the report and the manifest record it
DECLARATIONS = ("decoder_steps",)


@dataclass
class Serialized:
    """A model object as the validity check wrote it, once: spooled into a file of ``folder``
    (:mod:`~graphopt.opt.graph.spool`), or as bytes where it cannot be spooled."""

    folder: SpoolDir
    model: onnx.ModelProto | None = None
    data: bytes | None = None
    spooled: Spooled | None = None

    def hold(self, model: onnx.ModelProto, data: bytes | None, spooled: Spooled | None) -> None:
        """Hold ``model``'s written form, letting go of the one held before."""
        if self.spooled is not None and self.spooled is not spooled:
            remove_path(self.spooled.path)
        self.model, self.data, self.spooled = model, data, spooled


@dataclass(eq=False)
class Run:
    """The working state of one :func:`optimize` call that a caller going on (the bundle
    writer) needs beside the report's data: the clock it times its phases on, the original
    model and the parity inputs for the golden outputs (``context``), and the returned model as
    the validity check wrote it.  :func:`run_of` finds it from the report."""

    clock: Clock = field(default_factory=Clock)
    #: the original model, the parity inputs (shapes, user inputs, seed), the original's
    #: outputs by session level and the fast path the performance net saved
    context: dict[str, Any] = field(default_factory=dict)
    #: the returned model as the validity check wrote it (and onnxruntime loaded it)
    serialized: Serialized | None = None

    def take_serialized(self, model: onnx.ModelProto) -> Serialized | None:
        """The written form of ``model`` (its spooled file, or its bytes) when it is the very
        object ``optimize`` returned (the bundle moves or writes it instead of serializing the
        model again), else None.  Once: the run lets go of it either way."""
        held, self.serialized = self.serialized, None
        return held if held is not None and held.model is model else None


#: the run of each report :func:`optimize` returned and that is still alive, by id
_RUNS: dict[int, Run] = {}


def _keep_run(report: Report, run: Run) -> None:
    _RUNS[id(report)] = run
    weakref.finalize(report, _RUNS.pop, id(report), None)


def run_of(report: Report) -> Run:
    """The working state of the :func:`optimize` call that returned ``report``; for a report
    made otherwise (read back, built by hand) an empty one: its clock starts now."""
    run = _RUNS.get(id(report))
    if run is None:
        run = Run()
        _keep_run(report, run)
    return run


#: the recursion limit while optimizing: shape and dim analyses follow a value back through
#: every node before it (GPT-2 in fp16, a Cast around each op: over 2,000 calls deep); Python
#: calls between Python functions take no C stack (3.11+), only frame memory
RECURSION_LIMIT = 50_000


@contextmanager
def deep_recursion():
    """Allow analyses to follow long chains (:data:`RECURSION_LIMIT`) while optimizing."""
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old, RECURSION_LIMIT))
    try:
        yield
    finally:
        sys.setrecursionlimit(old)


@contextmanager
def sparse_collection():
    """Collect cycles less often while optimizing.  A large graph is millions of small objects
    (nodes, tensors, protos) alive for the whole run; with the default thresholds the cyclic
    collector rescans them again and again: 25-30 % of -O2's time on a 50k-node graph.  Cycles
    are still collected, only in fewer, larger batches."""
    old = gc.get_threshold()
    gc.set_threshold(max(old[0], 50_000), max(old[1], 20), max(old[2], 100))
    try:
        yield
    finally:
        gc.set_threshold(*old)


@contextmanager
def imported_apart():
    """Keep an imported graph out of the cyclic collector's scans while it is optimized: the
    import runs without collections and what exists once it is done is frozen (``gc.freeze``)
    until the block ends.  A 200k-node graph is millions of objects, each scanned twice on its
    way to the oldest generation otherwise (about 6 % of -O2's time there).  Yields the call
    that ends the import.  Nothing is done where the collector is off or objects are frozen
    already (the caller's own freeze is left alone)."""
    mine = gc.isenabled() and gc.get_freeze_count() == 0
    if mine:
        gc.disable()

    def imported() -> None:
        if mine:
            gc.freeze()
            gc.enable()

    try:
        yield imported
    finally:
        if mine:
            gc.enable()
            gc.unfreeze()


#: main-graph nodes from which the optimized IR's cycles are collected as soon as it is exported
COLLECT_NODES = 20_000


def _collect_large(model: onnx.ModelProto) -> None:
    """Free the IR of a large graph now: its nodes and tensors reference each other, and under
    :func:`sparse_collection`'s thresholds those cycles would stay through parity and the bundle
    (at 200k nodes, 40 % of the run's peak memory).  Small graphs are left to the collector: a
    full collection costs in proportion to everything alive."""
    if len(model.graph.node) >= COLLECT_NODES:
        gc.collect()


def _collecting_sparsely(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with sparse_collection(), deep_recursion():
            return fn(*args, **kwargs)

    return wrapper


@_collecting_sparsely
def optimize(
    model: onnx.ModelProto | str | os.PathLike,
    *,
    target: str = "cpu",
    level: int = 2,
    pipeline: str | None = None,
    check: bool = True,
    shapes: dict[str, list[int]] | None = None,
    inputs: dict[str, np.ndarray] | None = None,
    seed: int = 0,
    bisect_limit: int | None = None,
    verify_each: bool = False,
    options: dict[str, Any] | None = None,
    progress: Progress | None = None,
    reference: str = "original",
    output_tolerances: dict[str, tuple[float, float]] | None = None,
    base_dir: str | os.PathLike | None = None,
    opset: int | None = None,
    measure: bool = True,
    clock: Clock | None = None,
    spool: SpoolDir | None = None,
    in_place: bool = False,
    keep_weight_inputs: bool = False,
    parity_net: bool = True,
) -> tuple[onnx.ModelProto, Report]:
    """Optimize a model for a target; return the optimized model and the report.

    A model given by path keeps its external data on disk (memory-mapped when a pass needs
    values); ``base_dir`` says where a given ModelProto's external references resolve.  With
    ``in_place`` the large inline weights of a large file stay on disk too (see
    :func:`~graphopt.opt.graph.io.load_model`): the returned model then references the input file
    for them, and is to be written by ``write_bundle`` (which copies them from it).

    Weights an export listed as graph inputs (``keep_initializers_as_inputs=True``) become
    constants at levels 1 and above (:func:`~graphopt.opt.graph.compat.weights_as_inputs`; an
    analysis remark says so) unless ``keep_weight_inputs``.

    ``reference`` chooses what parity compares with: the ``original`` model, its ``float64``
    upcast (catches fp16 overflow that CPU kernels hide), or ``both``.  ``opset`` lifts the
    model to that default-domain opset before the pipeline runs (parity still compares with
    the original).  ``measure`` (cpu, with ``check``) runs the performance safety net
    (:mod:`graphopt.opt.verify.perf`) on the parity inputs; ``GRAPHOPT_NO_MEASURE=1`` turns it off
    too.  ``parity_net``: when parity fails, bisect to the rewrite responsible and revert it
    (:func:`_keep_equal`; off for ``graphopt bisect``, which asks about the failure itself).

    ``clock`` (:mod:`graphopt.opt.clock`) times the phases (load, passes, validity, parity,
    measure); a caller that goes on (writing the bundle) passes its own and times its phases on
    it too.  ``report.seconds`` is the clock's reading when this returns.

    The report holds the returned model as the validity check wrote it (the model is complete
    then: its metadata is set as it is exported), a file in ``spool`` (default: a folder of the
    system's temporary folder) or its bytes, so that ``write_bundle`` moves or writes it instead
    of serializing the model again (not when parity runs the model lean); change a copy, not
    the returned model, if it is to be changed before it is written.
    """
    if reference not in ("original", "float64", "both"):
        raise UsageError(f"reference must be original, float64 or both (got '{reference}')")
    say = progress or (lambda _msg: None)
    clock = clock or Clock()
    name = str(model) if isinstance(model, (str, os.PathLike)) else (model.graph.name or "<model>")
    with clock.phase("load"):
        if isinstance(model, (str, os.PathLike)):
            say("loading")
            base_dir = Path(model).resolve().parent
            model = load_model(model, lazy_external=True, in_place=in_place)
            given_notes = []  # loading noted in the model what it sorted
        else:
            given_notes = compat.unsorted_notes(model)  # the IR sorts it on export
        validate_args(model, shapes, inputs, output_tolerances)
        # given inputs that contradict a shared dim_param: the passes see those axes apart
        splits = split_dims(model, inputs)
        work, upgrade_remarks = _upgraded(model, opset, say)
        tgt = get_target(target)
        text = preset(level) if pipeline is None else pipeline
        passes = parse(text)
        ops_before = op_histogram(model.graph.node)
    ranges, range_remarks = None, []
    if inputs is not None and level >= 2:
        with clock.phase("calibration"):
            say("measuring value ranges on the calibration inputs")
            ranges, range_remarks = _guarded_ranges(model, inputs, shapes, seed, base_dir)

    freeze = level >= 1 and not keep_weight_inputs
    original = Original(model)  # what legalize compares the output's fallbacks with

    def execute(limit: int | None, skip: frozenset = frozenset()):
        with imported_apart() as imported:
            ir = ModelIR(work, base_dir, freeze_weights=freeze, split_dims=splits)
            imported()
            return optimize_ir(ir, limit, skip)

    def optimize_ir(ir: ModelIR, limit: int | None, skip: frozenset):
        cx = PassContext(
            target=tgt,
            level=level,
            options={"input_shapes": _parity_shapes(shapes, inputs), **(options or {})},
            bisect_limit=limit,
            verify_each=verify_each,
            ir=ir,
            ranges=ranges,
            skip=skip,
            original=original,
        )
        for r in range_remarks + upgrade_remarks + compat.remarks(model, ir, given_notes):
            cx.remarks.add(r)
        for p in passes:
            say(f"running {p.text()}")
            run_pass(p, ir, cx)
        run_final_checks(ir, cx)
        say("exporting")
        exported = ir.to_onnx(consume=True)
        # complete before the validity check serializes it: those are the bytes written
        _set_metadata(exported, {"graphopt.pipeline": to_text(passes), "graphopt.target": tgt.name})
        # the graph and the values it computed go (the phase replay records hold its nodes);
        # the remarks, stats and applied rewrites stay
        cx.ir, cx.settled_ir, cx.settled, cx.phases = None, None, {}, {}
        return exported, cx

    # parity's run of the original goes on beside the passes (they leave a core idle)
    with _reference_ahead(model, check, reference, shapes, inputs, seed, base_dir, clock) as ahead:
        with clock.phase("passes"):
            optimized, cx = execute(bisect_limit)
            _collect_large(model)
        # the output's bytes wait for the bundle in memory; through parity and the safety net only
        # where those hold the model whole anyway (not lean), else the bundle serializes it again
        serialized = Serialized(spool or SpoolDir()) if not check or not is_lean(model) else None
        with clock.phase("validity"):
            say("checking that the output is valid")
            # spent in the failure path only: the three bisections _keep_valid may run
            steps = math.ceil(math.log2(len(cx.applied) + 1)) + 1
            budget = max(10.0, 3 * steps * clock.elapsed("passes"))
            optimized, cx = _keep_valid(
                model,
                optimized,
                cx,
                execute,
                bisect_limit,
                say,
                base_dir,
                budget,
                keep=check and not is_lean(model),  # lean parity runs its own pieces
                into=serialized,
            )
            _collect_large(model)  # the IRs of any rerun the safety net made
        optimize_s = clock.elapsed("passes") + clock.elapsed("validity")

        kw = dict(
            shapes=shapes,
            inputs=inputs,
            seed=seed,
            tolerances=tgt.tolerances,
            per_output=quantized_weight_tolerances(cx.options, output_tolerances),  # opt-in int4
            base_dir=base_dir,
        )
        with clock.phase("parity"):
            parity, parity_f64 = _parities(
                model, optimized, check, reference, kw | {"ahead": ahead}, base_dir, say
            )
            if parity_net and parity.ran and not parity.ok and reference != "float64":
                budget = max(20.0, 3 * (optimize_s + clock.elapsed("parity")))
                net = (execute, bisect_limit, kw | {"ahead": ahead}, say, budget)
                optimized, cx, reverted = _keep_equal(model, optimized, cx, parity, *net)
                if reverted:
                    parity, parity_f64 = _parities(
                        model, optimized, check, reference, kw | {"ahead": ahead}, base_dir, say
                    )
        if parity.runtime_floor:  # later checks against the same golden outputs: the same floor
            kw["per_output"] = {**(kw["per_output"] or {}), **parity.floor_tolerances()}
        _LOADED.clear()  # the validity check's session, when parity did not take it: its weights go
        # a model too large for one session is not timed: both would be held whole, twice
        why = _unmeasured(measure, check, tgt.name, parity) or too_large(model)
        performance: dict[str, Any] = {"measured": False, "why": why}
        original_outputs: dict[str, dict] = {}
        fast_path = None
        if why is None:
            with clock.phase("measure"):
                net = _PerfNet(model, optimized, cx, execute, bisect_limit, base_dir, say)
                # the final model is loaded as written to save the bundle's fast path beside
                # it, which is timed as it loads back (its outputs there: the bundle's check)
                optimized, cx, performance = net.run(tgt, parity.feeds, optimize_s, serialized)
                original_outputs, fast_path = net.original_outputs, net.fast_path
            if performance.get("reverted"):
                with clock.phase("parity"):
                    parity, parity_f64 = _parities(
                        model, optimized, check, reference, kw | {"ahead": ahead}, base_dir, say
                    )

    report = Report(
        model=name,
        target=tgt.name,
        level=level,
        pipeline=to_text(passes),
        nodes_before=len(model.graph.node),
        nodes_after=len(optimized.graph.node),
        ops_before=ops_before,
        ops_after=op_histogram(optimized.graph.node),
        remarks=(kept := cx.remarks.final() + _growth_remarks(model, optimized, performance)),
        passes=[
            {
                "name": r.name,
                "seconds": round(r.seconds, 6),
                "changed": r.changed,
                "iteration": r.iteration,
            }
            for r in cx.records
        ],
        rules={
            k: {
                "attempts": v.attempts,
                "fired": v.fired,
                # the missed remarks kept (one per node); attempts over all fixpoint rounds apart
                "missed": sum(r.kind == "missed" and r.rule == k for r in kept),
                "missed_attempts": v.missed,
                "seconds": round(v.seconds, 6),
            }
            for k, v in sorted(cx.stats.items())
        },
        parity=parity,
        parity_float64=parity_f64,
        performance=performance,
        declared={k: v for k, v in (options or {}).items() if k in DECLARATIONS},
        rewrites=cx.rewrites,
        applied=list(cx.applied),
    )
    run = Run(
        clock=clock,
        # the bytes of the model returned (not of one the safety net replaced it with)
        serialized=serialized if serialized and serialized.model is optimized else None,
        context={
            "original": model,
            "shapes": shapes,
            "inputs": inputs,
            "seed": seed,
            "base_dir": base_dir,
            "per_output": kw["per_output"],  # --tolerance, and the int4 weights' tolerance
            "feeds": parity.feeds if parity.ran else None,
            "reference_outputs": parity.reference_outputs if parity.ran else None,
            # the original's outputs on those inputs by session level (the performance net's)
            "original_outputs": original_outputs,
            # onnxruntime's optimized form of the returned model, saved and timed by the
            # performance net (perf.Saved; the net keeps it for the model it returns only)
            "fast_path": fast_path,
        },
    )
    _keep_run(report, run)
    report.seconds = clock.seconds()
    return optimized, report


def constant_bytes(model: onnx.ModelProto) -> int:
    """The bytes of a model's constants (initializers of every graph, Constant node values),
    from their metadata: nothing is read."""
    from .graph.ir import all_graphs

    total = 0
    for g in all_graphs(model.graph):
        total += sum(tensor_nbytes(t) for t in g.initializer)
        for n in g.node:
            if n.op_type == "Constant" and not n.domain:
                total += sum(tensor_nbytes(a.t) for a in n.attribute if a.name == "value")
    return total


def _growth_remarks(original, optimized, performance: dict) -> list[Remark]:
    """An analysis remark when the optimized model's constants outgrow the original's: how
    much, and what the bundle measured in exchange (the performance net's latency ratio)."""
    before, after = constant_bytes(original), constant_bytes(optimized)
    if after <= before or not before:
        return []
    bought = (
        f"; the bundle runs at {performance['ratio']:.3f} of the original's latency (measured)"
        if performance.get("measured") and performance.get("ratio") is not None
        else "; no speed was measured for it"
    )
    return [
        Remark(
            "analysis",
            "optimize",
            "model-size",
            "output-grew",
            (),
            f"the optimized model's constants are {after / before:.3f}x the original's "
            f"({before / 2**20:.2f} -> {after / 2**20:.2f} MiB){bought}",
            {"before_bytes": before, "after_bytes": after},
        )
    ]


def _upgraded(model: onnx.ModelProto, opset: int | None, say: Progress) -> tuple:
    """(the model the pipeline starts from, remarks): lifted to ``opset`` when asked."""
    work, upgrade_remarks = model, []
    if opset is not None:
        say(f"upgrading to opset {opset}")
        work, before = upgrade_opset(model, opset)
        if work is not model:
            upgrade_remarks.append(
                Remark(
                    "analysis",
                    "upgrade-opset",
                    "upgrade-opset",
                    "opset-upgraded",
                    (),
                    f"default-domain opset {before} → {opset} (onnx version converter) before "
                    "the pipeline; parity compares with the original",
                )
            )
    return work, upgrade_remarks


def _parity_shapes(shapes: dict | None, inputs: dict | None) -> dict[str, list[int]]:
    """The input shapes parity runs at when the user fixed them (--inputs, then --shape)."""
    given = {k: [int(d) for d in np.shape(v)] for k, v in (inputs or {}).items()}
    return {**given, **{k: [int(d) for d in v] for k, v in (shapes or {}).items()}}


def _set_metadata(model: onnx.ModelProto, values: dict[str, str]) -> None:
    """Set model metadata keys, replacing earlier values (keys must stay unique)."""
    kept = [p for p in model.metadata_props if p.key not in values]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    for key, value in values.items():
        model.metadata_props.add(key=key, value=value)


def _guarded_ranges(model, inputs, shapes, seed, base_dir) -> tuple[dict | None, list]:
    """Calibration ranges, or None (with an analysis remark) when the model cannot run here."""
    try:
        return measure_ranges(model, inputs, shapes=shapes, seed=seed, base_dir=base_dir), []
    except UsageError:
        raise
    except GraphoptError as e:
        return None, [
            Remark(
                "analysis",
                "calibration",
                "calibration",
                "calibration-failed",
                (),
                f"value ranges not measured: {e}",
            )
        ]


#: the last onnxruntime session ``_invalid`` created and the model it was created for: parity
#: reuses it instead of serializing and loading the same model again
_LOADED: dict[str, Any] = {}


#: session config of a validity check's session (parity's, :data:`~graphopt.opt.verify.parity.
#: LEAN_CONFIG`): weights are not pre-packed (copied) for the kernels, and external weights stay
#: mapped from their file: a decoder's 705 MB of weights cost 55 MB instead of 750 MB
CHECK_ONLY = {"session.disable_prepacking": "1"}


def _invalid(
    model: onnx.ModelProto,
    base_dir=None,
    checker: bool = True,
    runtime: bool = True,
    keep: bool = False,
    into: Serialized | None = None,
) -> str | None:
    """Why ``model`` is not a valid, loadable model (onnx.checker with full shape checks, then an
    onnxruntime session), or None.  The checker reads the model without its weights
    (:func:`~graphopt.opt.graph.io.check_without_weights`).  With a holder ``into``, the model is
    written once (:func:`~graphopt.opt.graph.spool.spool`, else serialized), onnxruntime loads it
    from what was written, and a valid model's written form goes into the holder (the bundle moves
    the file, or writes the bytes, when it writes the model whole, without external data).
    The session is built as parity builds its own (:data:`CHECK_ONLY`: weights not
    pre-packed); with ``keep`` it is kept for parity (``_loaded_session``), profiling, so that
    parity's run also tells every node's output shape (the bundle's memory plan); else dropped."""
    _LOADED.clear()
    spooled = spool(model, into.folder.path) if runtime and into is not None else None
    data = serialize(model) if runtime and spooled is None else None
    try:
        error = _check(model, base_dir, checker, runtime, keep, data, spooled)
    except BaseException:
        if spooled is not None:
            remove_path(spooled.path)
        raise
    if error is None and into is not None and runtime:
        into.hold(model, data, spooled)
    elif spooled is not None:
        remove_path(spooled.path)
    return error


def _check(model, base_dir, checker, runtime, keep, data, spooled) -> str | None:
    """``_invalid``'s checks of ``model``, given its bytes ``data`` or its ``spooled`` file."""
    if checker:
        written = (spooled.path, spooled.raw_lengths()) if spooled is not None else None
        try:
            check_without_weights(model, full_check=True, data=data, written=written)
        except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
            text = str(e).strip()
            if not about_external_data(e):  # data files resolve beside the model, not here
                return "onnx.checker: " + (text.splitlines()[0] if text else type(e).__name__)
    if not runtime:
        return None
    if too_many_nodes(model) and Pieces.cuttable(model):
        try:  # one session of it would cost more than linear time: each piece loads instead
            if Pieces(model, base_dir=base_dir).load():
                return None
        except GraphoptError as e:
            return str(e)
    config = CHECK_ONLY  # kept or not: parity runs it once, so weights are not pre-packed
    try:
        if spooled is not None:  # weights mapped from the written file, not copied
            session = Session(
                session_skeleton(model, spooled),
                base_dir=spooled.path.parent,
                config=config,
                profile=keep,
            )
        else:
            session = Session(
                model, base_dir=base_dir, serialized=data, config=config, profile=keep
            )
    except GraphoptError as e:
        return str(e)
    if canary.at_risk(model):  # a default session of it must not kill the process
        crashed = canary.crash(data, spooled.path if spooled is not None else None, base_dir)
        if crashed is not None:
            return crashed
    if keep:
        _LOADED.update(model=model, session=session)
    return None


def _loaded_session(model: onnx.ModelProto):
    """The session ``_invalid`` made for exactly this model object, once; else None."""
    session = _LOADED.get("session") if _LOADED.get("model") is model else None
    _LOADED.clear()
    return session


def _keep_valid(
    original,
    optimized,
    cx,
    execute,
    limit,
    say,
    base_dir,
    budget_s: float,
    keep: bool = True,
    into: Serialized | None = None,
):
    """Every output passes onnx.checker (full) and loads in onnxruntime, or the run fails;
    ``keep``: the valid output's session is kept for parity; ``into``: the valid output's bytes
    (see ``_invalid``).

    Checks the original's standing too: a clause the original already fails (its own shapes
    contradict the checker, onnxruntime refuses it) is not held against the output.  When the
    output is invalid, the safety net bisects to the rewrite responsible and reverts it, at most
    three times and within ``budget_s`` seconds; each revert is a failure remark and a warning
    (a firing is a bug in a rule).  If that does not make the output valid, GraphoptError."""
    error = _invalid(optimized, base_dir, keep=keep, into=into)
    if error is None:
        return optimized, cx
    refused = _invalid(original, base_dir, checker=False)  # onnxruntime's word on the input
    clauses = {"checker": _invalid(original, base_dir, runtime=False) is None}
    clauses["runtime"] = refused is None
    refused = refused or _refused_by_default(original, base_dir)
    error = _invalid(optimized, base_dir, **clauses, keep=keep, into=into)
    if error is None:
        return optimized, cx
    deadline = time.perf_counter() + budget_s
    skip: frozenset = frozenset()
    reverted = []
    for _ in range(3):
        if not cx.applied or time.perf_counter() > deadline:
            break
        say("the optimized model is invalid; finding the rewrite responsible")
        found = _first_bad(
            cx, lambda n, s=skip: _invalid(execute(n, s)[0], base_dir, **clauses) is None, deadline
        )
        if found is None:
            break
        rule, node = found
        reverted.append((rule, node, error))
        skip = skip | {(rule, node)}
        optimized, cx = execute(limit, skip)
        error = _invalid(optimized, base_dir, **clauses, keep=keep, into=into)
        if error is None:
            break
    if error is not None:
        done = f"; reverting {len(reverted)} rewrite(s) did not fix it" if reverted else ""
        if refused is not None:
            raise GraphoptError(
                f"the input model does not load in onnxruntime ({refused}), and the optimized "
                f"model is invalid ({error}){done}; nothing was written"
            )
        raise GraphoptError(
            f"the optimized model is invalid ({error}){done}; nothing was written "
            "(-O0 or --pipeline without the rule named by `graphopt bisect` avoids it)"
        )
    for rule, node, why in reverted:
        cx.remark(
            "failure",
            "safety-net",
            rule,
            "invalid-output",
            [node],
            f"the model was invalid after {rule} at '{node}' ({why}); that rewrite was reverted",
        )
    return optimized, cx


def _refused_by_default(model: onnx.ModelProto, base_dir) -> str | None:
    """Why onnxruntime refuses ``model`` in a session at its default optimization level (its
    own constant folding can bring out what a plain load does not check: a Tile's repeats of
    the wrong rank), else None."""
    import onnxruntime as ort

    from .verify.parity import Session

    if too_many_nodes(model):
        return None
    try:
        Session(model, base_dir=base_dir, level=ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    except GraphoptError as e:
        return str(e)
    return None


def _first_bad(cx, good: Callable[[int], bool], deadline: float) -> tuple[str, str] | None:
    """(rule, node) of the first of ``cx.applied`` whose prefix is not ``good`` (the full list
    is bad), by bisection; None when the deadline cut the search short."""
    lo, hi = 1, len(cx.applied)
    while lo < hi and time.perf_counter() < deadline:
        mid = (lo + hi) // 2
        if good(mid):
            lo = mid + 1
        else:
            hi = mid
    if lo < hi:
        return None
    _, rule, node = cx.applied[lo - 1]
    return rule, node


def _keep_equal(original, optimized, cx, parity, execute, limit, kw: dict, say, budget_s: float):
    """Parity failed (an output out of tolerance, or the optimized model does not run where the
    original does): bisect to the rewrite responsible, as :func:`_keep_valid` does, and revert
    it, at most three times and within ``budget_s`` seconds; when that is not enough, every
    rewrite of the rules found is reverted (a rule wrong at three nodes is wrong at all of its
    kind).  Each revert is a failure remark and a warning (a firing is a bug in a rule).
    Returns the model, its context and whether anything was reverted (the caller checks parity
    again; still failing, the run fails)."""
    deadline = time.perf_counter() + budget_s
    quick = kw | {"localize_on_failure": False}

    def equal(model) -> bool:
        return _guarded(functools.partial(check_parity, original, model, **quick)).ok

    if is_lean(original) or not equal(execute(0)[0]):
        return optimized, cx, False  # too large to rerun, or no rewrite is to blame
    why = parity.error or "outputs out of tolerance"
    skip: frozenset = frozenset()
    reverted, fixed = [], False
    for _ in range(3):
        if not cx.applied or time.perf_counter() > deadline:
            break
        say("the optimized model does not match the original; finding the rewrite responsible")
        found = _first_bad(cx, lambda n, s=skip: equal(execute(n, s)[0]), deadline)
        if found is None:
            break
        rule, node = found
        reverted.append((rule, node, why))
        skip = skip | {(rule, node)}
        optimized, cx = execute(limit, skip)
        fixed = equal(optimized)
        if fixed:
            break
        why = "outputs still differ"
    rules = {rule for rule, _, _ in reverted}
    if reverted and not fixed and time.perf_counter() < deadline:
        rest = [(r, n) for _, r, n in cx.applied if r in rules]
        candidate = execute(limit, skip | set(rest))
        if equal(candidate[0]):
            optimized, cx = candidate
            reverted += [(r, n, "its rule broke parity at the nodes above") for r, n in rest]
    for rule, node, why in reverted:
        cx.remark(
            "failure",
            "safety-net",
            rule,
            "parity-failure",
            [node],
            f"parity failed after {rule} at '{node}' ({why}); that rewrite was reverted",
        )
    return optimized, cx, bool(reverted)


@contextmanager
def _reference_ahead(model, check, reference, shapes, inputs, seed, base_dir, clock=None):
    """Parity's run of the original (:class:`~graphopt.opt.verify.parity.ReferenceRun`) started now,
    when parity will compare with it and runs it whole; None otherwise.  Its session is made in
    ``clock``'s parity phase.  Stopped on the way out (an error in between does not wait for
    it to finish)."""
    if not check or reference not in ("original", "both") or is_lean(model):
        yield None
        return
    with (clock or Clock()).phase("parity"):
        ahead = ReferenceRun(model, shapes=shapes, inputs=inputs, seed=seed, base_dir=base_dir)
    try:
        yield ahead
    finally:
        ahead.stop()


def _guarded(run: Callable[[], ParityReport]) -> ParityReport:
    """Parity that cannot run (runtime refuses a model) is reported as not run, not as an error."""
    try:
        return run()
    except UsageError:
        raise
    except GraphoptError as e:
        return ParityReport.not_run(str(e))


def _parities(model, optimized, check: bool, reference: str, kw: dict, base_dir, say):
    """(parity, parity_float64) of ``optimized`` against the original as ``reference`` asks."""
    if not check:
        return ParityReport.not_run("skipped (--no-check)"), None
    say("checking parity with onnxruntime")
    parity, parity_f64 = ParityReport.not_run("not requested"), None
    if reference in ("original", "both"):
        loaded = _loaded_session(optimized)
        parity = _guarded(lambda: check_parity(model, optimized, optimized_session=loaded, **kw))
    if reference in ("float64", "both"):
        say("checking parity against a float64 reference")
        parity_f64 = _guarded(
            lambda: check_parity(
                model,
                optimized,
                reference=upcast_to_float64(model, get_target("cpu"), base_dir),
                reference_name="float64",
                **kw,
            )
        )
        if reference == "float64":
            parity, parity_f64 = parity_f64, None
    return parity, parity_f64


#: the safety net's ``why`` when the user turned timing off: the bundle does not time either
NOT_MEASURED = "not requested (--no-measure)"


def _unmeasured(measure: bool, check: bool, target: str, parity: ParityReport) -> str | None:
    """Why the performance safety net does not run, or None when it does."""
    if not measure:
        return NOT_MEASURED
    if os.environ.get("GRAPHOPT_NO_MEASURE", "") not in ("", "0"):
        return "turned off by GRAPHOPT_NO_MEASURE"
    if target != "cpu":
        return (
            f"the {target} target's device is not measured here: the safety net times cpu "
            "bundles on this machine"
        )
    if not check:
        return "parity was skipped (--no-check): no inputs to time the models on"
    if not parity.ran:
        return f"parity did not run ({parity.error}): no inputs to time the models on"
    if not parity.ok:
        return "parity failed: the optimized model is not timed"
    return None


def _written_form(held: Serialized | None, model: onnx.ModelProto):
    """``model`` as the validity check wrote it, for an onnxruntime session: (a skeleton whose
    weights are mapped from the spooled file, its folder) or (its bytes, None); None when
    ``held`` does not hold this very model."""
    if held is None or held.model is not model:
        return None
    if held.spooled is not None:
        return serialize(session_skeleton(model, held.spooled)), held.spooled.path.parent
    return (held.data, None) if held.data is not None else None


class _PerfNet:
    """The performance safety net over one optimization (:mod:`graphopt.opt.verify.perf`):
    candidates are the pipeline re-run with every rewrite of some rules skipped."""

    def __init__(self, original, optimized, cx, execute, limit, base_dir, say) -> None:
        self.original, self.optimized, self.cx = original, optimized, cx
        self.execute, self.limit, self.base_dir, self.say = execute, limit, base_dir, say
        self.rules = list(dict.fromkeys(rule for _, rule, _ in cx.applied))
        self.built: dict[frozenset, tuple] = {frozenset(): (optimized, cx)}
        #: the original's outputs on the parity inputs by session level, as the net ran it
        self.original_outputs: dict[str, dict] = {}
        #: onnxruntime's optimized form of the returned model, saved and timed by the net
        #: (:class:`~graphopt.opt.verify.perf.Saved`): the bundle's fast path
        self.fast_path = None

    def skip_for(self, rules: frozenset) -> frozenset:
        return self.cx.skip | {(r, n) for _, r, n in self.cx.applied if r in rules}

    def build(self, rules: frozenset) -> tuple:
        """The pipeline's output with every rewrite of ``rules`` skipped (rewrites at nodes the
        first run did not have are added until none is left, a few re-runs at most)."""
        if rules not in self.built:
            self.built = {frozenset(): self.built[frozenset()]}  # keep one candidate alive
            skip = self.skip_for(rules)
            for _ in range(4):
                out = self.execute(self.limit, skip)
                more = {(r, n) for _, r, n in out[1].applied if r in rules}
                if not more:
                    break
                skip = skip | more
            self.built[rules] = out
        return self.built[rules]

    def run(
        self, tgt, feeds, optimize_s: float, held: Serialized | None = None
    ) -> tuple[onnx.ModelProto, Any, dict]:
        """Time the optimized model against the original and revert the rules that made it
        slower.  With ``held`` (the validity check's written form of the model), a candidate
        that is the model it holds is loaded from that (not serialized again) to save
        onnxruntime's optimized form of it in its folder (:attr:`fast_path`), which is what is
        timed, loaded back as the bundle loads it."""
        from .rewrite.target import session_settings
        from .verify import perf

        budget = max(perf.MIN_BUDGET_S, optimize_s)
        self.say(f"timing the bundle against the original (at most {budget:.0f} s)")
        start = time.perf_counter()
        duel = None
        try:
            duel = perf.Duel(
                self.original,
                feeds,
                lambda m: session_settings(tgt, m),
                self.base_dir,
                save_into=held.folder.path if held is not None else None,
                save_as=perf.FAST_MODEL,
                written=lambda m: _written_form(held, m),
            )
            self.original_outputs = duel.outputs
            net = perf.find_slow_rules(
                self.rules,
                lambda rules, s: duel.measure(self.build(rules)[0], s),
                budget - (time.perf_counter() - start),  # loading the original counts too
            )
        except GraphoptError as e:
            if duel is not None:
                duel.discard_saved()
            return self.optimized, self.cx, {"measured": False, "why": str(e)}
        optimized, cx = self.optimized, self.cx
        reverted = frozenset(rule for rule, _ in net.reverted)
        if reverted:
            optimized, cx = self.build(reverted)
            skip = cx.skip

            def again(limit, extra: frozenset = frozenset()):
                return self.execute(limit, skip | extra)

            for r in self.cx.remarks:
                if r.pass_name == "safety-net":
                    cx.remarks.add(r)
            optimized, cx = _keep_valid(
                self.original, optimized, cx, again, self.limit, self.say, self.base_dir, budget
            )
        for remark in perf.remarks(net, self.cx.applied, budget):
            cx.remarks.add(remark)
        if duel.saved is not None and duel.saved.model is optimized:
            self.fast_path = duel.saved
        else:  # saved for a candidate that is not the model returned
            duel.discard_saved()
        return optimized, cx, perf.summary(net, budget)
