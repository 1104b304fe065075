"""The verdict of an optimization: which exit code a report earns, and the one line that says why.

:func:`decide` reads a :class:`~graphopt.opt.optimizer.Report` (and the ``--expect`` results) in
a fixed order — parity that ran and failed → 3 (also the bundle against the original at its
session settings), a failed generation check of a decoder (``report.generation_failure``) → 3;
a ``verify`` failure (the optimized model invalid or refused by onnxruntime)
→ 1; not converged or a node the target cannot run → 4; parity requested that could not run →
3; unmet expectations → 4; else 0 — and returns a :class:`Verdict`.  The warnings a successful
run still owes (a rewrite reverted by the safety net, parity that could not run while another
verdict decided the code, fallback nodes the original model already had) are lines too; the
caller prints them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import EXIT_ERROR, EXIT_OK, EXIT_PARITY, EXIT_TARGET
from ..remarks import Remark
from ..rewrite.target import get_target
from .gate import Expectation, op_vocabulary, resolve_expectations
from .parity import ParityReport

PARITY_NOT_RUN = "parity could not run"


@dataclass(frozen=True)
class Verdict:
    """An exit code (``errors.EXIT_*``) and its one line (empty when the code is 0)."""

    code: int
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.code == EXIT_OK

    @property
    def parity_not_run(self) -> bool:
        """The code was decided by parity that could not run."""
        return self.reason.startswith(PARITY_NOT_RUN)


def parities(report) -> list[ParityReport]:
    """The parity checks of a report: against the original, and against float64 when asked."""
    return [report.parity] + ([report.parity_float64] if report.parity_float64 else [])


def decide(report, expectations: Sequence[Expectation], checked: bool) -> Verdict:
    """The exit code of an optimization and its one line (``checked``: parity was asked for)."""
    checks = parities(report)
    if checked and any(p.ran and not p.ok for p in checks):
        bad = [o.name for p in checks if p.ran for o in p.outputs if not o.ok]
        return Verdict(
            EXIT_PARITY, f"parity failed (outputs: {', '.join(bad) or 'see report.json'})"
        )
    deployed = getattr(report, "parity_deployed", None)
    if checked and deployed is not None and deployed.ran and not deployed.ok:
        bad = [o.name for o in deployed.outputs if not o.ok]
        return Verdict(EXIT_PARITY, f"parity failed (outputs: {', '.join(bad)}): {deployed.error}")
    if checked and getattr(report, "generation_failure", None):  # greedy decoding differed
        return Verdict(EXIT_PARITY, report.generation_failure)
    failures = [r for r in report.remarks if r.kind == "failure"]
    verify = [r for r in failures if r.pass_name == "verify"]
    if verify:
        return Verdict(EXIT_ERROR, remark_line(verify))
    if not report.converged or not report.legal:  # legalize: a node the target cannot run
        return Verdict(EXIT_TARGET, remark_line(failures) if failures else "exit 4")
    not_run = [p for p in checks if checked and not p.ran]
    if not_run:
        p = not_run[0]
        return Verdict(EXIT_PARITY, f"{PARITY_NOT_RUN}: {p.error}{parity_hint(p)}")
    unmet = [e.text for e in expectations if not e.ok]
    if unmet:
        return Verdict(EXIT_TARGET, f"expectations not met: {', '.join(unmet)}")
    return Verdict(EXIT_OK)


def remark_line(failures: Sequence[Remark]) -> str:
    """The first failure remark as one line, with how many more the report holds."""
    first = failures[0]
    more = f" (+{len(failures) - 1} more in report.json)" if len(failures) > 1 else ""
    return f"{first.rule}: {first.code}: {first.message}{more}"


def parity_hint(parity: ParityReport) -> str:
    """The --shape/--inputs hint for parity whose original failed to run, unless the error
    already carries one."""
    if parity.error and "failed to run" in parity.error and "--shape" not in parity.error:
        return (
            " (random inputs, symbolic dims at default sizes: give real sizes with "
            "--shape NAME=D0,D1,... or real inputs with --inputs FILE.npz)"
        )
    return ""


def parity_not_run_warnings(report, checked: bool) -> list[str]:
    """One line per parity check that was asked for and could not run."""
    if not checked:
        return []
    return [
        f"parity vs {p.reference} not run: {p.error}{parity_hint(p)}"
        for p in parities(report)
        if not p.ran
    ]


def safety_net_warnings(report) -> list[str]:
    """One line per rewrite the safety net reverted because it made the model invalid or broke
    parity (the run succeeds, loudly)."""
    return [
        f"safety net: {r.message}"
        for r in report.remarks
        if r.kind == "failure"
        and r.pass_name == "safety-net"
        and r.code in ("invalid-output", "parity-failure")
    ]


def fallback_warnings(report) -> list[str]:
    """The lines a run owes about nodes on the fallback provider that are not its failures: one
    for those the original model already ran there (legalize's ``original-fallback`` remarks:
    not graphopt's doing, not the user's to fix, so not exit 4 unless ``--strict-fallback``),
    and one when most of the model runs there (``mostly-fallback``)."""
    legalize = [r for r in report.remarks if r.pass_name == "legalize"]
    inherited = [r for r in legalize if r.kind == "analysis" and r.code == "original-fallback"]
    lines = []
    if inherited:
        kinds: dict[str, int] = {}
        for r in inherited:
            label = f"{r.args.get('op')} {r.args.get('dtype') or 'unknown dtype'}"
            kinds[label] = kinds.get(label, 0) + 1
        named = ", ".join(
            f"{k} x{n}" if n > 1 else k for k, n in sorted(kinds.items(), key=lambda kv: -kv[1])
        )
        islands = {r.args.get("island") for r in inherited}
        copies = sum(
            int(r.args.get("copies", 0))
            for r in legalize
            if r.code == "fallback-island" and r.args.get("island") in islands
        )
        provider = next(
            (r.args.get("provider") for r in legalize if r.code == "fallback-island"), None
        )
        lines.append(
            f"{len(inherited)} node(s) run on {provider or 'the fallback provider'} as in the "
            f"original model ({named}): {len(islands)} island(s), {copies} device<->host "
            f"cop{'y' if copies == 1 else 'ies'} per inference (manifest.json -> fallbacks; "
            "--strict-fallback makes them exit 4)"
        )
    lines += [r.message for r in legalize if r.code == "mostly-fallback"]
    return lines


def resolve_report_expectations(
    expectations: list[Expectation], report, target: str
) -> list[Expectation]:
    """``--expect`` op names in full (``FusedConv`` → ``com.microsoft.FusedConv``), from the
    report's ops and the target's kernels; an unknown op is a usage error."""
    if not expectations:
        return expectations
    vocabulary = op_vocabulary(
        report.ops_before, report.ops_after, kernels=get_target(target).kernels()
    )
    return resolve_expectations(expectations, vocabulary)
