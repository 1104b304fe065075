"""C for the cpu target: one onnxruntime custom-op library holding every generated kernel.

Shape of the generated code (per kernel):

* a leaf ``go_kN_body(n, x0.., p0../s0.., y)``: ``noinline``, ``restrict`` pointers, one flat
  loop whose body is the expression in SSA form (``const float tK = ...``; equal sub-trees are
  computed once).  It is the loop gcc must vectorize: the build asks ``-fopt-info-vec-optimized``
  and :func:`vectorized_loops` reads which source lines were vectorized;
* a driver ``go_kN_run`` splitting the tensor into rows, OpenMP over rows
  (``num_threads``: ``GRAPHOPT_KERNEL_THREADS``, 0 = OpenMP's default, unset = 1; serial below
  ``GO_PAR_MIN`` elements; flush-to-zero while it runs, see ``go_ftz_begin``).  Rows follow the
  channel axis: per-channel parameters along the last axis are vectors indexed with the element
  (``p0[i]``); along an outer axis (``[C,1,1]`` in NCHW) each row is one channel and the
  parameter a scalar (``s0 = p0[row % C]``); without
  parameters rows are fixed-size blocks;
* a shared compute callback that reads shapes through the C API, checks them (runtime inputs of
  one shape, each parameter holding one value per channel) and reports a mismatch as an
  ``OrtStatus`` error.

Math without libm: with gcc 12, calls to ``expf``/``erff``/``tanhf`` vectorize only under
``-ffast-math`` (glibc's libmvec).  The default here (``math="own"``) uses polynomial
approximations written out in C (Cephes-style ``exp``/``log`` with exponent bit tricks, tanh
from a small-argument polynomial and ``exp``, erf from Taylor / Abramowitz-Stegun 7.1.26), which
vectorize with ``-O3 -fno-math-errno -fno-trapping-math`` and stay IEEE otherwise.  ``math="libm"``
uses libm and ``-ffast-math`` instead (measured in ``examples/kernels/README.md``).

Identifiers in the source are made up here (``go_kN``, ``tN``, ``x0``, ``p0``); op names are the
spec's hash (``Elementwise_<hex>``); no model name or attribute text is ever written into the C.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from .expr import Expr
from .ort_abi import HEADER, OP_CALLBACKS
from .spec import ELEM, KernelSpec

SOURCE = "graphopt_fused.c"
ABI_HEADER = "graphopt_ort_abi.h"
LIBRARY = "libgraphopt_fused.so"

#: gcc flags; the -march is chosen by the toolchain (x86-64-v3 where the CPU has AVX2+FMA)
BASE_FLAGS = (
    "-O3",
    "-std=gnu11",
    "-fPIC",
    "-shared",
    "-fvisibility=hidden",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fopenmp",
    # onnxruntime dlcloses a custom-op library with its last session; unloading it would unload
    # libgomp under its idle worker threads (measured: segfaults later in unrelated code)
    "-Wl,-z,nodelete",
)
#: "own": polynomial math, IEEE flags; "libm": expf/erff/... with -ffast-math (glibc libmvec);
#: "libm-strict": libm without fast-math (gcc 12 leaves such loops scalar: for measurements)
MATH_FLAGS = {"own": (), "libm": ("-ffast-math",), "libm-strict": ()}

PAR_MIN = 32768  # elements below which the kernel runs on the calling thread
BLOCK = 16384  # row length when the kernel has no channel axis

_CTYPE = {"float32": "float", "float16": "_Float16"}


@dataclass
class CSource:
    text: str
    #: op type -> line of the loop that must vectorize
    loop_lines: dict[str, int] = field(default_factory=dict)
    math: str = "own"

    @property
    def flags(self) -> tuple[str, ...]:
        return BASE_FLAGS + MATH_FLAGS[self.math]


def literal(v: float) -> str:
    """A float32 literal as an exact C hex float."""
    x = float(np.float32(v))
    if x == 0:
        return "0.0f"
    return f"{x.hex()}f"


# ----------------------------------------------------------------------------- helpers
OWN_MATH = r"""
#define GO_INLINE static inline __attribute__((always_inline))
GO_INLINE float go_bits2f(int32_t b) { float f; memcpy(&f, &b, 4); return f; }
GO_INLINE int32_t go_f2bits(float f) { int32_t b; memcpy(&b, &f, 4); return b; }
/* exp: Cephes expf range reduction + degree-5 polynomial; 2^n through the exponent bits.
 * Inputs are clamped to [-87.33, 88.02] so that 2^n stays a normal float. */
GO_INLINE float go_exp(float x) {
  x = x > 88.0296875f ? 88.0296875f : x;
  x = x < -87.3365479f ? -87.3365479f : x;
  float fx = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
  float r = x - fx * 0.693359375f;
  r = r - fx * -2.12194440e-4f;
  float z = r * r;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * z + r + 1.0f;
  return y * go_bits2f(((int32_t)fx + 127) << 23);
}
/* log: Cephes logf (mantissa in [sqrt(1/2), sqrt(2)), degree-8 polynomial); 0 -> -inf, <0 -> nan */
GO_INLINE float go_log(float x) {
  int32_t b = go_f2bits(x);
  float e = (float)((b >> 23) - 126);
  float m = go_bits2f((b & 0x007fffff) | 0x3f000000);
  int small = m < 0.707106781186547524f;
  e = small ? e - 1.0f : e;
  m = small ? m + m - 1.0f : m - 1.0f;
  float z = m * m;
  float y = 7.0376836292e-2f;
  y = y * m - 1.1514610310e-1f;
  y = y * m + 1.1676998740e-1f;
  y = y * m - 1.2420140846e-1f;
  y = y * m + 1.4249322787e-1f;
  y = y * m - 1.6668057665e-1f;
  y = y * m + 2.0000714765e-1f;
  y = y * m - 2.4999993993e-1f;
  y = y * m + 3.3333331174e-1f;
  y = y * m * z;
  y = y + e * -2.12194440e-4f;
  y = y - 0.5f * z;
  float r = m + y + e * 0.693359375f;
  r = x == 0.0f ? -__builtin_inff() : r;
  r = x < 0.0f ? __builtin_nanf("") : r;
  r = x == __builtin_inff() ? x : r;
  return r != r ? x + r : r; /* nan input stays nan */
}
GO_INLINE float go_sigmoid(float x) { return 1.0f / (1.0f + go_exp(-x)); }
/* tanh: odd polynomial below 0.625 (Cephes tanhf), 1 - 2/(exp(2|x|)+1) above */
GO_INLINE float go_tanh(float x) {
  float a = __builtin_fabsf(x);
  float z = x * x;
  float p = -5.70498872745e-3f;
  p = p * z + 2.06390887954e-2f;
  p = p * z - 5.37397155531e-2f;
  p = p * z + 1.33314422036e-1f;
  p = p * z - 3.33332819422e-1f;
  float small = p * z * x + x;
  float big = 1.0f - 2.0f / (go_exp(a + a) + 1.0f);
  big = x < 0.0f ? -big : big;
  return a < 0.625f ? small : big;
}
/* erf: Taylor series (to x^15) below 0.5, Abramowitz-Stegun 7.1.26 above (abs err < 2e-7) */
GO_INLINE float go_erf(float x) {
  float a = __builtin_fabsf(x);
  float z = x * x;
  float s = -1.4925650e-5f;
  s = s * z + 1.2055333e-4f;
  s = s * z - 8.5483270e-4f;
  s = s * z + 5.2239776e-3f;
  s = s * z - 2.6866171e-2f;
  s = s * z + 1.1283792e-1f;
  s = s * z - 3.7612639e-1f;
  s = s * z + 1.1283792e+0f;
  s = s * x;
  float t = 1.0f / (1.0f + 0.3275911f * a);
  float q = 1.061405429f;
  q = q * t - 1.453152027f;
  q = q * t + 1.421413741f;
  q = q * t - 0.284496736f;
  q = q * t + 0.254829592f;
  float big = 1.0f - q * t * go_exp(-z);
  big = x < 0.0f ? -big : big;
  return a < 0.5f ? s : big;
}
"""

LIBM_MATH = r"""
#define GO_INLINE static inline __attribute__((always_inline))
GO_INLINE float go_exp(float x) { return expf(x); }
GO_INLINE float go_log(float x) { return logf(x); }
GO_INLINE float go_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
GO_INLINE float go_tanh(float x) { return tanhf(x); }
GO_INLINE float go_erf(float x) { return erff(x); }
"""


# ------------------------------------------------------------------- expression -> C
def c_statements(expr: Expr, leaf: dict[str, str]) -> tuple[list[str], str]:
    """SSA statements computing ``expr`` (equal sub-trees once) and the name of the result.

    ``leaf`` maps ``"x0"``/``"p1"`` to the C expression that reads it (already a float)."""
    names: dict[Expr, str] = {}
    lines: list[str] = []

    def ref(e: Expr) -> str:
        return literal(e.value) if e.op == "const" else names[e]

    for e in expr.walk():
        if e.op == "const":
            continue
        if e.op in ("x", "p"):
            code = leaf[f"{e.op}{e.index}"]
        else:
            code = _c_op(e, [ref(a) for a in e.args], [literal(v) for v in e.lits])
        name = f"t{len(names)}"
        names[e] = name
        lines.append(f"const float {name} = {code};")
    return lines, ref(expr)


def _c_op(e: Expr, a: list[str], lit: list[str]) -> str:
    op = e.op
    simple = {
        "sigmoid": f"go_sigmoid({a[0]})",
        "tanh": f"go_tanh({a[0]})",
        "exp": f"go_exp({a[0]})",
        "log": f"go_log({a[0]})",
        "erf": f"go_erf({a[0]})",
        "abs": f"__builtin_fabsf({a[0]})",
        "neg": f"-{a[0]}",
        "sqrt": f"__builtin_sqrtf({a[0]})",
        "recip": f"1.0f / {a[0]}",
        "add": f"{a[0]} + {a[1]}" if len(a) > 1 else "",
        "sub": f"{a[0]} - {a[1]}" if len(a) > 1 else "",
        "mul": f"{a[0]} * {a[1]}" if len(a) > 1 else "",
        "div": f"{a[0]} / {a[1]}" if len(a) > 1 else "",
    }
    if op in simple:
        return simple[op]
    if op == "relu":
        return f"{a[0]} > 0.0f ? {a[0]} : 0.0f"
    if op == "max":
        return f"{a[0]} > {a[1]} ? {a[0]} : {a[1]}"
    if op == "min":
        return f"{a[0]} < {a[1]} ? {a[0]} : {a[1]}"
    if op == "clip":
        return f"{a[0]} < {lit[0]} ? {lit[0]} : ({a[0]} > {lit[1]} ? {lit[1]} : {a[0]})"
    if op == "leakyrelu":
        return f"{a[0]} >= 0.0f ? {a[0]} : {lit[0]} * {a[0]}"
    if op == "elu":
        return f"{a[0]} >= 0.0f ? {a[0]} : {lit[0]} * (go_exp({a[0]}) - 1.0f)"
    if op == "hardsigmoid":
        v = f"({lit[0]} * {a[0]} + {lit[1]})"
        return f"{v} < 0.0f ? 0.0f : ({v} > 1.0f ? 1.0f : {v})"
    if op == "hardswish":
        v = f"({a[0]} * 0x1.555556p-3f + 0.5f)"
        return f"{a[0]} * ({v} < 0.0f ? 0.0f : ({v} > 1.0f ? 1.0f : {v}))"
    if op == "softplus":
        return f"{a[0]} > 20.0f ? {a[0]} : go_log(1.0f + go_exp({a[0]}))"
    if op == "pow":
        k = e.lits[0]
        return {
            1.0: a[0],
            2.0: f"{a[0]} * {a[0]}",
            3.0: f"{a[0]} * {a[0]} * {a[0]}",
            4.0: f"({a[0]} * {a[0]}) * ({a[0]} * {a[0]})",
            0.5: f"__builtin_sqrtf({a[0]})",
            -0.5: f"1.0f / __builtin_sqrtf({a[0]})",
            -1.0: f"1.0f / {a[0]}",
        }[k]
    raise ValueError(f"no C for {op}")


# ------------------------------------------------------------------------ the library
PRELUDE = r"""/* Generated by graphopt (targets/codegen/cpu.py): fused element-wise kernels as an
 * onnxruntime custom-op library, domain graphopt.fused.  Do not edit; regenerate. */
#include <stdint.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include "graphopt_ort_abi.h"

#define GO_MAX_RANK 16
#define GO_PAR_MIN %(par_min)d
#define GO_BLOCK %(block)d
#define GO_EXPORT __attribute__((visibility("default")))

/* Flush-to-zero / denormals-are-zero while a kernel runs (per thread, restored after).  Without
 * it, gcc's vectorization of the saturating branches (it evaluates both sides, e.g. x times the
 * subnormal sigmoid of the clamped argument) hits subnormal assists: measured 1.7x slower for
 * x*sigmoid(x).  Results that would be subnormal (|y| < 1.2e-38) become 0. */
#if defined(__x86_64__) || defined(__i386__)
static inline unsigned go_ftz_begin(void) {
  const unsigned c = __builtin_ia32_stmxcsr();
  __builtin_ia32_ldmxcsr(c | 0x8040u);
  return c;
}
static inline void go_ftz_end(unsigned c) { __builtin_ia32_ldmxcsr(c); }
#else
static inline unsigned go_ftz_begin(void) { return 0; }
static inline void go_ftz_end(unsigned c) { (void)c; }
#endif
"""

RUNTIME = r"""
/* ---------------------------------------------------------------- shared runtime part */
typedef struct go_call {
  int64_t n, rows, inner, channels;
  const void* x[8];
  const void* p[16];
  void* y;
  int threads;
} go_call;

typedef struct go_op {
  OrtCustomOp base; /* first member: onnxruntime hands back &base */
  const char* name;
  int n_in, n_par, axis, elem;
  void (*run)(const go_call*);
} go_op;

typedef struct go_kernel {
  const go_op* op;
  const OrtApi* api;
  int threads;
} go_kernel;

#define GO_TRY(e) do { OrtStatus* go_s_ = (e); if (go_s_) return go_s_; } while (0)
#define GO_FN(name) go_api_fn(api, GO_API_##name, go_##name)

/* element types need no check: onnxruntime matches inputs against the op's declared types */
static OrtStatus* go_shape(const OrtApi* api, const OrtValue* v, int64_t* dims, size_t* rank) {
  OrtTensorTypeAndShapeInfo* info = NULL;
  GO_TRY(GO_FN(GetTensorTypeAndShape)(v, &info));
  OrtStatus* s = GO_FN(GetDimensionsCount)(info, rank);
  if (!s && *rank > GO_MAX_RANK)
    s = GO_FN(CreateStatus)(GO_ORT_INVALID_ARGUMENT, "graphopt.fused: rank above 16");
  if (!s) s = GO_FN(GetDimensions)(info, dims, *rank);
  GO_FN(ReleaseTensorTypeAndShapeInfo)(info);
  return s;
}

static OrtStatus* go_count(const OrtApi* api, const OrtValue* v, size_t* count) {
  OrtTensorTypeAndShapeInfo* info = NULL;
  GO_TRY(GO_FN(GetTensorTypeAndShape)(v, &info));
  OrtStatus* s = GO_FN(GetTensorShapeElementCount)(info, count);
  GO_FN(ReleaseTensorTypeAndShapeInfo)(info);
  return s;
}

static OrtStatus* go_fail(const OrtApi* api, const char* msg) {
  return GO_FN(CreateStatus)(GO_ORT_INVALID_ARGUMENT, msg);
}

static OrtStatus* go_compute(void* kernel, OrtKernelContext* ctx) {
  const go_kernel* k = (const go_kernel*)kernel;
  const go_op* op = k->op;
  const OrtApi* api = k->api;
  go_call c;
  memset(&c, 0, sizeof c);
  int64_t dims[GO_MAX_RANK], d[GO_MAX_RANK];
  size_t rank = 0, r = 0;
#ifdef GO_ABI_SELFTEST
  { void* stream = (void*)1; GO_TRY(GO_FN(KernelContext_GetGPUComputeStream)(ctx, &stream));
    size_t count = 0; GO_TRY(GO_FN(KernelContext_GetInputCount)(ctx, &count));
    if (stream != NULL || count != (size_t)(op->n_in + op->n_par))
      return go_fail(api, "graphopt.fused: ABI self-test failed"); }
#endif
  for (int i = 0; i < op->n_in; ++i) {
    const OrtValue* v = NULL;
    GO_TRY(GO_FN(KernelContext_GetInput)(ctx, (size_t)i, &v));
    if (!v) return go_fail(api, "graphopt.fused: missing input");
    GO_TRY(go_shape(api, v, i ? d : dims, i ? &r : &rank));
    if (i && (r != rank || memcmp(d, dims, rank * sizeof(int64_t))))
      return go_fail(api, "graphopt.fused: runtime inputs must have one shape");
    void* data = NULL;
    GO_TRY(GO_FN(GetTensorMutableData)((OrtValue*)v, &data));
    c.x[i] = data;
  }
  int64_t n = 1;
  for (size_t j = 0; j < rank; ++j) n *= dims[j];
  c.n = n;
  if (op->axis) {
    const int64_t a = (int64_t)rank + op->axis;
    if (a < 0) return go_fail(api, "graphopt.fused: input rank below the channel axis");
    c.channels = dims[a];
    c.inner = 1;
    for (size_t j = (size_t)a + 1; j < rank; ++j) c.inner *= dims[j];
    if (op->axis == -1) c.inner = c.channels;
    c.rows = c.inner ? n / c.inner : 0;
  } else {
    c.channels = 1;
    c.inner = GO_BLOCK;
    c.rows = (n + GO_BLOCK - 1) / GO_BLOCK;
  }
  for (int i = 0; i < op->n_par; ++i) {
    const OrtValue* v = NULL;
    GO_TRY(GO_FN(KernelContext_GetInput)(ctx, (size_t)(op->n_in + i), &v));
    if (!v) return go_fail(api, "graphopt.fused: missing parameter");
    size_t m = 0;
    GO_TRY(go_count(api, v, &m));
    if ((int64_t)m != c.channels)
      return go_fail(api, "graphopt.fused: a parameter does not hold one value per channel");
    void* data = NULL;
    GO_TRY(GO_FN(GetTensorMutableData)((OrtValue*)v, &data));
    c.p[i] = data;
  }
  OrtValue* out = NULL;
  GO_TRY(GO_FN(KernelContext_GetOutput)(ctx, 0, dims, rank, &out));
  GO_TRY(GO_FN(GetTensorMutableData)(out, &c.y));
  if (n == 0) return NULL;
#ifdef _OPENMP
  c.threads = k->threads > 0 ? k->threads : omp_get_max_threads();
#else
  c.threads = 1;
#endif
  op->run(&c);
  return NULL;
}

static OrtStatus* go_create(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info,
                            void** kernel) {
  (void)info;
  go_kernel* k = (go_kernel*)calloc(1, sizeof(go_kernel));
  if (!k) return GO_FN(CreateStatus)(GO_ORT_FAIL, "graphopt.fused: out of memory");
  k->op = (const go_op*)op;
  k->api = api;
  /* OpenMP team size: GRAPHOPT_KERNEL_THREADS (0 = OpenMP's default), else 1.  A team beside
   * onnxruntime's own intra-op pool oversubscribes the cores: see examples/kernels/README.md */
  const char* t = getenv("GRAPHOPT_KERNEL_THREADS");
  k->threads = t ? atoi(t) : 1;
  if (k->threads < 0 || k->threads > 1024) k->threads = 1;
  *kernel = k;
  return NULL;
}

static void go_destroy(void* kernel) { free(kernel); }
static const char* go_name(const OrtCustomOp* op) { return ((const go_op*)op)->name; }
static const char* go_provider(const OrtCustomOp* op) { (void)op; return %(provider)s; }
%(callbacks)s

#define GO_OP(NAME, NIN, NPAR, AXIS, ELEM, RUN) \
  { { GO_ORT_API_VERSION, NULL, go_name, go_provider, go_in_type, go_in_count, go_out_type, \
      go_out_count, NULL, go_destroy, go_required, go_required, go_mem_default, go_one, go_one, \
      go_one, go_one, go_create, go_compute }, NAME, NIN, NPAR, AXIS, ELEM, RUN }
"""

REGISTER = r"""
GO_EXPORT OrtStatus* RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* base) {
  const OrtApi* api = base->GetApi(GO_ORT_API_VERSION);
  if (!api) return NULL; /* onnxruntime older than 1.16: nothing registered, the model fails */
  OrtCustomOpDomain* domain = NULL; /* owned by the sessions using it: never released */
  GO_TRY(GO_FN(CreateCustomOpDomain)("graphopt.fused", &domain));
  for (size_t i = 0; i < sizeof(go_ops) / sizeof(go_ops[0]); ++i)
    GO_TRY(GO_FN(CustomOpDomain_Add)(domain, &go_ops[i].base));
  return GO_FN(AddCustomOpDomain)(options, domain);
}
"""


def _kernel_code(k: int, spec: KernelSpec, lines_before: int) -> tuple[str, int]:
    """C of kernel number ``k``; returns (code, line of its vectorizable loop, 1-based)."""
    ct = _CTYPE[spec.dtype]
    vec_params = spec.channel_axis == -1
    args = [f"const {ct}* restrict x{i}" for i in range(spec.inputs)]
    args += [
        f"const {ct}* restrict p{j}" if vec_params else f"const float s{j}"
        for j in range(spec.params)
    ]
    leaf = {f"x{i}": f"(float)x{i}[i]" for i in range(spec.inputs)}
    leaf.update(
        {f"p{j}": (f"(float)p{j}[i]" if vec_params else f"s{j}") for j in range(spec.params)}
    )
    stmts, result = c_statements(spec.expr, leaf)
    out: list[str] = [
        f"/* kernel {k}: {spec.op_type} ({spec.dtype}, channel axis {spec.channel_axis}) */",
        "static void __attribute__((noinline))",
        f"go_k{k}_body(const int64_t n, {', '.join(args + [f'{ct}* restrict y'])}) {{",
    ]
    loop_line = lines_before + len(out) + 1
    out.append("  for (int64_t i = 0; i < n; ++i) {")
    out += [f"    {s}" for s in stmts]
    out += [f"    y[i] = ({ct}){result};", "  }", "}", ""]
    # driver
    out += [
        f"static void go_k{k}_run(const go_call* c) {{",
        "  const int64_t rows = c->rows, inner = c->inner, n = c->n, C = c->channels;",
    ]
    out += [f"  const {ct}* x{i} = (const {ct}*)c->x[{i}];" for i in range(spec.inputs)]
    out += [f"  const {ct}* p{j} = (const {ct}*)c->p[{j}];" for j in range(spec.params)]
    out += [
        f"  {ct}* y = ({ct}*)c->y;",
        "  (void)C;",
        "#pragma omp parallel num_threads(c->threads) "
        "if (c->threads > 1 && rows > 1 && n >= GO_PAR_MIN)",
        "  {",
        "  const unsigned csr = go_ftz_begin();",
        "#pragma omp for schedule(static)",
        "  for (int64_t r = 0; r < rows; ++r) {",
        "    const int64_t o = r * inner;",
        "    const int64_t m = n - o < inner ? n - o : inner;",
    ]
    call = [f"x{i} + o" for i in range(spec.inputs)]
    if vec_params:
        call += [f"p{j}" for j in range(spec.params)]
    elif spec.params:
        out.append("    const int64_t ch = r % C;")
        call += [f"(float)p{j}[ch]" for j in range(spec.params)]
    call.append("y + o")
    out += [f"    go_k{k}_body(m, {', '.join(call)});", "  }", "  go_ftz_end(csr);", "  }", "}", ""]
    return "\n".join(out) + "\n", loop_line


def generate(specs: list[KernelSpec], *, math: str = "own", provider: str | None = None) -> CSource:
    """The C source of a library holding ``specs`` (sorted, deduplicated by op type)."""
    if math not in MATH_FLAGS:
        raise ValueError(f"math must be one of {', '.join(MATH_FLAGS)}")
    unique = {s.op_type: s for s in specs}
    ordered = [unique[k] for k in sorted(unique)]
    text = PRELUDE % {"par_min": PAR_MIN, "block": BLOCK}
    text += OWN_MATH if math == "own" else LIBM_MATH
    if math == "libm":  # -ffast-math: the approximations need no IEEE corner cases either
        text += "\n/* built with -ffast-math: libm calls vectorize through glibc's libmvec */\n"
    text += RUNTIME % {
        "provider": '"' + provider + '"' if provider else "NULL",
        "callbacks": OP_CALLBACKS,
    }
    src = CSource("", {}, math)
    for k, spec in enumerate(ordered):
        code, line = _kernel_code(k, spec, text.count("\n"))
        text += "\n" + code
        src.loop_lines[spec.op_type] = line + 1
    text += "\nstatic go_op go_ops[] = {\n"
    for k, spec in enumerate(ordered):
        _check_name(spec.op_type)
        text += (
            f'  GO_OP("{spec.op_type}", {spec.inputs}, {spec.params}, {spec.channel_axis}, '
            f"{ELEM[spec.dtype]}, go_k{k}_run),\n"
        )
    text += "};\n" + REGISTER
    src.text = text
    return src


_SAFE_NAME = re.compile(r"Elementwise_[0-9a-f]{16}")


def _check_name(name: str) -> None:
    """Op names are the only strings from a spec that enter the source: hex hashes only."""
    if not _SAFE_NAME.fullmatch(name):
        raise ValueError(f"refusing to emit op name {name!r}")


_VEC = re.compile(r"^[^:\n]*:(\d+):\d+: optimized: loop vectorized", re.M)


def vectorized_loops(gcc_output: str) -> set[int]:
    """Source lines gcc reported as vectorized (``-fopt-info-vec-optimized``)."""
    return {int(m.group(1)) for m in _VEC.finditer(gcc_output)}


def header() -> str:
    return HEADER
