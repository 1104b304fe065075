"""Pipeline text: parse, print back canonically, and the -O0..-O3 presets.

Grammar (whitespace ignored)::

    pipeline := item ("," item)*
    item     := NAME ["(" pipeline ")"] ["{" KEY "=" VALUE ("," KEY "=" VALUE)* "}"]

``fixpoint(...){max-iterations=N}`` repeats its children; ``rules{level=N}`` runs every
registered rule up to level N; a pass name runs that pass; consecutive rule names form one rule
set.  A rule set runs its rules phase by phase (cleanups; norms, activations and Conv fusions;
attention; the linear-layer rules that would otherwise take attention's MatMuls; target
lowering: each rule's ``phase``), so the text needs no phase of its own.
Example: ``fold-constants,fixpoint(fuse-conv-bn,matmul-add-to-gemm,dce){max-iterations=8}``.
``max-iterations`` is at least 1, ``level`` 0..3, an option is given once, and fixpoints nest at
most ``MAX_DEPTH`` deep; anything else is a usage error.
"""

from __future__ import annotations

import re

from ..errors import UsageError
from .context import Pass
from .manager import PASSES, RULES, Fixpoint, RuleSetPass

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
    """``text`` with the kernel generation pass (on by default at -O2/-O3 for cpu and cuda, and
    ``optimize --kernels`` for a custom ``--pipeline``): before a final
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


MAX_DEPTH = 16  # nesting of fixpoint(...) a pipeline may have
LEVEL_RANGE = (0, 3)


def parse(text: str) -> list[Pass]:
    """Parse pipeline text into passes; unknown names, malformed or out-of-range options and
    nesting deeper than MAX_DEPTH are usage errors."""
    toks = _tokens(text)
    if not toks:
        return []
    passes, i = _parse_list(toks, 0, 1)
    if i != len(toks):
        raise UsageError(f"pipeline text: unexpected '{toks[i]}'")
    return passes


def _parse_list(toks: list[str], i: int, depth: int) -> tuple[list[Pass], int]:
    if depth > MAX_DEPTH:
        raise UsageError(f"pipeline text: nested more than {MAX_DEPTH} levels deep")
    items: list[Pass] = []
    pending_rules = []
    while True:
        if i >= len(toks) or toks[i] in "(),{}=":
            where = f"'{toks[i]}'" if i < len(toks) else "the end"
            raise UsageError(f"pipeline text: expected a pass name at {where}")
        name = toks[i]
        i += 1
        children = None
        opts: dict[str, str] = {}
        if i < len(toks) and toks[i] == "(":
            children, i = _parse_list(toks, i + 1, depth + 1)
            if i >= len(toks) or toks[i] != ")":
                raise UsageError("pipeline text: missing ')'")
            i += 1
        if i < len(toks) and toks[i] == "{":
            opts, i = _parse_options(toks, i + 1)
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


def _parse_options(toks: list[str], i: int) -> tuple[dict[str, str], int]:
    """``key=value,...}`` from just after the ``{``; returns the options and the index after
    the ``}``."""
    opts: dict[str, str] = {}
    while True:
        if i + 2 >= len(toks) or toks[i + 1] != "=" or toks[i + 2] in "(),{}=":
            raise UsageError("pipeline text: options are written {key=value,...}")
        if toks[i] in opts:
            raise UsageError(f"pipeline text: option {toks[i]} given twice")
        opts[toks[i]] = toks[i + 2]
        i += 3
        if i >= len(toks):
            raise UsageError("pipeline text: missing '}' after options")
        if toks[i] == "}":
            return opts, i + 1
        if toks[i] != ",":
            raise UsageError("pipeline text: expected ',' or '}' in options")
        i += 1


def _int_opt(
    opts: dict[str, str], key: str, default: int | None, lo: int, hi: int | None = None
) -> int | None:
    if key not in opts:
        return default
    text = opts.pop(key)
    try:
        value = int(text)
    except ValueError:
        raise UsageError(f"pipeline text: option {key} must be an integer (got '{text}')") from None
    if value < lo or (hi is not None and value > hi):
        bound = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise UsageError(f"pipeline text: option {key} must be {bound} (got {value})")
    return value


def _make(name: str, children: list[Pass] | None, opts: dict[str, str]) -> Pass:
    if name == "fixpoint":
        if not children:
            raise UsageError("pipeline text: fixpoint needs passes in parentheses")
        p: Pass = Fixpoint(children, _int_opt(opts, "max-iterations", 10, 1))
    elif children is not None:
        raise UsageError(f"pipeline text: '{name}' takes no nested passes")
    elif name == "rules":
        p = RuleSetPass(max_level=_int_opt(opts, "level", None, *LEVEL_RANGE))
    elif name in PASSES:
        p = PASSES[name]()
    else:
        raise UsageError(f"pipeline text: unknown pass or rule '{name}' (see `graphopt rules`)")
    if opts:
        raise UsageError(f"pipeline text: unknown option(s) for {name}: {', '.join(opts)}")
    return p


def to_text(passes: list[Pass]) -> str:
    return ",".join(p.text() for p in passes)
