"""The ``graphopt`` command line: parse, call the library, render, map errors to exit codes.

Exit codes (stable): 0 ok, 1 error, 2 usage, 3 parity failed, 4 target cannot run the model /
did not converge, 5 performance regression.  Errors are one line on stderr; ``--debug`` (before
or after the command) shows the traceback.  Long phases report progress on stderr: a live
status on a terminal, otherwise a timestamped line for each phase still running after
``GRAPHOPT_PROGRESS_AFTER`` seconds (default 2); ``--quiet`` turns both off.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from graphopt.opt.domains import is_default

from . import __version__
from . import optimize as run_optimize
from .opt import errors
from .opt.bench import apply_baseline, baseline_payload, measure, parse_regression
from .opt.bisect import bisect as run_bisect
from .opt.clock import Clock, phase_summary
from .opt.explain import check_filters, check_rule, group_misses, levers, resolve_explain_op
from .opt.explain import explain as explain_report
from .opt.gate import (
    IntervalTooWide,
    compare_baseline,
    evaluate_expectations,
    gate_baseline,
    junit_xml,
    op_vocabulary,
    paired_rounds,
    parse_expectations,
    resolve_expectations,
)
from .opt.io import (
    OutputDirKind,
    atomic_write,
    atomic_write_text,
    check_output_dir,
    check_side_outputs,
    load_model,
    remove_path,
    replace_dir,
    save_model,
    staging_dir,
    write_model_files,
)
from .opt.lint import freeze_initializers as freeze_model
from .opt.lint import lint as lint_model
from .opt.manager import PASSES, RULES
from .opt.optimizer import sparse_collection
from .opt.parity import check_parity, load_inputs, parse_shapes, parse_tolerances
from .opt.pipeline import LEVEL_NAMES
from .opt.reference import upcast_to_float64
from .opt.report_html import render_html
from .opt.target import TARGETS, get_target
from .targets.bundle import BUNDLE_KIND, default_bundle_dir, protected_paths, write_bundle
from .targets.codegen import kernel_pipeline

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Optimize ONNX models for a target, prove parity, explain every rewrite.",
)
out = Console(highlight=False)
err = Console(stderr=True, highlight=False)
STATE = {"debug": False}


class Format(str, Enum):
    text = "text"
    json = "json"


class Verify(str, Enum):
    fingerprint = "fingerprint"
    full = "full"
    none = "none"


class Reference(str, Enum):
    original = "original"
    float64 = "float64"
    both = "both"


def _show_version(value: bool) -> None:
    if value:
        print(f"graphopt {__version__}")
        raise typer.Exit()


def _set_debug(value: bool) -> bool:
    """``--debug`` after the command name: the same switch as before it."""
    if value:
        STATE["debug"] = True
    return value


FORMAT = typer.Option("--format", help="text or json (json: one document on stdout).")
TARGET = typer.Option("--target", "-t", help=f"Target: {', '.join(TARGETS)}.")
DEBUG = typer.Option(
    "--debug", help="Show tracebacks (also accepted before the command).", callback=_set_debug
)


@app.callback()
def main(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks.")] = False,
    version: Annotated[
        bool,
        typer.Option(
            "--version", help="Print the version and exit.", callback=_show_version, is_eager=True
        ),
    ] = False,
) -> None:
    STATE["debug"] = debug


@contextmanager
def handled():
    """Turn GraphoptError (and unexpected errors) into one line + exit code."""
    try:
        yield
    except errors.GraphoptError as e:
        if STATE["debug"]:
            raise
        err.print(f"[bold red]error:[/] {e}", markup=True, soft_wrap=True)
        raise typer.Exit(e.exit_code) from None
    except (KeyboardInterrupt, typer.Exit):
        raise
    except Exception as e:  # noqa: BLE001 - last resort: one line, never a traceback by default
        if STATE["debug"]:
            raise
        err.print(
            f"[bold red]internal error:[/] {type(e).__name__}: {e} (rerun with --debug)",
            markup=True,
            soft_wrap=True,
        )
        raise typer.Exit(errors.EXIT_ERROR) from None


BISECT_SCHEMA = "graphopt.bisect/1"
BISECT_KIND = OutputDirKind(
    "graphopt bisect folder",
    "report.json",
    BISECT_SCHEMA,
    ("report.json", "before.onnx", "after.onnx"),
)
MAX_THREADS = 1024
SEED = typer.Option("--seed", min=0, help="Seed of random parity inputs (>= 0).")
SHAPE = typer.Option(
    "--shape",
    help="NAME=D0,D1,... sizes of an input's dynamic dims for the random inputs (repeatable).",
)
INPUTS = typer.Option(
    "--inputs", help="Real inputs: an .npz (one array per input name) or an .npy (one input)."
)


def _protected(model: Path) -> list[Path]:
    """The input model and its external-data files: no output may replace or contain them."""
    return protected_paths(model)


def _finite(value: float, flag: str, lo: float | None = 0.0) -> float:
    """A flag's number must be finite (and at least ``lo``)."""
    if not math.isfinite(value) or (lo is not None and value < lo):
        bound = f"a finite number >= {lo:g}" if lo is not None else "a finite number"
        raise errors.UsageError(f"{flag} must be {bound} (got {value})")
    return value


def _graph_inputs(model) -> list[str]:
    """The model's real inputs (not initializers listed as inputs)."""
    proto = load_model(model, check=False, lazy_external=True) if isinstance(model, Path) else model
    inits = {t.name for t in proto.graph.initializer}
    return [i.name for i in proto.graph.input if i.name not in inits]


def _load_feeds(inputs: Path | None, model):
    """``--inputs``: an .npz of named arrays, or an .npy holding the one input of a model that
    has exactly one."""
    if inputs is None:
        return None
    try:
        with open(inputs, "rb") as f:
            is_npy = f.read(6) == b"\x93NUMPY"
    except OSError as e:
        raise errors.UsageError(f"--inputs {inputs}: cannot read ({e.strerror or e})") from None
    if not is_npy:
        return load_inputs(inputs)
    import numpy as np

    try:
        array = np.load(inputs, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise errors.UsageError(f"--inputs {inputs}: cannot read as .npy ({e})") from None
    names = _graph_inputs(model)
    if len(names) != 1:
        raise errors.UsageError(
            f"--inputs {inputs}: an .npy holds one array but the model has {len(names)} inputs "
            f"({', '.join(names) or 'none'}); give an .npz with one array per input name"
        )
    return {names[0]: array}


@app.command()
def optimize(
    model: Annotated[Path, typer.Argument(help="Input .onnx model (never modified).")],
    output: Annotated[
        Path | None,
        typer.Option(
            "-o",
            "--output",
            help="Output directory (default: <stem>.<target>.graphopt beside the input).",
        ),
    ] = None,
    target: Annotated[str, TARGET] = "cpu",
    level: Annotated[
        int,
        typer.Option(
            "-O",
            "--level",
            min=0,
            max=3,
            help="0 none, 1 exact cleanups, 2 standard fusions, 3 guarded numerics-changing.",
        ),
    ] = 2,
    pipeline: Annotated[
        str | None, typer.Option("--pipeline", help="Pipeline text (overrides -O).")
    ] = None,
    fmt: Annotated[Format, FORMAT] = Format.text,
    debug: Annotated[bool, DEBUG] = False,
    shape: Annotated[
        list[str] | None, typer.Option("--shape", help="NAME=D0,D1,... for parity inputs.")
    ] = None,
    inputs: Annotated[
        Path | None, typer.Option("--inputs", help=".npz of inputs for parity.")
    ] = None,
    no_check: Annotated[bool, typer.Option("--no-check", help="Skip the parity check.")] = False,
    no_measure: Annotated[
        bool,
        typer.Option("--no-measure", help="Skip timing the bundle against the original (cpu)."),
    ] = False,
    seed: Annotated[int, SEED] = 0,
    bisect_limit: Annotated[
        int | None,
        typer.Option("--bisect-limit", min=0, help="Apply only the first N rewrites (opt-bisect)."),
    ] = None,
    verify_each: Annotated[
        bool, typer.Option("--verify-each", help="Check the model after every pass.")
    ] = False,
    fold_size_limit: Annotated[
        float,
        typer.Option("--fold-size-limit", help="MiB a folded constant may grow to (finite, >= 0)."),
    ] = 1.0,
    remarks: Annotated[
        Path | None, typer.Option("--remarks", help="Write remarks as JSONL.")
    ] = None,
    reference: Annotated[
        Reference,
        typer.Option("--reference", help="Parity vs the original, its float64 upcast, or both."),
    ] = Reference.original,
    tolerance: Annotated[
        list[str] | None,
        typer.Option("--tolerance", help="OUTPUT=RTOL,ATOL overriding the dtype default."),
    ] = None,
    expect: Annotated[
        list[str] | None,
        typer.Option(
            "--expect", help='Op-count assertions, e.g. "LayerNormalization>=25" (exit 4).'
        ),
    ] = None,
    junit: Annotated[Path | None, typer.Option("--junit", help="Write JUnit XML.")] = None,
    html_report: Annotated[
        Path | None, typer.Option("--html", help="Write a self-contained HTML report.")
    ] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing on success.")] = False,
    kernels: Annotated[
        bool | None,
        typer.Option(
            "--kernels/--no-kernels",
            help="Fuse element-wise chains into generated C/CUDA kernels (fuse-elementwise; "
            "each kept only where its gates pass; the bundle ships kernels/). Default: on for "
            "the -O presets on cpu/cuda where a compiler is present (GRAPHOPT_NO_KERNELS=1 "
            "turns the default off); --kernels also adds it to a --pipeline.",
        ),
    ] = None,
    opset: Annotated[
        int | None,
        typer.Option(
            "--opset",
            min=1,
            help="Upgrade the model to this ONNX opset first (e.g. 23 for RMSNormalization); "
            "parity still compares with the original.",
        ),
    ] = None,
) -> None:
    """Optimize MODEL for a target; write OUT_DIR/model.onnx and OUT_DIR/report.json."""
    with handled(), sparse_collection():  # writing the bundle of a large graph too
        clock = Clock.since_process_start()  # report.seconds: every phase of the wait
        src = model.resolve()
        protected = _protected(src)
        dest = check_output_dir(output or default_bundle_dir(model, target), BUNDLE_KIND, protected)
        side = {"--remarks": remarks, "--junit": junit, "--html": html_report}
        check_side_outputs(side, models=[src], files=[inputs] if inputs else [], dirs=[dest])
        fold_limit = _finite(fold_size_limit, "--fold-size-limit")
        expectations = parse_expectations(expect)
        shapes = parse_shapes(shape)
        feeds = _load_feeds(inputs, src)
        custom = pipeline is not None
        pipeline = kernel_pipeline(target, level, pipeline, kernels)
        with _progress(quiet) as say:
            optimized, report = run_optimize(
                src,
                target=target,
                level=level,
                pipeline=pipeline,
                check=not no_check,
                measure=not no_measure,
                shapes=shapes,
                inputs=feeds,
                seed=seed,
                bisect_limit=bisect_limit,
                verify_each=verify_each,
                options={"fold_size_limit": int(fold_limit * 2**20)},
                progress=say,
                reference=reference.value,
                output_tolerances=parse_tolerances(tolerance),
                opset=opset,
                clock=clock,
            )
            expectations = _resolve_expectations(expectations, report, target)
            say("writing the bundle")
            write_bundle(optimized, report, dest, protected=protected, progress=say)
        if remarks:
            _atomic_text(
                remarks,
                "".join(json.dumps(r.to_dict(), sort_keys=True) + "\n" for r in report.remarks),
            )
        results = evaluate_expectations(expectations, report.ops_after)
        payload = _written_report(dest, report)
        if results:
            payload["expectations"] = [e.to_dict() for e in results]
        if junit:
            parities = [report.parity] + ([report.parity_float64] if report.parity_float64 else [])
            _atomic_text(junit, junit_xml(f"graphopt.optimize.{model.stem}", parities, results))
        if html_report:
            manifest_path = dest / "manifest.json"
            manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else None
            _atomic_text(html_report, render_html(payload, manifest))
        if fmt == Format.json:
            print(json.dumps(payload, indent=2, sort_keys=True))
        elif not quiet:
            _render_report(report, custom_pipeline=custom)
            for e in results:
                mark = "[green]ok[/]" if e.ok else "[red]FAILED[/]"
                out.print(f"expect {e.text}: {mark} (found {e.actual})")
        _warn_safety_net(report)
        code, reason = _verdict(report, results, checked=not no_check)
        if not reason.startswith(PARITY_NOT_RUN):
            _warn_parity_not_run(report, checked=not no_check)
        if code:
            err.print(f"error: {reason}", soft_wrap=True)
            raise typer.Exit(code)


def _written_report(bundle: Path, report) -> dict:
    """The report.json the bundle holds (the report and what the bundle phase added to it)."""
    try:
        return json.loads((bundle / "report.json").read_text())
    except (OSError, ValueError):
        return report.to_dict()


def _resolve_expectations(expectations: list, report, target: str) -> list:
    """``--expect`` op names in full (``FusedConv`` → ``com.microsoft.FusedConv``)."""
    if not expectations:
        return expectations
    vocabulary = op_vocabulary(
        report.ops_before, report.ops_after, kernels=get_target(target).kernels()
    )
    return resolve_expectations(expectations, vocabulary)


def _remark_line(failures: list) -> str:
    first = failures[0]
    more = f" (+{len(failures) - 1} more in report.json)" if len(failures) > 1 else ""
    return f"{first.rule}: {first.code}: {first.message}{more}"


def _verdict(report, expectations, checked: bool) -> tuple[int, str]:
    """The exit code and its one line, printed even with --quiet or --format json.

    In order: parity that ran and failed → 3 (also the bundle against the original at its
    session settings, ``report.parity_deployed``); a ``verify`` failure (the optimized model was
    invalid or refused by onnxruntime) → 1; not converged or a node the target cannot run → 4;
    parity requested that could not run → 3; unmet ``--expect`` → 4."""
    parities = [report.parity] + ([report.parity_float64] if report.parity_float64 else [])
    bad = [o.name for p in parities if checked and p.ran for o in p.outputs if not o.ok]
    if checked and any(p.ran and not p.ok for p in parities):
        return errors.EXIT_PARITY, f"parity failed (outputs: {', '.join(bad) or 'see report.json'})"
    deployed = getattr(report, "parity_deployed", None)
    if checked and deployed is not None and deployed.ran and not deployed.ok:
        bad = [o.name for o in deployed.outputs if not o.ok]
        return errors.EXIT_PARITY, f"parity failed (outputs: {', '.join(bad)}): {deployed.error}"
    failures = [r for r in report.remarks if r.kind == "failure"]
    verify = [r for r in failures if r.pass_name == "verify"]
    if verify:
        return errors.EXIT_ERROR, _remark_line(verify)
    if not report.converged or not report.legal:  # legalize: a node the target cannot run
        return errors.EXIT_TARGET, _remark_line(failures) if failures else "exit 4"
    not_run = [p for p in parities if checked and not p.ran]
    if not_run:
        p = not_run[0]
        return errors.EXIT_PARITY, f"{PARITY_NOT_RUN}: {p.error}{_parity_hint(p)}"
    unmet = [e.text for e in expectations if not e.ok]
    if unmet:
        return errors.EXIT_TARGET, f"expectations not met: {', '.join(unmet)}"
    return errors.EXIT_OK, ""


PARITY_NOT_RUN = "parity could not run"


def _warn_parity_not_run(report, checked: bool) -> None:
    """When another verdict decides the exit code, parity that could not run is still said."""
    parities = [report.parity] + ([report.parity_float64] if report.parity_float64 else [])
    for p in parities:
        if checked and not p.ran:
            err.print(
                f"[yellow]warning:[/] parity vs {p.reference} not run: {p.error}{_parity_hint(p)}",
                markup=True,
                soft_wrap=True,
            )


def _warn_safety_net(report) -> None:
    """A rewrite that made the model invalid was reverted: the run succeeds, loudly."""
    for r in report.remarks:
        if r.kind == "failure" and r.pass_name == "safety-net" and r.code == "invalid-output":
            err.print(f"[yellow]warning:[/] safety net: {r.message}", markup=True, soft_wrap=True)


def _parity_hint(parity) -> str:
    """The --shape/--inputs hint, unless the error already carries one."""
    if parity.error and "failed to run" in parity.error and "--shape" not in parity.error:
        return (
            " (random inputs, symbolic dims at default sizes: give real sizes with "
            "--shape NAME=D0,D1,... or real inputs with --inputs FILE.npz)"
        )
    return ""


def _discard(path: Path) -> None:
    if os.path.lexists(path):
        try:
            remove_path(path)
        except OSError as e:
            err.print(f"warning: could not remove {path}: {e}", soft_wrap=True)


def _atomic_text(path: Path, text: str) -> None:
    try:
        atomic_write_text(path, text)
    except OSError as e:
        raise errors.ModelSaveError(f"cannot write {path}: {e.strerror or e}") from None


QUIET_PROGRESS = typer.Option("--quiet", "-q", help="No progress lines on stderr.")


def _progress_after() -> float:
    """Seconds a phase runs before its line is printed when stderr is not a terminal."""
    try:
        value = float(os.environ.get("GRAPHOPT_PROGRESS_AFTER", "2"))
    except ValueError:
        return 2.0
    return value if math.isfinite(value) and value >= 0 else 2.0


@contextmanager
def _progress(quiet: bool):
    """``say(msg)`` for each phase: a live status on a terminal; otherwise one timestamped line
    on stderr for each phase still running after ``GRAPHOPT_PROGRESS_AFTER`` seconds (fast runs
    stay silent); nothing with ``quiet``.  Never writes to stdout."""
    if quiet:
        yield lambda _msg: None
        return
    if err.is_terminal:
        with err.status("graphopt") as status:
            yield lambda msg: status.update(f"graphopt: {msg}")
        return
    lines = _PhaseLines(_progress_after())
    try:
        yield lines.say
    finally:
        lines.stop()


class _PhaseLines:
    """Timestamped progress lines for logs: a phase's line is printed once it has run for
    ``after`` seconds (a timer thread), so that silence never lasts longer than that."""

    def __init__(self, after: float) -> None:
        self.after = after
        self.t0 = time.monotonic()
        self.lock = threading.Lock()
        self.phase = 0
        self.timer: threading.Timer | None = None

    def say(self, msg: str) -> None:
        with self.lock:
            self._cancel()
            self.phase += 1
            stamp = (time.strftime("%H:%M:%S"), time.monotonic() - self.t0)
            if self.after <= 0:
                self._emit(msg, stamp)
                return
            self.timer = threading.Timer(self.after, self._fire, (self.phase, msg, stamp))
            self.timer.daemon = True
            self.timer.start()

    def _fire(self, phase: int, msg: str, stamp: tuple[str, float]) -> None:
        with self.lock:
            if phase == self.phase:
                self._emit(msg, stamp)

    @staticmethod
    def _emit(msg: str, stamp: tuple[str, float]) -> None:
        err.print(f"{stamp[0]} graphopt +{stamp[1]:.1f}s: {msg}", markup=False, soft_wrap=True)

    def _cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def stop(self) -> None:
        with self.lock:
            self._cancel()
            self.phase += 1


def _device_note(report) -> str:
    """Where parity ran, for targets other than cpu: onnxruntime's CPU provider here, and
    whether the bundle ran on the device (its manifest says)."""
    if report.target == "cpu":
        return ""
    device = "not-run"
    manifest = Path(report.outputs.get("manifest", "")) if report.outputs else None
    if manifest and manifest.is_file():
        try:
            device = json.loads(manifest.read_text()).get("verified", {}).get("device", device)
        except (OSError, ValueError):
            pass
    ran = "not run" if device == "not-run" else f"run ({device})"
    return (
        "parity ran on this machine's CPU (onnxruntime CPUExecutionProvider); "
        f"the {report.target} device was {ran}"
    )


def _render_report(report, custom_pipeline: bool = False) -> None:
    how = f"pipeline '{report.pipeline}'" if custom_pipeline else f"-O{report.level}"
    took = phase_summary(report.seconds)  # the wait, phase by phase
    out.print(
        f"[bold]{report.model}[/] → target [cyan]{report.target}[/], {how}: "
        f"{report.nodes_before} → {report.nodes_after} nodes, {report.rewrites} rewrites, {took}",
        soft_wrap=True,
    )
    changed = [
        f"{op} {report.ops_before.get(op, 0)}→{report.ops_after.get(op, 0)}"
        for op in sorted(set(report.ops_before) | set(report.ops_after))
        if report.ops_before.get(op, 0) != report.ops_after.get(op, 0)
    ]
    if changed:
        out.print("ops (before→after): " + ", ".join(changed), soft_wrap=True)
    _render_fired(report)
    _render_misses(group_misses(report))
    note = _device_note(report)
    _render_parity(report.parity, note)
    if report.parity_float64 is not None:
        _render_parity(report.parity_float64, note)
    deployed = report.parity_deployed
    if deployed is not None:
        verdict = "[green]ok[/]" if deployed.ok else "[red]FAILED[/]" if deployed.ran else "not run"
        out.print(f"parity at the bundle's session settings ({deployed.reference}): {verdict}")
    _render_performance(report.performance)
    passes = {}
    for p in report.passes:
        passes[p["name"]] = passes.get(p["name"], 0.0) + p["seconds"]
    out.print("time per pass: " + ", ".join(f"{k} {v:.3f}s" for k, v in passes.items()))
    if report.outputs:
        out.print(f"wrote {report.outputs.get('model')}")


MAX_MISS_GROUPS = 10


def _render_fired(report) -> None:
    """Fired fusions (rules of level 2+) and cleanups with their counts, most first."""
    fired = sorted(
        ((n, st["fired"]) for n, st in report.rules.items() if st["fired"]),
        key=lambda kv: (-kv[1], kv[0]),
    )
    fusions = [(n, c) for n, c in fired if n in RULES and RULES[n].level >= 2]
    cleanups = [(n, c) for n, c in fired if (n, c) not in fusions]
    for label, rows in (("[green]fused[/]", fusions), ("cleaned up", cleanups)):
        if rows:
            out.print(f"{label}: " + ", ".join(f"{n} ×{c}" for n, c in rows), soft_wrap=True)


def _render_misses(groups: list[dict]) -> None:
    """Missed/failed remarks grouped by (rule, code), one line each: count, rule, code, one
    example node, what to do; at most MAX_MISS_GROUPS lines, then the flags that would let more
    fuse.  The full list is in report.json, --remarks and `graphopt explain`."""
    if not groups:
        return
    total = sum(g["count"] for g in groups)
    out.print(f"[yellow]missed[/]: {total} remarks in {len(groups)} groups, actionable first")
    for g in groups[:MAX_MISS_GROUPS]:
        what = "[red]failure[/] " if g["kind"] == "failure" else ""
        todo = g["hint"] or g["message"]
        todo = todo if len(todo) <= 160 else todo[:159] + "…"
        if g["lever"]:
            todo = f"[bold]{g['lever']}[/]: {todo}"
        out.print(
            f"  {g['count']:>4}× {what}{g['rule']} {g['code']} (e.g. '{g['example']}'): {todo}",
            soft_wrap=True,
        )
    if len(groups) > MAX_MISS_GROUPS:
        rest = groups[MAX_MISS_GROUPS:]
        out.print(
            f"  ... {len(rest)} more groups ({sum(g['count'] for g in rest)} remarks): "
            "`graphopt explain`, --remarks FILE or report.json list them all",
            soft_wrap=True,
        )
    more = levers(groups)
    if more:
        out.print(
            "to get more: " + "; ".join(f"{lever} ({n} missed)" for lever, n in more),
            soft_wrap=True,
        )


def _render_performance(perf: dict) -> None:
    """One line: the performance safety net's verdict, or why it did not measure."""
    if not perf.get("measured"):
        if perf.get("why"):
            out.print(f"latency vs original: not measured ({perf['why']})")
        return
    reverted = perf.get("reverted") or []
    tail = f"; reverted {', '.join(str(r) for r in reverted)}" if reverted else ""
    out.print(
        f"latency vs original (1 thread, this machine): {perf.get('ratio', 0):.3f} "
        f"[{perf.get('low', 0):.3f}, {perf.get('high', 0):.3f}], {perf.get('rounds', 0)} rounds"
        f"{tail}"
    )


def _render_parity(parity, note: str = "") -> None:
    if not parity.ran:
        out.print(f"parity: [yellow]not run[/] ({parity.error})")
        return
    verdict = "[green]ok[/]" if parity.ok else "[red]FAILED[/]"
    t = Table(title=f"parity vs {parity.reference}: {verdict}", show_edge=False)
    for col in ("output", "dtype", "max abs", "max rel", "mean abs", "mismatch", "cosine", "ok"):
        t.add_column(col, justify="left" if col in ("output", "dtype") else "right")
    for d in parity.outputs:
        t.add_row(
            d.name,
            d.dtype,
            f"{d.max_abs:.3g}",
            f"{d.max_rel:.3g}",
            f"{d.mean_abs:.3g}",
            f"{d.mismatch:.2%}",
            f"{d.cosine:.6f}",
            "yes" if d.ok else "[red]NO[/]",
        )
    out.print(t)
    if note:
        out.print(note, soft_wrap=True)
    if parity.error:
        out.print(f"[red]{parity.error}[/]")
    if parity.first_divergence:
        d = parity.first_divergence
        out.print(
            f"first diverging tensor: '{d['tensor']}' from {d['op']} '{d['producer']}' "
            f"(max abs {d['max_abs']:.3g})"
        )


@app.command()
def check(
    original: Annotated[Path, typer.Argument(help="Reference model.")],
    optimized: Annotated[Path, typer.Argument(help="Model to compare (a file or a bundle dir).")],
    shape: Annotated[list[str] | None, SHAPE] = None,
    inputs: Annotated[Path | None, INPUTS] = None,
    seed: Annotated[int, SEED] = 0,
    reference: Annotated[
        Reference,
        typer.Option("--reference", help="Compare with ORIGINAL, its float64 upcast, or both."),
    ] = Reference.original,
    tolerance: Annotated[
        list[str] | None,
        typer.Option("--tolerance", help="OUTPUT=RTOL,ATOL overriding the dtype default."),
    ] = None,
    fmt: Annotated[Format, FORMAT] = Format.text,
    quiet: Annotated[bool, QUIET_PROGRESS] = False,
    debug: Annotated[bool, DEBUG] = False,
) -> None:
    """Compare two models' outputs with onnxruntime; exit 3 when they differ."""
    with handled():
        if optimized.is_dir():
            optimized = optimized / "model.onnx"
        with _progress(quiet) as say:
            say("loading the models")
            ref_model, opt_model = load_model(original), load_model(optimized)
        kw = dict(
            shapes=parse_shapes(shape),
            inputs=_load_feeds(inputs, ref_model),
            seed=seed,
            per_output=parse_tolerances(tolerance),
        )
        results = []
        with _progress(quiet) as say:
            if reference in (Reference.original, Reference.both):
                say("parity vs the original: running both models")
                results.append(check_parity(ref_model, opt_model, **kw))
            if reference in (Reference.float64, Reference.both):
                say("parity vs a float64 upcast of the original")
                f64 = upcast_to_float64(ref_model, TARGETS["cpu"])
                results.append(
                    check_parity(
                        ref_model, opt_model, reference=f64, reference_name="float64", **kw
                    )
                )
        if fmt == Format.json:
            payload = [p.to_dict() for p in results]
            body = payload[0] if len(payload) == 1 else payload
            print(json.dumps(body, indent=2, sort_keys=True))
        else:
            for p in results:
                _render_parity(p)
        if not all(p.ok for p in results):
            raise typer.Exit(errors.EXIT_PARITY)


@app.command()
def bisect(
    model: Annotated[Path, typer.Argument(help="Model whose optimization breaks parity.")],
    output: Annotated[
        Path | None,
        typer.Option("-o", "--output", help="Directory for the minimal before/after models."),
    ] = None,
    target: Annotated[str, TARGET] = "cpu",
    level: Annotated[int, typer.Option("-O", "--level", min=0, max=3)] = 2,
    pipeline: Annotated[str | None, typer.Option("--pipeline")] = None,
    shape: Annotated[list[str] | None, SHAPE] = None,
    inputs: Annotated[Path | None, INPUTS] = None,
    seed: Annotated[int, SEED] = 0,
    fmt: Annotated[Format, FORMAT] = Format.text,
    quiet: Annotated[bool, QUIET_PROGRESS] = False,
    debug: Annotated[bool, DEBUG] = False,
) -> None:
    """Find the first rewrite that breaks parity (binary search on --bisect-limit).

    Exit 3 when a culprit is found (parity is broken), 0 when parity holds."""
    with handled():
        protected = _protected(model.resolve())
        dest = check_output_dir(
            output or model.with_name(f"{model.stem}.bisect"), BISECT_KIND, protected
        )
        with _progress(quiet) as say:
            result = run_bisect(
                load_model(model),
                target=target,
                level=level,
                pipeline=pipeline,
                shapes=parse_shapes(shape),
                inputs=_load_feeds(inputs, model),
                seed=seed,
                progress=say,
            )
        payload = result.to_dict()
        if result.found and result.before is not None:
            _write_bisect(dest, result, payload, protected)
            payload["files"] = str(dest)
        if fmt == Format.json:
            print(json.dumps(payload, indent=2, sort_keys=True))
        else:
            _render_bisect(result, payload)
        if result.found:
            raise typer.Exit(errors.EXIT_PARITY)


def _write_bisect(dest: Path, result, payload: dict, protected: list[Path]) -> None:
    """before.onnx, after.onnx and report.json (its schema marks the folder as ours) written in
    a staging folder and renamed into place; the staging folder never survives."""
    try:
        staging = staging_dir(dest)
    except OSError as e:
        raise errors.ModelSaveError(f"cannot write to {dest.parent}: {e.strerror or e}") from None
    try:
        write_model_files(result.before, staging / "before.onnx", external=False)
        if result.after is not None:
            write_model_files(result.after, staging / "after.onnx", external=False)
        marked = {"schema": BISECT_SCHEMA, **payload}
        (staging / "report.json").write_text(json.dumps(marked, indent=2, sort_keys=True))
        check_output_dir(dest, BISECT_KIND, protected)
        replace_dir(staging, dest)
    except OSError as e:
        raise errors.ModelSaveError(f"cannot write {dest}: {e.strerror or e}") from None
    finally:
        _discard(staging)


def _render_bisect(result, payload: dict) -> None:
    out.print(result.message)
    if result.remark is not None:
        r = result.remark
        out.print(f"remark: {r.kind} {r.rule} nodes={list(r.nodes)}: {r.message}")
    div = (result.culprit or {}).get("first_divergence")
    if div:
        out.print(
            f"first diverging tensor: '{div['tensor']}' from {div['op']} '{div['producer']}' "
            f"(max abs {div['max_abs']:.3g})"
        )
    out.print(f"parity runs: {result.parity_runs} (bound {payload['max_parity_runs']})")
    if "files" in payload:
        out.print(f"wrote {payload['files']}/before.onnx and after.onnx")


@app.command()
def explain(
    model: Annotated[Path, typer.Argument(help="Model to explain.")],
    target: Annotated[str, TARGET] = "cpu",
    level: Annotated[int, typer.Option("-O", "--level", min=0, max=3)] = 2,
    pipeline: Annotated[str | None, typer.Option("--pipeline")] = None,
    rule: Annotated[str | None, typer.Option("--rule", help="Only this rule.")] = None,
    node: Annotated[str | None, typer.Option("--node", help="Only remarks on this node.")] = None,
    code: Annotated[str | None, typer.Option("--code", help="Only this guard code.")] = None,
    op: Annotated[
        str | None,
        typer.Option("--op", help="Only remarks on nodes of this op (FusedConv or its domain.op)."),
    ] = None,
    shape: Annotated[list[str] | None, SHAPE] = None,
    inputs: Annotated[Path | None, INPUTS] = None,
    remarks: Annotated[Path | None, typer.Option("--remarks", help="Write JSONL.")] = None,
    fmt: Annotated[Format, FORMAT] = Format.text,
    quiet: Annotated[bool, QUIET_PROGRESS] = False,
    debug: Annotated[bool, DEBUG] = False,
) -> None:
    """Which rules fired where, which were refused where and why (with a hint for the fix).

    A --rule, --node, --code or --op that names nothing exits 2 with the nearest names."""
    with handled():
        src = model.resolve()
        check_side_outputs({"--remarks": remarks}, models=[src], files=[inputs] if inputs else [])
        check_rule(rule)
        with _progress(quiet) as say:
            optimized, report = run_optimize(
                src,
                target=target,
                level=level,
                pipeline=pipeline,
                check=False,
                shapes=parse_shapes(shape),
                inputs=_load_feeds(inputs, src),
                progress=say,
            )
        original = load_model(src, check=False, lazy_external=True)
        node_ops = {**_node_ops(optimized.graph), **_node_ops(original.graph)}
        check_filters(report, node_ops, node=node, code=code)
        op = resolve_explain_op(op, report) if op is not None else None
        data = explain_report(report, rule=rule, node=node, code=code, op=op, node_ops=node_ops)
        if remarks:
            _atomic_text(
                remarks,
                "".join(json.dumps(r.to_dict(), sort_keys=True) + "\n" for r in report.remarks),
            )
        if fmt == Format.json:
            print(json.dumps(data, indent=2, sort_keys=True))
            return
        _render_explain(data)


def _node_ops(graph) -> dict[str, str]:
    """Node name → op type (``domain.op`` outside the default domain), subgraphs included."""
    found: dict[str, str] = {}
    for n in graph.node:
        found[n.name] = f"{n.domain}.{n.op_type}" if not is_default(n.domain) else n.op_type
        for a in n.attribute:
            for g in [a.g] if a.HasField("g") else list(a.graphs):
                found.update(_node_ops(g))
    return found


def _render_explain(data: dict) -> None:
    t = Table(title=f"rules (target {data['target']}, -O{data['level']})", show_edge=False)
    for col in ("rule", "attempts", "fired", "missed", "missed by code", "seconds"):
        t.add_column(
            col,
            justify="right" if col in ("attempts", "fired", "missed", "seconds") else "left",
            overflow="fold",
        )
    for name, st in data["rules"].items():
        if st["attempts"] or st["fired"] or st["missed"]:
            codes = ", ".join(f"{c}×{n}" for c, n in st["missed_by_code"].items())
            t.add_row(
                name,
                str(st["attempts"]),
                str(st["fired"]),
                str(st["missed"]),
                codes,
                f"{st['seconds']:.3f}",
            )
    out.print(t)
    for f in data["fired"][:50]:
        created = ", ".join(f["created"]) or "(removed)"
        out.print(f"[green]fired[/]  {f['rule']}: {', '.join(f['nodes'])} → {created}")
    if len(data["fired"]) > 50:
        out.print(f"... {len(data['fired']) - 50} more fired (--format json for all)")
    for m in data["missed"]:
        out.print(f"[yellow]missed[/] {m['rule']} at '{m['node']}': {m['code']}: {m['message']}")
        if m["hint"]:
            out.print(f"         hint: {m['hint']}")
    if data["never_matched"]:
        out.print("never matched: " + ", ".join(data["never_matched"]))


@app.command()
def lint(
    model: Annotated[Path, typer.Argument(help="Model to lint.")],
    freeze_initializers: Annotated[
        bool,
        typer.Option(
            "--freeze-initializers",
            help="Write a copy whose initializers are not graph inputs (changes the interface).",
        ),
    ] = False,
    output: Annotated[
        Path | None,
        typer.Option("-o", "--output", help="Where --freeze-initializers writes the model."),
    ] = None,
    target: Annotated[str, TARGET] = "cpu",
    fmt: Annotated[Format, FORMAT] = Format.text,
    quiet: Annotated[bool, QUIET_PROGRESS] = False,
    debug: Annotated[bool, DEBUG] = False,
) -> None:
    """Pitfalls of real exports (weights as inputs, custom domains, fp16 saturation...), each
    with its fix."""
    with handled():
        get_target(target)  # an unknown target is a usage error, not "no findings"
        dest = None
        if freeze_initializers:
            dest = (output or model.with_name(f"{model.stem}.frozen.onnx")).resolve()
            check_side_outputs(
                {"-o": dest, "-o (its external data)": dest.with_name(dest.name + ".data")},
                models=[model.resolve()],
            )
        with _progress(quiet) as say:
            say("loading")
            proto = load_model(model, check=False)
            try:
                _, report = run_optimize(proto, target=target, check=False, progress=say)
                missed = [r for r in report.remarks if r.kind == "missed"]
            except errors.GraphoptError:
                missed = []
            say("linting")
            findings = lint_model(proto, missed_remarks=missed)
        payload = {
            "schema": "graphopt.lint/1",
            "model": str(model),
            "findings": [f.to_dict() for f in findings],
        }
        if dest is not None:
            frozen, names = freeze_model(proto)
            save_model(frozen, dest)
            payload["frozen"] = {"output": str(dest), "initializers": len(names)}
        if fmt == Format.json:
            print(json.dumps(payload, indent=2, sort_keys=True))
            return
        if not findings:
            out.print("no findings")
        for f in findings:
            color = {"error": "red", "warning": "yellow"}.get(f.severity, "cyan")
            out.print(f"[{color}]{f.severity}[/] {f.code}: {f.message}")
            out.print(f"    fix: {f.fix}")
        if "frozen" in payload:
            out.print(
                f"wrote {payload['frozen']['output']} "
                f"({payload['frozen']['initializers']} initializers frozen)"
            )


@app.command()
def bench(
    model: Annotated[Path, typer.Argument(help="Original model.")],
    optimized: Annotated[
        Path | None,
        typer.Option(
            "--optimized", help="Optimized model or bundle (default: optimize MODEL now)."
        ),
    ] = None,
    target: Annotated[str, TARGET] = "cpu",
    level: Annotated[int, typer.Option("-O", "--level", min=0, max=3)] = 2,
    runs: Annotated[int, typer.Option("--runs", min=1)] = 100,
    warmup: Annotated[int, typer.Option("--warmup", min=0)] = 10,
    threads: Annotated[
        int, typer.Option("--threads", min=1, max=MAX_THREADS, help="intra-op threads.")
    ] = 1,
    ort_level: Annotated[
        str,
        typer.Option(
            "--ort-level", help="onnxruntime session level: disable, basic, extended, all."
        ),
    ] = "all",
    shape: Annotated[list[str] | None, SHAPE] = None,
    inputs: Annotated[Path | None, INPUTS] = None,
    baseline: Annotated[
        Path | None,
        typer.Option(
            "--baseline", help="Compare with this baseline; exit 5 past --max-regression."
        ),
    ] = None,
    save_baseline: Annotated[
        Path | None, typer.Option("--save-baseline", help="Write this run as a baseline file.")
    ] = None,
    max_regression: Annotated[str, typer.Option("--max-regression")] = "5%",
    min_seconds: Annotated[
        float, typer.Option("--min-seconds", help="Keep measuring at least this long.")
    ] = 2.0,
    junit: Annotated[Path | None, typer.Option("--junit")] = None,
    fmt: Annotated[Format, FORMAT] = Format.text,
    quiet: Annotated[bool, QUIET_PROGRESS] = False,
    debug: Annotated[bool, DEBUG] = False,
) -> None:
    """p50/p95 latency of original and optimized (interleaved); the CI regression gate."""
    with handled():
        limit = _finite(parse_regression(max_regression), "--max-regression", None)
        _finite(min_seconds, "--min-seconds")
        src = model.resolve()
        opt_path = optimized / "model.onnx" if optimized and optimized.is_dir() else optimized
        check_side_outputs(
            {"--save-baseline": save_baseline, "--junit": junit},
            models=[src] + ([opt_path] if opt_path else []),
            files=[inputs] if inputs else [],
            dirs=[optimized] if optimized and optimized.is_dir() else [],
        )
        with _progress(quiet) as say:
            say("loading")
            original = load_model(model)
            if opt_path is None:
                opt_model, _ = run_optimize(
                    original, target=target, level=level, check=False, progress=say
                )
            else:
                opt_model = load_model(opt_path)
            say(f"measuring latency (interleaved, at least {min_seconds:g}s)")
            result = measure(
                original,
                opt_model,
                runs=runs,
                warmup=warmup,
                threads=threads,
                level=ort_level,
                shapes=parse_shapes(shape),
                inputs=_load_feeds(inputs, original),
                min_seconds=min_seconds,
            )
        if baseline:
            result = apply_baseline(result, baseline, limit)
        if save_baseline:
            _atomic_text(
                save_baseline,
                json.dumps(baseline_payload(result, str(model), target), indent=2, sort_keys=True),
            )
        if junit:
            _atomic_text(junit, _bench_junit(model.stem, result))
        if fmt == Format.json:
            print(json.dumps(result.to_dict(), indent=2, sort_keys=True))
        else:
            _render_bench(result)
        if result.regressed:
            raise typer.Exit(errors.EXIT_PERF)


@app.command()
def gate(
    model: Annotated[Path, typer.Argument(help="Model to gate (never modified).")],
    target: Annotated[str, TARGET] = "cpu",
    level: Annotated[int, typer.Option("-O", "--level", min=0, max=3)] = 2,
    pipeline: Annotated[
        str | None, typer.Option("--pipeline", help="Pipeline text (overrides -O).")
    ] = None,
    expect: Annotated[
        list[str] | None,
        typer.Option("--expect", help='Op-count assertions, e.g. "FusedConv>=10" (exit 4).'),
    ] = None,
    baseline: Annotated[
        Path | None,
        typer.Option("--baseline", help="Gate baseline to compare with (exit 5 on regression)."),
    ] = None,
    save_baseline: Annotated[
        Path | None,
        typer.Option(
            "--save-baseline",
            help="Write this run's latency as the baseline (refused, exit 4, when its interval "
            "is wider than --max-regression).",
        ),
    ] = None,
    max_regression: Annotated[
        str,
        typer.Option(
            "--max-regression",
            help="Allowed slowdown of optimized/original vs the baseline, e.g. 5%.",
        ),
    ] = "5%",
    max_seconds: Annotated[
        float,
        typer.Option("--max-seconds", help="Longest the latency measurement may take."),
    ] = 60.0,
    threads: Annotated[
        int, typer.Option("--threads", min=1, max=MAX_THREADS, help="intra-op threads.")
    ] = 1,
    shape: Annotated[list[str] | None, SHAPE] = None,
    inputs: Annotated[Path | None, INPUTS] = None,
    seed: Annotated[int, SEED] = 0,
    tolerance: Annotated[
        list[str] | None,
        typer.Option("--tolerance", help="OUTPUT=RTOL,ATOL overriding the dtype default."),
    ] = None,
    junit: Annotated[Path | None, typer.Option("--junit", help="Write JUnit XML.")] = None,
    fmt: Annotated[Format, FORMAT] = Format.text,
    quiet: Annotated[bool, QUIET_PROGRESS] = False,
    debug: Annotated[bool, DEBUG] = False,
) -> None:
    """The CI gate in one call: optimize, parity, --expect, latency against a baseline, JUnit.

    Latency is the median of optimized/original over interleaved rounds with a 95 % interval,
    measured until the interval is narrower than --max-regression.  Exit 3 parity, 4 target /
    expectations / an interval too wide to save, 5 the whole interval regressed past the limit.
    Writes nothing but --junit and --save-baseline."""
    with handled():
        limit = _finite(parse_regression(max_regression), "--max-regression")
        if limit <= 0:
            raise errors.UsageError("--max-regression must be above 0 (e.g. 5%)")
        _finite(max_seconds, "--max-seconds")
        src = model.resolve()
        check_side_outputs(
            {"--save-baseline": save_baseline, "--junit": junit},
            models=[src],
            files=[f for f in (inputs, baseline) if f],
        )
        expectations = parse_expectations(expect)
        feeds = _load_feeds(inputs, src)
        with _progress(quiet) as say:
            optimized, report = run_optimize(
                src,
                target=target,
                level=level,
                pipeline=pipeline,
                check=True,
                shapes=parse_shapes(shape),
                inputs=feeds,
                seed=seed,
                progress=say,
                output_tolerances=parse_tolerances(tolerance),
            )
            results = evaluate_expectations(
                _resolve_expectations(expectations, report, target), report.ops_after
            )
            code, reason = _verdict(report, results, checked=True)
            latency = None
            if code == errors.EXIT_OK:
                say("latency: paired interleaved rounds")
                latency = _gate_latency(
                    src, optimized, report, feeds, seed, (threads, limit, max_seconds), say
                )
        verdict = _gate_verdict(latency, baseline, save_baseline, limit, code, reason)
        if save_baseline and verdict.get("baseline_payload"):
            payload = {"model": str(model), "target": target, **verdict["baseline_payload"]}
            _atomic_text(save_baseline, json.dumps(payload, indent=2, sort_keys=True))
        if junit:
            parities = [report.parity] + ([report.parity_float64] if report.parity_float64 else [])
            case = {"text": verdict["line"], "failure": verdict["failure"]} if latency else None
            _atomic_text(junit, junit_xml(f"graphopt.gate.{model.stem}", parities, results, case))
        _render_gate(report, results, latency, verdict, fmt, model)
        if verdict["code"]:
            err.print(f"error: {verdict['reason']}", soft_wrap=True)
            raise typer.Exit(verdict["code"])


def _gate_latency(src, optimized, report, feeds, seed, budget, say):
    """Sessions as `bench` builds them (ORT_ENABLE_ALL, CPU) on parity's input sizes."""
    threads, limit, max_seconds = budget
    from .opt.bench import _session
    from .opt.parity import Session, make_inputs

    original = load_model(src)
    shapes = dict(report.parity.inputs or {})
    inputs = make_inputs(Session(original).sess, shapes, seed, feeds)
    runs = []
    for m, which in ((original, "original"), (optimized, "optimized")):
        sess, _ = _session(m, "all", threads, which)
        names = {i.name for i in sess.get_inputs()}
        f = {k: v for k, v in inputs.items() if k in names}
        sess.run(None, f)  # warm-up
        runs.append(lambda s=sess, f=f: s.run(None, f))
    return paired_rounds(*runs, precision=limit, max_seconds=max_seconds, progress=say)


def _gate_verdict(latency, baseline, save_baseline, limit, code, reason) -> dict:
    """The gate's exit code and lines: the optimize verdict first, then the latency."""
    verdict = {"code": code, "reason": reason, "line": "", "failure": None}
    if latency is None:
        return verdict
    verdict["line"] = (
        f"optimized/original {latency.ratio:.3f} [{latency.low:.3f}, {latency.high:.3f}] "
        f"({latency.rounds} paired rounds, {latency.seconds:.1f}s)"
    )
    if baseline:
        cmp = compare_baseline(latency, baseline, limit)
        verdict["comparison"] = cmp
        verdict["line"] += (
            f"; vs baseline {cmp['baseline_ratio']:.3f}: {cmp['change']:+.1%} "
            f"[{cmp['change_low']:+.1%}, {cmp['change_high']:+.1%}] (limit {limit:.1%})"
        )
        if cmp["regressed"]:
            verdict["failure"] = f"latency regression: {verdict['line']}"
            verdict.update(code=errors.EXIT_PERF, reason=verdict["failure"])
            return verdict
    if save_baseline:
        try:
            verdict["baseline_payload"] = gate_baseline(latency, limit)
        except IntervalTooWide as e:
            verdict.update(code=e.exit_code, reason=str(e), failure=str(e))
    return verdict


def _render_gate(report, results, latency, verdict, fmt, model) -> None:
    if fmt == Format.json:
        payload = {
            "schema": "graphopt.gate/1",
            "model": str(model),
            "exit_code": verdict["code"],
            "reason": verdict["reason"],
            "report": report.to_dict(),
            "expectations": [e.to_dict() for e in results],
            "latency": latency.to_dict() if latency else None,
            "comparison": verdict.get("comparison"),
        }
        print(json.dumps(payload, indent=2, sort_keys=True, default=float))
        return
    parity = report.parity
    out.print(
        f"[bold]{model}[/] → {report.target}: parity "
        + ("[green]ok[/]" if parity.ran and parity.ok else "[red]not ok[/]")
        + f", {report.nodes_before} → {report.nodes_after} nodes",
        soft_wrap=True,
    )
    for e in results:
        mark = "[green]ok[/]" if e.ok else "[red]FAILED[/]"
        out.print(f"expect {e.text}: {mark} (found {e.actual})")
    if latency is not None:
        out.print(f"latency: {verdict['line']}", soft_wrap=True)
    if not verdict["code"]:
        out.print("[green]gate passed[/]")


def _bench_junit(name: str, result) -> str:
    from xml.sax.saxutils import quoteattr

    if result.regression is None:
        body = ""
    elif result.regressed:
        msg = (
            f"normalized p95 {result.ratio_p95:.3f} is {result.regression:+.1%} vs baseline "
            f"(limit {result.max_regression:.1%})"
        )
        body = f"<failure message={quoteattr(msg)}/>"
    else:
        body = ""
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f'<testsuite name="graphopt.bench" tests="1" failures="{int(result.regressed)}">\n'
        f'  <testcase classname="graphopt.bench" name={quoteattr(name)}>{body}</testcase>\n'
        "</testsuite>\n"
    )


def _render_bench(result) -> None:
    t = Table(
        title=f"latency (onnxruntime {result.level}, {result.threads} thread(s), "
        f"{result.original.runs} interleaved runs)",
        show_edge=False,
    )
    for col in ("model", "p50 ms", "p95 ms", "session ms"):
        t.add_column(col, justify="left" if col == "model" else "right")
    for name, lat in (("original", result.original), ("optimized", result.optimized)):
        t.add_row(name, f"{lat.p50_ms:.3f}", f"{lat.p95_ms:.3f}", f"{lat.session_ms:.1f}")
    out.print(t)
    out.print(f"optimized / original: p50 {result.ratio_p50:.3f}, p95 {result.ratio_p95:.3f}")
    if result.regression is not None:
        verdict = "[red]REGRESSION[/]" if result.regressed else "[green]ok[/]"
        out.print(
            f"vs baseline: {result.regression:+.1%} (limit {result.max_regression:.1%}) {verdict}"
        )


@app.command()
def rules(
    fmt: Annotated[Format, FORMAT] = Format.text, debug: Annotated[bool, DEBUG] = False
) -> None:
    """List every rule and pass with its level and one line."""
    rows = [
        {"name": r.name, "kind": "rule", "root": r.root, "level": r.level, "summary": r.summary}
        for r in RULES.values()
    ]
    rows += [
        {"name": p.name, "kind": "pass", "root": "", "level": p.level, "summary": p.summary}
        for p in PASSES.values()
    ]
    rows.sort(key=lambda r: (r["level"], r["kind"], r["name"]))
    if fmt == Format.json:
        print(json.dumps(rows, indent=2))
        return
    t = Table(show_edge=False)
    for col in ("name", "kind", "root", "level", "summary"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["name"], r["kind"], r["root"], f"O{r['level']}", r["summary"])
    out.print(t)
    out.print("levels: " + "; ".join(f"O{k} {v}" for k, v in LEVEL_NAMES.items()))


@app.command()
def targets(
    action: Annotated[
        str | None, typer.Argument(help="'show' to print one target's profile and kernel table.")
    ] = None,
    name: Annotated[str | None, typer.Argument(help="The target to show.")] = None,
    fmt: Annotated[Format, FORMAT] = Format.text,
    debug: Annotated[bool, DEBUG] = False,
) -> None:
    """List the targets; `targets show NAME` prints one target's profile and kernel table."""
    with handled():
        if action is not None:
            if action != "show" or not name:
                raise errors.UsageError("usage: graphopt targets [show NAME]")
            from .targets.describe import describe_target

            data = describe_target(name)
            if fmt == Format.json:
                print(json.dumps(data, indent=2, sort_keys=True))
            else:
                _render_target(data)
            return
    rows = [
        {
            "name": t.name,
            "description": t.description,
            "runtime": t.runtime,
            "kernels": t.kernels_source,
            "device_available": t.device_available,
        }
        for t in TARGETS.values()
    ]
    if fmt == Format.json:
        print(json.dumps(rows, indent=2))
        return
    t = Table(show_edge=False)
    for col in ("name", "description", "kernels", "device here"):
        t.add_column(col, overflow="fold")
    for r in rows:
        t.add_row(
            r["name"], r["description"], r["kernels"], "yes" if r["device_available"] else "no"
        )
    out.print(t)


def _render_target(data: dict) -> None:
    p = data["profile"]
    out.print(f"[bold]{data['name']}[/]: {p['description']}")
    for key in (
        "runtime",
        "runtime_version",
        "providers",
        "kernels_source",
        "layout",
        "static_shapes",
        "fallback",
        "approximations",
        "disabled_rules",
        "session",
    ):
        out.print(f"  {key}: {p[key]}")
    for key, value in p["prefers"].items():
        why = p["prefers_why"].get(key)
        out.print(f"  prefers {key}: {value}" + (f"  ({why})" if why else ""))
    for op, why in p["measured_slower"].items():
        out.print(f"  slower: {op}  ({why})")
    for op, (bound, why) in p["slower_below"].items():
        out.print(f"  slower below {bound}: {op}  ({why})")
    out.print(f"  tolerances: {p['tolerances']}")
    doc = data.get("document") or {}
    if doc:
        out.print(f"  source: {doc.get('source')}; commit: {doc.get('commit')}")
    t = Table(title=f"{len(data['kernels'])} kernels", show_edge=False)
    for col in ("op", "domain", "opsets", "types", "restrictions"):
        t.add_column(col, overflow="fold")
    for k in data["kernels"]:
        t.add_row(
            k["op"],
            k["domain"] or "ai.onnx",
            f"{k['since']}+" if k["end"] is None else f"{k['since']}-{k['end']}",
            ", ".join(x.removeprefix("tensor(").removesuffix(")") for x in k["types"]),
            k.get("restrictions") or "",
        )
    out.print(t)


@app.command()
def run(
    bundle: Annotated[Path, typer.Argument(help="A bundle directory written by `optimize`.")],
    inputs: Annotated[
        Path | None,
        typer.Option(
            "--inputs",
            help=".npz of inputs (default: the bundle's golden inputs, "
            "compared with its golden outputs).",
        ),
    ] = None,
    output: Annotated[
        Path | None, typer.Option("-o", "--output", help="Write the outputs to this .npz.")
    ] = None,
    provider: Annotated[
        list[str] | None,
        typer.Option(
            "--provider",
            help="Override the bundle's providers (repeatable), e.g. "
            "CPUExecutionProvider to run a cuda/npu bundle's semantics on CPU.",
        ),
    ] = None,
    repeat: Annotated[int, typer.Option("--repeat", min=1, help="Runs (timed).")] = 1,
    verify: Annotated[
        Verify,
        typer.Option(
            "--verify",
            help="Integrity of the model files: fingerprint (size and sampled blocks), full "
            "(every byte against the sha256 taken when the bundle was written) or none.",
        ),
    ] = Verify.fingerprint,
    portable: Annotated[
        bool,
        typer.Option(
            "--portable",
            help="Run the portable model.onnx even where the machine-specific fast path applies.",
        ),
    ] = False,
    fmt: Annotated[Format, FORMAT] = Format.text,
    debug: Annotated[bool, DEBUG] = False,
) -> None:
    """Run a bundle with onnxruntime exactly as its manifest and session config say (on the
    machine that wrote it, its machine-specific fast path)."""
    with handled():
        from .targets.bundle import describe_value, providers_problem, read_bundle, run_bundle

        folder, manifest, _ = read_bundle(bundle)
        why = None if provider else providers_problem(folder)
        if why:
            raise errors.UsageError(
                f"the {manifest.get('target')} bundle {why}; add --provider "
                "CPUExecutionProvider to run its semantics on this machine's CPU"
            )
        check_side_outputs({"-o": output}, files=[inputs] if inputs else [], dirs=[folder])
        feeds = _load_feeds(inputs, folder / "model.onnx") if inputs else None
        result = run_bundle(
            bundle,
            feeds,
            providers=provider or None,
            repeat=repeat,
            verify=verify.value,
            fast_path=not portable,
        )
        if output:
            import numpy as np

            try:
                atomic_write(output, lambda f: np.savez(f, **result["outputs"]))
            except OSError as e:
                raise errors.ModelSaveError(f"cannot write {output}: {e.strerror or e}") from None
        summary = {
            "bundle": result["bundle"],
            "target": result["target"],
            "providers": result["providers"],
            "outputs": {k: describe_value(v) for k, v in result["outputs"].items()},
            "session_create_ms": result["session_create_ms"],
            "session": result["session"],
            "run_ms": result["run_ms"],
            "golden": result["golden"],
        }
        if fmt == Format.json:
            print(json.dumps(summary, indent=2, sort_keys=True, default=float))
        else:
            out.print(
                f"[bold]{summary['bundle']}[/] ({summary['target']}) on "
                f"{', '.join(summary['providers'])}: session {summary['session_create_ms']} ms, "
                f"run {', '.join(f'{t:.2f}' for t in summary['run_ms'][:5])} ms"
            )
            how = summary["session"]
            out.print(
                f"  model: {how['model']} "
                + (
                    "(machine-specific fast path, optimizations off)"
                    if how["fast_path"]
                    else f"at {how['level']} (fast path not used: {how['why']})"
                )
                + f"; integrity checked: {how['verify']}",
                soft_wrap=True,
            )
            for k, v in summary["outputs"].items():
                out.print(f"  {k}: {v['dtype']} {v['shape']}")
            if result["golden"] is not None:
                g = result["golden"]
                worst = max((d["max_abs"] for d in g["outputs"]), default=0.0)
                out.print(
                    "golden outputs: "
                    + ("[green]match[/]" if g["ok"] else "[red]DIFFER[/]")
                    + f" (max abs {worst:.3g})"
                )
        if result["golden"] is not None and not result["golden"]["ok"]:
            raise typer.Exit(errors.EXIT_PARITY)


if __name__ == "__main__":  # pragma: no cover
    app()
