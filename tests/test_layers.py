"""The package's layers, read from its source: no import cycle, and each layer imports only the ones below it."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "refreshkv"
# layer -> the package's layers it may import (besides itself)
# (core is the method API; methods and the engine that runs them inside a model are both written against it alone)
ALLOWED = {
    "core": set(),
    "methods": {"core"},
    "engine": {"core"},
    "texts": set(),
    "runtime": {"core", "engine", "methods"},
    "measure": {"core", "engine", "methods", "runtime", "texts"},
    "eval": {"core", "engine", "methods", "runtime", "measure", "texts"},
    "train": {"core", "engine", "methods", "runtime", "texts", "eval"},
    "cli": {"core", "engine", "methods", "runtime", "measure", "texts", "eval", "train"},
}


def module_name(path: Path) -> str:
    parts = ["refreshkv", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_imports(path: Path) -> set[str]:
    """Modules (absolute names) that importing or running this file imports; `if TYPE_CHECKING:` blocks excluded."""
    tree = ast.parse(path.read_text())
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rsplit(".", 1)[0]
    found = set()
    skipped = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for child in node.body
        for n in ast.walk(child)
    }
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)  # `from . import module`
    return found


def import_graph() -> dict[str, set[str]]:
    files = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    return {name: {m for m in runtime_imports(path) if m in files and m != name} for name, path in files.items()}


def layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ALLOWED else None


def test_no_import_cycle():
    graph = import_graph()
    state: dict[str, str] = {}

    def visit(module, path):
        state[module] = "open"
        for target in sorted(graph[module]):
            if target == "refreshkv":
                continue  # the package's front door (refreshkv/__init__.py) imports the layers; none imports it
            if state.get(target) == "open":
                pytest.fail(
                    "import cycle: "
                    + " -> ".join([*path, module, target][path.index(target) if target in path else 0 :])
                )
            if target not in state:
                visit(target, [*path, module])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [])


def test_no_module_imports_the_package_front_door():
    assert [m for m, targets in import_graph().items() if "refreshkv" in targets and m != "refreshkv"] == []


def test_each_layer_imports_only_the_layers_below_it():
    wrong = sorted(
        (module, target)
        for module, targets in import_graph().items()
        for target in targets
        if layer(module)
        and layer(target)
        and layer(target) != layer(module)
        and layer(target) not in ALLOWED[layer(module)]
    )
    assert wrong == []


def test_only_the_command_line_imports_typer():
    users = sorted(
        module_name(path)
        for path in PACKAGE.rglob("*.py")
        if any(m == "typer" or m.startswith("typer.") for m in runtime_imports(path))
    )
    assert users and all(layer(module) == "cli" for module in users), users


def test_the_checks_see_the_imports(tmp_path):
    """The graph is read correctly: a relative import of a module and a function-level import are both edges."""
    graph = import_graph()
    assert "refreshkv.core.policy" in graph["refreshkv.methods.snapkv"]
    assert "refreshkv.runtime.loading" in graph["refreshkv.runtime.prepare"]  # imported inside load_checked
