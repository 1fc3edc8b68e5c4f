"""The package's floors: each subpackage imports only the ones below it, nothing
imports in a circle, the planner is a leaf, and the blocks import without
DeepSpeed. The rules are read from the source (``ast``), function-level
imports included, and checked again in a fresh interpreter's ``sys.modules``."""

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "ds_tsp")

# Lowest first. ``config`` and ``planning`` are leaves: they import nothing else of the package.
FLOORS = {"config": 0, "planning": 0, "parallel": 1, "blocks": 2, "inference": 3, "injection": 4, "checkpoint": 5,
          "runtime": 6, "cli": 7}
LEAVES = ("config", "planning")


def package_modules():
    """``{module name: path}`` of every module under ``ds_tsp/``."""
    modules = {}
    for directory, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                dotted = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                modules[dotted.removesuffix(".__init__")] = path
    return modules


def imported_modules(name, path, modules):
    """The package's modules ``name`` imports anywhere in its source, relative imports resolved."""
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(target for target in targets if target in modules and target != name)
    return found


def floor_of(name):
    """The floor of a module (``ds_tsp.blocks.moe.module`` is in ``blocks``); None for the package itself."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else None


def import_graph():
    modules = package_modules()
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def floor_violations(graph):
    """``(importer, imported)`` pairs that import a higher floor, or leave a leaf."""
    bad = []
    for importer, imported in graph.items():
        floor = floor_of(importer)
        if floor is None:  # ds_tsp/__init__.py loads its public names lazily, from every floor
            continue
        for target in imported:
            target_floor = floor_of(target)
            if target_floor is None:
                continue
            upward = FLOORS[target_floor] > FLOORS[floor]
            leaves_leaf = floor in LEAVES and target_floor != floor
            if upward or leaves_leaf:
                bad.append((importer, target))
    return sorted(bad)


def circles(graph):
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in graph.get(node, ()):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_every_module_imports_only_its_own_floor_and_below_and_nothing_imports_in_a_circle():
    graph = import_graph()
    floors = {floor_of(name) for name in graph} - {None}
    assert floors == set(FLOORS), f"a module outside the known floors: {floors - set(FLOORS)}"
    violations = floor_violations(graph)
    found = circles(graph)
    print(f"{len(graph)} modules, {sum(map(len, graph.values()))} imports; upward: {violations}; circles: {found}")
    assert not violations and not found


def test_the_check_catches_an_upward_import_and_a_circle():
    graph = import_graph()
    graph["ds_tsp.blocks.mlp"] = graph["ds_tsp.blocks.mlp"] | {"ds_tsp.runtime.engine"}
    graph["ds_tsp.planning.shapes"] = graph["ds_tsp.planning.shapes"] | {"ds_tsp.parallel.layout"}
    graph["ds_tsp.checkpoint.formats"] = graph["ds_tsp.checkpoint.formats"] | {"ds_tsp.checkpoint.reading"}
    assert floor_violations(graph) == [("ds_tsp.blocks.mlp", "ds_tsp.runtime.engine"),
                                       ("ds_tsp.planning.shapes", "ds_tsp.parallel.layout")]
    assert any({"ds_tsp.checkpoint.formats", "ds_tsp.checkpoint.reading"} <= set(c) for c in circles(graph))


def _loaded_after(code):
    """The ``sys.modules`` names a fresh interpreter holds after running ``code``."""
    probe = code + "\nimport sys\nprint('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-3000:]
    return set(out.stdout.split())


@pytest.mark.parametrize("imported, absent", [
    ("ds_tsp.blocks", ("ds_tsp.planning", "ds_tsp.runtime", "ds_tsp.injection", "ds_tsp.inference", "deepspeed")),
    ("ds_tsp.planning", ("ds_tsp.blocks", "ds_tsp.parallel", "torch")),
])
def test_a_floor_loads_nothing_above_it(imported, absent):
    """Every module under ``imported``, imported in a fresh interpreter, leaves ``absent`` unloaded."""
    code = (f"import importlib, pkgutil, {imported} as package\n"
            f"for found in pkgutil.walk_packages(package.__path__, '{imported}.'):\n"
            "    importlib.import_module(found.name)")
    loaded = _loaded_after(code)
    walked = sorted(name for name in loaded if name.startswith(imported + "."))
    print(f"{imported}: {len(walked)} modules imported; loaded of {absent}: "
          f"{[name for name in absent if name in loaded]}")
    assert walked and not [name for name in absent if name in loaded]


def test_at_most_six_modules_at_the_top_and_no_function_over_100_lines():
    top = sorted(name for name in os.listdir(PACKAGE) if name.endswith(".py") and name != "__init__.py")
    assert len(top) <= 6, top
    long = []
    for name, path in package_modules().items():
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 100:
                long.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    print(f"top-level modules: {top}; functions over 100 lines: {long}")
    assert not long
