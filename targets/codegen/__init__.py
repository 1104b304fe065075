"""Kernel code generation for fused element-wise chains (issue 8).

* :mod:`.expr`: the expression a ``graphopt.fused`` node carries (grammar, validation, numpy
  evaluation, kernel identity);
* :mod:`.spec`: one kernel = expression + element type + channel axis;
* :mod:`.cpu` / :mod:`.cuda`: C (OpenMP rows, vectorized inner loop) and CUDA C (grid-stride,
  fp32/fp16) generators, each emitting an onnxruntime custom-op library;
* :mod:`.ort_abi`: graphopt's own minimal declarations of the onnxruntime C API (pinned API 16);
* :mod:`.toolchain`: compilers (gcc, nvcc) and the content-addressed build cache;
* :mod:`.library`: builds, the session resolver (registered with ``graphopt.opt.customops``)
  and the bundle's ``kernels/`` folder;
* :mod:`.gates`: the numerics, vectorization and benchmark gates a kernel passes before use.

Importing this package registers the ``graphopt.fused`` resolver.
"""

from . import library  # noqa: F401  (registers the graphopt.fused custom-op resolver)
