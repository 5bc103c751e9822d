"""The package's structure, checked from its source (no import runs): imports point one way (no
module of cupyflash imports, at any depth or lazily, a module that imports it back), and no module
reaches into another's private names (``_x._name`` or ``from ._x import _name``)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "cupyflash"


def _modules() -> dict[str, ast.Module]:
    trees = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        trees[name.removesuffix(".__init__")] = ast.parse(path.read_text(), str(path))
    return trees


def _resolve(module: str, node: ast.ImportFrom) -> str:
    base = module.split(".")
    package = base if module in _PACKAGES else base[:-1]
    if node.level:
        package = package[: len(package) - node.level + 1]
    return ".".join([*package, *(node.module.split(".") if node.module else [])])


TREES = _modules()
_PACKAGES = {name for name in TREES if (PACKAGE.parent / name.replace(".", "/") / "__init__.py").exists()}


def _imports(module: str, tree: ast.Module) -> dict[str, set[str]]:
    """The cupyflash modules ``module`` imports, each with the names it takes from it."""
    found: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = _resolve(module, node) if node.level else (node.module or "")
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in TREES:
                    found.setdefault(sub, set())
                elif target in TREES:
                    found.setdefault(target, set()).add(alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in TREES:
                    found.setdefault(alias.name, set())
    found.pop(module, None)
    return found


GRAPH = {module: _imports(module, tree) for module, tree in TREES.items()}
# The package's face and the tools above the library: they import the library, nothing imports them.
_FACES = {"cupyflash", "cupyflash.integrations"}


def _cycle_from(start: str) -> list[str] | None:
    stack, seen = [(start, [start])], set()
    while stack:
        node, path = stack.pop()
        for nxt in GRAPH.get(node, {}):
            if nxt in _FACES:
                continue
            if nxt == start:
                return [*path, start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, [*path, nxt]))
    return None


def test_no_import_cycle():
    cycles = [cycle for module in GRAPH if module not in _FACES if (cycle := _cycle_from(module))]
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_module_reaches_into_another_s_private_names():
    reached = []
    for module, tree in TREES.items():
        imported = GRAPH[module]
        for target, names in imported.items():
            private = (n for n in names if n.startswith("_") and n != "__version__")
            reached += [f"{module}: from {target} import {n}" for n in private]
        aliases = {t.rsplit(".", 1)[-1]: t for t in imported}
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                reached.append(f"{module}: {node.value.id}.{node.attr}")
    assert not reached, "private names used across modules: " + ", ".join(sorted(set(reached)))


def test_the_check_sees_imports():
    """The checks above read real arrows: the public API's module imports the front door."""
    assert "cupyflash._front" in GRAPH["cupyflash._api"]
    assert "cupyflash._interop" in GRAPH["cupyflash._front"]
