"""The package's dependencies point one way: each subpackage imports with the others' heavy
dependencies (and the layers above it) made unimportable, in a fresh interpreter; the import
graph of the package, bench/, testbed/ and the tests, read from the source, has no circle; and
each of those trees imports only the trees below it (the package none of them)."""

from __future__ import annotations

import ast
import graphlib
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
# Import name -> source folder of every tree whose import graph is checked.
TREES = {
    "triton_sampling_mask": REPO_ROOT / "plugin",
    "bench": REPO_ROOT / "bench",
    "tests": REPO_ROOT / "tests",
    "client_tests": REPO_ROOT / "client_tests",
    "testbed": REPO_ROOT / "testbed",
}
# Tree -> the other trees it may import. The package imports none of them; the harnesses both the
# client tests and the benchmarks run (testbed) import neither, and those two never each other.
TREE_IMPORTS = {
    "triton_sampling_mask": set(),
    "testbed": {"triton_sampling_mask"},
    "bench": {"triton_sampling_mask", "testbed"},
    "client_tests": {"triton_sampling_mask", "testbed", "tests"},
    "tests": {"triton_sampling_mask", "testbed", "bench"},
}
# The package's layers, lowest first (plugin/__init__.py): each may import only those before it.
# model_config is shared by client, serving and ops (torch-free).
LAYERS = ("sampling", "generation", "model_config", "client", "api", "serving", "ops")
# ops runs the server and talks to it over HTTP only: none of the client's code.
NEVER = {("ops", "client")}

# subpackage -> top-level modules it must never need (an import of any of them fails the test).
FORBIDDEN = {
    "sampling": [
        "triton_python_backend_utils",
        "tritonclient",
        "transformers",
        "triton_sampling_mask.serving",
        "triton_sampling_mask.client",
        "triton_sampling_mask.generation",
        "triton_sampling_mask.ops",
        "triton_sampling_mask.model_config",
    ],
    "generation": [
        "triton_python_backend_utils",
        "tritonclient",
        "triton_sampling_mask.serving",
        "triton_sampling_mask.client",
        "triton_sampling_mask.ops",
    ],
    "client": [
        "triton_python_backend_utils",
        "transformers",
        "triton_sampling_mask.serving",
        "triton_sampling_mask.generation",
        "triton_sampling_mask.ops",
    ],
    # The HTTP API: a client of the generate model in a process of its own, never inside Triton.
    "api": [
        "triton_python_backend_utils",
        "triton_sampling_mask.serving",
        "triton_sampling_mask.ops",
    ],
    "serving": [
        "triton_python_backend_utils",
        "tritonclient",
        "triton_sampling_mask.client",
        "triton_sampling_mask.ops",
    ],
    # The probe runs as a Kubernetes exec probe, a fresh interpreter each period: no torch to load.
    "ops": [
        "triton_python_backend_utils",
        "tritonclient",
        "transformers",
        "torch",
        "triton_sampling_mask.client",
    ],
}

PROBE = textwrap.dedent(
    """
    import importlib, pkgutil, sys

    forbidden = sys.argv[2:]

    class Block:
        def find_spec(self, name, path=None, target=None):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                raise ImportError(f"blocked by the layering test: {name}")
            return None

    sys.meta_path.insert(0, Block())
    package = importlib.import_module("triton_sampling_mask." + sys.argv[1])
    for info in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{info.name}")
    print("ok")
    """
)


@pytest.mark.parametrize("subpackage", sorted(FORBIDDEN))
def test_subpackage_imports_without_the_layers_above(subpackage):
    done = subprocess.run(
        [sys.executable, "-c", PROBE, subpackage, *FORBIDDEN[subpackage]], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_probe_blocks_what_it_names():
    # The test above can fail: importing the client with tritonclient blocked must fail.
    done = subprocess.run(
        [sys.executable, "-c", PROBE, "client", "tritonclient"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0 and "blocked by the layering test: tritonclient" in done.stderr


def source_modules(trees: dict[str, Path]) -> dict[str, Path]:
    """Module name -> file, for every .py file of `trees` (a package is its __init__.py)."""
    found = {}
    for name, root in trees.items():
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join((name, *parts[: -1 if parts[-1] == "__init__" else None]))] = path
    return found


def imported_modules(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of `known` that module `name` imports anywhere in its file (function-local and
    TYPE_CHECKING imports too: no import can hide a circle), relative imports resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = alias.name
                while target and target not in known:
                    target = target.rpartition(".")[0]
                found.add(target)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:  # `from package import module` imports the module
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {target for target in found if target in known and target != name}


def import_graph(trees: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules it imports, over `trees`."""
    known = source_modules(trees)
    return {name: imported_modules(name, path, known) for name, path in known.items()}


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` (its modules, the first repeated at the end), or None."""
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as error:
        return error.args[1]
    return None


def layer(module: str) -> str | None:
    """The package layer `module` belongs to (None outside them: the package root, bench, tests)."""
    parts = module.split(".")
    return parts[1] if parts[0] == "triton_sampling_mask" and len(parts) > 1 and parts[1] in LAYERS else None


def test_the_import_graph_has_no_circle():
    graph = import_graph(TREES)
    assert len(graph) > 100 and "triton_sampling_mask.ops.launcher" in graph
    assert "triton_sampling_mask.ops.server_process" in graph["triton_sampling_mask.ops.supervisor"]
    circle = find_circle(graph)
    assert circle is None, "import circle: " + " -> ".join(circle)


def test_each_layer_imports_only_the_layers_below_it():
    wrong = sorted(
        f"{module} imports {target}"
        for module, targets in import_graph({"triton_sampling_mask": TREES["triton_sampling_mask"]}).items()
        for target in targets
        if layer(module) and layer(target) and layer(module) != layer(target)
        if LAYERS.index(layer(target)) > LAYERS.index(layer(module)) or (layer(module), layer(target)) in NEVER
    )
    assert not wrong, "\n".join(wrong)


def test_a_planted_circle_is_found_even_through_a_function_local_import(tmp_path):
    package = tmp_path / "planted"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "first.py").write_text("from .sub import second\n")
    (package / "sub" / "second.py").write_text("import os\n\n\ndef late():\n    from ..first import late\n")
    graph = import_graph({"planted": package})
    assert graph["planted.first"] == {"planted.sub.second"}
    assert graph["planted.sub.second"] == {"planted.first"}
    assert set(find_circle(graph)) == {"planted.first", "planted.sub.second"}
    (package / "sub" / "second.py").write_text("import os\n")
    assert find_circle(import_graph({"planted": package})) is None


def cross_tree_imports(graph: dict[str, set[str]]) -> list[str]:
    """The imports of `graph` from one tree into another that TREE_IMPORTS does not allow."""
    return sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        for target in targets
        if (tree := module.split(".")[0]) != (other := target.split(".")[0]) and other not in TREE_IMPORTS[tree]
    )


def test_each_tree_imports_only_the_trees_below_it():
    assert set(TREE_IMPORTS) == set(TREES)
    wrong = cross_tree_imports(import_graph(TREES))
    assert not wrong, "\n".join(wrong)


def test_a_planted_cross_tree_import_is_found():
    graph = {"bench.load": {"client_tests.server", "testbed.stack"}, "testbed.stack": {"bench.common"}}
    assert cross_tree_imports(graph) == ["bench.load imports client_tests.server", "testbed.stack imports bench.common"]
