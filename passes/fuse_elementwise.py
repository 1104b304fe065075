"""fuse-elementwise: chains of element-wise ops -> one generated kernel.

Not in the -O preset texts: it needs a compiler at optimize time and ships a custom-op library
the runtime must load.  ``optimize`` adds it before ``legalize`` by default for the -O2/-O3
presets on cpu and cuda (``graphopt.targets.codegen.kernel_pipeline``; ``--no-kernels`` or
``GRAPHOPT_NO_KERNELS=1`` turn that off), ``--kernels`` adds it to any pipeline, and
``--pipeline`` may name it.

Each region of the top-level graph with one value leaving it becomes a ``graphopt.fused`` node
(a call of a model-local function whose body is the chain in standard ops), kept only after its
kernel passed the gates of ``targets/codegen/gates.py``, the speed gate run with the chain's
neighbours because onnxruntime fuses across the chain's boundary.  A failed gate is a missed
remark with the numbers; no compiler is a ``no-compiler`` remark, never an error.  What is fused,
the gates and their measurements: docs/kernels.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx_graphsurgeon.exporters.onnx_exporter import OnnxExporter

from graphopt.opt.graph.analysis import infer_shapes
from graphopt.opt.graph.domains import is_default, norm_domain
from graphopt.opt.graph.ir import (
    Constant,
    ModelIR,
    Node,
    Tensor,
    Variable,
    standalone_tensor_proto,
    subgraphs,
    toposort,
)
from graphopt.opt.rewrite.context import Pass, PassContext
from graphopt.opt.rewrite.engine import Builder
from graphopt.opt.rewrite.manager import register_pass
from graphopt.targets.codegen import cuda as cuda_gen
from graphopt.targets.codegen import gates
from graphopt.targets.codegen.expr import (
    MAX_NODES,
    POW_EXPONENTS,
    Expr,
    ExprError,
    evaluate,
    f32,
)
from graphopt.targets.codegen.library import NoCompiler, cpu_library, cuda_library
from graphopt.targets.codegen.portable import function_for
from graphopt.targets.codegen.spec import DOMAIN, KernelSpec
from graphopt.targets.codegen.toolchain import BuildError

PASS = "fuse-elementwise"
MIN_NODES = 3  # two-node regions only when they gate a tensor by a function of itself


def _big_enough(r: Region) -> bool:
    """Three nodes or more; or two where one runtime tensor is read by both (``x·g(x)``:
    HardSwish spelled x·HardSigmoid(x) before opset 14, which no onnxruntime kernel runs whole)."""
    if len(r.nodes) >= MIN_NODES:
        return True
    if len(r.nodes) != 2:
        return False
    first, second = r.nodes
    return any(t is u and isinstance(t, Variable) for t in first.inputs for u in second.inputs)


UNARY = {
    "Relu": "relu",
    "Sigmoid": "sigmoid",
    "Tanh": "tanh",
    "Exp": "exp",
    "Log": "log",
    "Erf": "erf",
    "Abs": "abs",
    "Neg": "neg",
    "Sqrt": "sqrt",
    "Reciprocal": "recip",
    "Softplus": "softplus",
    "HardSwish": "hardswish",
}
BINARY = {"Add": "add", "Sub": "sub", "Mul": "mul", "Div": "div", "Max": "max", "Min": "min"}
WITH_ATTRS = {"Clip", "LeakyRelu", "Elu", "HardSigmoid", "Pow"}
DTYPES = {"cpu": ("float32",), "cuda": ("float32", "float16")}


# ------------------------------------------------------------------------ local checks
def _dims_equal(a, b) -> bool:
    if a is None or b is None or len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, (int, np.integer)) and isinstance(y, (int, np.integer)):
            if int(x) != int(y):
                return False
        elif not (isinstance(x, str) and x and x == y):
            return False
    return True


def _known(shape) -> bool:
    return shape is not None and all(
        (isinstance(d, (int, np.integer)) and d >= 0) or (isinstance(d, str) and d) for d in shape
    )


def _absent(t) -> bool:
    return t is None or (isinstance(t, Variable) and not t.name)


def _scalar(t) -> float | None:
    if isinstance(t, Constant):
        v = np.asarray(t.values)
        if v.size == 1 and v.dtype.kind == "f":
            return float(v.reshape(()))
    return None


def _channel_axis(c: Constant, out_shape) -> int | None:
    """The negative axis along which constant ``c`` holds one value per channel, else None."""
    shape = [int(d) for d in c.shape]
    r = len(out_shape)
    if len(shape) > r:
        return None
    full = [1] * (r - len(shape)) + shape
    big = [i for i, d in enumerate(full) if d != 1]
    if len(big) != 1:
        return None
    i = big[0]
    d = out_shape[i]
    if not isinstance(d, (int, np.integer)) or int(d) != full[i]:
        return None
    return i - r


#: elements a broadcast constant may be expanded to (it becomes a full-shape kernel input)
MAX_BROADCAST_ELEMENTS = 1 << 20


def _broadcast_const(c: Constant, out_shape) -> bool:
    """Whether constant ``c`` (neither a scalar nor per-channel) can be expanded to the static
    ``out_shape`` and read as one more full-shape input: YOLO's anchor grids and strides."""
    if np.dtype(c.dtype).kind != "f" or not all(
        isinstance(d, (int, np.integer)) for d in out_shape
    ):
        return False
    shape = [int(d) for d in out_shape]
    if int(np.prod(shape)) > MAX_BROADCAST_ELEMENTS:
        return False
    try:
        return list(np.broadcast_shapes(tuple(c.shape), tuple(shape))) == shape
    except ValueError:
        return False


def _dtype(t: Tensor) -> str | None:
    try:
        return np.dtype(t.dtype).name if t.dtype is not None else None
    except TypeError:
        return None


def out_type(node: Node) -> tuple[list | None, str | None]:
    """Shape and dtype of an element-wise node's output: as inferred, or (a graph output
    declared without them) those of its first runtime operand."""
    out = node.outputs[0]
    shape, dtype = out.shape, _dtype(out)
    if _known(shape) and shape and dtype:
        return list(shape), dtype
    first = next((t for t in node.inputs[:2] if isinstance(t, Variable) and t.name), None)
    if first is None or not _known(first.shape) or not first.shape:
        return None, None
    return list(first.shape), _dtype(first)


def fusible(node: Node, target: str) -> bool:
    """Whether ``node`` can be part of a fused region (structure, dtype, operand shapes)."""
    if not is_default(node.domain) or len(node.outputs) != 1:
        return False
    op = node.op
    if op not in UNARY and op not in BINARY and op not in WITH_ATTRS:
        return False
    shape, dtype = out_type(node)
    if dtype not in DTYPES.get(target, ()) or shape is None:
        return False
    ins = [None if _absent(t) else t for t in node.inputs]
    if op in BINARY:
        if len(ins) != 2 or any(t is None for t in ins):
            return False
        operands = ins
    else:
        operands = ins[:1]
        if op == "Clip":
            if any(t is not None and _scalar(t) is None for t in ins[1:]):
                return False
        elif op == "Pow":
            if (
                len(ins) != 2
                or _scalar(ins[1]) is None
                or f32(_scalar(ins[1])) not in POW_EXPONENTS
            ):
                return False
        elif len(ins) != 1:
            return False
    chain = 0
    for t in operands:
        if isinstance(t, Constant):
            per_channel = _channel_axis(t, shape) is not None and np.dtype(t.dtype).kind == "f"
            if _scalar(t) is None and not per_channel and not _broadcast_const(t, shape):
                return False
        elif isinstance(t, Variable):
            if not _dims_equal(t.shape, shape) or _dtype(t) != dtype:
                return False
            chain += 1
        else:
            return False
    return chain >= 1


# ------------------------------------------------------------------------- regions
@dataclass
class Region:
    root: Node
    nodes: list[Node]
    xs: list[Tensor] = field(default_factory=list)
    ps: list[Constant] = field(default_factory=list)
    axis: int = 0
    #: broadcast constants (by id) expanded to the output shape, read as inputs in ``xs``
    expanded: dict[int, Constant] = field(default_factory=dict)
    expr: Expr | None = None
    spec: KernelSpec | None = None
    problem: tuple[str, str] | None = None

    @property
    def out(self) -> Tensor:
        return self.root.outputs[0]

    @property
    def shape(self) -> list:
        return out_type(self.root)[0]

    @property
    def dtype(self) -> str:
        return out_type(self.root)[1]

    @property
    def labels(self) -> list[str]:
        return [self.root.name] + [n.name for n in self.nodes if n is not self.root]


def find_regions(ir: ModelIR, target: str) -> list[Region]:
    toposort(ir.graph)
    nodes = list(ir.graph.nodes)
    ok = {id(n) for n in nodes if fusible(n, target)}
    position = {id(n): i for i, n in enumerate(nodes)}
    assigned: set[int] = set()
    regions: list[Region] = []
    for root in reversed(nodes):
        if id(root) not in ok or id(root) in assigned:
            continue
        # each member's producers are looked at when it joins (a producer read by several
        # members joins when the last of them does): linear in the region, a chain too
        members = {id(root): root}
        todo = [root]
        while todo:
            n = todo.pop()
            for t in n.inputs:
                if not isinstance(t, Variable) or not t.inputs:
                    continue
                p = t.inputs[0]
                if id(p) in members or id(p) not in ok or id(p) in assigned:
                    continue
                if ir.is_graph_output(t):
                    continue
                if all(id(c) in members for c in t.outputs):
                    members[id(p)] = p
                    todo.append(p)
        assigned.update(members)
        order = sorted(members.values(), key=lambda n: position[id(n)])
        regions.append(Region(root, order))
    regions.reverse()
    return regions


def build_expr(region: Region) -> None:
    """Fill ``expr``, ``xs``, ``ps`` and ``axis`` (or ``problem``)."""
    if len(region.nodes) > MAX_NODES:  # one node of the expression per op at least
        region.problem = (
            "expression-too-large",
            f"the chain has {len(region.nodes)} nodes, more than the {MAX_NODES} of one kernel",
        )
        return
    inside = {id(n) for n in region.nodes}
    out_shape = region.shape
    memo: dict[int, Expr] = {}
    axes: set[int] = set()

    def leaf(t: Tensor) -> Expr:
        if isinstance(t, Constant):
            s = _scalar(t)
            if s is not None:
                return Expr.const(s)
            if _channel_axis(t, out_shape) is None:  # a broadcast constant, expanded
                return expanded(t)
            axes.add(_channel_axis(t, out_shape))
            for k, p in enumerate(region.ps):
                if p is t:
                    return Expr.p(k)
            region.ps.append(t)
            return Expr.p(len(region.ps) - 1)
        for k, x in enumerate(region.xs):
            if x is t:
                return Expr.x(k)
        region.xs.append(t)
        return Expr.x(len(region.xs) - 1)

    def expanded(t: Constant) -> Expr:
        if id(t) not in region.expanded:
            full = np.broadcast_to(np.asarray(t.values), [int(d) for d in out_shape])
            value = np.ascontiguousarray(full.astype(region.dtype))
            region.expanded[id(t)] = Constant(f"{t.name}_expanded", value)
            region.xs.append(region.expanded[id(t)])
        return Expr.x(next(k for k, x in enumerate(region.xs) if x is region.expanded[id(t)]))

    def value(t: Tensor) -> Expr:
        if isinstance(t, Variable) and t.inputs and id(t.inputs[0]) in inside:
            n = t.inputs[0]
            if id(n) not in memo:
                memo[id(n)] = node_expr(n)
            return memo[id(n)]
        return leaf(t)

    def node_expr(n: Node) -> Expr:
        op = n.op
        a = n.attrs
        if op in UNARY:
            return Expr.call(UNARY[op], value(n.inputs[0]))
        if op in BINARY:
            return Expr.call(BINARY[op], value(n.inputs[0]), value(n.inputs[1]))
        x = value(n.inputs[0])
        if op == "LeakyRelu":
            return Expr.call("leakyrelu", x, lits=[a.get("alpha", 0.01)])
        if op == "Elu":
            return Expr.call("elu", x, lits=[a.get("alpha", 1.0)])
        if op == "HardSigmoid":
            return Expr.call("hardsigmoid", x, lits=[a.get("alpha", 0.2), a.get("beta", 0.5)])
        if op == "Pow":
            return Expr.call("pow", x, lits=[_scalar(n.inputs[1])])
        if op == "Clip":
            if "min" in a or "max" in a:  # opset < 11
                lo, hi = a.get("min"), a.get("max")
            else:
                ins = list(n.inputs) + [None, None]
                lo = None if _absent(ins[1]) else _scalar(ins[1])
                hi = None if _absent(ins[2]) else _scalar(ins[2])
            lo = None if lo is None or lo <= -3.4e38 else lo
            hi = None if hi is None or hi >= 3.4e38 else hi
            if lo is not None and hi is not None:
                return Expr.call("clip", x, lits=[lo, hi])
            if lo is not None:
                return Expr.call("max", x, Expr.const(lo))
            if hi is not None:
                return Expr.call("min", x, Expr.const(hi))
            return x
        raise ExprError(f"no expression for {op}")

    try:
        region.expr = value(region.out)
        if len(region.expr.text()) > 8192:
            region.problem = ("expression-too-large", "the chain's expression exceeds 8 KiB")
            return
    except ExprError as e:
        region.problem = ("unsupported", str(e))
        return
    axes.discard(None)
    if len(axes) > 1:
        region.problem = (
            "mixed-channel-axes",
            f"per-channel constants lie along different axes ({sorted(axes)}); one kernel "
            "indexes one channel axis",
        )
        return
    region.axis = axes.pop() if axes else 0
    if region.ps and region.axis != -1:
        # a [C] constant along the last axis and a [C,1,1] one must describe the same C
        sizes = {int(np.prod(p.shape)) for p in region.ps}
        if len(sizes) != 1:
            region.problem = ("mixed-channel-axes", "per-channel constants of different sizes")
            return


# ------------------------------------------------------------ single-kernel equivalents
_PROBE = np.linspace(-8, 8, 2001)


def _gelu_erf(x):
    import math

    return 0.5 * x * (1 + np.vectorize(math.erf)(x / np.sqrt(2)))


EQUIVALENTS = [
    ("HardSwish", "", 14, lambda x: x * np.clip(x / 6 + 0.5, 0, 1)),
    ("Gelu", "com.microsoft", 1, _gelu_erf),
    ("Gelu", "", 20, _gelu_erf),
    (
        "FastGelu",
        "com.microsoft",
        1,
        lambda x: 0.5 * x * (1 + np.tanh(0.7978845608028654 * (x + 0.044715 * x**3))),
    ),
    ("QuickGelu", "com.microsoft", 1, lambda x: x / (1 + np.exp(-1.702 * x))),
    ("QuickGelu", "com.microsoft", 1, lambda x: x / (1 + np.exp(-x))),
    ("Mish", "", 18, lambda x: x * np.tanh(np.logaddexp(0, x))),
]


def single_kernel(expr: Expr, cx: PassContext, dtype: str, opsets: dict[str, int]) -> str | None:
    """'domain.Op-version' when the expression is one op the target runs as one kernel."""
    if expr.inputs() != 1 or expr.params():
        return None
    got = evaluate(expr, [_PROBE], [])
    tname = {"float32": "tensor(float)", "float16": "tensor(float16)"}[dtype]
    for op, domain, since, fn in EQUIVALENTS:
        with np.errstate(all="ignore"):
            ref = fn(_PROBE)
        if not np.allclose(got, ref, rtol=1e-5, atol=1e-6):
            continue
        opset = opsets.get(domain, 1 if domain else None)
        if opset is None or opset < since:
            continue
        if cx.target.has_kernel(op, domain, opset, tname):
            return f"{domain or 'ai.onnx'} {op}-{since}"
    return None


# ------------------------------------------------------------------------------ pass
def _gate_shape(ir: ModelIR, cx: PassContext, shape) -> list[int]:
    named: dict[str, int] = {}
    given = cx.options.get("input_shapes") or {}
    for t in ir.graph.inputs:
        want = given.get(t.name)
        if want and t.shape is not None and len(want) == len(t.shape):
            for d, w in zip(t.shape, want):
                if isinstance(d, str):
                    named[d] = int(w)
    out = []
    for i, d in enumerate(shape):
        if isinstance(d, (int, np.integer)):
            out.append(int(d))
        else:
            out.append(named.get(d, 1 if i == 0 else 16))
    return out


def _value_info(name: str, dtype: str, shape) -> onnx.ValueInfoProto:
    elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    return onnx.helper.make_tensor_value_info(name, elem, list(shape))


def chain_models(ir: ModelIR, region: Region, shape: list[int]):
    """(unfused chain, fused node) as standalone models at ``shape``; param arrays."""
    spec = region.spec
    opsets = [o for o in ir.template.opset_import if o.domain != DOMAIN]
    inits, seen = [], set()
    for n in region.nodes:
        for t in n.inputs:
            if isinstance(t, Constant) and t.name not in seen:
                seen.add(t.name)
                inits.append(standalone_tensor_proto(t))
    xs = [_value_info(x.name, spec.dtype, shape) for x in region.xs if isinstance(x, Variable)]
    expanded = [standalone_tensor_proto(c) for c in region.expanded.values()]
    y = _value_info(region.out.name, spec.dtype, shape)
    nodes = [OnnxExporter.export_node(n) for n in region.nodes]
    unfused = onnx.helper.make_model(
        onnx.helper.make_graph(nodes, "chain", xs, [y], inits), opset_imports=opsets
    )
    unfused.ir_version = ir.template.ir_version or 8
    params = [np.asarray(p.values).reshape(-1) for p in region.ps]
    pinit = [onnx.numpy_helper.from_array(v, f"p{k}") for k, v in enumerate(params)]
    node = onnx.helper.make_node(
        spec.op_type,
        [x.name for x in region.xs] + [f"p{k}" for k in range(len(params))],
        [region.out.name],
        domain=DOMAIN,
        **spec.attrs(),
    )
    fused = onnx.helper.make_model(
        onnx.helper.make_graph([node], "fused", xs, [y], pinit + expanded),
        opset_imports=opsets + [onnx.helper.make_opsetid(DOMAIN, 1)],
    )
    fused.ir_version = unfused.ir_version
    # params broadcast as in the chain, for the float64 reference
    r = len(shape)
    full = []
    for p in region.ps:
        s = [int(d) for d in p.shape]
        full.append(np.asarray(p.values).reshape([1] * (r - len(s)) + s))
    return unfused, fused, full


MAX_CONTEXT_BYTES = 64 << 20  # constants a context benchmark model may copy


def context_models(ir: ModelIR, cx: PassContext, region: Region, fused_node: onnx.NodeProto):
    """The chain with its direct neighbours -- producers of its runtime inputs, readers of its
    output -- unfused and fused, plus feeds; None when a neighbour's inputs are not plain float
    tensors of known shape.  onnxruntime fuses across the chain's boundary (a bias Add into the
    Gemm before it, Add + LayerNormalization after it into SkipLayerNormalization), so only a
    baseline with the neighbours says whether the generated kernel wins in the model."""
    inside = {id(n) for n in region.nodes}
    producers: list[Node] = []
    for x in region.xs:
        p = x.inputs[0] if isinstance(x, Variable) and x.inputs else None
        if p is not None and id(p) not in inside and all(p is not q for q in producers):
            producers.append(p)
    consumers: list[Node] = []
    for c in region.out.outputs:
        if id(c) not in inside and all(c is not q for q in consumers):
            consumers.append(c)
    consumers = _reads_first(consumers)
    ctx = producers + consumers
    if not ctx or any(_has_graph_attr(n) for n in ctx):
        return None
    # a reader may read another reader's output (a Conv after the chain and the Concat of a
    # dense block reading both): that tensor is made here, not fed
    made = {id(t) for n in producers + region.nodes + consumers for t in n.outputs}
    inputs, inits, seen, nbytes = [], [], set(), 0
    for n in ctx + region.nodes:
        for t in n.inputs:
            if t is None or not t.name or t.name in seen or id(t) in made:
                continue
            seen.add(t.name)
            if isinstance(t, Constant):
                nbytes += int(np.prod(t.shape)) * np.dtype(t.dtype).itemsize
                if nbytes > MAX_CONTEXT_BYTES:
                    return None
                inits.append(standalone_tensor_proto(t))
                continue
            dt = _dtype(t)
            if dt not in ("float32", "float16") or not _known(t.shape):
                return None
            inputs.append((t.name, dt, _gate_shape(ir, cx, t.shape)))
    outs = [t for n in consumers for t in n.outputs if t.name] or [region.out]
    outputs = []
    for t in outs:
        dt = _dtype(t) or (region.dtype if t is region.out else None)
        if dt is None:
            return None
        elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dt))
        outputs.append(onnx.helper.make_tensor_value_info(t.name, elem, None))
    vis = [_value_info(name, dt, shape) for name, dt, shape in inputs]
    opsets = [o for o in ir.template.opset_import if o.domain != DOMAIN]
    before = [OnnxExporter.export_node(n) for n in producers]
    after = [OnnxExporter.export_node(n) for n in consumers]
    chain = [OnnxExporter.export_node(n) for n in region.nodes]
    params = [
        onnx.numpy_helper.from_array(np.asarray(p.values).reshape(-1), f"p{k}")
        for k, p in enumerate(region.ps)
    ]
    params += [standalone_tensor_proto(c) for c in region.expanded.values()]
    unfused = onnx.helper.make_model(
        onnx.helper.make_graph(before + chain + after, "ctx", vis, outputs, inits),
        opset_imports=opsets,
    )
    fused = onnx.helper.make_model(
        onnx.helper.make_graph(before + [fused_node] + after, "ctx", vis, outputs, inits + params),
        opset_imports=opsets + [onnx.helper.make_opsetid(DOMAIN, 1)],
    )
    unfused.ir_version = fused.ir_version = ir.template.ir_version or 8
    rng = np.random.default_rng(0)
    feeds = {
        name: np.asarray(rng.standard_normal(shape) * 3, dtype=np.dtype(dt))  # 0-d: an array too
        for name, dt, shape in inputs
    }
    return unfused, fused, feeds, [n.op for n in ctx]


def _reads_first(nodes: list[Node]) -> list[Node]:
    """``nodes`` ordered so that a node reading another one's output comes after it."""
    made = {id(t): n for n in nodes for t in n.outputs}
    done: list[Node] = []
    placed: set[int] = set()

    def place(n: Node) -> None:
        if id(n) in placed:
            return
        placed.add(id(n))
        for t in n.inputs:
            if t is not None and id(t) in made:
                place(made[id(t)])
        done.append(n)

    for n in nodes:
        place(n)
    return done


def _has_graph_attr(n: Node) -> bool:
    return bool(subgraphs(n))


@register_pass
class FuseElementwise(Pass):
    name = PASS
    summary = (
        "fuse element-wise chains into generated C/CUDA kernels (graphopt.fused custom ops; "
        "on by default in optimize's -O2/-O3 on cpu/cuda; --no-kernels)"
    )
    level = 3
    recurse = False

    def run(self, ir: ModelIR, cx: PassContext) -> bool:
        target = cx.target.name
        if target not in DTYPES:
            return False
        infer_shapes(ir)
        stats = cx.rule_stats(PASS)
        regions = [r for r in find_regions(ir, target) if _big_enough(r)]
        if not regions:
            return False
        opsets = {norm_domain(o.domain): o.version for o in ir.template.opset_import}
        opsets.setdefault("", ir.opset)
        candidates: list[Region] = []
        for r in regions:
            stats.attempts += 1
            build_expr(r)
            if r.problem is None:
                try:
                    r.spec = KernelSpec(r.expr, r.dtype, r.axis)
                except ExprError as e:
                    r.problem = ("unsupported", str(e))
            if r.problem is None:
                same = single_kernel(r.expr, cx, r.spec.dtype, opsets)
                if same:
                    r.problem = (
                        "target-has-kernel",
                        f"the chain computes {same}, which {target} runs as one kernel",
                    )
            if r.problem is not None:
                self._missed(cx, r, *r.problem)
                continue
            candidates.append(r)
        if not candidates:
            return False
        specs = [r.spec for r in candidates]
        try:
            lib = cpu_library(specs)
            cuda_lib = cuda_library(specs) if target == "cuda" else None
        except NoCompiler as e:
            for r in candidates:
                self._missed(cx, r, "no-compiler", f"{e}; the chain stays unfused")
            return False
        except BuildError as e:
            for r in candidates:
                self._missed(cx, r, "build-failed", f"kernel build failed: {e}")
            return False
        results: dict[tuple, gates.GateResult] = {}
        changed = False
        self._moved: dict[int, Tensor] = {}  # tensors an earlier rewrite of this run replaced
        for r in candidates:
            shape = _gate_shape(ir, cx, r.shape)
            key = (r.spec.op_type, tuple(shape))
            if key not in results:
                try:
                    results[key] = self._gates(ir, cx, r, shape, lib, cuda_lib)
                except Exception as e:  # noqa: BLE001 - an unmeasurable kernel stays unfused
                    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                    results[key] = gates.GateResult(
                        False, "gate-failed", f"its gates could not run ({text})", {}
                    )
            res = results[key]
            if not res.ok:
                self._missed(cx, r, res.code, res.message, gates=res.numbers, shape=shape)
                continue
            if not cx.take_bisect_step(PASS, r.root.name):
                continue
            self._rewrite(ir, r)
            stats.fired += 1
            changed = True
            b = res.numbers.get("benchmark", {})
            c = res.numbers.get("in_context", {})
            timing = (
                f"{b['fused_us']:.1f} us vs {b['unfused_us']:.1f} us unfused ({b['speedup']:.2f}x)"
                if b
                else "not benchmarked (no device here)"
            )
            if c and "fused_us" not in c:
                timing += (
                    f"; onnxruntime runs the same kernels around it either way "
                    f"({', '.join(c['neighbours'])}: no fusion across its boundary lost)"
                )
            elif c:
                timing += (
                    f"; with its neighbours {c['fused_us']:.1f} vs {c['unfused_us']:.1f} us "
                    f"({c['speedup']:.2f}x)"
                )
            cx.remark(
                "passed",
                PASS,
                PASS,
                "fired",
                r.labels,
                f"fused {len(r.nodes)} nodes ({', '.join(n.op for n in r.nodes)}) into "
                f"{DOMAIN} {r.spec.op_type} = {r.spec.expr.text()[:120]}: {timing} at {shape}",
                op_type=r.spec.op_type,
                expr=r.spec.expr.text(),
                gates=res.numbers,
                shape=shape,
            )
        if changed:
            ir.graph.nodes = [n for n in ir.graph.nodes if n.outputs]
            toposort(ir.graph)
        return changed

    # ---------------------------------------------------------------------- gates
    def _gates(self, ir, cx, r: Region, shape, lib, cuda_lib) -> gates.GateResult:
        spec = r.spec
        numbers: dict = {"shape": shape}
        if spec.dtype == "float32":
            vec = lib.vectorized.get(spec.op_type, False)
            numbers["vectorized"] = vec
            numbers["loop_line"] = lib.source.loop_lines[spec.op_type]
            if not vec:
                return gates.GateResult(
                    False,
                    "not-vectorized",
                    f"gcc did not vectorize the kernel's loop (line "
                    f"{numbers['loop_line']} of the generated C, -fopt-info-vec-optimized)",
                    numbers,
                )
        unfused, fused, params = chain_models(ir, r, shape)
        runtime = [x.name for x in r.xs if isinstance(x, Variable)]
        feeds = gates.make_feeds(runtime, shape, np.dtype(spec.dtype))
        tol = cx.target.tolerances or None
        num = gates.numerics(spec, unfused, fused, feeds, params, str(lib.path), tol)
        numbers["numerics"] = num.numbers
        if not num.ok:
            return gates.GateResult(False, num.code, num.message, numbers)
        if cuda_lib is not None:
            res = {}
            for v in cuda_gen.variants([spec]):
                res[v.dtype] = cuda_lib.resources.get(v.op_type, {})
            numbers["cuda_resources"] = res
            numbers["device"] = "not-run"
            for dt, per_arch in res.items():
                for arch, rr in per_arch.items():
                    if rr.get("spill_stores", 0) or rr.get("spill_loads", 0):
                        return gates.GateResult(
                            False,
                            "spills",
                            f"the {dt} CUDA kernel spills on {arch} ({rr})",
                            numbers,
                        )
                    if rr.get("registers", 0) > cuda_gen.MAX_REGISTERS:
                        return gates.GateResult(
                            False,
                            "registers",
                            f"the {dt} CUDA kernel uses {rr['registers']} registers on {arch} "
                            f"(limit {cuda_gen.MAX_REGISTERS})",
                            numbers,
                        )
            cx.remark(
                "analysis",
                PASS,
                PASS,
                "device-not-run",
                [r.root.name],
                f"{spec.op_type}: CUDA kernels compiled for {', '.join(cuda_gen.ARCHS)} and "
                "resource-checked; not run or benchmarked (no GPU here): device not-run",
                op_type=spec.op_type,
            )
            return gates.GateResult(True, numbers=numbers)
        # per kernel: the chain alone; the decision: the chain with its neighbours, where
        # onnxruntime's fusions across the chain's boundary are part of the baseline
        bench = gates.benchmark(unfused, fused, feeds, str(lib.path))
        numbers["benchmark"] = bench.numbers
        ctx = context_models(ir, cx, r, fused.graph.node[0])
        if ctx is not None:
            c_unfused, c_fused, c_feeds, neighbours = ctx
            around = gates.kernels_after_ort(c_unfused)
            around_fused = gates.kernels_after_ort(c_fused, str(lib.path))
            chain = [n.op if is_default(n.domain) else f"{n.domain}:{n.op}" for n in r.nodes]
            kernel = f"{DOMAIN}:{spec.op_type}"
            if gates.same_neighbour_kernels(around, around_fused, chain, kernel):
                numbers["in_context"] = {
                    "neighbours": neighbours,
                    "timed": False,
                    "onnxruntime_ops": around,
                    "onnxruntime_ops_fused": around_fused,
                }
                if not bench.ok:
                    return gates.GateResult(False, bench.code, bench.message, numbers)
                return gates.GateResult(True, numbers=numbers)
            in_ctx = gates.benchmark(
                c_unfused, c_fused, c_feeds, str(lib.path), unfused_kernels=around
            )
            numbers["in_context"] = {**in_ctx.numbers, "neighbours": neighbours}
            if not in_ctx.ok:
                return gates.GateResult(
                    False,
                    "slower-in-context",
                    f"{in_ctx.message}; with its neighbours ({', '.join(neighbours)}) in both "
                    f"(the chain alone: {bench.numbers['fused_us']:.1f} vs "
                    f"{bench.numbers['unfused_us']:.1f} us)",
                    numbers,
                )
            return gates.GateResult(True, numbers=numbers)
        if not bench.ok:
            return gates.GateResult(False, bench.code, bench.message, numbers)
        return gates.GateResult(True, numbers=numbers)

    # -------------------------------------------------------------------- rewrite
    def _current(self, t: Tensor) -> Tensor:
        while id(t) in self._moved:
            t = self._moved[id(t)]
        return t

    def _rewrite(self, ir: ModelIR, r: Region) -> None:
        b = Builder(ir, PASS, r.root.name or r.root.op)
        params = [
            b.const(np.asarray(p.values).reshape(-1), base=f"p{k}") for k, p in enumerate(r.ps)
        ]
        xs = [  # an input may be an earlier region's output
            b.const(np.asarray(x.values), base="expanded")
            if isinstance(x, Constant)
            else self._current(x)
            for x in r.xs
        ]
        new = b.op(
            r.spec.op_type,
            xs + params,
            r.spec.attrs(),
            domain=DOMAIN,
            like=r.out,
            name=f"{r.root.name or r.root.op}/fused",
        )
        ir.add_function(function_for(r.spec, ir.opset))  # what a bare session runs instead
        old = r.out
        if not ir.is_graph_output(old):  # a graph output keeps its tensor, produced anew
            self._moved[id(old)] = new
        ir.replace_all_uses(old, new)
        for n in r.nodes:
            ir.remove_node(n)

    def _missed(self, cx: PassContext, r: Region, code: str, message: str, **args) -> None:
        cx.rule_stats(PASS).missed += 1
        cx.remark(
            "missed",
            PASS,
            PASS,
            code,
            r.labels,
            f"{len(r.nodes)} element-wise nodes ({', '.join(n.op for n in r.nodes)}) at "
            f"'{r.root.name}' not fused: {message}",
            **args,
        )
