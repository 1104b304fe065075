"""Target profiles; importing this package registers them (see :mod:`graphopt.opt.target`)."""

from . import profiles  # noqa: F401
