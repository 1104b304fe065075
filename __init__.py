"""graphopt: an ONNX graph optimizer with explainable rewrites, per-target legalization and
numerical parity checks.

    >>> import graphopt
    >>> optimized, report = graphopt.optimize("model.onnx", target="cpu", level=2)
    >>> bundle = graphopt.write_bundle(optimized, report)  # model.cpu.graphopt/
    >>> session = graphopt.load_session(bundle)
"""

from . import _interrupt  # noqa: F401  first: Ctrl-C while the rest imports (the command)

# isort: split
from . import passes, rules, targets  # noqa: F401  (register passes, rules and targets)
from .opt.errors import GraphoptError
from .opt.graph.io import load_model, save_model
from .opt.optimizer import Report, optimize
from .targets.bundle import load_session, open_session, run_bundle, write_bundle

__version__ = "0.1.0"
__all__ = [
    "GraphoptError",
    "Report",
    "load_model",
    "load_session",
    "open_session",
    "optimize",
    "run_bundle",
    "save_model",
    "write_bundle",
    "__version__",
]
