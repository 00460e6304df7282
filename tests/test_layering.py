"""The import structure: layers import only what they may, and nothing imports in a circle.

Layers, bottom to top (docs/DESIGN.md): the core (IR, ops, nn, optim, attributes) <- the
plan contract (``distgraph.plan``) <- ``distgraph.resources`` <- the planner
(``distgraph.passes``) and the runtime (``distgraph.runtime``) <- the application
(``distgraph.app``, ``distgraph.cli``, ``distgraph.tools`` and the ``distgraph`` facade).
The planner and the runtime sit side by side: the planner makes the contract's values,
the runtime reads them, and neither imports the other. Every import counts, those inside
functions included, relative ones and ``importlib.import_module`` of a literal name too:
they are read from the source with ``ast``, not from a running interpreter. A dynamic
import the check cannot read is refused outside the facade.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"distgraph": "distgraph", "resources": "distgraph.resources",
           "passes": "distgraph.passes", "runtime": "distgraph.runtime"}
LAYER_ROOTS = set(FOLDERS.values())
LAYERS = ("core", "contract", "resources", "passes", "runtime", "application")
APPLICATION = ("distgraph.app", "distgraph.cli", "distgraph.tools")
# what each layer may import besides itself
ALLOWED = {"core": set(), "contract": {"core"}, "resources": {"core", "contract"},
           "passes": {"core", "contract", "resources"},
           "runtime": {"core", "contract", "resources"},
           "application": set(LAYERS)}
FACADE = "distgraph"


def modules() -> dict:
    """{module name: source path} of the four package folders."""
    out = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def layer(name: str) -> str:
    if name == FACADE or any(_within(name, p) for p in APPLICATION):
        return "application"
    for package, which in (("distgraph.runtime", "runtime"), ("distgraph.passes", "passes"),
                           ("distgraph.resources", "resources"), ("distgraph.plan", "contract")):
        if _within(name, package):
            return which
    return "core"


def group(name: str, mods: dict) -> str:
    """What a circle is counted between: a sub-package (``distgraph.passes.search``), or a
    module that sits directly in a layer's folder (``distgraph.passes.planner``)."""
    if mods[name].name == "__init__.py":
        return name
    parent = name.rsplit(".", 1)[0]
    return name if parent in LAYER_ROOTS else parent


def imports(path: Path, mods: dict, name: str | None = None) -> list:
    """(line, imported module) for every distgraph import in ``path`` (module ``name``):
    ``from P import X`` counts as an import of module ``P.X`` where that is one; relative
    imports are resolved against ``name``'s package; ``importlib.import_module("...")``
    counts, and one whose name is not a literal is ``(line, None)``."""
    package = None
    if name is not None:
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                module = ".".join(base + ([module] if module else []))
            if _within(module, "distgraph"):
                for alias in node.names:
                    full = f"{module}.{alias.name}"
                    out.append((node.lineno, full if full in mods else module))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if _within(a.name, "distgraph")]
        elif isinstance(node, ast.Call) and _is_dynamic_import(node.func):
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                if _within(arg.value, "distgraph"):
                    out.append((node.lineno, arg.value))
            else:
                out.append((node.lineno, None))
    return out


def _is_dynamic_import(func) -> bool:
    """``importlib.import_module``, a bare ``import_module`` or ``__import__``."""
    if isinstance(func, ast.Attribute):
        return func.attr == "import_module"
    return isinstance(func, ast.Name) and func.id in ("import_module", "__import__")


def import_graph(mods: dict) -> nx.DiGraph:
    graph = nx.DiGraph(unreadable=[])
    graph.add_nodes_from(mods)
    for name, path in mods.items():
        for line, target in imports(path, mods, name):
            where = f"{_shown(path)}:{line}"
            if target is None:
                if name != FACADE:
                    graph.graph["unreadable"].append(f"{where}: {name} imports a module "
                                                     f"whose name is not a literal")
            elif target != name:
                graph.add_edge(name, target, where=where)
    return graph


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def forbidden_imports(graph: nx.DiGraph) -> list:
    """Imports a layer may not make (``ALLOWED``), and dynamic imports it cannot read."""
    return [f"{d['where']}: {a} ({layer(a)}) imports {b} ({layer(b)})"
            for a, b, d in graph.edges(data=True)
            if layer(a) != layer(b) and layer(b) not in ALLOWED[layer(a)]] + \
        graph.graph.get("unreadable", [])


def circles(graph: nx.DiGraph, key=lambda name: name) -> list:
    """Each circle of ``graph`` with nodes merged by ``key``, as the imports that make it."""
    merged = nx.DiGraph()
    for a, b, d in graph.edges(data=True):
        if key(a) != key(b):
            merged.add_edge(key(a), key(b))
            merged.edges[key(a), key(b)].setdefault("why", []).append(
                f"{d['where']}: {a} imports {b}")
    found = []
    for component in nx.strongly_connected_components(merged):
        if len(component) > 1:
            sub = merged.subgraph(component)
            found.append("circle between " + ", ".join(sorted(component)) + ":\n    "
                         + "\n    ".join(w for _, _, d in sub.edges(data=True) for w in d["why"]))
    return found


@pytest.fixture(scope="module")
def graph():
    return import_graph(modules())


def test_every_module_of_the_four_folders_is_read():
    mods = modules()
    assert "distgraph.passes.search.layouts.ilp" in mods and "distgraph.runtime.comm.mpi" in mods
    assert "distgraph.app.engine" in mods and "distgraph.resources.cluster" in mods


def test_no_layer_imports_what_it_may_not(graph):
    found = forbidden_imports(graph)
    assert not found, "imports against the layering:\n" + "\n".join(found)


def test_packages_do_not_import_each_other_in_a_circle(graph):
    mods = modules()
    found = circles(graph, key=lambda name: group(name, mods))
    assert not found, "\n".join(found)


def test_modules_do_not_import_each_other_in_a_circle(graph):
    found = circles(graph)
    assert not found, "\n".join(found)


def _graph_of(tmp_path, sources: dict) -> nx.DiGraph:
    """The import graph of made-up modules {module name: source}."""
    mods = {}
    for name, source in sources.items():
        path = tmp_path / f"{name.replace('.', '_')}.py"
        path.write_text(source)
        mods[name] = path
    return import_graph(mods)


def test_the_checks_see_an_upward_import_and_a_circle(tmp_path):
    """The checker itself: a resources module importing passes, and two modules importing
    each other inside functions, are both found."""
    fake = _graph_of(tmp_path, {
        "distgraph.resources.a": "def f():\n    from distgraph.passes.search import b\n",
        "distgraph.passes.search.b": "import os\n\ndef g():\n    import distgraph.resources.a\n"})
    assert forbidden_imports(fake) == [
        "distgraph_resources_a.py:2: distgraph.resources.a (resources) imports "
        "distgraph.passes.search.b (passes)"]
    assert len(circles(fake)) == 1


def test_the_checks_refuse_the_runtime_importing_the_planner(tmp_path):
    fake = _graph_of(tmp_path, {
        "distgraph.runtime.execution.x": "from distgraph.passes.reshard import plan_reshard\n",
        "distgraph.passes.reshard": "",
        "distgraph.runtime.comm.y": "from distgraph.plan.kinds import StepKind\n",
        "distgraph.plan.kinds": ""})
    assert forbidden_imports(fake) == [
        "distgraph_runtime_execution_x.py:1: distgraph.runtime.execution.x (runtime) imports "
        "distgraph.passes.reshard (passes)"]


def test_the_checks_read_relative_and_importlib_imports(tmp_path):
    """A relative import and an ``importlib`` import upward are both refused (both passed
    unseen before), and an import whose name is computed is refused outside the facade."""
    fake = _graph_of(tmp_path, {
        "distgraph.passes.reshard": "def f():\n    from ..runtime.execution import runner\n",
        "distgraph.runtime.execution.runner": "",
        "distgraph.passes.search.layouts.ilp": "import importlib\n\n\ndef g(name):\n"
                                       "    importlib.import_module('distgraph.app.engine')\n"
                                       "    return importlib.import_module(name)\n",
        "distgraph.app.engine": ""})
    assert forbidden_imports(fake) == [
        "distgraph_passes_reshard.py:2: distgraph.passes.reshard (passes) imports "
        "distgraph.runtime.execution.runner (runtime)",
        "distgraph_passes_search_layouts_ilp.py:5: distgraph.passes.search.layouts.ilp (passes) imports "
        "distgraph.app.engine (application)",
        "distgraph_passes_search_layouts_ilp.py:6: distgraph.passes.search.layouts.ilp imports a module whose "
        "name is not a literal"]
