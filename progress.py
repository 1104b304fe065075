"""Progress of the long commands, on stderr only (stdout stays the command's one document).

``say(msg)`` announces each phase: a live status on a terminal; otherwise one timestamped line
``HH:MM:SS graphopt +SECONDS: PHASE`` for each phase still running after
``GRAPHOPT_PROGRESS_AFTER`` seconds (default 2; 0 prints every phase), so fast runs stay silent
and a log never stays silent longer than that; nothing when quiet.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from .render import err


def progress_after() -> float:
    """Seconds a phase runs before its line is printed when stderr is not a terminal."""
    from .opt.environment import env_number

    return env_number("GRAPHOPT_PROGRESS_AFTER", 2.0)


@contextmanager
def progress(quiet: bool) -> Iterator[Callable[[str], None]]:
    """``say(msg)`` for each phase: a live status on a terminal; otherwise one timestamped line
    on stderr for each phase still running after ``GRAPHOPT_PROGRESS_AFTER`` seconds (fast runs
    stay silent); nothing with ``quiet``.  Never writes to stdout."""
    if quiet:
        yield lambda _msg: None
        return
    if err.is_terminal:
        with err.status("graphopt") as status:
            yield lambda msg: status.update(f"graphopt: {msg}")
        return
    lines = PhaseLines(progress_after())
    try:
        yield lines.say
    finally:
        lines.stop()


class PhaseLines:
    """Timestamped progress lines for logs: a phase's line is printed once it has run for
    ``after`` seconds (a timer thread), so that silence never lasts longer than that."""

    def __init__(self, after: float) -> None:
        self.after = after
        self.t0 = time.monotonic()
        self.lock = threading.Lock()
        self.phase = 0
        self.timer: threading.Timer | None = None

    def say(self, msg: str) -> None:
        with self.lock:
            self._cancel()
            self.phase += 1
            stamp = (time.strftime("%H:%M:%S"), time.monotonic() - self.t0)
            if self.after <= 0:
                self._emit(msg, stamp)
                return
            self.timer = threading.Timer(self.after, self._fire, (self.phase, msg, stamp))
            self.timer.daemon = True
            self.timer.start()

    def _fire(self, phase: int, msg: str, stamp: tuple[str, float]) -> None:
        with self.lock:
            if phase == self.phase:
                self._emit(msg, stamp)

    @staticmethod
    def _emit(msg: str, stamp: tuple[str, float]) -> None:
        err.print(f"{stamp[0]} graphopt +{stamp[1]:.1f}s: {msg}", soft_wrap=True)

    def _cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def stop(self) -> None:
        with self.lock:
            self._cancel()
            self.phase += 1
