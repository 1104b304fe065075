"""graphopt: an ONNX graph optimizer with explainable rewrites, per-target legalization and
numerical parity checks.

    >>> import graphopt
    >>> optimized, report = graphopt.optimize("model.onnx", target="cpu", level=2)
"""

from . import passes, rules, targets  # noqa: F401  (register passes, rules and targets)
from .opt.errors import GraphoptError
from .opt.io import load_model, save_model
from .opt.optimizer import Report, optimize
from .targets.bundle import load_session

__version__ = "0.1.0"
__all__ = [
    "GraphoptError",
    "Report",
    "load_model",
    "load_session",
    "optimize",
    "save_model",
    "__version__",
]
