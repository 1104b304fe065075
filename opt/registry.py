"""The tables passes, rules and targets add themselves to when their package is imported.

The first read of a table imports those packages (:data:`PLUGINS`, named by the top-level
package), so the core never imports them and a program that reads no table (``graphopt
--version``) imports none of them.  Writes (``register_*``) do not load anything.
"""

from __future__ import annotations

import importlib
from typing import Any

#: the packages that fill the tables, imported on the first read of any table
PLUGINS: list[str] = []
_loaded: list[str] = []


def load_plugins() -> None:
    for name in PLUGINS:
        if name not in _loaded:
            _loaded.append(name)  # before importing: a plugin may read a table while it loads
            importlib.import_module(name)


class Registry(dict):
    """A name -> entry table whose reads first load :data:`PLUGINS`."""

    def __getitem__(self, key: Any) -> Any:
        load_plugins()
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        load_plugins()
        return super().__contains__(key)

    def __iter__(self):
        load_plugins()
        return super().__iter__()

    def __len__(self) -> int:
        load_plugins()
        return super().__len__()

    def get(self, key: Any, default: Any = None) -> Any:
        load_plugins()
        return super().get(key, default)

    def keys(self):
        load_plugins()
        return super().keys()

    def values(self):
        load_plugins()
        return super().values()

    def items(self):
        load_plugins()
        return super().items()
