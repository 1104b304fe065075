"""Operator domains: the one place that says which spellings name the same domain.

ONNX writes its default operator set as ``""`` or ``"ai.onnx"`` (and onnx-graphsurgeon leaves a
node's domain ``None``); every other domain, ``com.microsoft`` included, is named exactly.
"""

from __future__ import annotations

DEFAULT = ""
MS = "com.microsoft"
#: the custom-op domain of the element-wise kernels graphopt generates (targets.codegen)
GENERATED = "graphopt.fused"
_DEFAULT_SPELLINGS = (None, "", "ai.onnx")


def norm_domain(domain: str | None) -> str:
    """The canonical spelling: ``""`` for the default domain, else the name itself."""
    return DEFAULT if domain in _DEFAULT_SPELLINGS else str(domain)


def spellings(domains: frozenset[str]) -> frozenset[str | None]:
    """Every spelling of canonical ``domains`` (``norm_domain`` of a spelling is in them)."""
    extra = _DEFAULT_SPELLINGS if DEFAULT in domains else ()
    return frozenset(domains) | frozenset(extra)


def is_default(domain: str | None) -> bool:
    """Whether ``domain`` is ONNX's default operator set."""
    return domain in _DEFAULT_SPELLINGS


def same_domain(a: str | None, b: str | None) -> bool:
    """Whether two spellings name the same domain."""
    return norm_domain(a) == norm_domain(b)


def in_domains(domain: str | None, *domains: str | None) -> bool:
    """Whether ``domain`` is one of ``domains`` (each in any spelling)."""
    return norm_domain(domain) in {norm_domain(d) for d in domains}


#: default-domain ops that draw random numbers (a seed attribute makes one repeatable)
RANDOM_OPS = frozenset(
    {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial"}
    | {"Bernoulli"}
)
