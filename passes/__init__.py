"""Whole-graph passes; importing this package registers them with the pass manager."""

from . import cse, dce, fold_constants, fuse_elementwise, legalize, simplify_shapes  # noqa: F401
