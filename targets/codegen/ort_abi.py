"""graphopt's own minimal declarations of the onnxruntime C API it calls (no onnxruntime header).

No package reachable from this project ships ``onnxruntime_c_api.h`` (see
the project's kernel feasibility notes, §3), so generated custom-op libraries include
:data:`HEADER` instead: declarations written for this project from the public documentation of
the C API, covering only what the libraries use.

The facts it relies on (onnxruntime's documented ABI, stable by design):

* ``OrtGetApiBase()->GetApi(version)`` returns the ``OrtApi`` table for ``version``; the table is
  a struct of function pointers that only ever grows at the end, so an entry's position never
  changes.  We pin :data:`ORT_API_VERSION` = 16 (onnxruntime >= 1.16; tested against the
  installed 1.32) and address each entry by its index in that struct (:data:`API_INDEX`) instead
  of declaring the 190-odd entries in between.
* A custom-op library exports ``RegisterCustomOps(OrtSessionOptions*, const OrtApiBase*)``;
  onnxruntime calls it from ``SessionOptions.register_custom_ops_library``.
* ``OrtCustomOp`` is a versioned struct of callbacks; onnxruntime reads only the fields that
  exist at the ``version`` the op declares.  At version 16 these are the 18 fields declared
  below; 16 is the first version with ``CreateKernelV2``/``KernelComputeV2``, which return an
  ``OrtStatus*`` so a kernel can report a shape error instead of failing silently.
* Enums crossing the ABI (element type, memory type, input characteristic) are C ``int``.

``tests/test_codegen.py`` checks the indexes against the installed onnxruntime by running
kernels that call every entry (and ``KernelContext_GetGPUComputeStream``, which a CPU kernel
context answers with a null stream).
"""

from __future__ import annotations

ORT_API_VERSION = 16

#: OrtApi entries used, by their 0-based position in the OrtApi struct
API_INDEX = {
    "CreateStatus": 0,
    "CreateCustomOpDomain": 26,
    "CustomOpDomain_Add": 27,
    "AddCustomOpDomain": 28,
    "GetTensorMutableData": 51,
    "GetDimensionsCount": 61,
    "GetDimensions": 62,
    "GetTensorShapeElementCount": 64,
    "GetTensorTypeAndShape": 65,
    "KernelContext_GetInputCount": 88,
    "KernelContext_GetInput": 90,
    "KernelContext_GetOutput": 91,
    "ReleaseTensorTypeAndShapeInfo": 99,
    "KernelContext_GetGPUComputeStream": 193,
}

_DEFINES = "\n".join(f"#define GO_API_{name} {index}" for name, index in API_INDEX.items())

HEADER = (
    """/* graphopt_ort_abi.h: graphopt's own minimal declarations of the onnxruntime C API entries
 * its generated custom-op libraries call.  Written for graphopt from the public documentation
 * of onnxruntime's C API; not onnxruntime's header.  Pinned API version: 16 (onnxruntime >= 1.16).
 * OrtApi is an append-only table of function pointers: entries are addressed by index. */
#ifndef GRAPHOPT_ORT_ABI_H
#define GRAPHOPT_ORT_ABI_H
#include <stddef.h>
#include <stdint.h>

#define GO_ORT_API_VERSION 16

typedef struct OrtStatus OrtStatus;
typedef struct OrtApi OrtApi; /* opaque: read through go_api_fn() */
typedef struct OrtSessionOptions OrtSessionOptions;
typedef struct OrtCustomOpDomain OrtCustomOpDomain;
typedef struct OrtKernelInfo OrtKernelInfo;
typedef struct OrtKernelContext OrtKernelContext;
typedef struct OrtValue OrtValue;
typedef struct OrtTensorTypeAndShapeInfo OrtTensorTypeAndShapeInfo;
struct OrtCustomOp;

typedef struct OrtApiBase {
  const OrtApi* (*GetApi)(uint32_t version);
  const char* (*GetVersionString)(void);
} OrtApiBase;

/* element types (ONNX TensorProto numbering) and error codes used here */
#define GO_ELEM_FLOAT 1
#define GO_ELEM_FLOAT16 10
#define GO_ORT_FAIL 1
#define GO_ORT_INVALID_ARGUMENT 2
#define GO_MEM_DEFAULT 0
#define GO_IO_REQUIRED 0

"""
    + _DEFINES
    + """

/* the entry at index i of the OrtApi table, as a function pointer of type T */
#define go_api_fn(api, i, T) ((T)(((void* const*)(const void*)(api))[i]))

typedef OrtStatus* (*go_CreateStatus)(int code, const char* msg);
typedef OrtStatus* (*go_CreateCustomOpDomain)(const char* domain, OrtCustomOpDomain** out);
typedef OrtStatus* (*go_CustomOpDomain_Add)(OrtCustomOpDomain* d, const struct OrtCustomOp* op);
typedef OrtStatus* (*go_AddCustomOpDomain)(OrtSessionOptions* o, OrtCustomOpDomain* d);
typedef OrtStatus* (*go_GetTensorMutableData)(OrtValue* v, void** out);
typedef OrtStatus* (*go_GetDimensionsCount)(const OrtTensorTypeAndShapeInfo* i, size_t* out);
typedef OrtStatus* (*go_GetDimensions)(const OrtTensorTypeAndShapeInfo* i, int64_t* d, size_t n);
typedef OrtStatus* (*go_GetTensorShapeElementCount)(const OrtTensorTypeAndShapeInfo* i, size_t* o);
typedef OrtStatus* (*go_GetTensorTypeAndShape)(const OrtValue* v, OrtTensorTypeAndShapeInfo** o);
typedef OrtStatus* (*go_KernelContext_GetInputCount)(const OrtKernelContext* c, size_t* out);
typedef OrtStatus* (*go_KernelContext_GetInput)(const OrtKernelContext* c, size_t i,
                                                const OrtValue** out);
typedef OrtStatus* (*go_KernelContext_GetOutput)(OrtKernelContext* c, size_t i,
                                                 const int64_t* dims, size_t n, OrtValue** out);
typedef void (*go_ReleaseTensorTypeAndShapeInfo)(OrtTensorTypeAndShapeInfo* i);
typedef OrtStatus* (*go_KernelContext_GetGPUComputeStream)(const OrtKernelContext* c, void** out);

/* OrtCustomOp as of version 16: the fields onnxruntime reads for an op declaring version 16 */
typedef struct OrtCustomOp {
  uint32_t version;
  void* (*CreateKernel)(const struct OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info);
  const char* (*GetName)(const struct OrtCustomOp* op);
  const char* (*GetExecutionProviderType)(const struct OrtCustomOp* op);
  int (*GetInputType)(const struct OrtCustomOp* op, size_t index);
  size_t (*GetInputTypeCount)(const struct OrtCustomOp* op);
  int (*GetOutputType)(const struct OrtCustomOp* op, size_t index);
  size_t (*GetOutputTypeCount)(const struct OrtCustomOp* op);
  void (*KernelCompute)(void* kernel, OrtKernelContext* context);
  void (*KernelDestroy)(void* kernel);
  int (*GetInputCharacteristic)(const struct OrtCustomOp* op, size_t index);
  int (*GetOutputCharacteristic)(const struct OrtCustomOp* op, size_t index);
  int (*GetInputMemoryType)(const struct OrtCustomOp* op, size_t index);
  int (*GetVariadicInputMinArity)(const struct OrtCustomOp* op);
  int (*GetVariadicInputHomogeneity)(const struct OrtCustomOp* op);
  int (*GetVariadicOutputMinArity)(const struct OrtCustomOp* op);
  int (*GetVariadicOutputHomogeneity)(const struct OrtCustomOp* op);
  OrtStatus* (*CreateKernelV2)(const struct OrtCustomOp* op, const OrtApi* api,
                               const OrtKernelInfo* info, void** kernel);
  OrtStatus* (*KernelComputeV2)(void* kernel, OrtKernelContext* context);
} OrtCustomOp;

#endif /* GRAPHOPT_ORT_ABI_H */
"""
)


#: OrtCustomOp callbacks shared by the CPU and CUDA libraries: each op's inputs and single
#: output have the op's element type, and every input is required.
OP_CALLBACKS = r"""
static int go_in_type(const OrtCustomOp* op, size_t i) { (void)i; return ((const go_op*)op)->elem; }
static size_t go_in_count(const OrtCustomOp* op) {
  const go_op* o = (const go_op*)op;
  return (size_t)(o->n_in + o->n_par);
}
static int go_out_type(const OrtCustomOp* op, size_t i) {
  (void)i;
  return ((const go_op*)op)->elem;
}
static size_t go_out_count(const OrtCustomOp* op) { (void)op; return 1; }
static int go_required(const OrtCustomOp* op, size_t i) {
  (void)op, (void)i;
  return GO_IO_REQUIRED;
}
static int go_mem_default(const OrtCustomOp* op, size_t i) {
  (void)op, (void)i;
  return GO_MEM_DEFAULT;
}
static int go_one(const OrtCustomOp* op) { (void)op; return 1; }
""".strip("\n")
