"""One exception hierarchy; each error kind carries the CLI exit code it maps to (DESIGN §9)."""

from __future__ import annotations

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_PARITY = 3
EXIT_TARGET = 4
EXIT_PERF = 5


class GraphoptError(Exception):
    """Base of every error graphopt raises on purpose; the message is one user-facing line."""

    exit_code = EXIT_ERROR


class ModelLoadError(GraphoptError):
    """The input is not a loadable, valid ONNX model (corrupt, truncated, missing data...)."""


class ModelSaveError(GraphoptError):
    """The optimized model could not be written (unwritable directory, output == input...)."""


class UsageError(GraphoptError):
    """A flag, pipeline text or input specification is malformed."""

    exit_code = EXIT_USAGE


class ParityError(GraphoptError):
    """The optimized model's outputs differ from the original's beyond tolerance."""

    exit_code = EXIT_PARITY


class TargetError(GraphoptError):
    """The target cannot run the model, or the pipeline did not converge."""

    exit_code = EXIT_TARGET
