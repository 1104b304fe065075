"""CI gate pieces: op-count expectations and JUnit XML.

``--expect "MultiHeadAttention>=12,LayerNormalization>=25"`` asserts on the optimized model's
op histogram, so a CI notices when an exporter change silently breaks a fusion.  JUnit XML holds
one test case per parity output and per expectation, for CI systems that render test reports.
Op names are ``domain.op`` outside the default domain (the keys of ``ops_after``); the short form
(``FusedConv`` for ``com.microsoft.FusedConv``) is accepted when it names one op, and a name that
is no op at all is a usage error that suggests the nearest names.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
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


def op_vocabulary(*histograms: dict[str, int], kernels: Iterable[tuple[str, str]] = ()) -> set[str]:
    """Every op name an expectation may use: the models' ops, the target's kernels (as
    ``domain.op`` outside the default domain) and the standard ONNX ops."""
    import onnx.defs

    names = {k for h in histograms for k in h}
    names |= {f"{d}.{op}" if d else op for op, d in kernels}
    names |= {
        s.name if s.domain in ("", "ai.onnx") else f"{s.domain}.{s.name}"
        for s in onnx.defs.get_all_schemas()
    }
    return names


def resolve_op(name: str, vocabulary: set[str], flag: str) -> str:
    """``name`` itself when known, else the one ``domain.name`` it abbreviates; a usage error
    naming the candidates (ambiguous) or the nearest names (unknown) otherwise."""
    if name in vocabulary:
        return name
    full = sorted(v for v in vocabulary if v.rsplit(".", 1)[-1] == name)
    if len(full) == 1:
        return full[0]
    if full:
        raise UsageError(f"{flag}: '{name}' is ambiguous: {', '.join(full)}")
    raise UsageError(f"{flag}: unknown op '{name}'{suggest(name, vocabulary)}")


def suggest(name: str, names: Iterable[str], n: int = 3) -> str:
    """``"; did you mean A, B?"`` with the nearest names (short forms compared too)."""
    names = sorted(set(names))
    short = {v.rsplit(".", 1)[-1].lower(): v for v in names}
    near = difflib.get_close_matches(name, names, n=n, cutoff=0.6)
    near += [short[k] for k in difflib.get_close_matches(name.lower(), list(short), n=n)]
    near = list(dict.fromkeys(near))[:n]
    return f"; did you mean {', '.join(near)}?" if near else ""


def resolve_expectations(
    expectations: list[Expectation], vocabulary: set[str]
) -> list[Expectation]:
    return [replace(e, op=resolve_op(e.op, vocabulary, "--expect")) for e in expectations]


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
