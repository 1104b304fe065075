"""The target profiles, as data: which runtime, which kernels, which tolerances.

* ``cpu``: onnxruntime's CPU execution provider; its kernel table is read live from the
  installed onnxruntime's registry, so it is always the truth for this machine.
* ``cuda``: onnxruntime's CUDA execution provider; its kernel table is a pinned snapshot
  (``data/cuda_kernels.json``) transcribed from onnxruntime's documented kernel list.  Nodes
  without a CUDA kernel fall back to ``cpu`` (``fallback``): legalize reports those islands.
* ``tensorrt``: TensorRT through its ONNX parser, standard ONNX ops only; the table
  (``data/tensorrt_ops.json``) is onnx-tensorrt's operator support matrix for TensorRT 10.15.
* ``npu``: a generic edge NPU (``data/npu_ops.json``, a synthetic table): a restricted op set
  without Erf, static shapes only, fp16/int8 compute.

Besides the kernel table, a profile says which lowering it prefers (``prefers``: read by the
target rewrites in ``rules/target_rewrites.py``, never a target name), which numerics-changing
rewrites it accepts below -O3, whether shapes must be static, and the onnxruntime session
settings its bundle is verified with (``targets/bundle.py``).
"""

from __future__ import annotations

import json
from importlib import resources

import onnxruntime as ort

from graphopt.opt.errors import GraphoptError
from graphopt.opt.graph.domains import norm_domain
from graphopt.opt.rewrite.target import KernelTable, Target, register_target
from graphopt.opt.verify.parity import DEFAULT_TOLERANCES


def _add(
    table: KernelTable, op: str, domain: str, since: int, end: int | None, types: frozenset[str]
) -> None:
    table.setdefault((op, norm_domain(domain)), []).append((since, end, types))


def live_cpu_kernels() -> KernelTable:
    """The CPU provider's kernel registry of the installed onnxruntime."""
    from onnxruntime.capi import _pybind_state as C

    table: KernelTable = {}
    for k in C.get_all_opkernel_def():
        if k.provider != "CPUExecutionProvider":
            continue
        since, end = k.version_range
        types = frozenset(t for ts in k.type_constraints.values() for t in ts)
        _add(table, k.op_name, k.domain, since, None if end >= 2**31 - 1 else end, types)
    return table


def pinned_kernels(filename: str) -> KernelTable:
    """A kernel table transcribed from onnxruntime's documentation (see the file's 'source')."""
    try:
        data = json.loads(
            resources.files("graphopt.targets").joinpath("data", filename).read_text()
        )
    except FileNotFoundError:
        raise GraphoptError(f"kernel table {filename} is missing from the installation") from None
    table: KernelTable = {}
    for k in data["kernels"]:
        _add(
            table,
            k["op"],
            k["domain"],
            int(k["since"]),
            None if k.get("end") is None else int(k["end"]),
            frozenset(k.get("types", ())),
        )
    return table


#: measured with examples/benchmark/pixel_shuffle.py (1 thread, ORT_ENABLE_ALL, interleaved)
PIXEL_SHUFFLE_CPU = (
    "measured (examples/benchmark/pixel_shuffle.py, onnxruntime 1.32.0 CPU, 1 thread, "
    "ORT_ENABLE_ALL, 200 interleaved runs): DepthToSpace takes 0.28-0.69x the time of "
    "Reshape->Transpose->Reshape (x=[1,128,32,32] r=2: 250 vs 528 us; [1,64,128,128] r=2: "
    "2.36 vs 8.54 ms; both CRD and DCR); whole esrgan_tiny 14.4 vs 14.6 ms"
)

LINEAR_BIAS_CPU = (
    "a linear layer on a rank >= 3 input with static dims after the first runs as Reshape -> "
    "Gemm(bias) -> Reshape: the bias is added inside the GEMM, and a following Gelu stays a "
    "plain Gelu (onnxruntime 1.32.0 CPU, 1 thread, ORT_ENABLE_ALL: BiasGelu 1.28 ms vs Gelu "
    "0.78 ms at [1,56,56,384]; whole models against MatMul + Add, two pairs of interleaved runs "
    "in shuffled order: ConvNeXt-T 0.982/0.989, Swin-T 0.983/0.981, HF ViT 0.995/0.996, "
    "Whisper-tiny encoder 0.993/0.990, torchvision ViT-B/16 1.022/1.002)"
)

ATTENTION_CPU = (
    "measured (examples/benchmark/attention_shapes.py, onnxruntime 1.32.0 CPU, 1 thread, "
    "ORT_ENABLE_ALL, interleaved runs; MultiHeadAttention / the exporter's attention): with "
    "an attention_bias, Swin-T windows of 49 keys 1.02-1.09x (64 windows, 3 heads of 32: "
    "2545 vs 2326 us; the per-head bias), 16 keys with a padding mask 1.01-1.17x (reruns, "
    "95 % intervals: 1.02-1.05, 1.05-1.06), 64 keys 1.01-1.11x; from 128 keys on it pays: "
    "BERT-base S=128 0.99x (batch 8: 0.96x), ViT-B/16 (197) 0.85x, Whisper-tiny (1500) "
    "0.86x; whole Swin-T with its 12 attentions fused ran 1.014-1.026x against none fused.  "
    "Without a bias it pays at every length (400-1000 runs, median per-pair ratio, 95 % "
    "interval): 16 keys 0.81-0.86, Wav2Vec2/HuBERT-base's 49 frames (12 heads of 64) "
    "0.88-0.92 (batch 4: 0.93-0.99), Swin shapes without the bias 0.77-0.92, MobileViT-S's "
    "64 and 16 patches 0.83-0.92; whole Wav2Vec2/HuBERT (4 layers) and MobileViT-S with every "
    "attention fused tie with the bound's choice (examples/benchmark/attention_bound.py: "
    "0.97-1.01, 0.96-1.08, 0.95-1.07)"
)

RMS_FP16_CPU = (
    "measured (onnxruntime 1.32.0 CPU): float16 rows of 4096 values of magnitude ~200, whose "
    "sum of squares (~1.6e8) overflows float16, normalize to within 1.1e-3 of float64 (float16 "
    "rounding) in SkipSimplifiedLayerNormalization, RMSNormalization-23 and "
    "SimplifiedLayerNormalization alike: the mean square is accumulated in float32"
)

#: onnxruntime session settings shared by the onnxruntime-based targets (see targets/bundle.py)
ORT_SESSION = {
    "graph_optimization_level": "ORT_ENABLE_ALL",
    "why": "the bundle's model is saved by graphopt, portable (never an onnxruntime ALL-level "
    "save, which bakes in NCHWc layouts for one machine); at load time ALL builds those layouts "
    "for the machine that runs it. Measured: ResNet-50 at EXTENDED ran 27 % slower than at ALL",
}


CPU = register_target(
    Target(
        name="cpu",
        description="onnxruntime CPU execution provider",
        runtime=f"onnxruntime {ort.__version__}",
        providers=("CPUExecutionProvider",),
        kernels_source="live: onnxruntime.capi._pybind_state.get_all_opkernel_def()",
        load_kernels=live_cpu_kernels,
        tolerances=DEFAULT_TOLERANCES,
        fp32_accumulation={
            "LayerNormalization": "onnxruntime's CPU LayerNormalization-17 kernel "
            "(core/providers/cpu/nn/layer_norm.cc) is registered with U=float for every T, "
            "float16/bfloat16 included (the live registry lists the (T, float) pairs), and "
            "computes mean and inverse std-dev in U",
            "SkipSimplifiedLayerNormalization": RMS_FP16_CPU,
            "RMSNormalization": RMS_FP16_CPU,
        },
        slower_below={"MultiHeadAttention": (128, ATTENTION_CPU)},
        measured_slower={
            "FusedConv(Z)": "onnxruntime 1.32.0 CPU, ORT_ENABLE_ALL: its NCHWc transformer "
            "converts Conv + Add + Relu (and FusedConv without Z) to NCHWc, but leaves a "
            "FusedConv with a residual input in NCHW between reorders; torchvision ResNet-18 "
            "(dynamo export, 1x3x224x224, 1 thread): 1.18x the original with the residual "
            "fused, 8 FusedConv left unconverted",
            "SkipLayerNormalization": "onnxruntime 1.32.0 CPU, fp32, 1 intra-op thread, "
            "ORT_ENABLE_ALL, 30x5 interleaved runs on this project's 2-vCPU build machine: "
            "SkipLayerNormalization 0.501 ms vs Add+LayerNormalization 0.078 ms at [1,128,768] "
            "(6.4x slower), 4.01 ms vs 0.79 ms at [8,128,768] (5.1x slower)",
        },
        runtime_version=ort.__version__,
        prefers={
            "pixel-shuffle": "DepthToSpace",
            "relu6": "Clip",
            "clip-min-zero": "Relu",
            "linear-bias": "gemm",
        },
        prefers_why={
            "pixel-shuffle": PIXEL_SHUFFLE_CPU,
            "linear-bias": LINEAR_BIAS_CPU,
            "relu6": "one Clip kernel instead of Max and Min: one pass over the tensor",
            "clip-min-zero": "Clip(x, 0) is Relu; MLAS fuses Relu into the preceding Conv/Gemm",
        },
        kernel_attributes={
            "FusedConv": {
                "activation": ("Relu", "Tanh", "Sigmoid", "LeakyRelu", "Clip", "HardSigmoid")
            }
        },
        kernel_attributes_why={
            "FusedConv": "the CPU FusedConv is the Conv kernel with an MLAS activation "
            "(core/providers/cpu/fused_activation.cc); the Z input is added before it. "
            "Measured on ResNet-50 (graphopt -O2 output, 1 thread, interleaved): Conv+Relu "
            "and Conv+Add+Relu as FusedConv ran 0.98x at ORT_DISABLE_ALL and 1.01x (noise) at "
            "ORT_ENABLE_ALL, 57 nodes instead of 122",
        },
        expands_functions=True,
        fp16_via_float=True,
        session=ORT_SESSION,
    )
)

CUDA = register_target(
    Target(
        name="cuda",
        description="onnxruntime CUDA execution provider",
        runtime=f"onnxruntime {ort.__version__} (CUDA EP)",
        providers=("CUDAExecutionProvider", "CPUExecutionProvider"),
        kernels_source="pinned: targets/data/cuda_kernels.json "
        "(onnxruntime docs/OperatorKernels.md)",
        load_kernels=lambda: pinned_kernels("cuda_kernels.json"),
        tolerances=DEFAULT_TOLERANCES,
        fp32_accumulation={
            "Gemm": "onnxruntime's CUDA Gemm calls cublasGemmEx for fp16 with 32-bit compute "
            "(CUBLAS_COMPUTE_32F) unless ORT_CUDA_GEMM_OPTIONS selects 16-bit compute",
            "LayerNormalization": "onnxruntime's CUDA LayerNormalization-17 "
            "(core/providers/cuda/nn/layer_norm.cc) instantiates LayerNorm<T, U=float> for "
            "float16/bfloat16 and accumulates mean and variance in U",
        },
        device_available="CUDAExecutionProvider" in ort.get_available_providers(),
        runtime_version=ort.__version__,
        prefers={"pixel-shuffle": "DepthToSpace", "relu6": "Clip", "clip-min-zero": "Relu"},
        prefers_why={
            "pixel-shuffle": "one DepthToSpace kernel launch instead of a 6-D Transpose "
            "between two Reshapes (not measured here: no GPU)",
        },
        kernel_attributes={
            "FusedConv": {"activation": ("Relu",)},
            "GroupQueryAttention": {"causal": ("1",)},
            "Attention": {"softcap": ("0",)},
        },
        kernel_attributes_why={
            "FusedConv": "onnxruntime's CUDA FusedConv maps the activation to a cuDNN "
            "activation mode and accepts only Relu (core/providers/cuda/nn/fused_conv.cc)",
            "GroupQueryAttention": "the CUDA kernel runs fp16/bf16 (flash or memory-efficient "
            "attention); causal=0 with a whole-mask attention_bias, which the exact lowering "
            "needs, is not verified on CUDA (no GPU here), so decoders keep MultiHeadAttention",
            "Attention": "onnxruntime's CUDA Attention-23 (core/providers/cuda/llm/attention.cc) "
            "hands q/k/v to the contrib attention kernels, whose parameters carry no softcap: "
            "soft-capped scores are not lowered to it (not verified on a GPU here)",
        },
        expands_functions=True,
        fallback="cpu",
        session=ORT_SESSION,
    )
)

TENSORRT = register_target(
    Target(
        name="tensorrt",
        description="NVIDIA TensorRT through its ONNX parser (standard ONNX ops only)",
        runtime="TensorRT 10.15 (onnx-tensorrt parser)",
        providers=("TensorrtExecutionProvider",),
        kernels_source="pinned: targets/data/tensorrt_ops.json "
        "(onnx/onnx-tensorrt docs/operators.md, TensorRT 10.15)",
        load_kernels=lambda: pinned_kernels("tensorrt_ops.json"),
        tolerances=DEFAULT_TOLERANCES,
        device_available="TensorrtExecutionProvider" in ort.get_available_providers(),
        runtime_version="10.15",
        prefers={"pixel-shuffle": "DepthToSpace", "relu6": "Clip", "clip-min-zero": "Relu"},
        prefers_why={
            "pixel-shuffle": "TensorRT's parser maps DepthToSpace to one shuffle layer",
            "relu6": "Clip maps to one IActivationLayer (kCLIP), fusable into the Conv",
        },
        kernel_attributes={"Attention": {"softcap": ("0",)}},
        kernel_attributes_why={
            "Attention": "onnx-tensorrt's Attention: `qk_matmul_output_mode` and `softcap` "
            "attributes are unsupported; Q, K, V and attn_mask must be 4-D"
        },
        session={
            "graph_optimization_level": "ORT_ENABLE_BASIC",
            "why": "onnxruntime's EXTENDED level fuses into com.microsoft ops, which TensorRT "
            "cannot run; TensorRT does its own fusion when it builds the engine",
        },
    )
)

NPU = register_target(
    Target(
        name="npu",
        description="generic edge NPU: restricted op set, static shapes, fp16/int8 compute",
        runtime="generic-npu 1 (synthetic capability table)",
        providers=(),
        kernels_source="pinned: targets/data/npu_ops.json (synthetic generic edge-NPU table)",
        load_kernels=lambda: pinned_kernels("npu_ops.json"),
        # The NPU computes in fp16: parity of its lowered graph is judged at fp16 tolerance.
        tolerances={**DEFAULT_TOLERANCES, "float32": (1e-2, 1e-3), "float16": (1e-2, 1e-3)},
        device_available=False,
        runtime_version="1",
        prefers={"pixel-shuffle": "DepthToSpace", "relu6": "Clip", "gelu": "tanh"},
        prefers_why={
            "pixel-shuffle": "one DepthToSpace kernel; the Reshape form needs a 6-D Transpose, "
            "which edge NPUs run slowly or not at all (the table does not model rank limits)",
            "gelu": "the NPU has no Erf; Gelu runs as its tanh approximation (-O3)",
        },
        static_shapes=True,
    )
)

#: the document each pinned kernel table was transcribed from (targets/data/), by target
DOCUMENTS = {"cuda": "cuda_kernels.json", "tensorrt": "tensorrt_ops.json", "npu": "npu_ops.json"}


def pinned_document(filename: str) -> dict:
    """A pinned table's whole document: source, commit, notes and the kernel rows."""
    return json.loads(resources.files("graphopt.targets").joinpath("data", filename).read_text())
