"""Which kernel of a target runs a node: the lookup legalize checks and the bundle's manifest lists.

A node is resolved against its target's kernel table by (op, domain, opset, dtype):

* ``dtype`` is the node's *primary* element type: that of its first present input (the data
  operand of nearly every op), or of its first output for nodes without inputs.  Kernel tables
  hold the union of an op's type constraints (as onnxruntime's registry and documents list
  them), so a secondary operand (Reshape's int64 shape) cannot be told apart anyway.
* ``opset`` is the model's opset import for the node's domain; a kernel entry matches when
  ``since <= opset <= end``, and its ``since`` is the kernel's version in the manifest.
* A node the target has no kernel for may still run:
  - on runtimes that inline ONNX functions (onnxruntime: ``expands_functions``), as the op's
    function body, when every op of the body resolves (context-dependent bodies need types and
    are accepted unchecked, and say so);
  - on the target's ``fallback`` target (cuda -> cpu), which legalize reports as an island.
* A call of a model-local function (``ModelProto.functions``, when the IR kept one) is judged by
  its body, recursively through nested calls and subgraphs, at the function's own opset
  imports: it runs when every body node does (element types are not checked there: the body's
  types follow the call's), falls back when some body node only falls back, and otherwise fails
  with the first body node's code, named in the message.

Why this lives in ``targets/``: it reads target profiles and their documents; the ``legalize``
pass (``passes/legalize.py``) and the bundle writer (``targets/bundle.py``) both use it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np
import onnx

from graphopt.opt.graph.compat import FunctionId, proto_nodes
from graphopt.opt.graph.domains import norm_domain
from graphopt.opt.graph.ir import Node, Tensor, Variable, type_string
from graphopt.opt.rewrite.target import TARGETS, Target

OK = "ok"
#: domains of kernels graphopt generates itself, and the providers their libraries serve
#: (targets/codegen: the node exists only when its kernel was built and passed the gates)
GENERATED_DOMAINS = {"graphopt.fused": ("CPUExecutionProvider", "CUDAExecutionProvider")}


@dataclass(frozen=True)
class Resolution:
    """How a node runs on a target: ``status`` ok / fallback / a failure code."""

    status: str
    target: str
    provider: str
    op: str
    domain: str
    opset: int | None
    dtype: str | None
    since: int | None = None
    end: int | None = None
    kind: str = "kernel"  # kernel | function-body(-unchecked) | fallback | generated | none
    message: str = ""

    @property
    def runs(self) -> bool:
        return self.status in (OK, "fallback")

    def kernel_def(self) -> str | None:
        """onnxruntime's spelling: ``CPUExecutionProvider::ai.onnx::Conv(11+) T=tensor(float)``."""
        if self.since is None:
            return None
        rng = (
            f"{self.since}+"
            if self.end is None
            else (f"{self.since}" if self.end == self.since else f"[{self.since}, {self.end}]")
        )
        dom = self.domain or "ai.onnx"
        return f"{self.provider}::{dom}::{self.op}({rng})" + (
            f" T={self.dtype}" if self.dtype else ""
        )

    def to_dict(self) -> dict:
        return {
            "provider": self.provider,
            "op": self.op,
            "domain": self.domain or "ai.onnx",
            "since_version": self.since,
            "end_version": self.end,
            "dtype": self.dtype,
            "kind": self.kind,
            "kernel_def": self.kernel_def(),
        }


def tensor_type(t: Tensor | None) -> str | None:
    """``tensor(float)`` (or ``seq(tensor(float))``) for a tensor of known element type."""
    if t is None or (isinstance(t, Variable) and not t.name):
        return None
    # sequence/optional/map: kept by opt/graph/ir.py
    proto = getattr(t, "graphopt_type_proto", None)
    if proto is not None:
        return _type_proto_string(proto)
    if t.dtype is None:
        return None
    try:
        name = type_string(np.dtype(t.dtype))
    except (TypeError, ValueError, KeyError):
        return None
    return f"seq({name})" if getattr(t, "type", "tensor") in ("sequence", "sequence_type") else name


def _type_proto_string(tp: onnx.TypeProto) -> str | None:
    """onnxruntime's spelling of a TypeProto: ``seq(tensor(float))``, ``optional(...)``."""
    kind = tp.WhichOneof("value")
    if kind == "tensor_type":
        if not tp.tensor_type.elem_type:
            return None
        return f"tensor({onnx.TensorProto.DataType.Name(tp.tensor_type.elem_type).lower()})"
    if kind == "sequence_type":
        inner = _type_proto_string(tp.sequence_type.elem_type)
        return f"seq({inner})" if inner else None
    if kind == "optional_type":
        inner = _type_proto_string(tp.optional_type.elem_type)
        return f"optional({inner})" if inner else None
    return None


@lru_cache(maxsize=4096)
def primary_slots(
    op: str, domain: str, opset: int | None
) -> tuple[tuple[str, int, frozenset[str]], ...]:
    """Where a node's kernel-selecting element type is, best first: ("input"|"output", index,
    the kinds of type the slot takes: "tensor", "seq", "optional", ...).

    From the ONNX schema: formal inputs, then outputs, whose type is a type variable with more
    than one allowed type (Where's bool condition, DynamicQuantizeLinear's float-only input and
    Reshape's int64 shape are fixed, so they do not choose the kernel).  Ops ONNX does not
    define (com.microsoft, custom): the first input, else the first output.
    """
    anything = frozenset({"tensor", "seq", "optional", "map", "sparse_tensor"})
    try:
        schema = onnx.defs.get_schema(op, opset or onnx.defs.onnx_opset_version(), domain)
    except onnx.defs.SchemaError:
        return (("input", 0, anything), ("output", 0, anything))
    kinds = {
        tc.type_param_str: frozenset(t.split("(")[0] for t in tc.allowed_type_strs)
        for tc in schema.type_constraints
        if len(tc.allowed_type_strs) > 1
    }
    slots = [
        ("input", i, kinds[f.type_str]) for i, f in enumerate(schema.inputs) if f.type_str in kinds
    ]
    last = schema.inputs[-1] if schema.inputs else None
    if (
        slots
        and last is not None
        and last.type_str in kinds
        and (last.option == onnx.defs.OpSchema.FormalParameterOption.Variadic)
    ):
        n = len(schema.inputs)
        slots += [("input", i, kinds[last.type_str]) for i in range(n, n + 8)]
    slots += [
        ("output", i, kinds[f.type_str])
        for i, f in enumerate(schema.outputs)
        if f.type_str in kinds
    ]
    return tuple(slots) or (("input", 0, anything), ("output", 0, anything))


def primary_dtype(node: Node, opset: int | None = None) -> str | None:
    """The type a node's kernel is chosen by (see :func:`primary_slots`); None when unknown."""
    for kind, i, takes in primary_slots(node.op, norm_domain(node.domain), opset):
        tensors = node.inputs if kind == "input" else node.outputs
        t = tensors[i] if i < len(tensors) else None
        if t is None or not t.name:
            continue  # an absent optional input: the next slot decides
        name = tensor_type(t)
        # unknown, or a plain tensor type where the slot takes sequences (the IR lost the type)
        return name if name is not None and name.split("(")[0] in takes else None
    return None


def provider_of(target: Target) -> str:
    return target.providers[0] if target.providers else target.name


def domains_of(target: Target) -> set[str]:
    return {d for (_, d) in target.kernels()}


def resolve(
    target: Target,
    op: str,
    domain: str | None,
    opset: int | None,
    dtype: str | None,
    *,
    _depth: int = 0,
) -> Resolution:
    """Resolve (op, domain, opset, dtype) against ``target`` (and its fallback)."""
    own = _resolve_own(target, op, norm_domain(domain), opset, dtype, _depth)
    if own.runs or target.fallback is None or target.fallback not in TARGETS:
        return own
    fb = _resolve_own(TARGETS[target.fallback], op, norm_domain(domain), opset, dtype, _depth)
    if not fb.runs:
        return own
    return Resolution(
        "fallback",
        fb.target,
        fb.provider,
        op,
        norm_domain(domain),
        opset,
        dtype,
        fb.since,
        fb.end,
        "fallback",
        f"no {provider_of(target)} kernel ({own.message}); runs on {fb.provider}",
    )


def _resolve_own(
    target: Target, op: str, domain: str, opset: int | None, dtype: str | None, depth: int
) -> Resolution:
    provider = provider_of(target)

    def fail(code: str, message: str) -> Resolution:
        body = _function_body(target, op, domain, opset, dtype, depth) if code != OK else None
        if body is not None:
            return body
        return Resolution(
            code, target.name, provider, op, domain, opset, dtype, None, None, "none", message
        )

    if op == "Constant" and not domain:
        return Resolution(
            OK,
            target.name,
            provider,
            op,
            domain,
            opset,
            dtype,
            None,
            None,
            "constant",
            "a constant: loaded as data, no kernel runs",
        )
    if domain in GENERATED_DOMAINS and provider in GENERATED_DOMAINS[domain]:
        return Resolution(
            OK,
            target.name,
            provider,
            op,
            domain,
            opset,
            dtype,
            1,
            None,
            "generated",
            "a kernel graphopt generated (custom-op library in the bundle's kernels/)",
        )
    if dtype == "tensor(float16)" and target.fp16_via_float:
        exact = _resolve_own(replace(target, fp16_via_float=False), op, domain, opset, dtype, depth)
        if exact.status != OK or exact.kind.startswith("function"):
            wide = _resolve_own(target, op, domain, opset, "tensor(float)", depth)
            if wide.status == OK and wide.kind == "kernel":
                return replace(
                    wide,
                    dtype=dtype,
                    kind="float16-via-float",
                    message="no float16 kernel; the runtime casts to float around it",
                )
        return replace(exact, target=target.name)
    entries = target.kernels().get((op, domain))
    label = f"{domain + '.' if domain else ''}{op}"
    if not entries:
        if domain and domain not in domains_of(target):
            return fail(
                "unknown-domain",
                f"domain '{domain}' is not one {target.name} runs (it has "
                f"{', '.join(sorted(d or 'ai.onnx' for d in domains_of(target)))})",
            )
        return fail("no-kernel", f"{target.name} has no kernel for {label}")
    if opset is None:
        return fail(
            "opset-unsupported", f"the model imports no opset for domain '{domain or 'ai.onnx'}'"
        )
    in_range = [e for e in entries if e[0] <= opset and (e[1] is None or opset <= e[1])]
    if not in_range:
        ranges = ", ".join(f"{s}+" if e is None else f"{s}-{e}" for s, e, _ in entries)
        return fail(
            "opset-unsupported",
            f"{target.name} has {label} kernels for opsets {ranges}, not {opset}",
        )
    for since, end, types in in_range:
        if dtype is None or not types or dtype in types:
            return Resolution(OK, target.name, provider, op, domain, opset, dtype, since, end)
    types = sorted({t for _, _, ts in in_range for t in ts})
    return fail(
        "dtype-unsupported",
        f"{target.name}'s {label} kernels take {', '.join(types[:8])}"
        f"{' ...' if len(types) > 8 else ''}, not {dtype}",
    )


def _function_body(
    target: Target, op: str, domain: str, opset: int | None, dtype: str | None, depth: int
) -> Resolution | None:
    """The op as its ONNX function body, when the runtime inlines functions and can run it."""
    if not target.expands_functions or opset is None or depth > 2:
        return None
    try:
        schema = onnx.defs.get_schema(op, opset, domain)
    except onnx.defs.SchemaError:
        return None
    provider = provider_of(target)
    if schema.has_function:
        body = schema.function_body
        for n in body.node:
            sub = resolve(target, n.op_type, n.domain, opset, None, _depth=depth + 1)
            if not sub.runs:
                return None
        return Resolution(
            OK,
            target.name,
            provider,
            op,
            domain,
            opset,
            dtype,
            schema.since_version,
            None,
            "function-body",
            f"no kernel; runs as its ONNX function body "
            f"({', '.join(sorted({n.op_type for n in body.node}))})",
        )
    if schema.has_context_dependent_function:
        return Resolution(
            OK,
            target.name,
            provider,
            op,
            domain,
            opset,
            dtype,
            schema.since_version,
            None,
            "function-body-unchecked",
            "no kernel; runs as its context-dependent ONNX function body "
            "(built from the node's types at load time; not checked here)",
        )
    return None


def resolve_node(
    target: Target,
    node: Node,
    opsets: dict[str, int],
    functions: dict[FunctionId, onnx.FunctionProto] | None = None,
) -> Resolution:
    """How ``node`` runs on ``target``; ``functions``: the model-local functions by id."""
    domain = norm_domain(node.domain)
    opset = opsets.get(domain)
    dtype = primary_dtype(node, opset)
    direct = resolve(target, node.op, domain, opset, dtype)
    if functions and (node.domain or "", node.op) in functions and direct.status != OK:
        # a kernel the provider claims (a generated kernel) runs instead of the body, as in
        # onnxruntime; without one the call runs its body
        return resolve_call(target, (node.domain or "", node.op), functions, opsets, dtype)
    return direct


def resolve_call(
    target: Target,
    fid: FunctionId,
    functions: dict[FunctionId, onnx.FunctionProto],
    opsets: dict[str, int],
    dtype: str | None = None,
    _stack: tuple[FunctionId, ...] = (),
) -> Resolution:
    """A call of a model-local function, judged by its body (see the module docstring)."""
    func = functions[fid]
    domain, label = norm_domain(fid[0]), ".".join(p for p in fid if p)
    inner = {**opsets, **model_opsets(func.opset_import)}
    provider = provider_of(target)

    def verdict(status: str, kind: str, message: str, prov: str = provider) -> Resolution:
        return Resolution(
            status,
            target.name,
            prov,
            fid[1],
            domain,
            inner.get(domain),
            dtype,
            None,
            None,
            kind,
            message,
        )

    fallback = None
    for n in proto_nodes(func.node):
        call = (n.domain, n.op_type)
        if call in functions:
            if call in _stack + (fid,):
                return verdict("no-kernel", "none", f"model-local function {label} is recursive")
            res = resolve_call(target, call, functions, inner, None, _stack + (fid,))
        else:
            res = resolve(target, n.op_type, n.domain, inner.get(norm_domain(n.domain)), None)
        body_op = f"{norm_domain(n.domain) + '.' if norm_domain(n.domain) else ''}{n.op_type}"
        if not res.runs:
            return verdict(
                res.status,
                "none",
                f"model-local function {label}: its body's {body_op} cannot run ({res.message})",
            )
        if res.status == "fallback" and fallback is None:
            fallback = res
    if fallback is not None:
        return verdict(
            "fallback",
            "fallback",
            f"model-local function {label}: part of its body runs on {fallback.provider}",
            fallback.provider,
        )
    ops = sorted({n.op_type for n in proto_nodes(func.node)})
    return verdict(
        OK,
        "local-function",
        f"model-local function {label}: runs as its body ({', '.join(ops[:6])}"
        f"{' ...' if len(ops) > 6 else ''}); body types not checked",
    )


def model_opsets(opset_imports) -> dict[str, int]:
    """{domain: version} of a model's opset imports ('' for ai.onnx)."""
    return {norm_domain(o.domain): int(o.version) for o in opset_imports}
