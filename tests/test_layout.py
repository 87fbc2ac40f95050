"""The layout's rules, checked from the source (docs/architecture.md, "Layout").

1. The core never imports a plugin: no module under ``specdec/`` imports ``candidate_generators``,
   by an absolute or a relative import, at module level or inside a function, or by
   ``importlib.import_module`` / ``__import__`` of a literal name. Plugins reach the core through
   the entry-point group, never the other way round.
2. ``candidate_generators/`` holds plugins only: every module but ``__init__.py`` defines a
   ``CandidateGenerator`` subclass that the registry returns for its name and that
   ``pyproject.toml`` declares in the entry-point group.
3. No import cycle among the core's modules, counting every import statement a module holds:
   those that run when it is imported, those inside functions (a cycle that only a function's
   import closes still says two modules need each other) and those under ``if TYPE_CHECKING:``
   (a type is a dependency too). An edge goes to the module named, and to the packages on the way
   to it whose ``__init__`` would run (not the importer's own ancestors, which are already being
   imported).
4. Engines are reached through their root only: no module of the core outside ``specdec/engines/``
   and no plugin imports a module inside it, ``specdec.engines.<name>``, in any way rule 1 counts;
   ``from specdec.engines import Layout`` is the way in. (Tests and benchmarks of an engine's own
   parts, its stack or its packed weights, import those parts by name.)
5. One job per file: no module of the core, the plugins or the benchmarks is over
   :data:`MAX_LINES` lines but the bench schema (one pydantic model per section of a YAML file),
   and the README stays a page (:data:`README_LINES`).

The checkers are plain functions of a source tree, so the tests at the end run them on small
made-up trees that break each rule, proving each assertion can fail.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from specdec.generators import CandidateGenerator
from specdec.registry import ENTRY_POINT_GROUP, get_candidate_generator

ROOT = Path(__file__).resolve().parents[1]
CORE = "specdec"
PLUGINS = "candidate_generators"


# -- reading imports from the AST -----------------------------------------------------------------
def modules_of(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of ``package`` under ``root``."""
    found = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def every_import(tree: ast.Module):
    """Every Import / ImportFrom statement of a module: at its top level, in class and function
    bodies, under ``if TYPE_CHECKING:`` (rule 3 counts them all)."""
    return (node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)))


def resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str | None:
    """The absolute module an ImportFrom names (``""`` for ``from .. import x`` at the top), or
    None for a relative import that climbs past the top-level package."""
    if not node.level:
        return node.module
    parts = importer.split(".") if is_package else importer.split(".")[:-1]
    if node.level - 1 > len(parts):
        return None
    base = parts[: len(parts) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def targets(importer: str, is_package: bool, node) -> list[str | None]:
    """Every dotted name an import statement may load: the module, and ``module.name`` for each
    name of a ``from`` import (a name may be a submodule)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = resolve(importer, is_package, node)
    if base is None:
        return [None]
    return [base] + [f"{base}.{alias.name}".lstrip(".") for alias in node.names if alias.name != "*"]


def _literal_imports(tree: ast.AST):
    """Names given as literals to ``importlib.import_module(...)`` or ``__import__(...)``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                yield node.args[0].value


# -- rule 1: the core never imports a plugin ------------------------------------------------------
def core_imports_of(root: Path, core: str, forbidden: str) -> list[str]:
    """``file:line: what`` for every import of ``forbidden`` anywhere in ``core``."""
    problems = []
    for name, path in modules_of(root, core).items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        where = path.relative_to(root)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            names = targets(name, is_package, node)
            bad = [t for t in names if t is not None and (t == forbidden or t.startswith(forbidden + "."))]
            if None in names:
                problems.append(f"{where}:{node.lineno}: a relative import beyond the top-level package")
            elif bad:
                problems.append(f"{where}:{node.lineno}: imports {bad[-1]}")
        problems += [f"{where}: imports {literal} by name" for literal in _literal_imports(tree)
                     if literal == forbidden or literal.startswith(forbidden + ".")]
    return sorted(set(problems))


# -- rule 3: no import cycle ----------------------------------------------------------------------
def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` its imports load (see the docstring)."""
    modules = modules_of(root, package)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        if is_package:
            ancestors.add(name)
        edges = set()
        for node in every_import(ast.parse(path.read_text(), str(path))):
            for target in _loaded(targets(name, is_package, node), node, modules, ancestors):
                edges.add(target)
                parts = target.split(".")
                edges |= {p for p in (".".join(parts[:i]) for i in range(1, len(parts)))
                          if p in modules and p not in ancestors}
        edges.discard(name)
        graph[name] = edges
    return graph


def _loaded(names: list[str | None], node, modules, ancestors: set[str]) -> list[str]:
    """The modules of ``names`` an import statement depends on. ``from pkg import a, b``: the
    submodules among a and b, and pkg itself if some name is not a submodule (it comes from pkg's
    ``__init__``) or if pkg is not an ancestor of the importer (its ``__init__`` runs first)."""
    if isinstance(node, ast.Import):
        return [n for n in names if n in modules]
    base, members = names[0], names[1:]
    submodules = [m for m in members if m in modules]
    needs_base = base in modules and (len(submodules) < len(members) or base not in ancestors)
    return submodules + ([base] if needs_base else [])


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


# -- rule 4: engines through their root only -----------------------------------------------------
ENGINES = "specdec.engines"
#: the folders whose modules reach the engines through their root only
OUTSIDE = ("specdec", "candidate_generators")


def submodule_imports(root: Path, folders: tuple[str, ...], package: str) -> list[str]:
    """``file:line: what`` for every import of a module inside ``package`` (a submodule, or a name
    from one) by a module of ``folders`` outside ``package``."""
    inside = {name for name in modules_of(root, package.replace(".", "/")) if name != package}

    def private(name: str | None) -> bool:
        return name is not None and any(name == m or name.startswith(m + ".") for m in inside)

    problems = []
    for folder in folders:
        if not (root / folder).is_dir():
            continue
        for name, path in modules_of(root, folder).items():
            if name == package or name.startswith(package + "."):
                continue
            tree = ast.parse(path.read_text(), str(path))
            is_package = path.name == "__init__.py"
            where = path.relative_to(root)
            for node in ast.walk(tree):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    bad = [t for t in targets(name, is_package, node) if private(t)]
                    if bad:
                        problems.append(f"{where}:{node.lineno}: imports {bad[0]}")
            problems += [f"{where}: imports {literal} by name" for literal in _literal_imports(tree) if private(literal)]
    return sorted(set(problems))


# -- rule 5: one job per file ----------------------------------------------------------------------
MAX_LINES = 420
README_LINES = 120
#: files allowed to be longer: the bench schema, one pydantic model per section of a config
LONG_ALLOWED = {"specdec/bench/config.py"}


def long_files(root: Path, folders: tuple[str, ...], limit: int, allowed: set[str] = frozenset()) -> list[str]:
    """``path: N lines`` for every ``.py`` file of ``folders`` over ``limit`` lines, but ``allowed``."""
    found = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            where = path.relative_to(root).as_posix()
            lines = len(path.read_text().splitlines())
            if lines > limit and where not in allowed:
                found.append(f"{where}: {lines} lines")
    return found


# -- rule 2: plugins only -------------------------------------------------------------------------
def declared_entry_points(root: Path) -> dict[str, str]:
    """The entry points ``pyproject.toml`` declares (the installed metadata before Python 3.11)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: what the editable install recorded from the same file
        return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}
    with open(root / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    return project.get("entry-points", {}).get(ENTRY_POINT_GROUP, {})


def plugin_problems(root: Path, package: str, declared: dict[str, str]) -> list[str]:
    """What is wrong with each plugin of ``package`` (imported): a module directly in it, or a
    subpackage (its modules are the plugin's own; the generator is exported by the subpackage)."""
    problems = []
    for name, path in modules_of(root, package).items():
        depth = len(path.relative_to(root / package).parts)
        if path.name == "__init__.py" and depth == 1 or path.name != "__init__.py" and depth > 1:
            continue  # the package itself, or a module inside a subpackage plugin
        module = importlib.import_module(name)
        generators = [cls for _, cls in inspect.getmembers(module, inspect.isclass)
                      if issubclass(cls, CandidateGenerator) and (cls.__module__ == name or depth > 1
                                                                  and cls.__module__.startswith(name + "."))]
        registered = [cls for cls in generators if cls.name and _registered(cls)]
        if not registered:
            problems.append(f"{path.relative_to(root)}: defines no registered CandidateGenerator "
                            f"(found {[cls.__name__ for cls in generators]}); move it to the core")
        for cls in registered:
            if declared.get(cls.name) != f"{name}:{cls.__name__}":
                problems.append(f"{path.relative_to(root)}: {cls.name} is not declared in pyproject.toml's "
                                f"{ENTRY_POINT_GROUP} entry points as {name}:{cls.__name__}")
    return problems


def _registered(cls) -> bool:
    try:
        return get_candidate_generator(cls.name) is cls
    except KeyError:
        return False


# -- the rules on this repository -----------------------------------------------------------------
def test_the_core_never_imports_a_plugin():
    assert core_imports_of(ROOT, CORE, PLUGINS) == []


def test_the_plugin_folder_holds_plugins_only():
    assert plugin_problems(ROOT, PLUGINS, declared_entry_points(ROOT)) == []


def test_the_core_has_no_import_cycle():
    graph = import_graph(ROOT, CORE)
    assert len(graph) > 10 and "specdec.kv" in graph["specdec.state"]  # the graph is read at all
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_engines_are_imported_through_their_root_only():
    assert (ROOT / "specdec/engines/__init__.py").is_file()  # the package the rule is about exists
    assert submodule_imports(ROOT, OUTSIDE, ENGINES) == []


def test_no_file_is_over_the_line_limit():
    assert long_files(ROOT, (CORE, PLUGINS, "benchmarks"), MAX_LINES, LONG_ALLOWED) == []
    assert len((ROOT / "README.md").read_text().splitlines()) <= README_LINES


# -- each checker fails on a tree that breaks its rule ----------------------------------------------
def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_a_core_import_of_a_plugin_is_found_however_written(tmp_path):
    root = _tree(tmp_path, {
        "core/__init__.py": "",
        "core/a.py": "import plugins.x\n",
        "core/b.py": "def f():\n    from plugins import x\n",  # inside a function still counts
        "core/sub/__init__.py": "",
        "core/sub/c.py": "from ...plugins import y\n",  # relative, resolving outside the core
        "core/d.py": "from .. import plugins\n",
        "core/e.py": "import importlib\nM = importlib.import_module('plugins.z')\n",
        "core/f.py": "from .g import h\nimport pluginsfoo\n",  # a look-alike name is not the package
        "core/g.py": "h = 1\n",
    })
    found = core_imports_of(root, "core", "plugins")
    assert [line.split(":")[0] for line in found] == [
        "core/a.py", "core/b.py", "core/d.py", "core/e.py", "core/sub/c.py"], found


def test_an_import_cycle_is_found_and_reported(tmp_path):
    root = _tree(tmp_path, {
        "core/__init__.py": "from .a import A\n",
        "core/a.py": "from .b import B\nA = 1\n",
        "core/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\nB = 2\n",
        "core/c.py": "def f():\n    from .d import D\n",
        "core/d.py": "from . import c\nD = 3\n",
        "core/pkg/__init__.py": "from core.pkg.e import E\n",
        "core/pkg/e.py": "from . import f\nE = 4\n",  # the package's own __init__ is not a dependency
        "core/pkg/f.py": "",
    })
    assert find_cycle(import_graph(root, "core")) == ["core.a", "core.b", "core.a"]  # a type-only import counts
    (root / "core/b.py").write_text("B = 2\n")
    assert find_cycle(import_graph(root, "core")) == ["core.c", "core.d", "core.c"]  # one inside a function too
    (root / "core/c.py").write_text("def f():\n    return 1\n")
    assert find_cycle(import_graph(root, "core")) is None
    (root / "core/pkg/f.py").write_text("class F:\n    from core import a\n")  # a class body runs at import
    (root / "core/a.py").write_text("import core.pkg.f\nA = 1\n")  # core.pkg's __init__ runs first
    assert find_cycle(import_graph(root, "core")) == ["core.a", "core.pkg", "core.pkg.e", "core.pkg.f", "core.a"]


def test_a_module_that_is_not_a_plugin_is_found(tmp_path, monkeypatch):
    root = _tree(tmp_path, {
        "fake_plugins_27/__init__.py": "",
        "fake_plugins_27/helper.py": "def build_copy(model):\n    return model\n",
        "fake_plugins_27/unregistered.py": ("from specdec.generators import CandidateGenerator\n"
                                            "class Quiet(CandidateGenerator):\n    pass\n"),
    })
    monkeypatch.syspath_prepend(str(root))
    try:
        problems = plugin_problems(root, "fake_plugins_27", {})
    finally:
        for name in [m for m in sys.modules if m.startswith("fake_plugins_27")]:
            del sys.modules[name]
    assert [p.split(":")[0] for p in problems] == ["fake_plugins_27/helper.py", "fake_plugins_27/unregistered.py"]


def test_a_plugin_missing_from_the_entry_points_is_found():
    declared = dict(declared_entry_points(ROOT))
    name, value = sorted(declared.items())[0]
    del declared[name]
    problems = plugin_problems(ROOT, PLUGINS, declared)
    assert len(problems) == 1 and value.split(":")[0].replace(".", "/") in problems[0]


@pytest.mark.parametrize("importer, is_package, source, expected", [
    ("pkg.mod", False, "from . import x", ["pkg", "pkg.x"]),
    ("pkg.mod", False, "from .m import y", ["pkg.m", "pkg.m.y"]),
    ("pkg.mod", False, "from .. import x", ["", "x"]),
    ("pkg.mod", False, "from ...x import y", [None]),  # beyond the top-level package
    ("pkg.sub", True, "from .m import y", ["pkg.sub.m", "pkg.sub.m.y"]),  # a package's __init__
    ("pkg.mod", False, "import a.b, c", ["a.b", "c"]),
])
def test_imports_resolve_as_python_does(importer, is_package, source, expected):
    assert targets(importer, is_package, ast.parse(source).body[0]) == expected


def test_an_import_of_an_engine_module_from_outside_is_found_however_written(tmp_path):
    root = _tree(tmp_path, {
        "core/__init__.py": "",
        "core/engines/__init__.py": "from .eager import Eager\nfrom .cpu import Cpu\n",  # the root itself may
        "core/engines/eager.py": "Eager = 1\n",
        "core/engines/cpu/__init__.py": "from .stack import Cpu\n",
        "core/engines/cpu/stack.py": "from ..eager import Eager\nCpu = 2\n",  # inside the package: allowed
        "core/a.py": "from core.engines.eager import Eager\n",
        "core/b.py": "def f():\n    from .engines import eager\n",  # a submodule named by a from-import
        "core/c.py": "import core.engines.cpu.stack\n",
        "core/d.py": "import importlib\nM = importlib.import_module('core.engines.eager')\n",
        "core/e.py": "from core.engines import Eager, Cpu\nfrom . import engines\nimport core.engines\n",  # the root
        "core/f.py": "from .enginesque import x\n",  # a look-alike name is not the package
        "plugins/g.py": "from core.engines.cpu import Cpu\n",
    })
    found = submodule_imports(root, ("core", "plugins", "missing"), "core.engines")
    assert found == ["core/a.py:1: imports core.engines.eager", "core/b.py:2: imports core.engines.eager",
                     "core/c.py:1: imports core.engines.cpu.stack", "core/d.py: imports core.engines.eager by name",
                     "plugins/g.py:1: imports core.engines.cpu"], found


def test_a_long_file_is_found(tmp_path):
    root = _tree(tmp_path, {"core/a.py": "x = 1\n" * 5, "core/sub/b.py": "x = 1\n" * 6, "core/c.py": "x = 1\n" * 9,
                            "core/notes.md": "x\n" * 50})
    assert long_files(root, ("core",), 5, {"core/c.py"}) == ["core/sub/b.py: 6 lines"]
