"""The package's import structure: runtime layers only import downwards, and no module imports itself back.

Layers, lowest first: foundation (validation, errors, registries, plugins), kernels, layers, attention, models,
strategies and samplers, configuration, engine, front ends (docs/architecture.md, "Layers"). An import counts
wherever it is written (module level or inside a function); ``if TYPE_CHECKING:`` imports are annotations only and
do not count.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "diffulex"

# Module prefix -> layer; the longest matching prefix decides.
LAYERS: dict[str, int] = {
    "diffulex.errors": 0,
    "diffulex.validation": 0,
    "diffulex.registry": 0,
    "diffulex.plugins": 0,
    "diffulex.checkpoint_folder": 0,
    "diffulex.sampling_params": 0,
    "diffulex.yaml_file": 0,
    "diffulex.kernels": 1,
    "diffulex.attention.metadata": 1,  # the step layout the kernels read: a data description, no attention code
    "diffulex.layers": 2,
    "diffulex.lora": 2,
    "diffulex.attention": 3,
    "diffulex.models": 4,
    "diffulex.sampler": 5,
    "diffulex.strategy": 5,
    "diffulex.config": 6,
    "diffulex.engine": 7,
    "diffulex.outputs": 7,
    "diffulex.tokenizer": 7,
    "diffulex.prompts": 7,
    "diffulex": 8,  # the package's front door, the CLI, chat, server, bench, train, testing
}
LAYER_NAMES = ("foundation", "kernels", "layers", "attention", "models", "strategy", "config", "engine", "front end")


def module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


MODULES = module_names()


def owning_module(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(path: Path) -> set[str]:
    """The package modules ``path`` imports (``from a.b import c`` counts as ``a.b.c`` when that is a module)."""
    found: set[str] = set()

    class Visitor(ast.NodeVisitor):
        def visit_If(self, node: ast.If) -> None:
            if "TYPE_CHECKING" in ast.unparse(node.test):
                for child in node.orelse:
                    self.visit(child)
                return
            self.generic_visit(node)

        def visit_Import(self, node: ast.Import) -> None:
            found.update(alias.name for alias in node.names if alias.name.startswith("diffulex"))

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            if node.level == 0 and node.module and node.module.startswith("diffulex"):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    found.add(full if full in MODULES else node.module)

    Visitor().visit(ast.parse(path.read_text()))
    return {m for m in (owning_module(name) for name in found) if m is not None}


GRAPH = {name: imports_of(path) - {name} for name, path in MODULES.items()}


def layer_of(module: str) -> int:
    prefix = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[prefix]


def test_every_import_goes_to_the_same_layer_or_a_lower_one():
    upward = [
        f"{module} ({LAYER_NAMES[layer_of(module)]}) imports {target} ({LAYER_NAMES[layer_of(target)]})"
        for module, targets in sorted(GRAPH.items())
        for target in sorted(targets)
        if layer_of(target) > layer_of(module)
    ]
    assert upward == []


def test_no_module_imports_itself_back_through_others():
    """Tarjan's strongly connected components of the module graph: each must be a single module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in GRAPH.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(GRAPH):
        if module not in index:
            visit(module)
    assert circles == []


def test_the_layer_table_covers_every_module():
    tops = defaultdict(list)
    for module in MODULES:
        tops[layer_of(module)].append(module)
    assert set(tops) == set(range(len(LAYER_NAMES)))


def test_the_engine_and_the_configuration_name_no_strategy_and_no_family():
    """They ask the strategy and the family (`Strategy`, `Family`) and never branch on a name: a string literal
    equal to a registered name (docstrings aside) would be such a branch or a list of names kept in two places."""
    from diffulex.models.family import FAMILIES
    from diffulex.strategy.strategy import STRATEGIES

    names = set(STRATEGIES.names()) | set(FAMILIES.names())
    found = []
    for module, path in MODULES.items():
        if not (module == "diffulex.config" or module.startswith("diffulex.engine")):
            continue
        tree = ast.parse(path.read_text())
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
        }  # fmt: skip
        found += [
            f"{module}:{node.lineno} {node.value!r}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and node.value in names and id(node) not in docstrings
        ]
    assert found == []
