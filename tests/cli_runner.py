"""Run the ``graphopt`` command line in-process, as the tests read it: exit code, stdout,
stderr and both together, with environment variables set for the call."""

from __future__ import annotations

import contextlib
import io
import os
from dataclasses import dataclass

from graphopt.cli import run_args


@dataclass
class Result:
    exit_code: int
    stdout: str
    stderr: str
    output: str  # stdout then stderr
    exception: BaseException | None = None


class _Tee(io.StringIO):
    """A captured stream that also writes to the combined output."""

    def __init__(self, both: io.StringIO) -> None:
        super().__init__()
        self.both = both

    def write(self, text: str) -> int:
        self.both.write(text)
        return super().write(text)


class CliRunner:
    def invoke(
        self,
        app,
        args,  # app: graphopt.cli.app, run by run_args
        env: dict[str, str] | None = None,
    ) -> Result:
        both = io.StringIO()
        out, err = _Tee(both), _Tee(both)
        saved = {k: os.environ.get(k) for k in env or {}}
        os.environ.update(env or {})
        exception = None
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    code = run_args([str(a) for a in args])
                except SystemExit as e:
                    code = e.code if isinstance(e.code, int) else 1
                except Exception as e:  # noqa: BLE001 - reported like an uncaught error
                    exception, code = e, 1
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        return Result(code, out.getvalue(), err.getvalue(), both.getvalue(), exception)
