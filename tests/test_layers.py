"""The package's layers (docs/design.md), checked on the source: every import goes down, no new cycles.

Every ``import`` and ``from ... import`` of every module of ``overlap/`` and ``kernels/`` (installed as
``overlap.kernels``) is read with `ast`, those inside functions (lazy imports) included, and resolved to
the module it names. A module may import its own layer or the layers below it, never one above; within a
layer the imports form no cycle, except an op and the op that is its backward (their autograd functions
call each other).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: bottom to top; a module belongs to the first layer one of whose prefixes it starts with ("=": exactly that
#: module). The package's ``__init__`` (the public namespace) sits at the top with the command line, which
#: reads ``overlap.__file__`` for ``overlap info``.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("facts", ("overlap.envs", "overlap.errors", "overlap.version")),
    ("world", ("overlap.world", "overlap.shm", "overlap.pool")),
    ("signals", ("overlap._C",)),
    ("comm", ("overlap.comm",)),
    ("symmetric memory", ("overlap.symm",)),
    ("plans", ("overlap.plans",)),
    ("kernels", ("overlap.kernels",)),
    ("ops", ("overlap.ops", "overlap.moe")),
    ("tuning, modules, hooks, benchmarks", ("overlap.tune", "overlap.nn", "overlap.hooks", "overlap.benchmarks")),
    ("command line, and the package's own namespace", ("overlap.cli", "=overlap")),
]

#: the only cycles allowed: an op and its backward's op
ALLOWED_CYCLES = [
    {"overlap.ops.all_gather_matmul", "overlap.ops.matmul_reduce_scatter"},
    {"overlap.ops.moe_dispatch", "overlap.ops.moe_combine"},
]


def _modules() -> dict[str, Path]:
    """Module name -> file, for overlap/ and kernels/ (as overlap.kernels)."""
    found = {}
    for base, package in ((ROOT / "overlap", "overlap"), (ROOT / "kernels", "overlap.kernels")):
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES.get(name, Path()).name == "__init__.py"


def _imports(name: str, path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every import of `name` that names a module of this project."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if _is_package(name) else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:  # `from X import name`: the submodule X.name where there is one
                sub = f"{target}.{alias.name}"
                out.append((node.lineno, sub if sub in MODULES or sub == "overlap._C" else target))
    return [(line, mod) for line, mod in out if mod == "overlap" or mod.startswith("overlap.")]


def _layer(module: str) -> int:
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(module == p.lstrip("=") or (p[0] != "=" and module.startswith(p + ".")) for p in prefixes):
            return i
    raise AssertionError(f"{module} belongs to no layer: add it to LAYERS")


GRAPH = {name: sorted({mod for _, mod in _imports(name, path) if mod != name}) for name, path in MODULES.items()}


def test_every_module_has_a_layer():
    for name in MODULES:
        _layer(name)


def _upward(name: str, path: Path) -> list[str]:
    """The imports of module `name` (source `path`) that go up a layer."""
    return [f"{path}:{line}: {name} ({LAYERS[_layer(name)][0]}) imports {target} ({LAYERS[_layer(target)][0]})"
            for line, target in _imports(name, path) if target != name and _layer(target) > _layer(name)]


def test_imports_go_down():
    upward = [line for name, path in MODULES.items() for line in _upward(name, path)]
    assert not upward, "imports that go up a layer:\n" + "\n".join(upward)


def _cycles(graph: dict[str, list[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module of `graph` (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, []):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_cycles_but_an_op_and_its_backward():
    unexpected = [sorted(c) for c in _cycles(GRAPH) if c not in ALLOWED_CYCLES]
    assert not unexpected, f"import cycles: {unexpected}"


@pytest.mark.parametrize("source, expected", [
    ("from ..ops import context\n", "overlap.ops.context"),
    ("from .. import symm\n", "overlap.symm"),
    ("from ..plans import Plan\n", "overlap.plans"),
    ("import overlap.world\n", "overlap.world"),
])
def test_the_checker_resolves_imports(tmp_path, source, expected):
    """The walk itself: relative and absolute imports resolve to modules (a broken resolver passes anything)."""
    path = tmp_path / "probe.py"
    path.write_text("def f():\n    " + source)  # a lazy import, inside a function
    assert (2, expected) in _imports("overlap.tune.search", path)


def test_the_checker_rejects_an_upward_import_and_a_cycle(tmp_path):
    """The checks themselves, on a planted violation: symmetric memory importing the ops (lazily) is
    reported, a downward import is not, and a two-module cycle is found."""
    path = tmp_path / "layout.py"
    path.write_text("from .. import world\n\n\ndef f():\n    from ..ops import context\n")
    found = _upward("overlap.symm.layout", path)
    assert len(found) == 1 and "imports overlap.ops.context (ops)" in found[0], found
    assert _cycles({"a": ["b"], "b": ["a", "c"], "c": []}) == [{"a", "b"}]
