"""graphopt: an ONNX graph optimizer with explainable rewrites, per-target legalization and
numerical parity checks.

    >>> import graphopt
    >>> optimized, report = graphopt.optimize("model.onnx", target="cpu", level=2)
    >>> bundle = graphopt.write_bundle(optimized, report)  # model.cpu.graphopt/
    >>> session = graphopt.load_session(bundle)

Importing graphopt imports neither onnx nor onnxruntime: each name below is imported on first
use, and the passes, rules and targets register themselves when a table is first read
(:mod:`graphopt.opt.registry`).
"""

from . import _interrupt  # noqa: F401  first: Ctrl-C while the rest imports (the command)

# isort: split
from .opt import registry

registry.PLUGINS[:] = ["graphopt.passes", "graphopt.rules", "graphopt.targets"]

__version__ = "0.1.0"

#: the public names and the modules they live in
_API = {
    "GraphoptError": "graphopt.opt.errors",
    "Report": "graphopt.opt.report.schema",
    "load_model": "graphopt.opt.graph.io",
    "save_model": "graphopt.opt.graph.io",
    "optimize": "graphopt.opt.optimizer",
    "load_session": "graphopt.targets.bundle",
    "open_session": "graphopt.targets.bundle",
    "run_bundle": "graphopt.targets.bundle",
    "write_bundle": "graphopt.targets.bundle",
}
__all__ = [*sorted(_API), "__version__"]


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'graphopt' has no attribute {name!r}")
    import importlib

    registry.load_plugins()
    value = getattr(importlib.import_module(_API[name]), name)
    globals()[name] = value
    return value
