"""The README and docs/ stay true to the repository: the quick start is what CI runs, every
command has its example, every relative link lands on a file, and each index lists its pages."""

import re
from pathlib import Path

import graphopt.cli as cli
from cli_runner import CliRunner

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _code_blocks(markdown: str) -> list[str]:
    return re.findall(r"```(?:bash|sh)?\n(.*?)```", markdown, flags=re.S)


def _section(markdown: str, title: str) -> str:
    return markdown.split(f"## {title}", 1)[1].split("\n## ", 1)[0]


def test_quick_start_is_what_ci_runs():
    install, tests = _code_blocks(_section(README.read_text(), "Quick start"))[:2]
    ci = (ROOT / ".ci" / "run").read_text()
    steps = [s.strip() for s in install.strip().split("&&")]
    assert steps[0].startswith("python3 -m venv") and "activate" in steps[1]
    pip, first = steps[2], steps[3]
    ci_lines = [[t for t in line.split() if t != "--quiet"] for line in ci.splitlines()]
    assert pip.split() in ci_lines, f"README installs with '{pip}', CI does not"
    assert first.startswith("graphopt optimize ") and first in ci, first
    model = first.split()[2]
    assert (ROOT / model).is_file(), f"the quick start's model {model} is not shipped"
    assert tests.strip() == "pytest" and re.search(r"^pytest\b", ci, flags=re.M)


def _commands_in_help() -> set[str]:
    """The subcommands `graphopt --help` lists (a name, two spaces, its one-line help)."""
    text = CliRunner().invoke(cli.app, ["--help"], env={"COLUMNS": "200"}).stdout
    names = set()
    for line in text.splitlines():
        m = re.match(r"^[\s│|]*([a-z][a-z-]+)\s{2,}\S", line)
        if m:
            names.add(m.group(1))
    return names


def test_every_command_has_a_readme_example():
    commands = _commands_in_help()
    assert {"optimize", "check", "run", "explain", "bench", "gate"} <= commands, commands
    examples = "\n".join(_code_blocks(_section(README.read_text(), "One example per command")))
    shown = set(re.findall(r"^graphopt ([a-z-]+)", examples, flags=re.M))
    assert commands - shown == set(), f"no README example for {sorted(commands - shown)}"
    assert shown - commands == set(), f"README shows unknown commands {sorted(shown - commands)}"


def test_relative_links_land_on_files():
    pages = [README, ROOT / "examples" / "README.md", *sorted(DOCS.glob("*.md"))]
    headings = {}
    for page in pages:
        text = page.read_text()
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            assert dest.exists(), f"{page.relative_to(ROOT)} links to missing {target}"
            if anchor and dest.suffix == ".md":
                if dest not in headings:
                    headings[dest] = {_anchor(h) for h in _headings(dest.read_text())}
                assert anchor in headings[dest], f"{page.relative_to(ROOT)}: no #{anchor} in {path}"


def _headings(markdown: str) -> list[str]:
    body = re.sub(r"```.*?```", "", markdown, flags=re.S)
    return re.findall(r"^#+ (.+)$", body, flags=re.M)


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_docs_index_lists_every_page():
    index = (DOCS / "README.md").read_text()
    listed = set(LINK.findall(index))
    pages = {p.name for p in DOCS.glob("*.md")} - {"README.md"}
    assert pages - listed == set(), f"docs/README.md does not list {sorted(pages - listed)}"


def test_examples_index_has_one_line_per_folder():
    index = (ROOT / "examples" / "README.md").read_text()
    rows = re.findall(r"^\| \[`([\w-]+)/`\]", index, flags=re.M)
    folders = sorted(
        p.name
        for p in (ROOT / "examples").iterdir()
        if p.is_dir() and not p.name.startswith((".", "_"))
    )
    assert sorted(rows) == folders


def test_readme_is_short():
    words = len(README.read_text().split())
    assert words <= 1600, f"README.md is {words} words; move detail into docs/"
