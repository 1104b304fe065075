"""Kernel code generation for fused element-wise chains.

* :mod:`.expr`: the expression a ``graphopt.fused`` node carries (grammar, validation, numpy
  evaluation, kernel identity);
* :mod:`.spec`: one kernel = expression + element type + channel axis;
* :mod:`.cpu` / :mod:`.cuda`: C (OpenMP rows, vectorized inner loop) and CUDA C (grid-stride,
  fp32/fp16) generators, each emitting an onnxruntime custom-op library;
* :mod:`.ort_abi`: graphopt's own minimal declarations of the onnxruntime C API (pinned API 16);
* :mod:`.toolchain`: compilers (gcc, nvcc) and the content-addressed build cache;
* :mod:`.library`: builds, the session resolver (registered with ``graphopt.opt.verify.customops``)
  and the bundle's ``kernels/`` folder;
* :mod:`.gates`: the numerics, vectorization and benchmark gates a kernel passes before use.

Importing this package registers the ``graphopt.fused`` resolver.  :func:`kernel_pipeline` says
when ``optimize`` generates kernels: by default for the ``-O2``/``-O3`` presets on the targets
that have a generator (cpu, cuda), each kernel kept only where its gates pass; a machine
without a compiler gets ``no-compiler`` remarks, never an error.
"""

from __future__ import annotations

import os

from . import library  # noqa: F401  (registers the graphopt.fused custom-op resolver)

#: the targets with a kernel generator (``fuse-elementwise``)
KERNEL_TARGETS = ("cpu", "cuda")
#: set to 1 to turn the default off (``--kernels`` still turns it on)
NO_KERNELS_ENV = "GRAPHOPT_NO_KERNELS"


def kernels_by_default(target: str, level: int) -> bool:
    """Whether ``optimize`` generates kernels when neither ``--kernels`` nor ``--no-kernels``
    is given: the fusion presets (-O2, -O3) of a target with a generator, unless
    ``GRAPHOPT_NO_KERNELS`` is set to a true value."""
    off = os.environ.get(NO_KERNELS_ENV, "").strip().lower() in ("1", "true", "yes", "on")
    return not off and level >= 2 and target in KERNEL_TARGETS


def kernel_pipeline(target: str, level: int, pipeline: str | None, kernels: bool | None):
    """The pipeline ``optimize`` runs: ``pipeline`` (None: the ``-O`` preset, kept as None) with
    ``fuse-elementwise`` added where kernels are on -- ``kernels=True`` adds it to any pipeline,
    ``None`` follows :func:`kernels_by_default` for the presets (a custom pipeline is run as
    written), ``False`` never adds it."""
    from graphopt.opt.rewrite.pipeline import preset, with_kernels

    if kernels is None:
        kernels = pipeline is None and kernels_by_default(target, level)
    if not kernels:
        return pipeline
    return with_kernels(preset(level) if pipeline is None else pipeline)
