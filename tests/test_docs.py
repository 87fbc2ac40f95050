"""The README's figures are the committed results' (generated, never typed), and its install gives
what the docs' examples use, as .ci/run installs it."""

import ast
import importlib
import importlib.util
import re
import shlex
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent


def test_readme_figures_match_committed_results():
    spec = importlib.util.spec_from_file_location("figures", ROOT / "benchmarks" / "figures.py")
    figures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(figures)
    readme = (ROOT / "README.md").read_text()
    block = readme.split(figures.START, 1)[1].split(figures.END, 1)[0].split("\n", 1)[1].strip()
    assert block == figures.table(), "README.md's figures are stale: run python benchmarks/figures.py --write"


# -- the README's install gives what the docs' examples use -------------------------------------------
#: modules a page's example defines itself (not installed by anyone): module -> the page
EXAMPLE_MODULES = {"bigram_drafter": "docs/plugins.md"}


def pip_installs(shell: str) -> set[tuple[str, bool]]:
    """(requirement as written, whether ``--no-deps``) of every ``pip install`` in ``shell`` text
    (commands split at ``&&``, ``;`` and line ends; pip upgrading itself left out; environment
    settings before the command, ``CMAKE_ARGS=... pip install``, skipped)."""
    found = set()
    for command in re.split(r"&&|;|\n", shell):
        words = shlex.split(command, comments=True)
        while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
            words = words[1:]
        if words[:2] != ["pip", "install"]:
            continue
        found |= {(word, "--no-deps" in words) for word in words[2:] if not word.startswith("-") and word != "pip"}
    return found


def readme_run_block() -> str:
    """The shell block of the README's "Run it" section: the install line first, then the main job and the tests."""
    section = (ROOT / "README.md").read_text().split("## Run it", 1)[1].split("\n## ", 1)[0]
    return section.split("```bash\n", 1)[1].split("```", 1)[0]


def installed_by(installs: set[tuple[str, bool]]) -> set[str]:
    """The distributions (canonical names) those pip installs put in an environment: each named one
    and, unless ``--no-deps``, its requirements (extras and markers as this machine evaluates them)."""
    todo = []
    for spec, no_deps in installs:
        if spec.startswith("."):  # the project itself, with extras: .[test,bench]
            extras = re.search(r"\[(.*)\]", spec)
            todo.append(("specdec", set(extras.group(1).split(",")) if extras else set(), not no_deps))
        else:
            requirement = Requirement(spec)
            todo.append((requirement.name, set(requirement.extras), not no_deps))
    seen: set[tuple[str, frozenset]] = set()
    names = set()
    while todo:
        name, extras, follow = todo.pop()
        name = canonicalize_name(name)
        names.add(name)
        if not follow or (name, frozenset(extras)) in seen:
            continue
        seen.add((name, frozenset(extras)))
        try:
            lines = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for line in lines:
            requirement = Requirement(line)
            environments = [{"extra": extra} for extra in extras] or [{"extra": ""}]
            if requirement.marker is None or any(requirement.marker.evaluate(env) for env in environments):
                todo.append((requirement.name, set(requirement.extras), True))
    return names


def example_imports() -> dict[str, set[str]]:
    """Top-level modules (not the standard library's) the Python blocks of docs/*.md import -> the pages."""
    found: dict[str, set[str]] = {}
    for page in sorted((ROOT / "docs").glob("*.md")):
        for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.S):
            for node in ast.walk(ast.parse(block)):
                names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                         else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names:
                        found.setdefault(top, set()).add(f"docs/{page.name}")
    return found


def test_the_readme_installs_what_ci_installs():
    """The README's commands and .ci/run install the same requirements, the same way (--no-deps)."""
    assert pip_installs(readme_run_block()) == pip_installs((ROOT / ".ci" / "run").read_text())


def test_the_readmes_install_line_gives_what_every_docs_example_imports():
    """Every module a docs/ example imports comes with the README's install line (its first line),
    and imports here: docs/structured.md's xgrammar once did not (No module named 'xgrammar')."""
    install_line = readme_run_block().splitlines()[0]
    installed = installed_by(pip_installs(install_line))
    assert "triton" not in installed  # no GPU kernels on a CPU machine
    providers = metadata.packages_distributions()
    missing = []
    for module, pages in sorted(example_imports().items()):
        if module in EXAMPLE_MODULES:
            assert all(module in (ROOT / page).read_text() for page in [EXAMPLE_MODULES[module]])
            continue
        spec = importlib.util.find_spec(module)
        local = spec is not None and spec.origin is not None and Path(spec.origin).is_relative_to(ROOT)
        dists = {"specdec"} if local else {canonicalize_name(d) for d in providers.get(module, [])}
        if not dists & installed:
            source = sorted(dists) or "nothing installed"
            missing.append(f"{module} (imported by {', '.join(sorted(pages))}; from {source})")
            continue
        importlib.import_module(module)
    assert not missing, f"the README's install line leaves out: {'; '.join(missing)}"


def test_the_missing_xgrammar_message_gives_the_readmes_install():
    from specdec.grammar import CPU_INSTALL

    packages = CPU_INSTALL.split("--no-deps", 1)[1].split()
    run = readme_run_block()
    assert all(p in run for p in packages) and "--no-deps" in run
