"""Ctrl-C in the ``graphopt`` command: one line (``error: interrupted``) and exit 130, at any
moment, never a traceback.

Imported first by the package: when the process is the ``graphopt`` console script, SIGINT
while the package and its dependencies import (most of the first half second) writes the line
and ends the process at once; :func:`graphopt.cli.console` then hands SIGINT back to Python
(KeyboardInterrupt unwinds the command, which removes its temporaries) and, once the command is
over, to :func:`exit_now` again.  Imported as a library, nothing changes.
"""

from __future__ import annotations

import os
import signal
import sys

#: the exit code of a command ended by SIGINT (128 + the signal's number, as shells report it)
EXIT_INTERRUPTED = 128 + signal.SIGINT
MESSAGE = "error: interrupted\n"
#: the names the console script runs under (pip's script; the Windows launcher's)
_SCRIPT_NAMES = ("graphopt", "graphopt-script.py")


def exit_now(_signum: int = signal.SIGINT, _frame: object = None) -> None:
    """A SIGINT handler: the line, then the process ends with :data:`EXIT_INTERRUPTED` (nothing
    to unwind: no command is running)."""
    try:
        os.write(2, MESSAGE.encode())
    finally:
        os._exit(EXIT_INTERRUPTED)


def is_console() -> bool:
    """Whether this process is the ``graphopt`` console script."""
    main = sys.modules.get("__main__")
    name = os.path.basename(getattr(main, "__file__", None) or "")
    return name in _SCRIPT_NAMES


def handle_with(handler) -> None:
    """SIGINT goes to ``handler`` from now on, unless the process was started with SIGINT
    ignored (``nohup``, a shell's background job), which stays so."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        return
    try:
        signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread
        pass


def guard_imports() -> None:
    """In the console script, Ctrl-C while the rest of the package imports ends it cleanly."""
    if is_console():
        handle_with(exit_now)


guard_imports()
