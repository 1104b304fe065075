"""Whole-graph passes; importing this package registers them with the pass manager."""

from . import dce, fold_constants, simplify_shapes  # noqa: F401
