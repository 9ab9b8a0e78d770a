"""The package's import graph: every module imports on its own, no import (lazy ones included)
closes a circle, and every import points down the layer table DESIGN.md keeps, so each layer can be
read and changed knowing only the layers below it."""

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "fullshard"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(name: str, path: Path, top_level_only: bool = False) -> set[str]:
    """Package modules `name` imports anywhere in its body (top level or inside functions), or at
    its top level only. `from a import b` names the module `a.b` where there is one, else `a`."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    found = set()
    for node in tree.body if top_level_only else ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            submodules = {f"{target}.{a.name}" for a in node.names} & set(MODULES)
            candidates = submodules | ({target} if len(submodules) < len(node.names) else set())
        elif isinstance(node, ast.Import):
            candidates = {a.name for a in node.names}
        else:
            continue
        found |= {c for c in candidates if c in MODULES and c != name}
    return found


def import_graph() -> dict[str, set[str]]:
    graph = {name: imported_modules(name, path) for name, path in MODULES.items()}
    # importing `a.b` runs `a/__init__` first, but a package's own __init__ re-exporting its
    # children is not a circle: drop edges from a module to the packages that contain it
    return {n: {t for t in targets if not n.startswith(t + ".")} for n, targets in graph.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_import_graph_has_no_cycle():
    graph = import_graph()
    assert len(graph) > 20
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_cycle_finder_finds_a_planted_cycle():
    graph = import_graph()
    graph["fullshard.dtypes"] = graph["fullshard.dtypes"] | {"fullshard.engine"}
    assert find_cycle(graph) is not None


def test_every_module_imports_alone_in_a_fresh_interpreter():
    code = ("import importlib, sys\n"
            "for name in sys.argv[1:]:\n"
            "    for loaded in [m for m in sys.modules if m.startswith('fullshard')]:\n"
            "        del sys.modules[loaded]\n"
            "    importlib.import_module(name)\n")
    # one interpreter, the package's modules dropped between imports: each import starts from nothing
    # of ours, which is what a fresh interpreter per module would show, at a fraction of the start-ups
    result = subprocess.run([sys.executable, "-c", code, *sorted(MODULES)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


def design_layers() -> dict[str, int]:
    """DESIGN.md's module table: `| `path.py` or `package/` | layer | owns |` -> module name: layer."""
    layers = {}
    for row in re.finditer(r"^\| (`[^|]+`) \| (\d+) \|", (PACKAGE.parents[1] / "DESIGN.md").read_text(), re.M):
        for path in re.findall(r"`([\w/]+(?:\.py|/))`", row.group(1)):
            file = PACKAGE / (path + "__init__.py" if path.endswith("/") else path)
            layers[module_name(file)] = int(row.group(2))
    return layers


def top_level_imports() -> dict[str, set[str]]:
    """What each package `__init__` imports at its top (what importing any of its modules runs)."""
    return {name: imported_modules(name, path, top_level_only=True) for name, path in MODULES.items()
            if path.name == "__init__.py" and name != PACKAGE.name}


def upward_imports(graph: dict[str, set[str]], layers: dict[str, int], tops: dict[str, set[str]]) -> list[str]:
    """Imports (lazy ones included) naming a module of a higher layer, and package `__init__`s
    importing at their top a module above their package's lowest layer (importing any module of a
    package runs its `__init__` first, so that import would reach up from the lowest one)."""
    found = [f"{name} (layer {layers[name]}) imports {target} (layer {layers[target]})"
             for name, targets in graph.items() for target in sorted(targets) if layers[target] > layers[name]]
    for package, targets in tops.items():
        lowest = min(layer for module, layer in layers.items() if module.startswith(package + "."))
        found += [f"package {package} imports {target} (layer {layers[target]}) at its top, above its lowest "
                  f"module's layer {lowest}" for target in sorted(targets) if layers[target] > lowest]
    return found


def test_design_names_every_module_and_its_layer():
    layers = design_layers()
    assert sorted(set(MODULES) - set(layers)) == [], "modules DESIGN.md's table does not name"
    assert sorted(set(layers) - set(MODULES)) == [], "DESIGN.md names modules that do not exist"


def test_every_import_points_down_the_layers():
    assert upward_imports(import_graph(), design_layers(), top_level_imports()) == []


def test_the_layer_check_finds_planted_upward_imports():
    graph, layers, tops = import_graph(), design_layers(), top_level_imports()
    graph["fullshard.hf.export"] = graph["fullshard.hf.export"] | {"fullshard.engine"}
    tops["fullshard.checkpoint"] = tops["fullshard.checkpoint"] | {"fullshard.checkpoint.manager"}
    assert upward_imports(graph, layers, tops) == [
        "fullshard.hf.export (layer 4) imports fullshard.engine (layer 6)",
        "package fullshard.checkpoint imports fullshard.checkpoint.manager (layer 5) at its top, above its lowest "
        "module's layer 3"]


def test_old_module_paths_import_as_the_moved_modules():
    from fullshard._moved import MOVED
    code = ("import importlib, sys\n"
            "for old, new in [a.split('=') for a in sys.argv[1:]]:\n"
            "    assert importlib.import_module(old) is importlib.import_module(new), old\n")
    tests = str(Path(__file__).resolve().parent)  # where the harnesses that left the package live
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PACKAGE.parent), tests])}
    result = subprocess.run([sys.executable, "-c", code, *(f"{o}={n}" for o, n in MOVED.items())],
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]


LOW_LAYERS = ["fullshard.dtypes", "fullshard.errors", "fullshard.tensors", "fullshard.plan", "fullshard.fsdp",
              "fullshard.loading", "fullshard.checkpoint"]
HIGH = ("fullshard.engine", "fullshard.faces", "fullshard.train", "fullshard.pretrained", "fullshard.cli")


@pytest.fixture(scope="module")
def pulled_in_by_low_layers() -> dict:
    """For each of LOW_LAYERS, imported alone (our modules dropped between, as in
    test_every_module_imports_alone_in_a_fresh_interpreter), the high modules it pulled in."""
    code = ("import importlib, json, sys\n"
            "found = {}\n"
            "for name in sys.argv[1:]:\n"
            "    for loaded in [m for m in sys.modules if m.startswith('fullshard')]:\n"
            "        del sys.modules[loaded]\n"
            "    importlib.import_module(name)\n"
            f"    found[name] = [m for m in {HIGH!r} if m in sys.modules]\n"
            "print(json.dumps(found))\n")
    result = subprocess.run([sys.executable, "-c", code, *LOW_LAYERS], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", LOW_LAYERS)
def test_low_layers_do_not_import_upwards(name, pulled_in_by_low_layers):
    """The ground floor and the loader never pull in the engine, the strategy or the trainer."""
    assert pulled_in_by_low_layers[name] == []


MAX_FUNCTION_LINES = 60


def test_no_function_is_longer_than_a_screen():
    """Issue 9's rule: each function (docstring included) reads on one screen."""
    long = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long.append(f"{name}.{node.name}: {length} lines")
    assert not long, long
