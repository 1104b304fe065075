"""Wall time per phase of one run, so that what a report says adds up to what the user waited.

A :class:`Clock` charges every instant between its start and now to exactly one phase: the one
open at that instant, or ``other`` when none is.  A phase opened inside another is charged to
the outer one (re-running the pipeline inside the validity check is validity time).  With
:meth:`Clock.since_process_start` the interpreter's start-up and imports before the clock
existed are the ``startup`` phase (when the process is the graphopt command).
:meth:`Clock.seconds` gives every phase, ``other`` and ``total``; the phases and ``other`` sum
to ``total`` up to rounding.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

#: the phases in the order a run goes through them (others are listed after these)
ORDER = (
    "startup",
    "load",
    "calibration",
    "passes",
    "validity",
    "parity",
    "measure",
    "write",
    "bundle",
)


def process_age() -> float | None:
    """Seconds since this process started (Linux /proc), or None where that is not known."""
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
        # the command name (field 2) may hold spaces: fields after its closing parenthesis
        fields = stat[stat.rindex(b")") + 2 :].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start, in ticks
    except (OSError, ValueError, IndexError):
        return None
    age = uptime - started
    return age if age >= 0 else None


class Clock:
    """Exclusive wall time per phase; see the module docstring."""

    def __init__(self, startup: float | None = None) -> None:
        self.start = time.perf_counter()
        self.phases: dict[str, float] = {}
        self.startup = startup
        self._open: str | None = None
        self._mark = self.start

    @classmethod
    def since_process_start(cls) -> Clock:
        """A clock whose ``startup`` phase is the process's life before this call, when the
        process is the graphopt command itself (the ``graphopt`` script, ``python -m
        graphopt.cli``, ``python -c``); a longer-lived host (a test runner, a notebook) calling
        the command in-process gets no ``startup``: its age is not part of this command's wait."""
        command = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
        own = command in ("graphopt", "cli.py", "-c")
        return cls(startup=process_age() if own else None)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Charge the time inside the block to ``name`` (to the open phase when nested)."""
        if self._open is not None:
            yield
            return
        self._charge("other")
        self._open = name
        try:
            yield
        finally:
            self._charge(name)
            self._open = None

    def _charge(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + (now - self._mark)
        self._mark = now

    def elapsed(self, name: str) -> float:
        """Seconds charged to ``name`` so far (the open phase counts up to now)."""
        spent = self.phases.get(name, 0.0)
        if self._open == name:
            spent += time.perf_counter() - self._mark
        return spent

    def seconds(self, digits: int = 4) -> dict[str, float]:
        """Every phase, ``other`` (time in no phase) and ``total``, rounded; the phases and
        ``other`` sum to ``total`` up to that rounding."""
        now = time.perf_counter()
        spent = dict(self.phases)
        pending = "other" if self._open is None else self._open
        spent[pending] = spent.get(pending, 0.0) + (now - self._mark)
        if self.startup is not None:
            spent["startup"] = self.startup
        spent.setdefault("other", 0.0)
        keys = [k for k in ORDER if k in spent] + sorted(k for k in spent if k not in ORDER)
        keys.remove("other")
        out = {k: round(spent[k], digits) for k in keys + ["other"]}
        out["total"] = round(sum(spent.values()), digits)
        return out


def phase_summary(seconds: dict[str, float]) -> str:
    """'12.3s with the bundle (startup 1.1, load 0.2, passes 5.0, ...)': the total and each
    phase of at least 5 ms, in order."""
    total = f"{seconds.get('total', 0.0):.2f}s"
    if "bundle" in seconds:
        total += " with the bundle"
    parts = [f"{k} {v:.2f}" for k, v in seconds.items() if k != "total" and v >= 0.005]
    return total + (f" ({', '.join(parts)})" if parts else "")
