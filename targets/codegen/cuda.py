"""CUDA C for the cuda target: grid-stride kernels (fp32 and fp16) in an onnxruntime custom-op
library for the CUDA execution provider.

Per expression, two ``extern "C" __global__`` kernels ``go_kN_f32`` / ``go_kN_f16`` with
``__launch_bounds__(256)``: one thread per element in a grid-stride loop, loads through
``__ldg``, math in float (fp16 is converted at load and store), per-channel parameters indexed by
``(i / inner) % C``.  The custom ops report ``CUDAExecutionProvider`` and launch on the stream
onnxruntime gives the kernel (``KernelContext_GetGPUComputeStream``).  Both element types are
registered (``Elementwise_<id>`` differs by dtype), so an fp16 model uses the same library.

Built with nvcc for sm_80 and sm_90 SASS plus compute_90 PTX (forward compatibility), with
``-Xptxas -v``: :func:`ptxas_resources` turns its report into registers / spill bytes / stack per
kernel and architecture for the manifest, and the gate refuses a kernel that spills.

Nothing here runs without a GPU: on a machine without one the kernels are compiled and
resource-checked only, and the manifest says ``"device": "not-run"``.  The expression semantics
are checked on CPU through the C build of the same expressions (``cpu.py``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from .cpu import _check_name, c_statements, literal  # noqa: F401  (literal used in f-strings)
from .ort_abi import HEADER, OP_CALLBACKS
from .spec import ELEM, KernelSpec

SOURCE = "graphopt_fused_cuda.cu"
ABI_HEADER = "graphopt_ort_abi.h"
LIBRARY = "libgraphopt_fused_cuda.so"
ARCHS = ("sm_80", "sm_90")
PTX_ARCH = "compute_90"
BLOCK = 256
MAX_REGISTERS = 64


def flags() -> list[str]:
    out = ["-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC,-fvisibility=hidden"]
    for a in ARCHS:
        out += ["-gencode", f"arch=compute_{a[3:]},code={a}"]
    out += ["-gencode", f"arch={PTX_ARCH},code={PTX_ARCH}", "-Xptxas", "-v"]
    return out


@dataclass
class CudaSource:
    text: str
    #: op type -> device kernel symbol
    symbols: dict[str, str] = field(default_factory=dict)
    specs: list[KernelSpec] = field(default_factory=list)


DEVICE_MATH = r"""
__device__ __forceinline__ float go_ld(const float* p, int64_t i) { return __ldg(p + i); }
__device__ __forceinline__ float go_ld(const __half* p, int64_t i) {
  return __half2float(__ldg(p + i));
}
__device__ __forceinline__ void go_st(float* p, int64_t i, float v) { p[i] = v; }
__device__ __forceinline__ void go_st(__half* p, int64_t i, float v) { p[i] = __float2half_rn(v); }
__device__ __forceinline__ float go_exp(float x) { return expf(x); }
__device__ __forceinline__ float go_log(float x) { return logf(x); }
__device__ __forceinline__ float go_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float go_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ float go_erf(float x) { return erff(x); }
"""

RUNTIME = r"""
struct go_op {
  OrtCustomOp base;
  const char* name;
  int n_in, n_par, axis, elem;
  cudaError_t (*launch)(cudaStream_t, int64_t, int64_t, int64_t, const void* const*,
                        const void* const*, void*);
};
struct go_kernel { const go_op* op; const OrtApi* api; };

#define GO_TRY(e) do { OrtStatus* go_s_ = (e); if (go_s_) return go_s_; } while (0)
#define GO_FN(name) go_api_fn(api, GO_API_##name, go_##name)
#define GO_MAX_RANK 16

static OrtStatus* go_fail(const OrtApi* api, const char* msg) {
  return GO_FN(CreateStatus)(GO_ORT_INVALID_ARGUMENT, msg);
}

static OrtStatus* go_shape(const OrtApi* api, const OrtValue* v, int64_t* dims, size_t* rank) {
  OrtTensorTypeAndShapeInfo* info = NULL;
  GO_TRY(GO_FN(GetTensorTypeAndShape)(v, &info));
  OrtStatus* s = GO_FN(GetDimensionsCount)(info, rank);
  if (!s && *rank > GO_MAX_RANK) s = go_fail(api, "graphopt.fused: rank above 16");
  if (!s) s = GO_FN(GetDimensions)(info, dims, *rank);
  GO_FN(ReleaseTensorTypeAndShapeInfo)(info);
  return s;
}

static OrtStatus* go_compute(void* kernel, OrtKernelContext* ctx) {
  const go_kernel* k = (const go_kernel*)kernel;
  const go_op* op = k->op;
  const OrtApi* api = k->api;
  const void* xs[8] = {0};
  const void* ps[16] = {0};
  int64_t dims[GO_MAX_RANK], d[GO_MAX_RANK];
  size_t rank = 0, r = 0;
  for (int i = 0; i < op->n_in; ++i) {
    const OrtValue* v = NULL;
    GO_TRY(GO_FN(KernelContext_GetInput)(ctx, (size_t)i, &v));
    if (!v) return go_fail(api, "graphopt.fused: missing input");
    GO_TRY(go_shape(api, v, i ? d : dims, i ? &r : &rank));
    if (i && (r != rank || memcmp(d, dims, rank * sizeof(int64_t))))
      return go_fail(api, "graphopt.fused: runtime inputs must have one shape");
    void* data = NULL;
    GO_TRY(GO_FN(GetTensorMutableData)((OrtValue*)v, &data));
    xs[i] = data;
  }
  int64_t n = 1, inner = 1, C = 1;
  for (size_t j = 0; j < rank; ++j) n *= dims[j];
  if (op->axis) {
    const int64_t a = (int64_t)rank + op->axis;
    if (a < 0) return go_fail(api, "graphopt.fused: input rank below the channel axis");
    C = dims[a];
    for (size_t j = (size_t)a + 1; j < rank; ++j) inner *= dims[j];
  }
  for (int i = 0; i < op->n_par; ++i) {
    const OrtValue* v = NULL;
    GO_TRY(GO_FN(KernelContext_GetInput)(ctx, (size_t)(op->n_in + i), &v));
    if (!v) return go_fail(api, "graphopt.fused: missing parameter");
    OrtTensorTypeAndShapeInfo* info = NULL;
    size_t m = 0;
    GO_TRY(GO_FN(GetTensorTypeAndShape)(v, &info));
    OrtStatus* s = GO_FN(GetTensorShapeElementCount)(info, &m);
    GO_FN(ReleaseTensorTypeAndShapeInfo)(info);
    if (s) return s;
    if ((int64_t)m != C)
      return go_fail(api, "graphopt.fused: a parameter does not hold one value per channel");
    void* data = NULL;
    GO_TRY(GO_FN(GetTensorMutableData)((OrtValue*)v, &data));
    ps[i] = data;
  }
  OrtValue* out = NULL;
  void* y = NULL;
  GO_TRY(GO_FN(KernelContext_GetOutput)(ctx, 0, dims, rank, &out));
  GO_TRY(GO_FN(GetTensorMutableData)(out, &y));
  if (n == 0) return NULL;
  void* stream = NULL;
  GO_TRY(GO_FN(KernelContext_GetGPUComputeStream)(ctx, &stream));
  cudaError_t e = op->launch((cudaStream_t)stream, n, inner ? inner : 1, C ? C : 1, xs, ps, y);
  if (e != cudaSuccess) return GO_FN(CreateStatus)(GO_ORT_FAIL, cudaGetErrorString(e));
  return NULL;
}

static OrtStatus* go_create(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info,
                            void** kernel) {
  (void)info;
  go_kernel* k = (go_kernel*)calloc(1, sizeof(go_kernel));
  if (!k) return GO_FN(CreateStatus)(GO_ORT_FAIL, "graphopt.fused: out of memory");
  k->op = (const go_op*)op;
  k->api = api;
  *kernel = k;
  return NULL;
}
static void go_destroy(void* kernel) { free(kernel); }
static const char* go_name(const OrtCustomOp* op) { return ((const go_op*)op)->name; }
static const char* go_provider(const OrtCustomOp* op) { (void)op; return "CUDAExecutionProvider"; }
%(callbacks)s

static int go_grid(int64_t n) {
  int64_t g = (n + %(block)d - 1) / %(block)d;
  return (int)(g < 4096 ? g : 4096);
}

#define GO_OP(NAME, NIN, NPAR, AXIS, ELEM, LAUNCH) \
  { { GO_ORT_API_VERSION, NULL, go_name, go_provider, go_in_type, go_in_count, go_out_type, \
      go_out_count, NULL, go_destroy, go_required, go_required, go_mem_default, go_one, go_one, \
      go_one, go_one, go_create, go_compute }, NAME, NIN, NPAR, AXIS, ELEM, LAUNCH }
"""

REGISTER = r"""
extern "C" __attribute__((visibility("default")))
OrtStatus* RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* base) {
  const OrtApi* api = base->GetApi(GO_ORT_API_VERSION);
  if (!api) return NULL;
  OrtCustomOpDomain* domain = NULL;
  GO_TRY(GO_FN(CreateCustomOpDomain)("graphopt.fused", &domain));
  for (size_t i = 0; i < sizeof(go_ops) / sizeof(go_ops[0]); ++i)
    GO_TRY(GO_FN(CustomOpDomain_Add)(domain, &go_ops[i].base));
  return GO_FN(AddCustomOpDomain)(options, domain);
}
"""


def variants(specs: list[KernelSpec]) -> list[KernelSpec]:
    """Each expression in both element types, deduplicated, sorted by op type."""
    out: dict[str, KernelSpec] = {}
    for s in specs:
        for dt in ("float32", "float16"):
            v = replace(s, dtype=dt)
            out[v.op_type] = v
    return [out[k] for k in sorted(out)]


def generate(specs: list[KernelSpec]) -> CudaSource:
    ordered = variants(specs)
    text = (
        "/* Generated by graphopt (targets/codegen/cuda.py): fused element-wise kernels as an\n"
        " * onnxruntime custom-op library for the CUDA execution provider. Do not edit. */\n"
        "#include <stdint.h>\n#include <stdlib.h>\n#include <string.h>\n"
        "#include <cuda_runtime.h>\n#include <cuda_fp16.h>\n"
        '#include "graphopt_ort_abi.h"\n'
    )
    text += DEVICE_MATH + RUNTIME % {"block": BLOCK, "callbacks": OP_CALLBACKS}
    src = CudaSource("", {}, ordered)
    for k, spec in enumerate(ordered):
        _check_name(spec.op_type)
        suffix = "f16" if spec.dtype == "float16" else "f32"
        sym = f"go_k{k}_{suffix}"
        src.symbols[spec.op_type] = sym
        text += "\n" + _kernel(sym, spec)
    text += "\nstatic go_op go_ops[] = {\n"
    for spec in ordered:
        text += (
            f'  GO_OP("{spec.op_type}", {spec.inputs}, {spec.params}, {spec.channel_axis}, '
            f"{ELEM[spec.dtype]}, {src.symbols[spec.op_type]}_launch),\n"
        )
    text += "};\n" + REGISTER
    src.text = text
    return src


def _kernel(sym: str, spec: KernelSpec) -> str:
    t = "__half" if spec.dtype == "float16" else "float"
    args = [f"const {t}* __restrict__ x{i}" for i in range(spec.inputs)]
    args += [f"const {t}* __restrict__ p{j}" for j in range(spec.params)]
    leaf = {f"x{i}": f"go_ld(x{i}, i)" for i in range(spec.inputs)}
    leaf.update({f"p{j}": f"go_ld(p{j}, ch)" for j in range(spec.params)})
    stmts, result = c_statements(spec.expr, leaf)
    body = [
        f'extern "C" __global__ void __launch_bounds__({BLOCK})',
        f"{sym}(const int64_t n, const int64_t inner, const int64_t C, "
        f"{', '.join(args + [f'{t}* __restrict__ y'])}) {{",
        "  const int64_t stride = (int64_t)gridDim.x * blockDim.x;",
        "  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {",
    ]
    body.append(
        "    const int64_t ch = (i / inner) % C;" if spec.params else "    (void)inner; (void)C;"
    )
    body += [f"    {s}" for s in stmts]
    body += [f"    go_st(y, i, {result});", "  }", "}"]
    xs = ", ".join(f"(const {t}*)x[{i}]" for i in range(spec.inputs))
    ps = "".join(f", (const {t}*)p[{j}]" for j in range(spec.params))
    body += [
        f"static cudaError_t {sym}_launch(cudaStream_t s, int64_t n, int64_t inner, int64_t C,",
        "                                const void* const* x, const void* const* p, void* y) {",
        f"  {sym}<<<go_grid(n), {BLOCK}, 0, s>>>(n, inner, C, {xs}{ps}, ({t}*)y);",
        "  return cudaGetLastError();",
        "}",
        "",
    ]
    return "\n".join(body) + "\n"


def header() -> str:
    return HEADER


_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\d+)'")
_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")


def ptxas_resources(log: str) -> dict[str, dict[str, dict[str, int]]]:
    """``-Xptxas -v`` output -> {kernel symbol: {arch: {registers, spill_stores, spill_loads,
    stack_bytes}}}."""
    out: dict[str, dict[str, dict[str, int]]] = {}
    current: dict[str, int] | None = None
    for line in log.splitlines():
        m = _ENTRY.search(line)
        if m:
            current = out.setdefault(m.group(1), {}).setdefault(m.group(2), {})
            continue
        if current is None:
            continue
        m = _STACK.search(line)
        if m:
            current.update(
                stack_bytes=int(m.group(1)),
                spill_stores=int(m.group(2)),
                spill_loads=int(m.group(3)),
            )
        m = _REGS.search(line)
        if m:
            current["registers"] = int(m.group(1))
    return out
