"""The import layering of prefixserve (docs/DESIGN.md section 9), checked on the source.

Every module under ``prefixserve/`` is parsed with ``ast`` and each of its imports is collected:
module level, inside functions, under ``TYPE_CHECKING``, relative ones, and
``importlib.import_module`` / ``__import__`` calls with a literal name. Each module belongs to
one layer, and each layer may import only the layers listed in ``ALLOWED``. From top to bottom:

    cli            cli.py and __main__.py: may import everything
    server, tools, package
                   package is prefixserve/__init__.py, the lazy LLM / SamplingParams facade;
                   server and tools never import each other
    engine
    core, model    independent of each other

Imports only go down: core and model know nothing of each other nor of anything above them,
the engine nothing of server, tools or the package facade. Skipping a layer downwards is allowed
(the server imports ``SamplingParams`` from model, the estimator uses core directly).

A second group of tests checks that the modules users import for plain values (the prefix cache,
``SamplingParams``, the HTTP request and response models) load neither torch nor numpy.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = "prefixserve"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE

#: Layer of each top-level part of the package; a module's layer is that of its first part below
#: ``prefixserve`` (``prefixserve.core.hashing`` is in ``core``); the package itself is
#: ``package``. A new top-level module or subpackage must be added here (the test says so).
LAYERS = {
    "core": "core",
    "model": "model",
    "engine": "engine",
    "server": "server",
    "tools": "tools",
    "cli": "cli",
    "__main__": "cli",
}

#: Which layers each layer may import (its own included).
ALLOWED: dict[str, frozenset[str]] = {
    "core": frozenset({"core"}),
    "model": frozenset({"model"}),
    "engine": frozenset({"engine", "model", "core"}),
    "server": frozenset({"server", "package", "engine", "model", "core"}),
    "tools": frozenset({"tools", "package", "engine", "model", "core"}),
    "package": frozenset({"package", "engine", "model", "core"}),
    "cli": frozenset({"cli", "server", "tools", "package", "engine", "model", "core"}),
}

#: Imports that break ``ALLOWED`` today and are tolerated until they are removed, as
#: ``(importing module, imported module)`` pairs, each with a comment saying why. Empty: no
#: module breaks the layering. An entry that no longer matches an import fails the test, so
#: the list only shrinks.
EXCEPTIONS: frozenset[tuple[str, str]] = frozenset()


def module_name(path: Path) -> str:
    """``prefixserve/core/hashing.py`` -> ``prefixserve.core.hashing``; a package's
    ``__init__.py`` is the package itself."""
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_modules() -> dict[str, tuple[ast.Module, bool]]:
    """Every module of the package: name -> (syntax tree, whether it is a package)."""
    modules = {}
    for path in sorted(ROOT.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        modules[module_name(path)] = (tree, path.name == "__init__.py")
    return modules


def imported_names(tree: ast.Module, module: str, is_package: bool,
                   known: set[str]) -> Iterator[str]:
    """The absolute names of the modules ``tree`` imports, wherever the import statement is.

    ``from a import b`` names ``a.b`` when that is a module of ``known`` (a submodule), else
    ``a``; relative imports are resolved against ``module``."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                yield submodule if submodule in known else target
        elif (isinstance(node, ast.Call) and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and _call_name(node.func) in ("import_module", "__import__")):
            yield node.args[0].value


def _call_name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def layer_of(module: str) -> str | None:
    """The layer of a module of the package (None outside it or in no known layer)."""
    parts = module.split(".")
    if parts[0] != PACKAGE:
        return None
    if len(parts) == 1:
        return "package"
    return LAYERS.get(parts[1])


def import_edges(modules: dict[str, tuple[ast.Module, bool]]) -> set[tuple[str, str]]:
    """Every (importing module, imported module of the package) pair."""
    known = set(modules)
    edges = set()
    for name, (tree, is_package) in modules.items():
        for target in imported_names(tree, name, is_package, known):
            if target == PACKAGE or target.startswith(PACKAGE + "."):
                edges.add((name, target))
    return edges


def bad_edges(edges: set[tuple[str, str]]) -> list[tuple[str, str]]:
    """The imports that break ``ALLOWED`` and are not in ``EXCEPTIONS`` (modules in no layer
    are left to ``test_every_module_has_a_layer``)."""
    bad = []
    for source, target in sorted(edges):
        here, there = layer_of(source), layer_of(target)
        if here is None or there is None or (source, target) in EXCEPTIONS:
            continue
        if there not in ALLOWED[here]:
            bad.append((source, target))
    return bad


@pytest.fixture(scope="module")
def modules() -> dict[str, tuple[ast.Module, bool]]:
    return source_modules()


def test_every_module_has_a_layer(modules: dict[str, tuple[ast.Module, bool]]) -> None:
    unknown = sorted(name for name in modules if layer_of(name) is None)
    assert not unknown, f"add these to LAYERS in {Path(__file__).name}: {unknown}"
    assert set(LAYERS.values()) | {"package"} == set(ALLOWED)


def test_imports_only_go_down_the_layers(modules: dict[str, tuple[ast.Module, bool]]) -> None:
    edges = import_edges(modules)
    assert edges, "no imports found: the walk is broken"
    problems = [
        f"{source} ({layer_of(source)}) imports {target} ({layer_of(target)}); "
        f"{layer_of(source)} may import only {', '.join(sorted(ALLOWED[layer_of(source)]))}"
        for source, target in bad_edges(edges)]
    assert not problems, "layering broken (docs/DESIGN.md section 9):\n" + "\n".join(problems)


def test_exceptions_are_still_needed(modules: dict[str, tuple[ast.Module, bool]]) -> None:
    stale = sorted(EXCEPTIONS - import_edges(modules))
    assert not stale, f"remove these from EXCEPTIONS, the imports are gone: {stale}"


def test_the_walk_sees_every_kind_of_upward_import() -> None:
    """The checker itself: imports planted in a made-up core module, at module level, inside a
    function, relative, as ``from package import submodule`` and through ``importlib``, are all
    reported; downward and sibling imports are not."""
    planted = ast.parse(
        "import prefixserve.engine.llm_engine\n"
        "from prefixserve.core import hashing\n"
        "def f():\n"
        "    from prefixserve.server.protocol import Usage\n"
        "    from ..model import sampler\n"
        "    from prefixserve import tools\n"
        "    import importlib\n"
        "    importlib.import_module('prefixserve.tools.estimate')\n"
    )
    downward = ast.parse(
        "from prefixserve.core import KVCacheManager\n"
        "def g():\n"
        "    from . import config\n"
        "    from prefixserve.model.sampling_params import SamplingParams\n"
    )
    modules = {
        "prefixserve.core.planted": (planted, False),
        "prefixserve.core.hashing": (ast.parse(""), False),
        "prefixserve.engine.planted": (downward, False),
        "prefixserve.engine.config": (ast.parse(""), False),
        "prefixserve.tools": (ast.parse(""), True),
    }
    assert bad_edges(import_edges(modules)) == [
        ("prefixserve.core.planted", target)
        for target in ("prefixserve.engine.llm_engine", "prefixserve.model",
                       "prefixserve.server.protocol", "prefixserve.tools",
                       "prefixserve.tools.estimate")]


# ---------------------------------------------------------------------- torch-free imports

#: Statements that load the values users import without running a model, and must stay cheap.
TORCH_FREE = [
    "import prefixserve.core",
    "import prefixserve; prefixserve.SamplingParams",
    "import prefixserve.model.sampling_params",
    "import prefixserve.server.protocol",
]


@pytest.mark.parametrize("statement", TORCH_FREE)
def test_value_modules_load_no_torch_or_numpy(statement: str) -> None:
    code = (f"{statement}\n"
            "import sys\n"
            "print(','.join(m for m in ('torch', 'numpy') if m in sys.modules) or 'none')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=False, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "none", f"{statement!r} loads {result.stdout.strip()}"
