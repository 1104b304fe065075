"""What a target is, as data, and the registry that target profiles add themselves to.

A :class:`Target` answers the questions rules and passes ask: does this runtime have a kernel for
(op, domain, dtype) at this opset; which rules are disabled here; which execution provider runs
it; what numerical tolerance its parity check uses.  The profiles themselves live in
``graphopt.targets``; ``opt`` only defines the shape of the data.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .errors import UsageError

#: (op_type, domain) -> list of (since_version, end_version or None, frozenset of type strings)
KernelTable = dict[tuple[str, str], list[tuple[int, int | None, frozenset[str]]]]


@dataclass(frozen=True)
class Target:
    name: str
    description: str
    runtime: str
    providers: tuple[str, ...]
    kernels_source: str
    load_kernels: Callable[[], KernelTable] = field(repr=False, compare=False)
    disabled_rules: frozenset[str] = frozenset()
    #: parity tolerance per dtype name: (rtol relative to the output's scale, atol)
    tolerances: dict[str, tuple[float, float]] = field(default_factory=dict)
    #: ops whose kernels on this target accumulate fp16/bf16 math in fp32: op -> source of fact
    fp32_accumulation: dict[str, str] = field(default_factory=dict)
    device_available: bool = True

    def kernels(self) -> KernelTable:
        return _kernel_cache(self)

    def has_kernel(
        self, op: str, domain: str = "", opset: int | None = None, dtype: str | None = None
    ) -> bool:
        """Whether the runtime registers a kernel for op at this opset for this element type."""
        entries = self.kernels().get((op, _norm_domain(domain)))
        if not entries:
            return False
        for since, end, types in entries:
            if opset is not None and (opset < since or (end is not None and opset > end)):
                continue
            if dtype is None or not types or dtype in types:
                return True
        return False

    def accumulates_fp32(self, op: str) -> bool:
        return op in self.fp32_accumulation

    def allows_rule(self, rule: str) -> bool:
        return rule not in self.disabled_rules


def _norm_domain(domain: str | None) -> str:
    return "" if domain in (None, "", "ai.onnx") else domain


_CACHE: dict[str, KernelTable] = {}


def _kernel_cache(target: Target) -> KernelTable:
    if target.name not in _CACHE:
        _CACHE[target.name] = target.load_kernels()
    return _CACHE[target.name]


TARGETS: dict[str, Target] = {}


def register_target(target: Target) -> Target:
    TARGETS[target.name] = target
    return target


def get_target(name: str) -> Target:
    try:
        return TARGETS[name]
    except KeyError:
        raise UsageError(
            f"unknown target '{name}'; known targets: {', '.join(sorted(TARGETS))}"
        ) from None
