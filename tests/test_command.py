"""The command-line layer: conversion and bounds of each kind of flag, one-line usage errors
(exit 2), on/off switches, repeatable flags, optional positionals, eager flags, help on stdout."""

from __future__ import annotations

import contextlib
import io
from enum import Enum
from pathlib import Path
from typing import Annotated

import pytest

from graphopt.command import App, Argument, Exit, Option


class Color(str, Enum):
    red = "red"
    blue = "blue"


def print_version(value: bool) -> None:
    print("prog 1.0")
    raise Exit()


VERSION = Option("--version", callback=print_version, is_eager=True)


def make_app(seen: dict) -> App:
    app = App("prog", help="A test program.")

    @app.callback()
    def main(
        loud: Annotated[bool, Option("--loud")] = False,
        version: Annotated[bool, VERSION] = False,
    ) -> None:
        seen["loud"] = loud

    @app.command()
    def go(
        model: Annotated[Path, Argument(help="The model.")],
        extra: Annotated[str | None, Argument(help="Optional.")] = None,
        level: Annotated[int, Option("-O", "--level", min=0, max=3)] = 2,
        ratio: Annotated[float, Option("--ratio", min=0)] = 1.0,
        color: Annotated[Color, Option("--color")] = Color.red,
        shape: Annotated[list[str] | None, Option("--shape")] = None,
        fast: Annotated[bool | None, Option("--fast/--slow")] = None,
        quiet: Annotated[bool, Option("--quiet", "-q")] = False,
    ) -> None:
        """Go somewhere.

        A longer description."""
        seen.update(model=model, extra=extra, level=level, ratio=ratio, color=color,
                    shape=shape, fast=fast, quiet=quiet)  # fmt: skip
        if model.name == "boom":
            raise KeyboardInterrupt
        if model.name == "fail":
            raise Exit(3)

    return app


def call(*args: str) -> tuple[int, str, str, dict]:
    seen: dict = {}
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = make_app(seen).run(list(args))
    return code, out.getvalue(), err.getvalue(), seen


def test_values_are_converted_and_defaults_kept():
    code, _, _, seen = call("go", "m.onnx")
    assert code == 0 and seen["model"] == Path("m.onnx") and seen["extra"] is None
    assert (seen["level"], seen["ratio"], seen["color"], seen["shape"]) == (2, 1.0, Color.red, None)
    assert seen["fast"] is None and seen["quiet"] is False and seen["loud"] is False
    args = ("--loud", "go", "-q", "m", "x", "-O", "3", "--ratio", "0.5", "--color", "blue",
            "--shape", "a=1", "--shape", "b=2", "--slow")  # fmt: skip
    code, _, _, seen = call(*args)
    assert code == 0 and seen["extra"] == "x" and seen["level"] == 3 and seen["ratio"] == 0.5
    assert seen["color"] is Color.blue and seen["shape"] == ["a=1", "b=2"]
    assert seen["fast"] is False and seen["quiet"] is True and seen["loud"] is True
    assert call("go", "m", "--fast")[3]["fast"] is True


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["go", "m", "-O", "4"], "-O/--level must be from 0 to 3 (got 4)"),
        (["go", "m", "-O", "two"], "-O/--level must be an integer (got 'two')"),
        (["go", "m", "--ratio", "-1"], "--ratio must be at least 0 (got -1)"),
        (["go", "m", "--color", "green"], "--color must be one of red, blue (got 'green')"),
        (["go"], "required: MODEL"),
        (["go", "m", "--bogus"], "unrecognized arguments: --bogus"),
        (["go", "m", "--lev", "1"], "unrecognized arguments"),  # no abbreviations
        (["nope"], "invalid choice: 'nope'"),
        (["--loud"], "a command is required"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(args, fragment):
    code, out, err, seen = call(*args)
    assert code == 2 and out == "" and "model" not in seen
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], err


def test_exit_codes_help_version_and_interrupts():
    assert call("go", "fail")[0] == 3
    code, _, err, _ = call("go", "boom")
    assert code == 130 and err.strip() == "error: interrupted"
    code, out, err, _ = call("--version", "go")
    assert (code, out, err) == (0, "prog 1.0\n", "")
    code, out, _, seen = call("go", "--help")
    assert code == 0 and "Go somewhere." in out and "A longer description." in out
    assert "--fast" in out and "--slow" in out and "[default: 2]" in out and not seen
    code, out, _, _ = call()
    assert code == 0 and "A test program." in out and "Go somewhere." in out
