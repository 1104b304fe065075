"""What the commands print: the optimization summary, parity tables, explain, lint, bench, gate,
targets, rules and run, on stdout (``out``); warnings and errors on stderr (``err``).

Only presentation lives here: every number and decision comes from the library (the report,
:mod:`graphopt.opt.verify.verdict`, :mod:`graphopt.opt.verify.gate`,
:mod:`graphopt.opt.report.explain`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Text from a model is shown, never obeyed: markup is off ("[/]" and "[bold]" in a name are
# printed as written; styled() colours our own words) and control characters (ANSI escapes, bidi
# overrides) are printed as their escapes.
_HIDDEN = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F) if chr(c) not in "\n\t"} | {
    c: f"\\u{c:04x}" for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A))
}


def visible(text: str) -> str:
    """``text`` with its control characters written as escapes."""
    return text.translate(_HIDDEN)


def _shown(obj: Any) -> Any:
    return visible(obj) if isinstance(obj, str) else obj


class _Console:
    """A rich Console made on first use: a run that prints nothing (``--quiet``) does not import
    rich (about 30 ms of every start)."""

    def __init__(self, **options: Any) -> None:
        self._options, self._console = options, None

    def __getattr__(self, name: str) -> Any:
        if self._console is None:
            from rich.console import Console

            self._console = Console(**self._options)
        return getattr(self._console, name)

    def print(self, *objects: Any, **kw: Any) -> None:
        self.__getattr__("print")(*map(_shown, objects), **kw)


def Table(*args: Any, title: Any = None, **kw: Any):  # noqa: N802 - rich's class, made lazily
    from rich.table import Table as RichTable

    class _Shown(RichTable):
        def add_row(self, *cells: Any, **row: Any) -> None:
            super().add_row(*map(_shown, cells), **row)

    return _Shown(*args, title=_shown(title), **kw)


out = _Console(highlight=False, markup=False)
err = _Console(stderr=True, highlight=False, markup=False)


def styled(*parts: str | tuple[str, str]):
    """One line of plain strings and ``(text, style)`` pairs, as a rich Text."""
    from rich.text import Text

    return Text.assemble(
        *(visible(p) if isinstance(p, str) else (visible(p[0]), p[1]) for p in parts)
    )


def _ok(ok: bool, yes: str = "ok", no: str = "FAILED") -> tuple[str, str]:
    return (yes, "green") if ok else (no, "red")


MAX_MISS_GROUPS = 10


def print_json(data: Any, default=None) -> None:
    """One JSON document on stdout."""
    print(json.dumps(data, indent=2, sort_keys=True, default=default))


def warn(line: str) -> None:
    err.print(styled(("warning:", "yellow"), f" {line}"), soft_wrap=True)


def error(line: str) -> None:
    """The one line a failed verdict prints (even with --quiet or --format json)."""
    err.print(f"error: {line}", soft_wrap=True)


def render_expectations(results: list) -> None:
    for e in results:
        out.print(styled(f"expect {e.text}: ", _ok(e.ok), f" (found {e.actual})"))


def device_note(report) -> str:
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


#: analysis remarks of what graphopt accepts as onnxruntime does (opt/graph/compat.py,
#: opt/verify/feeds.py)
ACCEPTED_CODES = ("graph-sorted", "dim-param-split")


def render_report(report, custom_pipeline: bool = False) -> None:
    from .opt.clock import phase_summary
    from .opt.report.explain import group_misses

    how = f"pipeline '{report.pipeline}'" if custom_pipeline else f"-O{report.level}"
    took = phase_summary(report.seconds)  # the wait, phase by phase
    out.print(
        styled(
            (str(report.model), "bold"),
            " → target ",
            (report.target, "cyan"),
            f", {how}: {report.nodes_before} → {report.nodes_after} nodes, "
            f"{report.rewrites} rewrites, {took}",
        ),
        soft_wrap=True,
    )
    changed = [
        f"{op} {report.ops_before.get(op, 0)}→{report.ops_after.get(op, 0)}"
        for op in sorted(set(report.ops_before) | set(report.ops_after))
        if report.ops_before.get(op, 0) != report.ops_after.get(op, 0)
    ]
    if changed:
        out.print("ops (before→after): " + ", ".join(changed), soft_wrap=True)
    for r in report.remarks:  # what the output's callers see changed
        if r.kind == "analysis" and r.code == "weights-frozen":
            out.print(styled(("interface", "yellow"), f": {r.message}"), soft_wrap=True)
    for r in report.remarks:  # what onnx's checker or the declared interface would refuse
        if r.kind == "analysis" and r.code in ACCEPTED_CODES:
            out.print(styled(("accepted", "yellow"), f": {r.message}"), soft_wrap=True)
    render_fired(report)
    render_misses(group_misses(report))
    note = device_note(report)
    render_parity(report.parity, note)
    if report.parity_float64 is not None:
        render_parity(report.parity_float64, note)
    deployed = report.parity_deployed
    if deployed is not None:
        verdict = _ok(deployed.ok) if deployed.ran else "not run"
        out.print(
            styled(f"parity at the bundle's session settings ({deployed.reference}): ", verdict)
        )
    render_performance(report.performance)
    passes = {}
    for p in report.passes:
        passes[p["name"]] = passes.get(p["name"], 0.0) + p["seconds"]
    out.print("time per pass: " + ", ".join(f"{k} {v:.3f}s" for k, v in passes.items()))
    if report.outputs:
        out.print(f"wrote {report.outputs.get('model')}")


def render_fired(report) -> None:
    """Fired fusions (rules of level 2+) and cleanups with their counts, most first."""
    from .opt.rewrite.manager import RULES

    fired = sorted(
        ((n, st["fired"]) for n, st in report.rules.items() if st["fired"]),
        key=lambda kv: (-kv[1], kv[0]),
    )
    fusions = [(n, c) for n, c in fired if n in RULES and RULES[n].level >= 2]
    cleanups = [(n, c) for n, c in fired if (n, c) not in fusions]
    for label, rows in ((("fused", "green"), fusions), ("cleaned up", cleanups)):
        if rows:
            listed = ", ".join(f"{n} ×{c}" for n, c in rows)
            out.print(styled(label, f": {listed}"), soft_wrap=True)


def render_misses(groups: list[dict]) -> None:
    """Missed/failed remarks grouped by (rule, code), one line each: count, rule, code, one
    example node, what to do; at most MAX_MISS_GROUPS lines, then the flags that would let more
    fuse.  The full list is in report.json, --remarks and `graphopt explain`."""
    from .opt.report.explain import levers

    if not groups:
        return
    total = sum(g["count"] for g in groups)
    out.print(
        styled(("missed", "yellow"), f": {total} remarks in {len(groups)} groups, actionable first")
    )
    for g in groups[:MAX_MISS_GROUPS]:
        what = ("failure ", "red") if g["kind"] == "failure" else ""
        todo = g["hint"] or g["message"]
        todo = todo if len(todo) <= 160 else todo[:159] + "…"
        lever = ((g["lever"], "bold"), ": ") if g["lever"] else ()
        out.print(
            styled(
                f"  {g['count']:>4}× ",
                what,
                f"{g['rule']} {g['code']} (e.g. '{g['example']}'): ",
                *lever,
                todo,
            ),
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


def render_performance(perf: dict) -> None:
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


def own_noise_line(d) -> str:
    """Why an output that missed its tolerance passed: the original's own drift."""
    from .opt.verify.parity import NOISE_FACTOR

    if d.judged == "own-noise":
        return (
            f"past its tolerance, within the model's own noise: onnxruntime's own optimizations "
            f"move the original by {d.own_noise:.3g} there (max abs {d.max_abs:.3g} allowed up to "
            f"{NOISE_FACTOR:g}x that)"
        )
    if d.own_noise is not None:
        return (
            f"selection changed on near-ties: {d.mismatch:.2%} of its elements differ, the "
            f"original itself changes {d.own_noise:.2%} between session levels"
        )
    return "selection changed on near-ties: its count differs, as the original's own does"


def render_parity(parity, note: str = "") -> None:
    if not parity.ran:
        out.print(styled("parity: ", ("not run", "yellow"), f" ({parity.error})"))
        return
    t = Table(title=styled(f"parity vs {parity.reference}: ", _ok(parity.ok)), show_edge=False)
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
            ("yes" if d.judged == "tolerance" else "yes*") if d.ok else styled(("NO", "red")),
        )
    out.print(t)
    for d in parity.outputs:
        if d.ok and d.judged != "tolerance":
            out.print(f"* {d.name}: {own_noise_line(d)}", soft_wrap=True)
    if note:
        out.print(note, soft_wrap=True)
    if parity.error:
        out.print(styled((parity.error, "red")))
    if parity.first_divergence:
        d = parity.first_divergence
        out.print(
            f"first diverging tensor: '{d['tensor']}' from {d['op']} '{d['producer']}' "
            f"(max abs {d['max_abs']:.3g})"
        )


def render_bisect(result, payload: dict) -> None:
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


def render_explain(data: dict) -> None:
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
        nodes = ", ".join(f["nodes"])
        out.print(styled(("fired", "green"), f"  {f['rule']}: {nodes} → {created}"))
    if len(data["fired"]) > 50:
        out.print(f"... {len(data['fired']) - 50} more fired (--format json for all)")
    for m in data["missed"]:
        where = f" {m['rule']} at '{m['node']}': {m['code']}: {m['message']}"
        out.print(styled(("missed", "yellow"), where))
        if m["hint"]:
            out.print(f"         hint: {m['hint']}")
    if data["never_matched"]:
        out.print("never matched: " + ", ".join(data["never_matched"]))


def gate_payload(report, results: list, latency, verdict, model: Path) -> dict[str, Any]:
    """``graphopt gate --format json``: the verdict, the report, expectations and latency."""
    return {
        "schema": "graphopt.gate/1",
        "model": str(model),
        "exit_code": verdict.code,
        "reason": verdict.reason,
        "report": report.to_dict(),
        "expectations": [e.to_dict() for e in results],
        "latency": latency.to_dict() if latency else None,
        "comparison": verdict.comparison,
    }


def render_gate(
    report, results: list, latency, verdict, model: Path, op_cmp: dict | None = None
) -> None:
    parity = report.parity
    out.print(
        styled(
            (str(model), "bold"),
            f" → {report.target}: parity ",
            _ok(parity.ran and parity.ok, no="not ok"),
            f", {report.nodes_before} → {report.nodes_after} nodes",
        ),
        soft_wrap=True,
    )
    render_expectations(results)
    if latency is not None:
        out.print(f"latency: {verdict.line}", soft_wrap=True)
    if op_cmp is not None:
        worse = op_cmp["regressed"]
        out.print(
            styled(
                f"op types vs the per-op baseline: {len(op_cmp['ops'])} compared, ",
                _ok(not worse, yes="none regressed", no=f"{len(worse)} regressed"),
                f" (limit {op_cmp['max_regression']:.1%}, floor {op_cmp['floor_ms']:.3f} ms)",
            ),
            soft_wrap=True,
        )
        for r in op_cmp["ops"][:5]:
            mark = ("REGRESSED ", "red") if r["regressed"] else ""
            out.print(
                styled(
                    "  ",
                    mark,
                    f"{r['op']}: {r['ms']:.3f} ms [{r['low_ms']:.3f}, "
                    f"{r['high_ms']:.3f}] vs baseline {r['baseline_ms']:.3f} ms "
                    f"[{r['baseline_low_ms']:.3f}, {r['baseline_high_ms']:.3f}]",
                ),
                soft_wrap=True,
            )
    if not verdict.code:
        out.print(styled(("gate passed", "green")))


def render_bench(result) -> None:
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
        out.print(
            styled(
                f"vs baseline: {result.regression:+.1%} (limit {result.max_regression:.1%}) ",
                _ok(not result.regressed, no="REGRESSION"),
            )
        )


def render_target(data: dict) -> None:
    p = data["profile"]
    out.print(styled((data["name"], "bold"), f": {p['description']}"))
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


def render_lint(payload: dict, findings: list) -> None:
    if not findings:
        out.print("no findings")
    for f in findings:
        color = {"error": "red", "warning": "yellow"}.get(f.severity, "cyan")
        out.print(styled((f.severity, color), f" {f.code}: {f.message}"))
        out.print(f"    fix: {f.fix}")
    if "frozen" in payload:
        out.print(
            f"wrote {payload['frozen']['output']} "
            f"({payload['frozen']['initializers']} initializers frozen)"
        )


def render_rules(rows: list[dict]) -> None:
    from .opt.rewrite.pipeline import LEVEL_NAMES

    t = Table(show_edge=False)
    for col in ("name", "kind", "root", "level", "summary"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["name"], r["kind"], r["root"], f"O{r['level']}", r["summary"])
    out.print(t)
    out.print("levels: " + "; ".join(f"O{k} {v}" for k, v in LEVEL_NAMES.items()))


def render_targets(rows: list[dict]) -> None:
    t = Table(show_edge=False)
    for col in ("name", "description", "kernels", "device here"):
        t.add_column(col, overflow="fold")
    for r in rows:
        t.add_row(
            r["name"], r["description"], r["kernels"], "yes" if r["device_available"] else "no"
        )
    out.print(t)


def render_run(summary: dict) -> None:
    """``graphopt run``: the session, which model ran and why, the outputs, the golden check."""
    out.print(
        styled(
            (str(summary["bundle"]), "bold"),
            f" ({summary['target']}) on {', '.join(summary['providers'])}: session "
            f"{summary['session_create_ms']} ms, "
            f"run {', '.join(f'{t:.2f}' for t in summary['run_ms'][:5])} ms",
        )
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
    if summary["golden"] is not None:
        g = summary["golden"]
        worst = max((d["max_abs"] for d in g["outputs"]), default=0.0)
        out.print(
            styled("golden outputs: ", _ok(g["ok"], "match", "DIFFER"), f" (max abs {worst:.3g})")
        )


# ------------------------------------------------------------------ profile
PROFILE_TOP = 10


def _pct(share: float) -> str:
    return f"{share * 100:.1f} %"


def _sites(names: list[str], limit: int = 3) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def render_profile(data: dict) -> None:
    """``graphopt profile``: the run, the tables by op type and region, the hottest nodes, the
    missed remarks that hold time, and ``--compare``'s delta per op type."""
    s = data["session"]
    how = f"{s.get('model')}, {s.get('level')}" + (", fast path" if s.get("fast_path") else "")
    feeds = ", ".join(f"{k}={v}" for k, v in data["inputs"].items())
    out.print(styled(("profile", "bold"), f" {data['model']} ({how}); inputs {feeds}"))
    if data.get("providers_note"):
        out.print(styled((data["providers_note"], "yellow")), soft_wrap=True)
    out.print(
        f"run {data['run_ms']:.3f} ms (median of {data['runs']} profiled runs; "
        f"{data['unprofiled_run_ms']:.3f} ms with the profiler off); coverage "
        f"{_pct(data['coverage'])} of the nodes' time ({_pct(data['run_coverage'])} of the "
        "run's rows) attributed to the model's nodes"
    )
    _profile_ops(data)
    t = Table(title=f"time by region (top {PROFILE_TOP})", show_edge=False)
    for col in ("region", "nodes", "ms", "share"):
        t.add_column(col, justify="left" if col == "region" else "right")
    for g in data["regions"][:PROFILE_TOP]:
        t.add_row(g["region"], str(g["count"]), f"{g['ms']:.3f}", _pct(g["share"]))
    out.print(t)
    out.print(styled((f"hottest nodes (top {PROFILE_TOP})", "bold")))
    for r in data["nodes"][:PROFILE_TOP]:
        owner = r["owner"]
        if owner == "model":
            made = f"{r['rule']} of " if r.get("rule") else ""
            owner = made + _sites(r["originals"], 2)
        line = f"{r['ms']:8.3f} ms {_pct(r['share']):>7}  {r['op']}  {r['node']}  <- {owner}"
        out.print(f"  {line}", soft_wrap=True)
    if data["missed"]:
        out.print(styled(("missed fusions by measured time", "bold")))
        for m in data["missed"][:PROFILE_TOP]:
            line = (
                f"{_pct(m['share'])} of the time is in {m['nodes']} node(s) that {m['rule']} "
                f"missed: {m['code']} ({m['message']}) at {_sites(m['sites'])}"
            )
            out.print(f"  {line}", soft_wrap=True)
    else:
        out.print("no missed remark names a profiled node")
    if data.get("compare"):
        _profile_compare(data["compare"])


def render_profile_brief(data: dict) -> None:
    """``optimize --profile``: the account in three lines and the top missed rows (the whole
    profile is in report.json and --html)."""
    if not data.get("ran", True):
        return
    acc = data["account"]
    out.print(
        styled(
            ("profile", "bold"),
            f" ({data['runs']} runs): rows {acc['rows_ms']:.3f} ms vs the measured "
            f"run {acc['measured_ms']:.3f} ms (ratio {data['ratio']:.3f}, residual "
            f"{acc['residual_ms']:+.3f} ms); coverage {_pct(data['coverage'])}",
        ),
        soft_wrap=True,
    )
    if data.get("providers_note"):
        out.print(styled((data["providers_note"], "yellow")), soft_wrap=True)
    for g in data["ops"][:3]:
        out.print(f"  {g['op']}: {g['ms']:.3f} ms ({_pct(g['share'])})")
    for m in data["missed"][:3]:
        line = f"{_pct(m['share'])} in {m['nodes']} node(s) that {m['rule']} missed: {m['code']}"
        out.print(f"  {line}", soft_wrap=True)


def _profile_ops(data: dict) -> None:
    """The op-type table: each op's nodes (kernel and the executor's gap after it), then the
    rows that belong to no node, their sum against the measured run and the residual."""
    acc = data["account"]
    t = Table(
        title=f"time by op type (mean over the {data['central_runs']} of {data['runs']} "
        "profiled runs nearest the median run; ms: kernel + the executor's work after it)",
        show_edge=False,
    )
    for col in ("op", "count", "ms", "kernel ms", "share"):
        t.add_column(col, justify="left" if col == "op" else "right")
    for g in data["ops"]:
        t.add_row(
            g["op"],
            str(g["count"]),
            f"{g['ms']:.3f}",
            f"{g['kernel_ms']:.3f}",
            _pct(g["share"]),
        )
    for o in acc["other"]:
        t.add_row(o["row"], "", f"{o['ms']:.3f}", "", _pct(o["share"]))
    t.add_row(
        "sum of the rows",
        str(data["node_count"]),
        f"{acc['rows_ms']:.3f}",
        f"{data['kernel_ms']:.3f}",
        _pct(data["ratio"] or 0.0),
    )
    t.add_row(
        "(residual: the measured run less the rows)",
        "",
        f"{acc['residual_ms']:+.3f}",
        "",
        _pct(acc["residual_share"]),
    )
    t.add_row(
        f"measured run ({acc['measured_by']}, median)",
        "",
        f"{acc['measured_ms']:.3f}",
        "",
        "100.0 %",
    )
    out.print(t)
    line = (
        f"rows {acc['rows_ms']:.3f} ms vs the measured run {acc['measured_ms']:.3f} ms: ratio "
        f"{data['ratio']:.3f}"
    )
    if acc.get("profiler_ms") is not None:
        per = acc["profiler_ms"] / max(1, acc["kernel_events"]) * 1000.0
        line += (
            f"; with the profiler off the run takes {data['unprofiled_run_ms']:.3f} ms: the "
            f"profiler's own cost is {acc['profiler_ms']:.3f} ms (about {per:.1f} µs on each "
            f"of {acc['kernel_events']} kernels), inside the rows above"
        )
    out.print(line, soft_wrap=True)


def _profile_compare(cmp: dict) -> None:
    t = Table(
        title=f"vs original at ORT_ENABLE_ALL: run {cmp['run_ms_original']:.3f} ms → "
        f"{cmp['run_ms_optimized']:.3f} ms (ratio {cmp['ratio']:.3f})",
        show_edge=False,
    )
    for col in ("op", "original", "optimized", "ms original", "ms optimized", "delta ms"):
        t.add_column(col, justify="left" if col == "op" else "right")
    for r in cmp["ops"]:
        t.add_row(
            r["op"],
            str(r["count_original"]),
            str(r["count_optimized"]),
            f"{r['ms_original']:.3f} [{r['interval_original'][0]:.3f}, "
            f"{r['interval_original'][1]:.3f}]",
            f"{r['ms_optimized']:.3f} [{r['interval_optimized'][0]:.3f}, "
            f"{r['interval_optimized'][1]:.3f}]",
            f"{r['delta_ms']:+.3f}",
        )
    out.print(t)
