"""Target profiles; importing this package registers them (see :mod:`graphopt.opt.rewrite.target`).

It also registers the custom-op resolver of generated kernels (:mod:`.codegen`)."""

from . import codegen, profiles  # noqa: F401
