"""Whole-graph passes; importing this package registers them with the pass manager."""

from . import dce, fold_constants  # noqa: F401
