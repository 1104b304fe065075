"""The verdict of an optimization (opt/verify/verdict.py): which exit code a report earns, in which
order the checks decide, and the warnings a run still owes."""

from types import SimpleNamespace

import pytest

from graphopt.opt import errors
from graphopt.opt.remarks import Remark
from graphopt.opt.verify.gate import Expectation
from graphopt.opt.verify.parity import OutputDiff, ParityReport
from graphopt.opt.verify.verdict import (
    PARITY_NOT_RUN,
    Verdict,
    decide,
    parity_hint,
    parity_not_run_warnings,
    resolve_report_expectations,
    safety_net_warnings,
)


def diff(name: str, ok: bool) -> OutputDiff:
    return OutputDiff(name, "float32", [1], 0.0, 0.0, 0.0, 0.0, 1.0, ok, 1e-4, 0.0)


OK = ParityReport(ok=True, ran=True, outputs=[diff("y", True)])
BAD = ParityReport(ok=False, ran=True, outputs=[diff("y", False), diff("z", True)])
NOT_RUN = ParityReport.not_run("the original failed to run: Reshape")
VERIFY = Remark("failure", "verify", "verify", "ort-refused", (), "onnxruntime refused it")
ILLEGAL = Remark("failure", "legalize", "legalize", "no-kernel", ("n",), "no kernel for X")
UNMET = Expectation("Relu", ">=", 2, actual=1, ok=False)
MET = Expectation("Relu", ">=", 1, actual=1, ok=True)
GEN = "generation check failed: greedy tokens differ from decode step 2"


def report(
    parity=OK, f64=None, deployed=None, remarks=(), converged=True, legal=True, generation=None
) -> SimpleNamespace:
    return SimpleNamespace(
        parity=parity,
        parity_float64=f64,
        parity_deployed=deployed,
        generation_failure=generation,
        remarks=list(remarks),
        converged=converged,
        legal=legal,
    )


@pytest.mark.parametrize(
    "rep, expectations, checked, code, reason",
    [
        (report(), [MET], True, errors.EXIT_OK, ""),
        (report(parity=BAD), [], True, errors.EXIT_PARITY, "parity failed (outputs: y)"),
        (report(f64=BAD), [], True, errors.EXIT_PARITY, "parity failed (outputs: y)"),
        (report(parity=BAD), [], False, errors.EXIT_OK, ""),  # --no-check: parity not judged
        (report(deployed=BAD), [], True, errors.EXIT_PARITY, "parity failed (outputs: y): None"),
        (report(generation=GEN), [], True, errors.EXIT_PARITY, GEN),
        (report(generation=GEN), [], False, errors.EXIT_OK, ""),
        (report(remarks=[VERIFY]), [], True, errors.EXIT_ERROR, "verify: ort-refused: onnx"),
        (report(legal=False, remarks=[ILLEGAL]), [], True, errors.EXIT_TARGET, "legalize: no-k"),
        (report(converged=False), [], True, errors.EXIT_TARGET, "exit 4"),
        (report(parity=NOT_RUN), [], True, errors.EXIT_PARITY, PARITY_NOT_RUN),
        (report(parity=NOT_RUN), [], False, errors.EXIT_OK, ""),
        (report(), [MET, UNMET], True, errors.EXIT_TARGET, "expectations not met: Relu>=2"),
    ],
)
def test_exit_code_table(rep, expectations, checked, code, reason):
    verdict = decide(rep, expectations, checked)
    assert verdict.code == code and verdict.reason.startswith(reason)
    assert verdict.ok == (code == errors.EXIT_OK)
    assert (verdict.reason == "") == verdict.ok


def test_first_check_in_order_decides():
    """Failed parity (or generation) outranks an invalid output, which outranks a node the
    target cannot run, parity that could not run and unmet expectations."""
    everything = report(parity=BAD, remarks=[VERIFY, ILLEGAL], legal=False)
    assert decide(report(remarks=[VERIFY], generation=GEN), [], True).reason == GEN
    assert decide(everything, [UNMET], True).code == errors.EXIT_PARITY
    assert decide(report(remarks=[VERIFY, ILLEGAL], legal=False), [UNMET], True).code == 1
    no_kernel = report(parity=NOT_RUN, remarks=[ILLEGAL], legal=False)
    assert decide(no_kernel, [UNMET], True).code == errors.EXIT_TARGET
    assert decide(report(parity=NOT_RUN), [UNMET], True).code == errors.EXIT_PARITY


def test_more_failures_are_counted_in_the_line():
    two = report(legal=False, remarks=[ILLEGAL, ILLEGAL])
    assert decide(two, [], True).reason.endswith("(+1 more in report.json)")


def test_parity_not_run_carries_the_hint_once():
    verdict = decide(report(parity=NOT_RUN), [], True)
    assert verdict.parity_not_run and verdict.reason.count("--shape") == 1
    carried = ParityReport.not_run("the original failed to run; give real sizes with --shape X")
    assert parity_hint(carried) == "" and "--shape" in parity_hint(NOT_RUN)
    assert parity_hint(ParityReport.not_run("no onnxruntime")) == ""


def test_warnings_owed_by_a_run():
    rep = report(parity=NOT_RUN, f64=NOT_RUN)
    lines = parity_not_run_warnings(rep, checked=True)
    assert [line.split(":")[0] for line in lines] == ["parity vs original not run"] * 2
    assert parity_not_run_warnings(rep, checked=False) == []
    reverted = Remark("failure", "safety-net", "r", "invalid-output", ("n",), "reverted r at n")
    other = Remark("failure", "safety-net", "r", "budget-exhausted", ("n",), "out of time")
    assert safety_net_warnings(report(remarks=[reverted, other])) == ["safety net: reverted r at n"]


def test_verdict_value():
    assert Verdict(0).ok and not Verdict(3, "parity failed").ok
    assert Verdict(3, f"{PARITY_NOT_RUN}: why").parity_not_run


def test_expectations_take_the_short_op_name_of_the_target():
    rep = SimpleNamespace(ops_before={"Conv": 1}, ops_after={"com.microsoft.FusedConv": 1})
    [e] = resolve_report_expectations([Expectation("FusedConv", ">=", 1)], rep, "cuda")
    assert e.op == "com.microsoft.FusedConv"
    assert resolve_report_expectations([], rep, "cuda") == []
    with pytest.raises(errors.UsageError, match="unknown op 'FusdConv'"):
        resolve_report_expectations([Expectation("FusdConv", ">=", 1)], rep, "cuda")
