"""Pipeline text: parse, print back canonically, and the -O0..-O3 presets.

Grammar (whitespace ignored)::

    pipeline := item ("," item)*
    item     := NAME ["(" pipeline ")"] ["{" KEY "=" VALUE ("," KEY "=" VALUE)* "}"]

``fixpoint(...){max-iterations=N}`` repeats its children; ``rules{level=N}`` runs every
registered rule up to level N; a pass name runs that pass; consecutive rule names form one rule
set.  Example: ``fold-constants,fixpoint(fuse-conv-bn,matmul-add-to-gemm,dce){max-iterations=8}``.
"""

from __future__ import annotations

import re

from .errors import UsageError
from .manager import PASSES, RULES, Fixpoint, Pass, RuleSetPass

LEVEL_NAMES = {
    0: "no optimization",
    1: "exact cleanups: constant folding, dead code, identities, shape glue",
    2: "standard fusions (Conv+BN, MatMul+Add->Gemm, Pad+Conv, ...)",
    3: "fusions that may change numerics, each behind a precision guard",
}


def preset(level: int) -> str:
    """The canonical pipeline text for an optimization level."""
    if level not in LEVEL_NAMES:
        raise UsageError(f"optimization level must be 0..3, got {level}")
    if level == 0:
        return ""
    # Exact cleanups run to convergence first: fusions introduce contrib ops that onnx shape
    # inference cannot see through, so shape glue must be folded before they appear.  After the
    # fusions one more cse merges what they repeated per layer (constants, shape reads); inside
    # that fixpoint it would cost a whole extra iteration on large graphs for that alone.
    cleanup = "fixpoint(fold-constants,simplify-shapes,cse,rules{level=1},dce){max-iterations=32}"
    if level == 1:
        return f"{cleanup},legalize"
    return (
        f"{cleanup},"
        f"fixpoint(fold-constants,simplify-shapes,rules{{level={level}}},dce){{max-iterations=10}}"
        ",cse,legalize"
    )


KERNELS_PASS = "fuse-elementwise"


def with_kernels(text: str) -> str:
    """``text`` with the opt-in kernel generation pass (``optimize --kernels``): before a final
    ``legalize`` (so legalize sees the fused nodes), else at the end; unchanged if present."""
    if KERNELS_PASS in _tokens(text):
        return text
    text = text.strip()
    if not text:
        return KERNELS_PASS
    if text == "legalize" or text.endswith(",legalize"):
        return text[: -len("legalize")] + f"{KERNELS_PASS},legalize"
    return f"{text},{KERNELS_PASS}"


_TOKEN = re.compile(r"\s*([A-Za-z0-9_.\-]+|[(),{}=])")


def _tokens(text: str) -> list[str]:
    pos, out = 0, []
    text = text.strip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m:
            raise UsageError(
                f"pipeline text: unexpected character at {pos}: {text[pos : pos + 10]!r}"
            )
        out.append(m.group(1))
        pos = m.end()
    return out


def parse(text: str) -> list[Pass]:
    """Parse pipeline text into passes; unknown names are a usage error."""
    toks = _tokens(text)
    if not toks:
        return []
    passes, i = _parse_list(toks, 0)
    if i != len(toks):
        raise UsageError(f"pipeline text: unexpected '{toks[i]}'")
    return passes


def _parse_list(toks: list[str], i: int) -> tuple[list[Pass], int]:
    items: list[Pass] = []
    pending_rules = []
    while True:
        if i >= len(toks):
            raise UsageError("pipeline text: expected a pass name at the end")
        name = toks[i]
        i += 1
        children = None
        opts: dict[str, str] = {}
        if i < len(toks) and toks[i] == "(":
            children, i = _parse_list(toks, i + 1)
            if i >= len(toks) or toks[i] != ")":
                raise UsageError("pipeline text: missing ')'")
            i += 1
        if i < len(toks) and toks[i] == "{":
            i += 1
            while True:
                if i + 2 >= len(toks) or toks[i + 1] != "=":
                    raise UsageError("pipeline text: options are written {key=value,...}")
                opts[toks[i]] = toks[i + 2]
                i += 3
                if toks[i] == "}":
                    i += 1
                    break
                if toks[i] != ",":
                    raise UsageError("pipeline text: expected ',' or '}' in options")
                i += 1
        if name in RULES and children is None and not opts:
            pending_rules.append(RULES[name])
        else:
            if pending_rules:
                items.append(RuleSetPass(pending_rules))
                pending_rules = []
            items.append(_make(name, children, opts))
        if i < len(toks) and toks[i] == ",":
            i += 1
            continue
        break
    if pending_rules:
        items.append(RuleSetPass(pending_rules))
    return items, i


def _int_opt(opts: dict[str, str], key: str, default: int | None) -> int | None:
    if key not in opts:
        return default
    try:
        return int(opts.pop(key))
    except ValueError:
        raise UsageError(f"pipeline text: option {key} must be an integer") from None


def _make(name: str, children: list[Pass] | None, opts: dict[str, str]) -> Pass:
    if name == "fixpoint":
        if not children:
            raise UsageError("pipeline text: fixpoint needs passes in parentheses")
        p: Pass = Fixpoint(children, _int_opt(opts, "max-iterations", 10))
    elif name == "rules":
        p = RuleSetPass(max_level=_int_opt(opts, "level", None))
    elif name in PASSES:
        if children is not None:
            raise UsageError(f"pipeline text: pass '{name}' takes no nested passes")
        p = PASSES[name]()
    else:
        raise UsageError(f"pipeline text: unknown pass or rule '{name}' (see `graphopt rules`)")
    if opts:
        raise UsageError(f"pipeline text: unknown option(s) for {name}: {', '.join(opts)}")
    return p


def to_text(passes: list[Pass]) -> str:
    return ",".join(p.text() for p in passes)
