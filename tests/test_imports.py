"""The imports of vlfuse run one way: no circle, no module below the command line imports it, and
each layer of the package imports only the layers beneath it (docs/api.md, "Layout").

Every ``import`` in every module counts, also those inside functions (they are imports all the same,
only later) and those under ``TYPE_CHECKING``.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "vlfuse"

LAYERS = [
    ("vlfuse", "vlfuse.errors", "vlfuse.parts", "vlfuse.runtime", "vlfuse.commands"),
    ("vlfuse.layers", "vlfuse.data", "vlfuse.model_io", "vlfuse.model_card", "vlfuse.hub", "vlfuse.metrics"),
    ("vlfuse.encoders", "vlfuse.datamodules", "vlfuse.baselines", "vlfuse.captioning.grammar", "vlfuse.captioning.metrics"),
    ("vlfuse.fusers", "vlfuse.heads", "vlfuse.processor"),
    ("vlfuse.model",),
    ("vlfuse.captioning", "vlfuse.baselines.hf_caption"),  # the caption peer is built from a caption config
    ("vlfuse.lit", "vlfuse.inference", "vlfuse.analysis", "vlfuse.callbacks", "vlfuse.resume", "vlfuse.captioning.lit"),
    ("vlfuse.commands.",),  # the subcommands' modules (``vlfuse.commands`` itself only names them)
    ("vlfuse.cli",),
]
"""From the bottom up: a module may import its own layer's modules and the layers below, never above."""


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str) -> set[str]:
    """The vlfuse modules that module ``name`` imports (``from pkg import sub`` counts as ``pkg.sub``)."""
    tree = ast.parse(MODULES[name].read_text(), filename=str(MODULES[name]))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "vlfuse")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vlfuse":
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names if f"{node.module}.{alias.name}" in MODULES)
    return {target for target in found if target in MODULES and target != name}


GRAPH = {name: imports_of(name) for name in MODULES}


def rank(name: str) -> int:
    """The layer of module ``name``: its most specific entry in :data:`LAYERS`."""
    best = None
    for level, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            matches = name == prefix or name.startswith(prefix if prefix.endswith(".") else prefix + ".")
            if matches and (best is None or len(prefix) > best[0]):
                best = (len(prefix), level)
    assert best is not None, f"{name} is in no layer of LAYERS: add it"
    return best[1]


def test_every_module_is_in_a_layer():
    for name in MODULES:
        rank(name)


def test_no_module_imports_a_layer_above_its_own():
    upward = sorted(
        f"{name} (layer {rank(name)}) imports {target} (layer {rank(target)})"
        for name, targets in GRAPH.items()
        for target in targets
        if rank(target) > rank(name)
    )
    assert not upward, "\n".join(upward)


def test_no_import_circle():
    """Tarjan's strongly connected components: every component is a single module."""
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(GRAPH[node]):
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

    for node in sorted(GRAPH):
        if node not in index:
            visit(node)
    assert not circles, f"import circles: {circles}"


@pytest.mark.parametrize("command_line", ["vlfuse.cli", "vlfuse.commands.lightning", "vlfuse.commands.predict"])
def test_nothing_below_the_command_line_imports_it(command_line):
    importers = sorted(name for name, targets in GRAPH.items() if command_line in targets and rank(name) < rank(command_line))
    assert not importers, f"{command_line} is imported by {importers}"


def test_the_walk_sees_imports_inside_functions_too():
    """The check would be empty if the walk missed what it looks for: cli imports vlfuse.commands at
    the top, and vlfuse.model imports vlfuse.model_io."""
    assert "vlfuse.commands" in GRAPH["vlfuse.cli"]
    assert "vlfuse.model_io" in GRAPH["vlfuse.model"]
    assert rank("vlfuse.commands") == 0 and rank("vlfuse.commands.predict") == 7
