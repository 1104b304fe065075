"""A declarative command line over :mod:`argparse`: commands are plain functions whose
parameters are annotated with :class:`Option` or :class:`Argument` (``Annotated[int,
Option("-O", "--level", min=0, max=3)]``); :class:`App` builds the parser from the signatures,
converts and bounds each value, and calls the command.

It starts in a few milliseconds (the command line of a CI tool runs once per model, so its own
start is part of every run).  Usage errors are one ``error:`` line on stderr and exit 2; ``--help``
prints the command's docstring and flags on stdout.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import types
import typing
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Any

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a command Ctrl-C ended


class Exit(Exception):  # noqa: N818 - named for what it does, like SystemExit
    """Leave the command with this exit code (0: success)."""

    def __init__(self, code: int = 0) -> None:
        super().__init__(code)
        self.code = code


class Option:
    """A flag: its names (``"--kernels/--no-kernels"`` declares an on/off pair), help, bounds of
    a number, and a callback given the converted value (``is_eager``: called while parsing,
    before any other value is checked, e.g. ``--version``)."""

    def __init__(
        self,
        *names: str,
        help: str = "",  # noqa: A002 - the word users know
        min: float | None = None,  # noqa: A002
        max: float | None = None,  # noqa: A002
        callback: Callable[[Any], Any] | None = None,
        is_eager: bool = False,
    ) -> None:
        self.names, self.help, self.min, self.max = names, help, min, max
        self.callback, self.is_eager = callback, is_eager


class Argument:
    """A positional parameter (optional when its default is None)."""

    def __init__(self, help: str = "") -> None:  # noqa: A002
        self.help = help


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line and exit 2 (help goes to stdout, as argparse prints it)."""

    def error(self, message: str) -> typing.NoReturn:
        sys.stderr.write(f"error: {message} (see '{self.prog} --help')\n")
        raise Exit(EXIT_USAGE)

    def exit(self, status: int = 0, message: str | None = None) -> typing.NoReturn:
        if message:
            sys.stderr.write(message)
        raise Exit(status)


class _Eager(argparse.Action):
    """An eager flag: its callback runs as soon as the flag is read."""

    def __init__(self, option_strings, dest, callback=None, **kw) -> None:  # noqa: ANN001
        super().__init__(option_strings, dest, nargs=0, **kw)
        self.callback = callback

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # noqa: ANN001
        setattr(namespace, self.dest, True)
        self.callback(True)


def _unwrap(annotation: Any) -> tuple[Any, bool]:
    """(the base type, whether repeatable) of an annotation (``X | None`` is X)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        (annotation,) = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is list:
        (item,) = typing.get_args(annotation)
        return item, True
    return annotation, False


class _Param:
    """One parameter of a command: how argparse reads it and how its value is converted."""

    def __init__(self, name: str, annotation: Any, default: Any) -> None:
        base, info = annotation, None
        if typing.get_origin(annotation) is typing.Annotated:
            base, info = annotation.__origin__, annotation.__metadata__[0]
        self.required = default is inspect.Parameter.empty
        self.name, self.default = name, None if self.required else default
        self.type, self.repeat = _unwrap(base)
        self.info = info if info is not None else Option(f"--{name.replace('_', '-')}")

    @property
    def label(self) -> str:
        if isinstance(self.info, Argument):
            return self.name.upper()
        return "/".join(n for n in self.info.names[:2] if "/" not in n) or self.info.names[0]

    def add_to(self, parser: argparse.ArgumentParser, dest: str) -> None:
        """Declare the parameter on ``parser``; its raw value lands in ``dest``."""
        info = self.info
        if isinstance(info, Argument):
            parser.add_argument(dest, nargs=None if self.required else "?", default=None,
                                help=info.help, metavar=self.label)  # fmt: skip
        elif info.is_eager:
            parser.add_argument(*info.names, dest=dest, action=_Eager, callback=info.callback,
                                help=info.help, default=False)  # fmt: skip
        elif self.type is bool:
            on, off = self._switch_names()
            parser.add_argument(*on, dest=dest, action="store_const", const=True, help=info.help)
            if off:
                parser.add_argument(*off, dest=dest, action="store_const", const=False,
                                    help=f"the opposite of {on[0]}")  # fmt: skip
            parser.set_defaults(**{dest: None})
        else:
            action = "append" if self.repeat else "store"
            parser.add_argument(*info.names, dest=dest, default=None, action=action,
                                metavar=self._metavar(), help=self._help())  # fmt: skip

    def _switch_names(self) -> tuple[list[str], list[str]]:
        on, off = [], []
        for name in self.info.names:
            yes, _, no = name.partition("/")
            on.append(yes)
            if no:
                off.append(no)
        return on, off

    def _metavar(self) -> str:
        if isinstance(self.type, type) and issubclass(self.type, Enum):
            return "{" + ",".join(m.value for m in self.type) + "}"
        return {int: "INT", float: "FLOAT", Path: "PATH"}.get(self.type, "TEXT")

    def _help(self) -> str:
        text = self.info.help
        if self.default not in (None, False) and not self.repeat:
            shown = self.default.value if isinstance(self.default, Enum) else self.default
            text = f"{text} [default: {shown}]".strip()
        return text.replace("%", "%%")

    def convert(self, raw: Any) -> Any:
        """The value the command receives: converted, bounded, passed to the callback."""
        if raw is None:
            value = self.default
        elif self.repeat:
            value = [self._one(r) for r in raw]
        elif self.type is bool or isinstance(raw, bool):
            value = raw
        else:
            value = self._one(raw)
        callback = getattr(self.info, "callback", None)
        if callback is not None and not getattr(self.info, "is_eager", False):
            callback(value)
        return value

    def _one(self, raw: str) -> Any:
        kind = self.type
        try:
            if isinstance(kind, type) and issubclass(kind, Enum):
                return kind(raw)
            value = kind(raw) if kind in (int, float, Path) else raw
        except ValueError:
            raise self._bad(raw, self._expected()) from None
        lo, hi = getattr(self.info, "min", None), getattr(self.info, "max", None)
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            if lo is not None and hi is not None:
                bounds = f"from {_number(lo)} to {_number(hi)}"
            else:
                bounds = f"at least {_number(lo)}" if lo is not None else f"at most {_number(hi)}"
            raise _UsageProblem(f"{self.label} must be {bounds} (got {raw})")
        return value

    def _expected(self) -> str:
        if issubclass(self.type, Enum):
            return "one of " + ", ".join(m.value for m in self.type)
        return {int: "an integer", float: "a number", Path: "a path"}.get(self.type, "text")

    def _bad(self, raw: str, expected: str) -> _UsageProblem:
        return _UsageProblem(f"{self.label} must be {expected} (got {raw!r})")


def _number(x: float) -> str:
    """A bound as users write it: whole numbers in full (1000000, not 1e+06)."""
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


class _UsageProblem(Exception):
    """A flag's value that cannot be converted or is out of bounds."""


class App:
    """A program of named commands with options shared before the command (``callback``)."""

    def __init__(self, name: str, help: str = "") -> None:  # noqa: A002
        self.name, self.help = name, help
        self.commands: dict[str, tuple[Callable, list[_Param]]] = {}
        self.main: tuple[Callable, list[_Param]] | None = None

    def command(self, name: str | None = None) -> Callable[[Callable], Callable]:
        def register(fn: Callable) -> Callable:
            self.commands[name or fn.__name__.replace("_", "-")] = (fn, _params(fn))
            return fn

        return register

    def callback(self) -> Callable[[Callable], Callable]:
        def register(fn: Callable) -> Callable:
            self.main = (fn, _params(fn))
            return fn

        return register

    def parser(self) -> tuple[_Parser, dict[str, _Parser]]:
        """The program's parser and each command's."""
        top = _Parser(prog=self.name, description=self.help, allow_abbrev=False)
        for p in self.main[1] if self.main else []:
            p.add_to(top, dest=f"_main_{p.name}")
        sub = top.add_subparsers(dest="_command", metavar="COMMAND", title="commands")
        parsers = {}
        for name, (fn, params) in self.commands.items():
            doc = inspect.cleandoc(fn.__doc__ or "")
            parsers[name] = one = sub.add_parser(
                name,
                help=doc.split("\n\n")[0].replace("\n", " "),
                description=doc,
                allow_abbrev=False,
                formatter_class=argparse.RawDescriptionHelpFormatter,
            )
            for p in params:
                p.add_to(one, dest=p.name)
        return top, parsers

    def __call__(self, args: list[str] | None = None) -> typing.NoReturn:
        """Parse ``args`` (default: ``sys.argv[1:]``), run the command, exit with its code."""
        raise SystemExit(self.run(sys.argv[1:] if args is None else list(args)))

    def run(self, args: list[str]) -> int:
        """The exit code of the command line ``args``."""
        top, parsers = self.parser()
        try:
            if not args:
                top.print_help()
                return 0
            ns = vars(top.parse_args(args))
            command = ns["_command"]
            if command is None:
                top.error("a command is required")
            if self.main:
                fn, params = self.main
                fn(**{p.name: p.convert(ns[f"_main_{p.name}"]) for p in params})
            fn, params = self.commands[command]
            try:
                values = {p.name: p.convert(ns[p.name]) for p in params}
            except _UsageProblem as e:
                parsers[command].error(str(e))
            fn(**values)
        except Exit as e:
            return e.code
        except KeyboardInterrupt:
            sys.stderr.write("error: interrupted\n")
            return EXIT_INTERRUPTED
        return 0


def _params(fn: Callable) -> list[_Param]:
    hints = typing.get_type_hints(fn, include_extras=True)
    return [
        _Param(name, hints[name], p.default) for name, p in inspect.signature(fn).parameters.items()
    ]
