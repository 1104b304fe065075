"""Every Python package of the source tree is listed in pyproject.toml, so a plain `pip install .`
ships it (an editable install would hide a missing entry)."""

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
SKIP = {"tests", "examples", ".venv", "build"}


def _source_packages() -> set[str]:
    found = {"graphopt"}
    for init in ROOT.rglob("__init__.py"):
        rel = init.parent.relative_to(ROOT)
        if not rel.parts or rel.parts[0] in SKIP or rel.parts[0].startswith("."):
            continue
        found.add(".".join(("graphopt", *rel.parts)))
    return found


def test_every_package_is_listed():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(config["tool"]["setuptools"]["packages"])
    assert _source_packages() - listed == set()
