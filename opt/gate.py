"""CI gate pieces: op-count expectations and JUnit XML.

``--expect "MultiHeadAttention>=12,LayerNormalization>=25"`` asserts on the optimized model's
op histogram, so a CI notices when an exporter change silently breaks a fusion.  JUnit XML holds
one test case per parity output and per expectation, for CI systems that render test reports.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any
from xml.sax.saxutils import escape, quoteattr

from .errors import UsageError
from .parity import ParityReport

_EXPECT = re.compile(r"^\s*([A-Za-z0-9_.]+)\s*(>=|<=|==|!=|>|<)\s*(\d+)\s*$")
_OPS = {
    ">=": lambda a, b: a >= b,
    "<=": lambda a, b: a <= b,
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
    ">": lambda a, b: a > b,
    "<": lambda a, b: a < b,
}


@dataclass(frozen=True)
class Expectation:
    op: str
    cmp: str
    count: int
    actual: int = 0
    ok: bool = False

    @property
    def text(self) -> str:
        return f"{self.op}{self.cmp}{self.count}"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "text": self.text}


def parse_expectations(specs: list[str] | None) -> list[Expectation]:
    out = []
    for spec in specs or []:
        for part in filter(None, (p.strip() for p in spec.split(","))):
            m = _EXPECT.match(part)
            if not m:
                raise UsageError(f"--expect: '{part}' is not OP>=N (also <=, ==, !=, >, <)")
            out.append(Expectation(m.group(1), m.group(2), int(m.group(3))))
    return out


def evaluate_expectations(
    expectations: list[Expectation], ops: dict[str, int]
) -> list[Expectation]:
    return [
        Expectation(e.op, e.cmp, e.count, ops.get(e.op, 0), _OPS[e.cmp](ops.get(e.op, 0), e.count))
        for e in expectations
    ]


def junit_xml(suite: str, parity: list[ParityReport], expectations: list[Expectation]) -> str:
    """One <testcase> per parity output and per expectation."""
    cases = []
    for p in parity:
        if not p.ran:
            cases.append(_case(f"parity[{p.reference}]", "parity", skipped=p.error or "not run"))
            continue
        if p.error:
            cases.append(_case(f"parity[{p.reference}]", "parity", failure=p.error))
        for d in p.outputs:
            detail = (
                f"max_abs={d.max_abs:.3g} max_rel={d.max_rel:.3g} mismatch={d.mismatch:.3%}"
                f" cosine={d.cosine:.6f} nonfinite_mismatch={d.nonfinite_mismatch}"
            )
            cases.append(
                _case(
                    f"parity[{p.reference}].{d.name}",
                    "parity",
                    failure=None if d.ok else detail,
                    out=detail,
                )
            )
    for e in expectations:
        cases.append(
            _case(
                f"expect.{e.text}",
                "expectations",
                failure=None if e.ok else f"{e.op} count is {e.actual}, expected {e.cmp}{e.count}",
            )
        )
    failures = sum("<failure" in c for c in cases)
    skipped = sum("<skipped" in c for c in cases)
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f'<testsuite name={quoteattr(suite)} tests="{len(cases)}" '
        f'failures="{failures}" skipped="{skipped}">\n' + "".join(cases) + "</testsuite>\n"
    )


def _case(
    name: str,
    classname: str,
    *,
    failure: str | None = None,
    skipped: str | None = None,
    out: str | None = None,
) -> str:
    body = ""
    if failure is not None:
        body += f"<failure message={quoteattr(failure)}>{escape(failure)}</failure>"
    if skipped is not None:
        body += f"<skipped message={quoteattr(skipped)}/>"
    if out:
        body += f"<system-out>{escape(out)}</system-out>"
    return (
        f"  <testcase classname={quoteattr('graphopt.' + classname)} name={quoteattr(name)}>"
        f"{body}</testcase>\n"
    )
