"""The ``GRAPHOPT_*`` numbers a user may set: read, checked, and refused in one line.

Every numeric variable is listed in :data:`NUMBERS` and read through :func:`env_number`: a value
that is no number, not finite, or outside its range is a UsageError (exit 2) naming the
variable, what it takes and what it got, never a silent default.  The command line checks them
all before a command starts (:func:`check_environment`), so a bad value is refused even where
the run would not have read it.  ``GRAPHOPT_MEMORY_MB`` is checked before the imports, by the
console script.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from .errors import UsageError


@dataclass(frozen=True)
class Number:
    what: str
    low: float = 0.0
    high: float = math.inf
    integer: bool = False
    low_open: bool = False  # the range excludes ``low``

    def bound(self) -> str:
        def shown(v: float) -> str:
            return f"{int(v)}" if float(v).is_integer() else f"{v:g}"

        text = f"{'above' if self.low_open else 'from'} {shown(self.low)}"
        return text + (f" to {shown(self.high)}" if math.isfinite(self.high) else "")


NUMBERS = {
    "GRAPHOPT_RUN_SECONDS": Number("seconds"),
    "GRAPHOPT_TIME_BUDGET": Number("seconds"),
    "GRAPHOPT_PROGRESS_AFTER": Number("seconds"),
    "GRAPHOPT_PIECE_MB": Number("a number of MiB", high=1 << 20, low_open=True),
    "GRAPHOPT_PIECE_NODES": Number("a node count", low=2, integer=True),
    "GRAPHOPT_IN_PLACE_ABOVE": Number("a number of bytes", integer=True),
    "GRAPHOPT_ROTARY_POSITIONS": Number("a position count", low=1, high=1 << 24, integer=True),
    "GRAPHOPT_KERNEL_THREADS": Number(
        "a thread count (0: OpenMP's default)", high=1024, integer=True
    ),
}


def env_number(name: str, default: float | None) -> float | None:
    """``os.environ[name]`` as :data:`NUMBERS` says it must be; ``default`` when unset or empty."""
    spec = NUMBERS[name]
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text) if spec.integer else float(text)
    except ValueError:
        value = None
    if (
        value is None
        or not math.isfinite(value)
        or (value <= spec.low if spec.low_open else value < spec.low)
        or value > spec.high
    ):
        raise UsageError(f"{name} must be {spec.what}, {spec.bound()} (got '{text}')")
    return value


def check_environment() -> None:
    """Every variable of :data:`NUMBERS` that is set holds a value it may (else UsageError)."""
    for name in NUMBERS:
        env_number(name, None)
