"""What a target is, as data, and the registry that target profiles add themselves to.

A :class:`Target` answers the questions rules and passes ask: does this runtime have a kernel for
(op, domain, dtype) at this opset; which rules are disabled here; which execution provider runs
it; what numerical tolerance its parity check uses.  The profiles themselves live in
``graphopt.targets``; ``opt`` only defines the shape of the data.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import UsageError
from ..graph.domains import norm_domain
from ..registry import Registry

FLOAT16 = "tensor(float16)"
FLOAT = "tensor(float)"

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
    #: fused ops measured slower on this target than what they replace: op -> the measurement
    #: (rules refuse to emit them with a "slower-on-target" remark quoting it)
    measured_slower: dict[str, str] = field(default_factory=dict)
    #: fused ops measured slower than what they replace while a static size stays below a
    #: bound: op -> (bound, the measurement).  For MultiHeadAttention the size is the key
    #: sequence length of an attention that takes an attention_bias (without one the kernel
    #: was measured faster at every length); a symbolic length is not refused.
    slower_below: dict[str, tuple[int, str]] = field(default_factory=dict)
    device_available: bool = True
    #: version of the runtime / kernel library the table describes ("1.32.0", "TensorRT 10.15")
    runtime_version: str = ""
    #: preferred lowering per concept, e.g. {"pixel-shuffle": "DepthToSpace", "relu6": "Clip"};
    #: target rewrites read this instead of target names
    prefers: dict[str, str] = field(default_factory=dict)
    #: why each preference holds (a measurement or a source), shown by `graphopt targets show`
    prefers_why: dict[str, str] = field(default_factory=dict)
    #: attribute values a kernel accepts where it accepts fewer than the op's schema:
    #: op -> attribute -> values (with the source in kernel_attributes_why)
    kernel_attributes: dict[str, dict[str, tuple[str, ...]]] = field(default_factory=dict)
    kernel_attributes_why: dict[str, str] = field(default_factory=dict)
    #: numerics-changing rewrites (rule names) this target accepts below -O3
    approximations: frozenset[str] = frozenset()
    #: every tensor must have a static shape (ahead-of-time compilers)
    static_shapes: bool = False
    #: the runtime runs an op without a kernel by inlining its ONNX function body
    expands_functions: bool = False
    #: the runtime runs a float16 node that has only a float kernel by casting around it
    #: (onnxruntime's InsertCastTransformer on the CPU provider)
    fp16_via_float: bool = False
    #: target whose kernels run the nodes this one has no kernel for (cuda: "cpu"); each such
    #: node is a fallback island costing device<->host copies
    fallback: str | None = None
    #: memory layout of image tensors in the target's kernels
    layout: str = "NCHW"
    #: onnxruntime session settings of the bundle (graph_optimization_level, ...); empty when
    #: the runtime is not onnxruntime
    session: dict[str, Any] = field(default_factory=dict)

    def kernels(self) -> KernelTable:
        return _kernel_cache(self)

    def has_kernel(
        self, op: str, domain: str = "", opset: int | None = None, dtype: str | None = None
    ) -> bool:
        """Whether the runtime registers a kernel for op at this opset for this element type."""
        entries = self.kernels().get((op, norm_domain(domain)))
        if not entries:
            return False
        for since, end, types in entries:
            if opset is not None and (opset < since or (end is not None and opset > end)):
                continue
            if dtype is None or not types or dtype in types:
                return True
        return False

    def runs_fused(
        self,
        op: str,
        domain: str,
        opset: int | None,
        dtype: str | None,
        instead_of: tuple[str, str, int | None],
    ) -> bool:
        """Whether the target runs ``op``, a fused node taking over the compute of
        ``instead_of`` ((op, domain, opset) of the node it fuses away), for ``dtype``: with a
        kernel for it, or, where the runtime runs a float16 node by casting around its float
        kernel (``fp16_via_float``), when it runs both that way: the fused node sits inside the
        casts the replaced node already had, so it adds none (and the nodes fused into it lose
        theirs)."""
        if self.has_kernel(op, domain, opset, dtype):
            return True
        return self.runs_via_float(op, domain, opset, dtype) and self.runs_via_float(
            *instead_of, dtype
        )

    def runs_via_float(self, op: str, domain: str, opset: int | None, dtype: str | None) -> bool:
        """Whether the runtime runs a ``dtype`` node of ``op`` by casting it to float around
        its float kernel: float16 on a ``fp16_via_float`` runtime, no float16 kernel, a float
        one."""
        return (
            dtype == FLOAT16
            and self.fp16_via_float
            and not self.has_kernel(op, domain, opset, FLOAT16)
            and self.has_kernel(op, domain, opset, FLOAT)
        )

    def accumulates_fp32(self, op: str) -> bool:
        return op in self.fp32_accumulation

    def allows_rule(self, rule: str) -> bool:
        return rule not in self.disabled_rules


_CACHE: dict[str, KernelTable] = {}


def _kernel_cache(target: Target) -> KernelTable:
    if target.name not in _CACHE:
        _CACHE[target.name] = target.load_kernels()
    return _CACHE[target.name]


TARGETS: dict[str, Target] = Registry()


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


#: the onnxruntime session settings a bundle runs a model with on a target, ``(target, model)
#: -> dict``: installed by the bundle writer (:mod:`graphopt.targets.bundle`) so that the
#: performance net times a model as it is deployed
_SESSION_SETTINGS: list[Callable[[Target, Any], dict[str, Any]]] = []


def register_session_settings(settings: Callable[[Target, Any], dict[str, Any]]):
    _SESSION_SETTINGS[:] = [settings]
    return settings


#: the module whose import registers them (a command that writes no bundle, ``gate``, still
#: times models as bundles run them)
BUNDLE_WRITER = "graphopt.targets.bundle"


def session_settings(target: Target, model: Any) -> dict[str, Any]:
    """The session settings of ``model``'s bundle on ``target`` (see :data:`_SESSION_SETTINGS`)."""
    if not _SESSION_SETTINGS:
        importlib.import_module(BUNDLE_WRITER)
    return _SESSION_SETTINGS[0](target, model)
