"""The house has no cycles: gradcomp's import graph (every import statement, at module level or
inside a function, read with ast) is acyclic, and each layer imports only from below it:
cli -> fronts (hooks, fsdp, optim) -> schemes / comm -> methods -> payload, with the analyser
beside the fronts, used by them and the cli, using none of them."""
import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent / "gradcomp"
FRONTS = ("gradcomp.hooks", "gradcomp.fsdp", "gradcomp.optim", "gradcomp.integrations")
ENTRY = ("gradcomp.cli", "gradcomp.demo", "gradcomp.emulate", "gradcomp.published")


def _module_name(path: Path) -> str:
    parts = ("gradcomp",) + path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _imports(name: str, path: Path) -> set[str]:
    """The gradcomp modules ``name`` imports: ``from X import Y`` counts X.Y when that is a
    module, else X; importing a module also runs its packages' ``__init__`` (counted unless
    ``name`` sits inside that package)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")
            base = base[:len(base) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            targets = [f"{target}.{a.name}" if f"{target}.{a.name}" in MODULES else target for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:  # a name inside a module: the module
                target = target.rpartition(".")[0]
            while target:
                if target in MODULES and not _within(name, target):
                    found.add(target)
                target = target.rpartition(".")[0]
    found.discard(name)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def test_every_gradcomp_module_imports():
    for name in MODULES:
        if name != "gradcomp.integrations.lightning":  # needs lightning installed
            importlib.import_module(name)


def test_the_import_graph_has_no_cycle():
    """Depth-first search over the graph; a cycle is reported as the path that closes it."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == "open":
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(GRAPH):
        if node not in state:
            visit(node)


def _importers_of(layer: tuple[str, ...], by: str) -> dict[str, set[str]]:
    return {name: {t for t in targets if any(_within(t, p) for p in layer)}
            for name, targets in GRAPH.items() if _within(name, by)}


@pytest.mark.parametrize("lower, forbidden", [
    ("gradcomp.analysis", FRONTS + ENTRY),
    ("gradcomp.methods", FRONTS + ENTRY + ("gradcomp.analysis", "gradcomp.schemes", "gradcomp.comm")),
    ("gradcomp.schemes", FRONTS + ENTRY + ("gradcomp.analysis",)),
    ("gradcomp.consistency", FRONTS + ENTRY + ("gradcomp.analysis", "gradcomp.schemes")),
    ("gradcomp.comm", FRONTS + ENTRY + ("gradcomp.analysis", "gradcomp.schemes")),
    ("gradcomp.payload", ("gradcomp",)),
    ("gradcomp.checks", ("gradcomp",)),
    ("gradcomp.schedules", ("gradcomp",)),
])
def test_each_layer_imports_only_from_below(lower, forbidden):
    upward = {name: sorted(targets) for name, targets in _importers_of(forbidden, lower).items() if targets}
    assert upward == {}


def test_the_graph_sees_imports_inside_functions():
    """A function-level import counts (the analyser once imported the hooks inside a function)."""
    assert "gradcomp.hooks" in GRAPH["gradcomp.emulate.train"]  # ``from .. import hooks`` inside attach_hook
