"""The import layering of prefixserve (docs/architecture.md), checked on the source.

Every module under ``prefixserve/`` is parsed with ``ast`` and each of its imports is collected:
module level, inside functions, under ``TYPE_CHECKING``, relative ones, and
``importlib.import_module`` / ``__import__`` calls with a literal name. Each module belongs to
one layer, and each layer may import only the layers listed in ``ALLOWED``. From top to bottom:

    cli            cli.py and __main__.py: may import everything
    server, tools, package
                   package is prefixserve/__init__.py, the lazy LLM / SamplingParams facade;
                   server and tools never import each other
    engine
    tiers          the disk and Redis cache tiers, over the core's tier interface
    core, model    independent of each other
    values         sampling_params.py and outputs.py, the API's plain values: every layer may
                   import them, and they import nothing else of prefixserve

Imports only go down: core and model know nothing of each other nor of anything above them,
the engine nothing of server, tools or the package facade. Skipping a layer downwards is allowed
(the server imports ``RequestOutput`` from values, the estimator uses core directly).

A second group of tests checks that the modules users import for plain values (the prefix cache,
``SamplingParams``, the outputs, the HTTP request and response models) load neither torch nor
numpy. A third checks that the server and the tools use only the engine's public surface.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

PACKAGE = "prefixserve"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE

#: Layer of each top-level part of the package; a module's layer is that of its first part below
#: ``prefixserve`` (``prefixserve.core.hashing`` is in ``core``); the package itself is
#: ``package``. A new top-level module or subpackage must be added here (the test says so).
LAYERS = {
    "core": "core",
    "tiers": "tiers",
    "router": "router",
    "model": "model",
    "engine": "engine",
    "server": "server",
    "serve_ray": "serve_ray",
    "tools": "tools",
    "cli": "cli",
    "__main__": "cli",
    "sampling_params": "values",
    "outputs": "values",
}

#: Which layers each layer may import (its own included).
ALLOWED: dict[str, frozenset[str]] = {
    "values": frozenset({"values"}),
    "core": frozenset({"core", "values"}),
    "tiers": frozenset({"tiers", "core", "values"}),
    "router": frozenset({"router", "core", "values"}),
    "model": frozenset({"model", "values"}),
    "engine": frozenset({"engine", "tiers", "model", "core", "values"}),
    "server": frozenset({"server", "package", "engine", "tiers", "model", "router", "core",
                         "values"}),
    "serve_ray": frozenset({"serve_ray", "server", "package", "engine", "tiers", "model", "router",
                            "core", "values"}),
    "tools": frozenset({"tools", "package", "engine", "tiers", "model", "router", "core",
                        "values"}),
    "package": frozenset({"package", "engine", "tiers", "model", "core", "values"}),
    "cli": frozenset({"cli", "serve_ray", "server", "tools", "package", "engine", "tiers",
                      "model", "router", "core", "values"}),
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
    assert not problems, "layering broken (docs/architecture.md):\n" + "\n".join(problems)


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
        "    from prefixserve.server.openai.protocol import Usage\n"
        "    from ..model import sampler\n"
        "    from prefixserve import tools\n"
        "    import importlib\n"
        "    importlib.import_module('prefixserve.tools.estimate.replay')\n"
    )
    downward = ast.parse(
        "from prefixserve.core import KVCacheManager\n"
        "def g():\n"
        "    from . import config\n"
        "    from prefixserve.sampling_params import SamplingParams\n"
    )
    values = ast.parse("from prefixserve.model import tokenizer\n")
    modules = {
        "prefixserve.core.planted": (planted, False),
        "prefixserve.core.hashing": (ast.parse(""), False),
        "prefixserve.engine.planted": (downward, False),
        "prefixserve.engine.config": (ast.parse(""), False),
        "prefixserve.tools": (ast.parse(""), True),
        "prefixserve.outputs": (values, False),
    }
    assert bad_edges(import_edges(modules)) == [
        ("prefixserve.core.planted", target)
        for target in ("prefixserve.engine.llm_engine", "prefixserve.model",
                       "prefixserve.server.openai.protocol", "prefixserve.tools",
                       "prefixserve.tools.estimate.replay")] + [
        ("prefixserve.outputs", "prefixserve.model")]


# ---------------------------------------------------------------------- torch-free imports

#: Statements that load the values users import without running a model, and the scheduler
#: (pure bookkeeping over the core), which must stay cheap.
TORCH_FREE = [
    "import prefixserve.core",
    "import prefixserve.router",
    "import prefixserve; prefixserve.SamplingParams",
    "import prefixserve.sampling_params",
    "import prefixserve.outputs",
    "import prefixserve.engine.errors",
    "import prefixserve.server.openai.protocol",
    "import prefixserve.engine.scheduler",
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


# ---------------------------------------------------------------- the engine's public surface

#: The engine classes the server and the tools hold, by file under ``prefixserve/``.
ENGINE_CLASSES = {"engine/async_llm.py": "AsyncLLM", "engine/llm_engine.py": "LLMEngine"}

#: The packages that may use the engine only through that surface.
ENGINE_USERS = ("server", "tools")


def engine_surface() -> frozenset[str]:
    """The public methods and properties the bodies of the ``ENGINE_CLASSES`` define. Attributes
    set in ``__init__`` (``AsyncLLM.engine``, ``LLMEngine.output_processor``, ``.config``, the
    KV cache manager, the scheduler...) are internals, not part of it."""
    names = set()
    for path, class_name in ENGINE_CLASSES.items():
        tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
        body = next(node.body for node in tree.body
                    if isinstance(node, ast.ClassDef) and node.name == class_name)
        names.update(node.name for node in body
                     if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                     and not node.name.startswith("_"))
    return frozenset(names)


def _is_engine(node: ast.expr) -> bool:
    """An expression that holds an engine: the name ``engine`` or an attribute ``.engine``."""
    return ((isinstance(node, ast.Name) and node.id == "engine")
            or (isinstance(node, ast.Attribute) and node.attr == "engine"))


def engine_reaches(tree: ast.Module, surface: frozenset[str]) -> list[str]:
    """Each ``<engine>.name`` of ``tree`` whose name is outside ``surface``, as ``line: text``
    in source order.

    Every module of the server and the tools holds its engine (an ``AsyncLLM``, or the
    ``LLMEngine`` of an ``LLM``) in a name or attribute called ``engine``, so this catches
    ``engine.engine.x``, ``self.engine._streams`` and ``llm.engine.config`` alike; an engine
    held under another name would escape it."""
    found = sorted((node.lineno, node.col_offset, ast.unparse(node)) for node in ast.walk(tree)
                   if isinstance(node, ast.Attribute) and _is_engine(node.value)
                   and node.attr not in surface)
    return [f"{line}: {text}" for line, _, text in found]


def test_the_server_and_tools_use_only_the_engines_public_surface() -> None:
    surface = engine_surface()
    assert {"generate", "validate_prompt", "max_model_len", "add_request"} <= surface
    problems = [
        f"{path.relative_to(ROOT.parent)}:{reach}"
        for package in ENGINE_USERS for path in sorted((ROOT / package).rglob("*.py"))
        for reach in engine_reaches(ast.parse(path.read_text(encoding="utf-8")), surface)]
    assert not problems, ("use a public method or property of AsyncLLM / LLMEngine instead "
                          "(or add one):\n" + "\n".join(problems))


def test_the_surface_check_sees_reaches_through_the_engine() -> None:
    planted = ast.parse(
        "engine.engine.model_config.vocab_size\n"
        "self.engine._streams\n"
        "llm.engine.groups\n"
        "self.engine.generate(ids)\n"
        "engine.max_model_len\n"
        "llm.chat(messages)\n"
    )
    assert engine_reaches(planted, engine_surface()) == [
        "1: engine.engine", "1: engine.engine.model_config", "2: self.engine._streams",
        "3: llm.engine.groups"]


def _graph(edges: set[tuple[str, str]]) -> dict[str, list[str]]:
    graph: dict[str, list[str]] = {}
    for source, target in sorted(edges):
        if source != target:
            graph.setdefault(source, []).append(target)
            graph.setdefault(target, [])
    return graph


def import_cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """The groups of modules that reach each other through imports (strongly connected
    components of more than one module, Tarjan's algorithm), each sorted."""
    graph = _graph(edges)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(cycles)


def test_no_module_imports_itself_through_others(modules: dict[str, tuple[ast.Module, bool]]
                                                 ) -> None:
    """No import loop in the package, counting every import: inside functions and under
    ``TYPE_CHECKING`` too (a loop there is still two modules that need each other; share what
    they need from a third instead). (Planted: ``prompt_attention`` importing ``fused_decode``
    again, inside a function, closes the loop through the models and ``attention``.)"""
    assert import_cycles(import_edges(modules)) == []


def test_the_cycle_search_finds_a_loop_of_three() -> None:
    edges = {("a", "b"), ("b", "c"), ("c", "a"), ("c", "d"), ("d", "e")}
    assert import_cycles(edges) == [["a", "b", "c"]]
