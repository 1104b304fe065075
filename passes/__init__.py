"""Whole-graph passes; importing this package registers them with the pass manager."""

from . import dce, fold_constants, legalize, simplify_shapes  # noqa: F401
