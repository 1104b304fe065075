"""The ``graphopt`` command line: parse flags, call the library, render, map verdicts to exit codes.

Each command is a list of flags (declared once in :mod:`graphopt.flags`) and a short body: the
work is the library's (optimize, bundle, parity, bisect, explain, lint, bench, gate, verdict),
what is printed is :mod:`graphopt.render`'s, progress is :mod:`graphopt.progress`'s.

Exit codes (stable): 0 ok, 1 error, 2 usage, 3 parity failed, 4 target cannot run the model /
did not converge, 5 performance regression, 130 interrupted (Ctrl-C).  Errors are one line on
stderr; ``--debug`` (before or after the command) shows the traceback.  Long phases report
progress on stderr: a live status on a terminal, otherwise a timestamped line for each phase
still running after ``GRAPHOPT_PROGRESS_AFTER`` seconds (default 2); ``--quiet`` turns both off.
"""

from __future__ import annotations

import gc
import json
import math
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Annotated

import typer
from typer import Argument, Exit, Option

from . import __version__, _interrupt, flags, render
from .flags import STATE, TARGET, Format, Reference
from .progress import progress
from .render import err, print_json

__all__ = ["TARGET", "app", "console"]  # TARGET: the --target option (its help names every target)

app = typer.Typer(
    name="graphopt",
    help="Optimize ONNX models for a target, prove parity, explain every rewrite.",
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _show_version(value: bool) -> None:
    if value:
        print(f"graphopt {__version__}")
        raise Exit()


@app.callback()
def main(
    debug: Annotated[bool, Option("--debug", help="Show tracebacks.")] = False,
    version: Annotated[
        bool,
        Option(
            "--version", help="Print the version and exit.", callback=_show_version, is_eager=True
        ),
    ] = False,
) -> None:
    STATE["debug"] = debug


@contextmanager
def handled() -> Iterator[None]:
    """Turn GraphoptError (and unexpected errors) into one line + exit code."""
    from .opt import errors

    try:
        yield
    except errors.GraphoptError as e:
        if STATE["debug"]:
            raise
        err.print(render.styled(("error:", "bold red"), f" {e}"), soft_wrap=True)
        raise Exit(e.exit_code) from None
    except (KeyboardInterrupt, Exit):
        raise
    except MemoryError:
        if STATE["debug"]:
            raise
        err.print(_out_of_memory(), soft_wrap=True)
        raise Exit(errors.EXIT_ERROR) from None
    except Exception as e:  # noqa: BLE001 - last resort: one line, never a traceback by default
        if STATE["debug"]:
            raise
        err.print(
            render.styled(
                ("internal error:", "bold red"), f" {type(e).__name__}: {e} (rerun with --debug)"
            ),
            soft_wrap=True,
        )
        raise Exit(errors.EXIT_ERROR) from None


def _finite(value: float, flag: str, lo: float | None = 0.0, hi: float | None = None) -> float:
    """A flag's number must be finite (and at least ``lo``, at most ``hi``)."""
    from .opt import errors

    if not math.isfinite(value) or (lo is not None and value < lo):
        bound = f"a finite number >= {lo:g}" if lo is not None else "a finite number"
        raise errors.UsageError(f"{flag} must be {bound} (got {value})")
    if hi is not None and value > hi:
        raise errors.UsageError(f"{flag} must be at most {hi:g} (got {value:g})")
    return value


#: MiB: more than any machine holds (a bound that keeps the flag's bytes an integer)
_MAX_MIB = float(2**30)


def _feeds(inputs: Path | None, model):
    """``--inputs`` read for ``model`` (a path or a proto), or None."""
    from .opt.verify.feeds import read_feeds

    return read_feeds(inputs, model) if inputs is not None else None


def _write_remarks(path: Path, remarks: list) -> None:
    """``--remarks``: the remark objects as JSON lines."""
    from .opt.graph.io import atomic_write_text

    text = "".join(json.dumps(r.to_dict(), sort_keys=True) + "\n" for r in remarks)
    atomic_write_text(path, text)


def _exit(code: int, reason: str) -> None:
    """The verdict's one line on stderr (even with --quiet or --format json) and its code."""
    if code:
        render.error(reason)
        raise Exit(code)


# ------------------------------------------------------------------ optimize
@app.command()
def optimize(
    model: Annotated[Path, Argument(readable=False, help="Input .onnx model (never modified).")],
    output: flags.BundleDir = None,
    target: flags.Target = "cpu",
    level: flags.OptLevel = 2,
    pipeline: flags.PipelineText = None,
    fmt: flags.Fmt = Format.text,
    debug: flags.Debug = False,
    shape: flags.ParityShapes = None,
    inputs: flags.ParityInputs = None,
    no_check: flags.NoCheck = False,
    no_measure: flags.NoMeasure = False,
    keep_initializer_inputs: flags.KeepInitializerInputs = False,
    seed: flags.Seed = 0,
    bisect_limit: flags.BisectLimit = None,
    verify_each: flags.VerifyEach = False,
    fold_size_limit: flags.FoldSizeLimit = 1.0,
    remarks: flags.RemarksOut = None,
    reference: flags.ParityReference = Reference.original,
    tolerance: flags.Tolerances = None,
    expect: flags.Expect = None,
    junit: flags.JUnit = None,
    html_report: flags.HtmlOut = None,
    quiet: flags.QuietAll = False,
    kernels: flags.Kernels = None,
    opset: flags.Opset = None,
    weights: flags.Weights = None,
    decoder_steps: flags.DecoderStepsFlag = None,
    machine_tier: flags.MachineTier = True,
    strict_fallback: flags.StrictFallback = False,
    profile: flags.OptimizeProfile = False,
    profile_runs: flags.OptimizeProfileRuns = 10,
) -> None:
    """Optimize MODEL for a target; write OUT_DIR/model.onnx and OUT_DIR/report.json."""
    from .opt import errors
    from .opt.clock import Clock
    from .opt.graph.io import atomic_write_text, check_output_dir, check_side_outputs
    from .opt.graph.spool import SpoolDir
    from .opt.optimizer import optimize as run_optimize
    from .opt.optimizer import sparse_collection
    from .opt.report.report_html import render_html
    from .opt.verify import gate as ci
    from .opt.verify import verdict as verdicts
    from .opt.verify.parity import parse_shapes, parse_tolerances
    from .targets.bundle import BUNDLE_KIND, default_bundle_dir, protected_paths, write_bundle
    from .targets.codegen import kernel_pipeline

    with handled(), sparse_collection():  # writing the bundle of a large graph too
        clock = Clock.since_process_start()  # report.seconds: every phase of the wait
        src = model.resolve()
        with suppress(OSError):  # a missing file is said below
            _fit_malloc(os.path.getsize(src))
        out = output or default_bundle_dir(model, target)
        # the input's external-data files exist: only an output that exists can be or hold one
        # (listing them reads the file; write_bundle checks them again, once it is read)
        early = protected_paths(src) if os.path.lexists(out) else [src]
        dest = check_output_dir(out, BUNDLE_KIND, early)
        side = {"--remarks": remarks, "--junit": junit, "--html": html_report}
        check_side_outputs(side, models=[src], files=[inputs] if inputs else [], dirs=[dest])
        fold_limit = _finite(fold_size_limit, "--fold-size-limit", hi=_MAX_MIB)
        expectations = ci.parse_expectations(expect)
        shapes = parse_shapes(shape)
        feeds = _feeds(inputs, src)
        custom = pipeline is not None
        if not machine_tier and kernels:
            raise errors.UsageError(
                "--kernels builds generated kernels, part of the machine tier that "
                "--no-machine-tier leaves out: give one of the two"
            )
        pipeline = kernel_pipeline(target, level, pipeline, kernels if machine_tier else False)
        with progress(quiet) as say, SpoolDir.beside(dest) as spool:
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
                options={"fold_size_limit": int(fold_limit * 2**20)}
                | ({"weights": weights.value} if weights else {})
                | ({"decoder_steps": decoder_steps.value} if decoder_steps else {})
                | ({"strict_fallback": True} if strict_fallback else {}),
                progress=say,
                reference=reference.value,
                output_tolerances=parse_tolerances(tolerance),
                opset=opset,
                clock=clock,
                spool=spool,  # the output is written once, beside the bundle: moved in
                in_place=True,  # large weights stay in the input file until written
                keep_weight_inputs=keep_initializer_inputs,
            )
            expectations = verdicts.resolve_report_expectations(expectations, report, target)
            say("writing the bundle")
            protected = protected_paths(src)  # the input and its data files, as read
            write_bundle(
                optimized,
                report,
                dest,
                protected=protected,
                progress=say,
                fast_path=None if machine_tier else False,
            )
            if profile:
                say("profiling the bundle")
                _add_profile(dest, profile_runs)
        if remarks:
            _write_remarks(remarks, report.remarks)
        results = ci.evaluate_expectations(expectations, report.ops_after)
        payload = _written_report(dest, report, results)
        if junit:
            suite = f"graphopt.optimize.{model.stem}"
            atomic_write_text(junit, ci.junit_xml(suite, verdicts.parities(report), results))
        if html_report:
            atomic_write_text(html_report, render_html(payload, _manifest(dest)))
        if fmt == Format.json:
            print_json(payload)
        elif not quiet:
            render.render_report(report, custom_pipeline=custom)
            render.render_expectations(results)
            if payload.get("profile"):
                render.render_profile_brief(payload["profile"])
        _conclude(report, results, checked=not no_check)


#: the hottest nodes ``optimize --profile`` keeps in report.json (the op, region and missed
#: tables are whole)
REPORT_PROFILE_NODES = 20


def _add_profile(bundle: Path, runs: int) -> None:
    """``optimize --profile``: profile the written bundle as ``graphopt profile`` does and add
    the numbers to its report.json; a bundle this machine cannot profile gets the reason."""
    from .opt import errors
    from .opt.graph.io import atomic_write_text
    from .targets.bundle import dumps_json

    path = bundle / "report.json"
    try:
        summary, _, _ = _profile_bundle(bundle, None, None, None, runs)
        summary["model"] = str(bundle)
        summary["nodes"] = summary["nodes"][:REPORT_PROFILE_NODES]
        summary["ran"] = True
    except errors.GraphoptError as e:
        summary = {"schema": "graphopt.profile/1", "ran": False, "why": str(e)}
        render.warn(f"--profile: not profiled: {e}")
    data = json.loads(path.read_text())
    data["profile"] = summary
    atomic_write_text(path, dumps_json(data))


def _written_report(bundle: Path, report, results: list) -> dict:
    """The report.json the bundle holds (the report and what the bundle phase added to it),
    with the ``--expect`` results."""
    try:
        payload = json.loads((bundle / "report.json").read_text())
    except (OSError, ValueError):
        payload = report.to_dict()
    if results:
        payload["expectations"] = [e.to_dict() for e in results]
    return payload


def _manifest(bundle: Path) -> dict | None:
    path = bundle / "manifest.json"
    return json.loads(path.read_text()) if path.exists() else None


def _conclude(report, results: list, checked: bool) -> None:
    """Warnings a run still owes, then the verdict's line and exit code."""
    from .opt.verify import verdict as verdicts

    for line in verdicts.safety_net_warnings(report) + verdicts.fallback_warnings(report):
        render.warn(line)
    verdict = verdicts.decide(report, results, checked=checked)
    if not verdict.parity_not_run:
        for line in verdicts.parity_not_run_warnings(report, checked=checked):
            render.warn(line)
    _exit(verdict.code, verdict.reason)


# ------------------------------------------------------------------ check, bisect
@app.command()
def check(
    original: Annotated[Path, Argument(readable=False, help="Reference model.")],
    optimized: Annotated[
        Path, Argument(readable=False, help="Model to compare (a file or a bundle dir).")
    ],
    shape: flags.Shapes = None,
    inputs: flags.Inputs = None,
    seed: flags.Seed = 0,
    reference: flags.CheckReference = Reference.original,
    tolerance: flags.Tolerances = None,
    fmt: flags.Fmt = Format.text,
    quiet: flags.Quiet = False,
    debug: flags.Debug = False,
) -> None:
    """Compare two models' outputs with onnxruntime; exit 3 when they differ."""
    from .opt import errors
    from .opt.graph.io import load_model
    from .opt.numerics.reference import upcast_to_float64
    from .opt.rewrite.target import TARGETS
    from .opt.verify.parity import check_parity, parse_shapes, parse_tolerances

    with handled():
        if optimized.is_dir():
            optimized = optimized / "model.onnx"
        with progress(quiet) as say:
            say("loading the models")  # external weights stay on disk, mapped when run
            ref_model = load_model(original, lazy_external=True)
            opt_model = load_model(optimized, lazy_external=True)
        kw = dict(
            shapes=parse_shapes(shape),
            inputs=_feeds(inputs, ref_model),
            seed=seed,
            per_output=parse_tolerances(tolerance),
            base_dir=original.resolve().parent,
            optimized_base_dir=optimized.resolve().parent,
        )
        results = []
        with progress(quiet) as say:
            if reference in (Reference.original, Reference.both):
                say("parity vs the original: running both models")
                results.append(check_parity(ref_model, opt_model, **kw))
            if reference in (Reference.float64, Reference.both):
                say("parity vs a float64 upcast of the original")
                f64 = upcast_to_float64(ref_model, TARGETS["cpu"], kw["base_dir"])
                kw.update(reference=f64, reference_name="float64")
                results.append(check_parity(ref_model, opt_model, **kw))
        if fmt == Format.json:
            payload = [p.to_dict() for p in results]
            print_json(payload[0] if len(payload) == 1 else payload)
        else:
            for p in results:
                render.render_parity(p)
        if not all(p.ok for p in results):
            failed = sorted({d.name for p in results for d in p.outputs if not d.ok})
            why = next((p.error for p in results if p.error), None)
            said = f"outputs: {', '.join(failed)}" if failed else why or "parity did not run"
            sys.stderr.write(f"error: parity failed ({said})\n")
            raise Exit(errors.EXIT_PARITY)


@app.command()
def bisect(
    model: Annotated[
        Path, Argument(readable=False, help="Model whose optimization breaks parity.")
    ],
    output: flags.BisectDir = None,
    target: flags.Target = "cpu",
    level: flags.Level = 2,
    pipeline: flags.Pipeline = None,
    shape: flags.Shapes = None,
    inputs: flags.Inputs = None,
    seed: flags.Seed = 0,
    fmt: flags.Fmt = Format.text,
    quiet: flags.Quiet = False,
    debug: flags.Debug = False,
) -> None:
    """Find the first rewrite that breaks parity (binary search on --bisect-limit).

    Exit 3 when a culprit is found (parity is broken), 0 when parity holds."""
    from .opt import errors
    from .opt.bisect import (
        BISECT_KIND,
        default_bisect_dir,
        write_bisect_result,
    )
    from .opt.bisect import (
        bisect as run_bisect,
    )
    from .opt.graph.io import check_output_dir, load_model
    from .opt.verify.parity import parse_shapes
    from .targets.bundle import protected_paths

    with handled():
        protected = protected_paths(model.resolve())
        dest = check_output_dir(output or default_bisect_dir(model), BISECT_KIND, protected)
        with progress(quiet) as say:
            result = run_bisect(
                load_model(model),
                target=target,
                level=level,
                pipeline=pipeline,
                shapes=parse_shapes(shape),
                inputs=_feeds(inputs, model),
                seed=seed,
                progress=say,
            )
        payload = write_bisect_result(result, dest, protected)
        if fmt == Format.json:
            print_json(payload)
        else:
            render.render_bisect(result, payload)
        if result.found:
            raise Exit(errors.EXIT_PARITY)


# ------------------------------------------------------------------ explain, lint
@app.command()
def explain(
    model: Annotated[Path, Argument(readable=False, help="Model to explain.")],
    target: flags.Target = "cpu",
    level: flags.Level = 2,
    pipeline: flags.Pipeline = None,
    rule: flags.RuleFilter = None,
    node: flags.NodeFilter = None,
    code: flags.CodeFilter = None,
    op: flags.OpFilter = None,
    shape: flags.Shapes = None,
    inputs: flags.Inputs = None,
    remarks: flags.RemarksJsonl = None,
    fmt: flags.Fmt = Format.text,
    quiet: flags.Quiet = False,
    debug: flags.Debug = False,
) -> None:
    """Which rules fired where, which were refused where and why (with a hint for the fix).

    A --rule, --node, --code or --op that names nothing exits 2 with the nearest names."""
    from .opt.graph.io import check_side_outputs, load_model
    from .opt.optimizer import optimize as run_optimize
    from .opt.report.explain import (
        check_filters,
        check_rule,
        node_ops,
        resolve_explain_op,
    )
    from .opt.report.explain import (
        explain as explain_report,
    )
    from .opt.verify.parity import parse_shapes

    with handled():
        src = model.resolve()
        check_side_outputs({"--remarks": remarks}, models=[src], files=[inputs] if inputs else [])
        check_rule(rule)
        with progress(quiet) as say:
            optimized, report = run_optimize(
                src,
                target=target,
                level=level,
                pipeline=pipeline,
                check=False,
                shapes=parse_shapes(shape),
                inputs=_feeds(inputs, src),
                progress=say,
            )
        original = load_model(src, check=False, lazy_external=True)
        ops = node_ops(optimized, original)  # the original's names win
        check_filters(report, ops, node=node, code=code)
        op = resolve_explain_op(op, report) if op is not None else None
        data = explain_report(report, rule=rule, node=node, code=code, op=op, node_ops=ops)
        if remarks:
            _write_remarks(remarks, report.remarks)
        if fmt == Format.json:
            print_json(data)
            return
        render.render_explain(data)


@app.command()
def lint(
    model: Annotated[Path, Argument(readable=False, help="Model to lint.")],
    freeze_initializers: flags.FreezeInitializers = False,
    output: flags.FrozenOut = None,
    target: flags.Target = "cpu",
    fmt: flags.Fmt = Format.text,
    quiet: flags.Quiet = False,
    debug: flags.Debug = False,
) -> None:
    """Pitfalls of real exports (weights as inputs, custom domains, fp16 saturation...), each
    with its fix."""
    from .opt import errors
    from .opt.graph.io import check_side_outputs, load_model, save_model
    from .opt.optimizer import optimize as run_optimize
    from .opt.report.lint import freeze_initializers as freeze_model
    from .opt.report.lint import lint as lint_model
    from .opt.rewrite.target import get_target

    with handled():
        get_target(target)  # an unknown target is a usage error, not "no findings"
        dest = None
        if freeze_initializers:
            dest = (output or model.with_name(f"{model.stem}.frozen.onnx")).resolve()
            check_side_outputs(
                {"-o": dest, "-o (its external data)": dest.with_name(dest.name + ".data")},
                models=[model.resolve()],
            )
        with progress(quiet) as say:
            say("loading")
            proto = load_model(model, check=False)
            try:
                _, report = run_optimize(proto, target=target, check=False, progress=say)
                missed = [r for r in report.remarks if r.kind == "missed"]
            except errors.GraphoptError:
                missed = []
            except Exception:
                _refuse_invalid(proto, model)
                raise
            say("linting")
            try:
                findings = lint_model(proto, missed_remarks=missed)
            except Exception:
                _refuse_invalid(proto, model)
                raise
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
            print_json(payload)
            return
        render.render_lint(payload, findings)


def _refuse_invalid(proto, path: Path) -> None:
    """``lint`` reads a model without onnx's checker (to point at what it would refuse, too);
    where the model is too broken to look at (a cycle, a recursive function, raw data of the
    wrong size), the checker's reason is the error (exit 1).  Returns when the checker accepts
    the model (the caller raises what it caught)."""
    from .opt.graph.io import validate

    validate(proto, path)


# ------------------------------------------------------------------ bench, gate
@app.command()
def bench(
    model: Annotated[Path, Argument(readable=False, help="Original model.")],
    optimized: flags.OptimizedModel = None,
    target: flags.Target = "cpu",
    level: flags.Level = 2,
    runs: flags.Runs = 100,
    warmup: flags.Warmup = 10,
    threads: flags.Threads = 1,
    ort_level: flags.OrtLevel = "all",
    shape: flags.Shapes = None,
    inputs: flags.Inputs = None,
    baseline: flags.BenchBaseline = None,
    save_baseline: flags.BenchSaveBaseline = None,
    max_regression: flags.BenchMaxRegression = "5%",
    min_seconds: flags.MinSeconds = 2.0,
    junit: flags.BenchJUnit = None,
    fmt: flags.Fmt = Format.text,
    quiet: flags.Quiet = False,
    debug: flags.Debug = False,
) -> None:
    """p50/p95 latency of original and optimized (interleaved); the CI regression gate."""
    from .opt import errors
    from .opt.graph.io import atomic_write_text, check_side_outputs, load_model
    from .opt.optimizer import optimize as run_optimize
    from .opt.verify import gate as ci
    from .opt.verify.bench import apply_baseline, baseline_payload, measure, parse_regression
    from .opt.verify.parity import parse_shapes

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
        with progress(quiet) as say:
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
                inputs=_feeds(inputs, original),
                min_seconds=min_seconds,
            )
        if baseline:
            result = apply_baseline(result, baseline, limit)
        if save_baseline:
            saved = baseline_payload(result, str(model), target)
            atomic_write_text(save_baseline, json.dumps(saved, indent=2, sort_keys=True))
        if junit:
            atomic_write_text(junit, ci.bench_junit_xml(model.stem, result))
        if fmt == Format.json:
            print_json(result.to_dict())
        else:
            render.render_bench(result)
        if result.regressed:
            raise Exit(errors.EXIT_PERF)


@app.command()
def gate(
    model: Annotated[Path, Argument(readable=False, help="Model to gate (never modified).")],
    target: flags.Target = "cpu",
    level: flags.Level = 2,
    pipeline: flags.PipelineText = None,
    expect: flags.GateExpect = None,
    baseline: flags.GateBaseline = None,
    save_baseline: flags.GateSaveBaseline = None,
    max_regression: flags.GateMaxRegression = "5%",
    max_seconds: flags.MaxSeconds = 60.0,
    threads: flags.Threads = 1,
    shape: flags.Shapes = None,
    inputs: flags.Inputs = None,
    seed: flags.Seed = 0,
    tolerance: flags.Tolerances = None,
    junit: flags.JUnit = None,
    op_baseline: flags.GateOpBaseline = None,
    save_op_baseline: flags.GateSaveOpBaseline = None,
    profile_runs: flags.GateProfileRuns = 20,
    fmt: flags.Fmt = Format.text,
    quiet: flags.Quiet = False,
    debug: flags.Debug = False,
) -> None:
    """The CI gate in one call: optimize, parity, --expect, latency against a baseline, JUnit.

    Latency is the median of optimized/original over interleaved rounds with a 95 % interval,
    measured until the interval is narrower than --max-regression.  --op-baseline: the
    optimized model profiled (ORT_ENABLE_ALL, CPU), each op type's interval against the
    baseline's.  Exit 3 parity, 4 target / expectations / an interval too wide to save, 5 the
    whole interval (of the latency, or of one op type) regressed past the limit.
    Writes nothing but --junit, --save-baseline and --save-op-baseline."""
    from .opt import errors
    from .opt.graph.io import atomic_write_text, check_side_outputs
    from .opt.optimizer import optimize as run_optimize
    from .opt.verify import gate as ci
    from .opt.verify import verdict as verdicts
    from .opt.verify.bench import parse_regression
    from .opt.verify.parity import parse_shapes, parse_tolerances

    with handled():
        limit = _finite(parse_regression(max_regression), "--max-regression")
        if limit <= 0:
            raise errors.UsageError("--max-regression must be above 0 (e.g. 5%)")
        _finite(max_seconds, "--max-seconds")
        src = model.resolve()
        check_side_outputs(
            {
                "--save-baseline": save_baseline,
                "--junit": junit,
                "--save-op-baseline": save_op_baseline,
            },
            models=[src],
            files=[f for f in (inputs, baseline, op_baseline) if f],
        )
        op_base = ci.read_op_baseline(op_baseline) if op_baseline else None
        expectations = ci.parse_expectations(expect)
        feeds = _feeds(inputs, src)
        with progress(quiet) as say:
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
            expectations = verdicts.resolve_report_expectations(expectations, report, target)
            results = ci.evaluate_expectations(expectations, report.ops_after)
            first = verdicts.decide(report, results, checked=True)
            latency = None
            if first.ok:  # latency only for a model that passed everything else
                say("latency: paired interleaved rounds")
                budget = dict(threads=threads, precision=limit, max_seconds=max_seconds)
                shapes = report.parity.inputs
                latency = ci.gate_latency(
                    src, optimized, shapes, feeds, seed, **budget, progress=say
                )
            ops = None
            if first.ok and (op_base is not None or save_op_baseline):
                say("profile: each op type's time")
                ops = _gate_profile(optimized, report, feeds, profile_runs)
        verdict = ci.gate_verdict(
            latency,
            first.code,
            first.reason,
            baseline=baseline,
            save_baseline=save_baseline is not None,
            max_regression=limit,
            meta={"model": str(model), "target": target},
        )
        op_cmp = None
        if ops is not None and op_base is not None:
            op_cmp = ci.compare_op_baseline(ops, op_base, limit)
            line = ci.op_regression_line(op_cmp)
            if line:
                line = f"op-type regression: {line}"
                verdict.failure = verdict.failure or line
                verdict.reason = line if not verdict.code else f"{verdict.reason}; {line}"
                verdict.code = verdict.code or errors.EXIT_PERF
        if save_op_baseline and ops is not None:
            atomic_write_text(save_op_baseline, json.dumps(ops, indent=2, sort_keys=True))
        _gate_outputs(model, report, results, latency, verdict, save_baseline, junit)
        if fmt == Format.json:
            payload = render.gate_payload(report, results, latency, verdict, model)
            print_json(payload | {"op_comparison": op_cmp}, default=float)
        else:
            render.render_gate(report, results, latency, verdict, model, op_cmp)
        _exit(verdict.code, verdict.reason)


def _gate_profile(optimized, report, feeds, runs: int) -> dict:
    """``gate --op-baseline``: the optimized model profiled as a model file is (ORT_ENABLE_ALL,
    CPU) on the inputs parity ran, its hottest nodes trimmed."""
    from .opt.verify import profile as prof

    summary, _, _ = prof.profile(
        prof.plain_opener(None, optimized),
        optimized,
        feeds=feeds,
        shapes=None if feeds else report.parity.inputs,
        runs=runs,
    )
    summary["nodes"] = summary["nodes"][:REPORT_PROFILE_NODES]
    return summary


def _gate_outputs(model: Path, report, results, latency, verdict, save_baseline, junit) -> None:
    """``--save-baseline`` (when the verdict has one to save) and ``--junit``."""
    from .opt.graph.io import atomic_write_text
    from .opt.verify import gate as ci
    from .opt.verify import verdict as verdicts

    if save_baseline and verdict.baseline:
        atomic_write_text(save_baseline, json.dumps(verdict.baseline, indent=2, sort_keys=True))
    if junit:
        case = verdict.junit_case() if latency else None
        suite = f"graphopt.gate.{model.stem}"
        atomic_write_text(junit, ci.junit_xml(suite, verdicts.parities(report), results, case))


# ------------------------------------------------------------------ rules, targets, run
@app.command()
def rules(fmt: flags.Fmt = Format.text, debug: flags.Debug = False) -> None:
    """List every rule and pass with its level and one line."""
    from .opt.rewrite.manager import PASSES, RULES

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
    render.render_rules(rows)


@app.command()
def targets(
    action: Annotated[
        str | None, Argument(help="'show' to print one target's profile and kernel table.")
    ] = None,
    name: Annotated[str | None, Argument(help="The target to show.")] = None,
    fmt: flags.Fmt = Format.text,
    debug: flags.Debug = False,
) -> None:
    """List the targets; `targets show NAME` prints one target's profile and kernel table."""
    from .opt import errors
    from .opt.rewrite.target import TARGETS

    with handled():
        if action is not None:
            if action != "show" or not name:
                raise errors.UsageError("usage: graphopt targets [show NAME]")
            from .targets.describe import describe_target

            data = describe_target(name)
            if fmt == Format.json:
                print_json(data)
            else:
                render.render_target(data)
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
    render.render_targets(rows)


@app.command()
def run(
    bundle: Annotated[
        Path, Argument(readable=False, help="A bundle directory written by `optimize`.")
    ],
    inputs: flags.RunInputs = None,
    output: flags.RunOutput = None,
    provider: flags.Providers = None,
    repeat: flags.Repeat = 1,
    verify: flags.VerifyFiles = flags.Verify.fingerprint,
    portable: flags.Portable = False,
    fmt: flags.Fmt = Format.text,
    debug: flags.Debug = False,
) -> None:
    """Run a bundle with onnxruntime exactly as its manifest and session config say (on the
    machine that wrote it, its machine-specific fast path)."""
    from .opt import errors
    from .opt.graph.io import check_side_outputs

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
        feeds = _feeds(inputs, folder / "model.onnx")
        result = run_bundle(
            bundle,
            feeds,
            providers=provider or None,
            repeat=repeat,
            verify=verify.value,
            fast_path=not portable,
        )
        if output:
            _save_outputs(output, result["outputs"])
        keys = ("bundle", "target", "providers", "session_create_ms", "session", "run_ms")
        summary = {k: result[k] for k in keys}
        summary["outputs"] = {k: describe_value(v) for k, v in result["outputs"].items()}
        summary["golden"] = result["golden"]
        if fmt == Format.json:
            print_json(summary, default=float)
        else:
            render.render_run(summary)
        if result["golden"] is not None and not result["golden"]["ok"]:
            worst = max((d["max_abs"] for d in result["golden"]["outputs"]), default=0.0)
            sys.stderr.write(
                f"error: the bundle's outputs differ from its golden outputs (max abs "
                f"{worst:.3g})\n"
            )
            raise Exit(errors.EXIT_PARITY)


@app.command()
def profile(
    model: Annotated[Path, Argument(readable=False, help="A bundle directory, or a model file.")],
    target: flags.ProfileTarget = None,
    inputs: flags.ProfileInputs = None,
    shape: flags.Shapes = None,
    runs: flags.ProfileRuns = 10,
    compare: flags.ProfileCompare = None,
    trace: flags.ProfileTrace = None,
    html: flags.ProfileHtml = None,
    fmt: flags.Fmt = Format.text,
    debug: flags.Debug = False,
) -> None:
    """Where the time goes, node by node (onnxruntime's profiler, the session as the bundle
    deploys), who owns it, and which missed fusions hold the most of it."""
    from .opt import errors
    from .opt.graph.io import atomic_write_text, check_side_outputs, load_model
    from .opt.rewrite.target import get_target
    from .opt.verify.parity import parse_shapes

    with handled():
        from .opt.verify import profile as prof

        shapes = parse_shapes(shape)
        dirs = [model] if model.is_dir() else []
        models = [] if dirs else [model.resolve()]
        check_side_outputs(
            {"--trace": trace, "--html": html},
            models=models + ([compare.resolve()] if compare else []),
            files=[inputs] if inputs else [],
            dirs=dirs,
        )
        if compare is not None and compare.is_dir():
            raise errors.UsageError(f"--compare {compare}: give the original model file")
        if dirs:
            summary, events, used = _profile_bundle(model, target, inputs, shapes, runs)
        else:
            spec = get_target(target or "cpu")
            proto = load_model(model, check=True, lazy_external=True)
            feeds = _feeds(inputs, proto)
            providers = list(spec.providers) or ["CPUExecutionProvider"]
            note = _cpu_in_place_of(providers)
            if note:  # the model's semantics on this machine's CPU, said so
                providers = ["CPUExecutionProvider"]
            summary, events, used = prof.profile(
                prof.plain_opener(model, proto, providers),
                proto,
                feeds=feeds,
                shapes=shapes,
                runs=runs,
            )
            summary["providers_note"] = note
        summary["model"] = str(model)
        summary["compare"] = None
        if compare is not None:
            original = load_model(compare, check=True, lazy_external=True)
            base, _, _ = prof.profile(
                prof.plain_opener(compare, original),
                original,
                feeds=_taken(used, original),
                runs=runs,
            )
            base["model"] = str(compare)
            summary["compare"] = prof.compare(summary, base) | {"original": base}
        if trace:
            atomic_write_text(trace, json.dumps(events, default=str))
        if html:
            from .opt.report.report_html import render_profile_html

            atomic_write_text(html, render_profile_html(summary))
        if fmt == Format.json:
            print_json(summary, default=float)
        else:
            render.render_profile(summary)


def _taken(feeds: dict, model) -> dict:
    """The arrays of ``feeds`` that ``model`` takes (``--compare``: the same inputs by name)."""
    names = {vi.name for vi in model.graph.input}
    return {k: v for k, v in feeds.items() if k in names}


def _profile_bundle(bundle: Path, target, inputs, shapes, runs) -> tuple[dict, dict, dict]:
    """``profile`` of a bundle: its session as ``open_session`` builds it (fast path where it
    applies), its golden inputs unless ``--inputs``/``--shape``, its report's remarks."""
    import onnx

    from .opt import errors
    from .opt.verify import profile as prof
    from .targets.bundle import GOLDEN_INPUTS, open_session, providers_problem, read_bundle

    folder, manifest, _ = read_bundle(bundle)
    if target is not None and target != manifest.get("target"):
        raise errors.UsageError(
            f"--target {target}: the bundle is for {manifest.get('target')} (a bundle is "
            "profiled as it deploys; give the model file to profile it for another target)"
        )
    why = providers_problem(folder)
    providers, note = None, None
    if why:
        cpu_only = _cpu_in_place_of(_bundle_providers(folder))
        if cpu_only is None:
            raise errors.UsageError(f"the {manifest.get('target')} bundle {why}")
        providers, note = ["CPUExecutionProvider"], cpu_only
    portable = folder / manifest.get("model", "model.onnx")
    try:
        proto = onnx.load(str(portable), load_external_data=False)
    except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and OSError alike
        raise errors.GraphoptError(f"{portable}: cannot read the bundle's model ({e})") from None
    feeds = _feeds(inputs, proto)
    if feeds is None and not shapes and (folder / GOLDEN_INPUTS).exists():
        import zipfile

        from .opt.verify.feeds import read_npz

        try:
            feeds = read_npz(folder / GOLDEN_INPUTS)
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
            raise errors.GraphoptError(f"{folder / GOLDEN_INPUTS}: cannot read ({e})") from None
    report = None
    with suppress(OSError, ValueError, RecursionError):  # a corrupt report is not needed here
        report = json.loads((folder / "report.json").read_text())

    def session_model(info: dict):
        if info.get("model") in (None, portable.name):
            return None
        return onnx.load(str(folder / info["model"]), load_external_data=False)

    summary, events, used = prof.profile(
        lambda prefix: open_session(folder, providers=providers, profile=prefix),
        proto,
        session_model=session_model,
        report=report if isinstance(report, dict) else None,
        feeds=feeds,
        shapes=shapes,
        runs=runs,
    )
    summary["providers_note"] = note
    return summary, events, used


def _bundle_providers(folder: Path) -> list[str]:
    from .targets.bundle import read_bundle

    _, _, config = read_bundle(folder)
    return list(config.get("providers") or [])


def _cpu_in_place_of(wanted: list[str]) -> str | None:
    """The line ``profile`` says when it runs the CPU provider in place of a device's (a cuda
    bundle, or ``--target cuda`` for a model file, on a machine without the device); None when
    every provider wanted is here (or none is wanted: not an onnxruntime target)."""
    import onnxruntime as ort

    have = ort.get_available_providers()
    missing = [p for p in wanted if p not in have]
    if not missing or "CPUExecutionProvider" not in have:
        return None
    device = " (no CUDA device)" if "CUDAExecutionProvider" in missing else ""
    return (
        f"{', '.join(missing)} not available here{device}; onnxruntime offers "
        f"{', '.join(have)}: profiled the CPU provider, not the device's kernel times"
    )


def _save_outputs(path: Path, outputs: dict) -> None:
    """``run -o``: the outputs as one .npz."""
    import numpy as np

    from .opt import errors
    from .opt.graph.io import atomic_write

    try:
        atomic_write(path, lambda f: np.savez(f, **outputs))
    except OSError as e:
        raise errors.ModelSaveError(f"cannot write {path}: {e.strerror or e}") from None


def _escaped(arg: str) -> bool:
    """Whether ``arg`` holds bytes the locale's encoding could not decode (Python keeps them
    as lone surrogates, which no UTF-8 consumer takes)."""
    return any("\udc80" <= c <= "\udcff" for c in arg)


def run_args(args: list[str]) -> int:
    """The exit code of the command line ``args``: typer parses and runs the command; a usage
    error is one ``error:`` line on stderr and exit 2, Ctrl-C inside the command exit 130."""
    from .opt import errors

    args = list(args) or ["--help"]
    undecodable = next((a for a in args if _escaped(a)), None)
    if undecodable is not None:
        shown = os.fsencode(undecodable).decode("utf-8", "backslashreplace")
        sys.stderr.write(
            f"error: the argument '{shown}' is not text in this locale's encoding "
            f"({sys.getfilesystemencoding()}); onnx and onnxruntime take paths as UTF-8: run "
            "under a UTF-8 locale (LANG=C.UTF-8) or rename the file\n"
        )
        return errors.EXIT_USAGE
    from .opt.environment import check_environment

    try:
        check_environment()
    except errors.UsageError as e:
        sys.stderr.write(f"error: {e}\n")
        return errors.EXIT_USAGE
    try:
        code = app(args=args, prog_name="graphopt", standalone_mode=False)
    except Exit as e:
        return e.exit_code
    except typer.TyperException as e:  # click's usage errors (typer's own exception tree)
        ctx = getattr(e, "ctx", None)
        where = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
        got = _given(args, getattr(e, "param", None))
        sys.stderr.write(f"error: {e.format_message()}{got}{where}\n")
        return getattr(e, "exit_code", errors.EXIT_USAGE)
    except (KeyboardInterrupt, typer.Abort):
        code = _interrupt.EXIT_INTERRUPTED
    except MemoryError:  # while parsing or importing, before the command's own handler
        sys.stderr.write(_out_of_memory() + "\n")
        return errors.EXIT_ERROR
    if code == _interrupt.EXIT_INTERRUPTED:  # typer turns Ctrl-C in the command into exit 130
        sys.stderr.write(_interrupt.MESSAGE)
    return code if isinstance(code, int) else 0


def _out_of_memory() -> str:
    """The one line of a run that ran out of memory (under ``GRAPHOPT_MEMORY_MB``, named)."""
    cap = os.environ.get("GRAPHOPT_MEMORY_MB", "").strip()
    named = f" (GRAPHOPT_MEMORY_MB={cap})" if cap else ""
    return f"error: ran out of memory{named}; nothing was written"


def _given(args: list[str], param) -> str:
    """`` (got VALUE)``: what the command line gave the flag a usage error is about."""
    names = getattr(param, "opts", None) or []
    for i, arg in enumerate(args):
        for name in names:
            if arg == name and i + 1 < len(args):
                return f" (got {args[i + 1]})"
            if name.startswith("--") and arg.startswith(name + "="):
                return f" (got {arg.split('=', 1)[1]})"
    return ""


def console() -> None:
    """The ``graphopt`` command as a process: the app, then the exit.  What the command leaves
    alive (a large model's graph: millions of objects, most in reference cycles) is frozen on
    the way out, so that the interpreter's exit neither scans nor frees them one by one (about
    2 s of a 200k-node -O2 run); the OS takes the memory back.  Exit handlers still run.

    Ctrl-C at any moment is ``error: interrupted`` and exit 130 (:mod:`graphopt._interrupt`):
    while the command runs it unwinds it (its temporaries are removed); before and after it
    (imports, exit handlers, threads still finishing), it ends the process at once."""
    code = _interrupt.EXIT_INTERRUPTED
    try:
        _interrupt.handle_with(signal.default_int_handler)  # the command unwinds
        _cap_memory()
        _tune_malloc()
        _one_blas_thread()
        try:
            code = run_args(sys.argv[1:])
        finally:
            _interrupt.handle_with(_interrupt.exit_now)  # exiting: nothing to unwind
            gc.freeze()
    except KeyboardInterrupt:  # outside the command (before it parsed, while it froze)
        sys.stderr.write(_interrupt.MESSAGE)
    sys.stderr.flush()
    raise SystemExit(code)


def _cap_memory() -> None:
    """``GRAPHOPT_MEMORY_MB``: the process's address space is capped there (RLIMIT_AS), so a
    run that would exhaust the machine ends with "ran out of memory", exit 1."""
    from .opt import errors

    value = os.environ.get("GRAPHOPT_MEMORY_MB", "").strip()
    if not value:
        return
    try:
        import resource

        import numpy  # noqa: F401  (the libraries' loads reserve address space: before the cap)
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401

        mib = float(value)
        if not 0 < mib <= _MAX_MIB:  # nan, inf and absurd sizes too
            raise ValueError(value)
        limit = int(mib * 2**20)
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    except (ValueError, OSError, ImportError):
        sys.stderr.write(f"error: GRAPHOPT_MEMORY_MB must be a number of MiB (got '{value}')\n")
        raise SystemExit(errors.EXIT_USAGE) from None


#: glibc's mallopt settings for the command's process: (parameter, value, the environment
#: variable that, when set, keeps glibc's own)
_MALLOC_SETTINGS = (
    (-8, 1, "MALLOC_ARENA_MAX"),  # M_ARENA_MAX
    (-3, 8 << 20, "MALLOC_MMAP_THRESHOLD_"),  # M_MMAP_THRESHOLD
    (-1, 32 << 20, "MALLOC_TRIM_THRESHOLD_"),  # M_TRIM_THRESHOLD
)


def _tune_malloc() -> None:
    """glibc's allocator, set for the command's process (unless the environment sets it; other
    C libraries: nothing).  One arena: glibc gives each thread that allocates an arena of its
    own and keeps what is freed there for that arena, so the threads that round fp16 weights,
    hash the output and run onnxruntime's sessions raised the peak with memory the main thread
    never reused (ResNet-50 fp16 ``--no-check``: 254 -> 221-234 MB peak, no slower).  Blocks
    below 8 MiB from the heap, which keeps up to 32 MiB free at its top: by default glibc maps
    each block above a threshold that only grows as such blocks are freed, and gives the heap's
    top back beyond twice that, so the folds' temporaries of a few MB were mapped, faulted in
    page by page and unmapped again, over and over (ResNet-50 fp16 ``--no-check``: 190,000 page
    faults, 0.55 s of system time, 1.58 s; now 0.2 s and 1.35 s), while blocks above 8 MiB (a
    whole layer's float64 temporaries, large weights) are still mapped and given back when
    freed (ResNet-50 ``--no-check`` peak 277 -> 243 MB; with 32 MiB, 273 MB)."""
    _mallopt({parameter: value for parameter, value, _ in _MALLOC_SETTINGS})


def _mallopt(settings: dict[int, int]) -> None:
    """glibc's ``mallopt`` of each (parameter, value) of :data:`_MALLOC_SETTINGS` in
    ``settings`` whose environment variable is unset; other C libraries: nothing."""
    import ctypes

    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return
        libc = ctypes.CDLL(None)
        for parameter, _, variable in _MALLOC_SETTINGS:
            if parameter in settings and variable not in os.environ:
                libc.mallopt(parameter, settings[parameter])
    except (AttributeError, OSError, ValueError):
        return


def _fit_malloc(model_bytes: int) -> None:
    """:func:`_tune_malloc`'s heap thresholds for a model file of 1 to 32 MiB: blocks from
    256 KiB mapped, 1 MiB kept free at the heap's top.  8 MiB / 32 MiB, which the large models
    run faster with, held such a model's weight-sized blocks in a fragmented heap, with no time
    to gain (EfficientNet-B0, 21 MB: peak 123 -> 117 MB, as fast).  A smaller file may keep
    its weights in other files: its thresholds stay."""
    if (1 << 20) <= model_bytes < (32 << 20):
        _mallopt({-3: 256 << 10, -1: 1 << 20})  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD


#: what numpy's OpenBLAS builds name the call that sets its thread count
_BLAS_THREADS_CALLS = (
    "scipy_openblas_set_num_threads64_",
    "scipy_openblas_set_num_threads",
    "openblas_set_num_threads64_",
    "openblas_set_num_threads",
)


def _one_blas_thread() -> int | None:
    """numpy's OpenBLAS runs its matrix products on one thread in the command's process: they
    are small (the fp16 refold's probes) and, once done, OpenBLAS's other threads spin waiting
    for more on the cores the rounding threads, onnxruntime and the hashing thread use
    (ResNet-50 fp16 ``--no-check``: 2.3-2.7 -> 1.9-2.0 s, 4.1 -> 2.2 s of CPU).  Unless
    ``OPENBLAS_NUM_THREADS`` or ``OMP_NUM_THREADS`` says otherwise; a numpy without OpenBLAS
    (or where the library is not found): nothing.  Returns the count set, or None."""
    import ctypes
    import os

    if "OPENBLAS_NUM_THREADS" in os.environ or "OMP_NUM_THREADS" in os.environ:
        return None
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "openblas" in line.lower()}
    except OSError:
        return None
    for path in sorted(p for p in paths if p.startswith("/")):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in _BLAS_THREADS_CALLS:
            call = getattr(lib, name, None)
            if call is not None:
                call.argtypes = [ctypes.c_int]
                call.restype = None
                call(1)
                return 1
    return None


if __name__ == "__main__":  # pragma: no cover
    console()
