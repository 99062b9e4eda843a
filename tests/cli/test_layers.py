"""The package's layers (docs/design.md), checked on the source: every import goes down, no new cycles,
every import names something that exists, and the scripts of ``bench/`` and the GPU check use no private module or name.

Every ``import`` and ``from ... import`` of every module of ``overlap/`` and ``kernels/`` (installed as
``overlap.kernels``) is read with `ast`, those inside functions (lazy imports) included, and resolved to
the module it names. A module may import its own layer or the layers below it, never one above; within a
layer the imports form no cycle. Inside the ops layer: the families (``overlap.ops.tp``, ``overlap.ops.moe``)
never import each other, no public op module imports another (what two ops share lives in a module both
import), and nothing is imported inside a function but the optional accelerators (Triton's kernels, the
compiled extension).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: bottom to top; a module belongs to the first layer one of whose prefixes it starts with ("=": exactly that
#: module). The package's ``__init__`` (the public namespace) sits at the top with the command line, which
#: reads ``overlap.__file__`` for ``overlap info``.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("facts", ("overlap.envs", "overlap.errors", "overlap.logs", "overlap.links", "overlap.lazy", "overlap.version",
               "overlap.stages")),
    ("world", ("overlap.world", "overlap.rendezvous", "overlap.shm", "overlap.lifetime", "overlap.pool")),
    ("signals", ("overlap._C", "overlap.signals")),
    ("comm", ("overlap.comm",)),
    ("symmetric memory", ("overlap.symm",)),
    ("plans", ("overlap.plans",)),
    ("kernels", ("overlap.kernels",)),
    ("ops", ("overlap.ops", "overlap.moe")),
    ("workloads", ("overlap.workloads",)),
    ("tuning, modules, hooks, benchmarks, demo",
     ("overlap.tune", "overlap.nn", "overlap.hooks", "overlap.benchmarks", "overlap.demo", "overlap.progress")),
    ("command line, and the package's own namespace", ("overlap.cli", "=overlap")),
]

#: the public op modules: each defines the custom ops of its public functions and their autograd
OP_MODULES = ("overlap.ops.tp.all_gather_matmul", "overlap.ops.tp.matmul_reduce_scatter",
              "overlap.ops.tp.matmul_all_reduce", "overlap.ops.tp.all_gather_weight_matmul", "overlap.ops.moe.dispatch",
              "overlap.ops.moe.combine", "overlap.ops.sp.matmul_all_to_all", "overlap.ops.sp.all_to_all_matmul")
#: what a module of overlap/ops may import inside a function: the optional accelerators
LAZY_ALLOWED = ("overlap.kernels", "overlap.signals", "overlap._C")


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


def _annotation_only(tree: ast.Module) -> set[int]:
    """The ids of the import nodes under ``if TYPE_CHECKING:``: names for annotations, never imported at run time."""
    found = set()
    for node in ast.walk(tree):
        test = getattr(node, "test", None)
        if isinstance(node, ast.If) and (getattr(test, "id", None) == "TYPE_CHECKING"
                                         or getattr(test, "attr", None) == "TYPE_CHECKING"):
            found |= {id(n) for stmt in node.body for n in ast.walk(stmt)
                      if isinstance(n, (ast.Import, ast.ImportFrom))}
    return found


def _imports(name: str, path: Path, annotations: bool = True) -> list[tuple[int, str]]:
    """``(line, module)`` of every import of `name` that names a module of this project (without `annotations`:
    only those made at run time, not the ``if TYPE_CHECKING:`` ones)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if _is_package(name) else name.rpartition(".")[0]
    skip = set() if annotations else _annotation_only(tree)
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
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
#: the imports made at run time: a module and the type of its owner may name each other in annotations
#: (``if TYPE_CHECKING:``), which is no cycle
RUN_TIME_GRAPH = {name: sorted({mod for _, mod in _imports(name, path, annotations=False) if mod != name})
                  for name, path in MODULES.items()}


def test_demo_is_imported_only_by_the_command_line():
    """``overlap.demo`` (the model and training of ``overlap demo``) is no library: only ``overlap.cli`` uses it."""
    users = [name for name, deps in GRAPH.items() if not name.startswith(("overlap.demo", "overlap.cli"))
             and any(d == "overlap.demo" or d.startswith("overlap.demo.") for d in deps)]
    assert not users, f"modules outside the command line import overlap.demo: {users}"


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


def test_no_cycles():
    assert not _cycles(RUN_TIME_GRAPH), f"import cycles: {[sorted(c) for c in _cycles(RUN_TIME_GRAPH)]}"


def test_families_and_op_modules_import_no_sibling():
    """The families (``overlap.ops.tp``, ``overlap.ops.moe``, ``overlap.ops.sp``) never import each other; no public op
    module imports another."""
    found = []
    families = ("overlap.ops.tp", "overlap.ops.moe", "overlap.ops.sp")
    for name, deps in GRAPH.items():
        for family in families:
            if name.startswith(family + "."):
                for other in (f for f in families if f != family):
                    found += [f"{name} imports {d}" for d in deps if d == other or d.startswith(other + ".")]
        if name in OP_MODULES:
            found += [f"{name} imports the op module {d}" for d in deps if d in OP_MODULES]
    assert not found, "\n".join(found)


def _lazy_imports(name: str, path: Path) -> list[tuple[int, str]]:
    """The imports of module `name` made inside a function (``(line, module)``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    lines = {n.lineno for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return [(line, mod) for line, mod in _imports(name, path) if line in lines]


def test_ops_import_nothing_lazily_but_the_accelerators():
    found = [f"{MODULES[name]}:{line}: {name} imports {mod} inside a function"
             for name in MODULES if name.startswith("overlap.ops.")
             for line, mod in _lazy_imports(name, MODULES[name])
             if not any(mod == a or mod.startswith(a + ".") for a in LAZY_ALLOWED)]
    assert not found, "\n".join(found)


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
    assert _lazy_imports("overlap.symm.layout", path) == [(5, "overlap.ops.context")]


# ----------------------------------------------------------------------------------------------
# Every import names something that exists (a lazy import of a missing module fails only when run)
# ----------------------------------------------------------------------------------------------


def _bound_names(path: Path) -> set[str]:
    """The names a module binds at its top level (definitions, assignments, imports)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.If, ast.Try)):  # names bound under a guard count too
            names.update(_bound_names_of(node))
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and "_LAZY" in _targets(node):
            names.update(_lazy_names(node))
    return names


def _targets(node: ast.Assign | ast.AnnAssign) -> set[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return {t.id for t in targets if isinstance(t, ast.Name)}


def _lazy_names(node: ast.Assign | ast.AnnAssign) -> set[str]:
    """The public names of a package that imports them on first use (PEP 562): the keys of its ``_LAZY`` table
    (a literal, with ``dict.fromkeys`` for names of one submodule)."""
    table = eval(compile(ast.Expression(node.value), "<_LAZY>", "eval"), {"__builtins__": {}, "dict": dict})
    return set(table)


def _bound_names_of(node: ast.AST) -> set[str]:
    names: set[str] = set()
    for sub in ast.walk(node):
        if isinstance(sub, (ast.FunctionDef, ast.ClassDef)):
            names.add(sub.name)
        elif isinstance(sub, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in sub.names)
        elif isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
            names.add(sub.id)
    return names


def _missing(name: str, path: Path) -> list[str]:
    """``from X import y`` in module `name` where X is a module of this project that has no submodule and
    binds no name ``y`` (``overlap._C``, the compiled extension, is taken as it is)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if _is_package(name) else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = package.split(".")
            target = ".".join(base[: len(base) - (node.level - 1)] + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        if target == "overlap._C" or not (target == "overlap" or target.startswith("overlap.")):
            continue
        if target not in MODULES:
            out.append(f"{path}:{node.lineno}: {name} imports from {target}, which does not exist")
            continue
        bound = _bound_names(MODULES[target])
        out += [f"{path}:{node.lineno}: {name} imports {alias.name} from {target}, which has no such name"
                for alias in node.names
                if alias.name != "*" and f"{target}.{alias.name}" not in MODULES
                and not (target == "overlap" and alias.name == "_C") and alias.name not in bound]
    return out


def test_every_import_exists():
    missing = [line for name, path in MODULES.items() for line in _missing(name, path)]
    assert not missing, "imports of things that do not exist:\n" + "\n".join(missing)


def test_the_checker_finds_a_missing_import(tmp_path):
    """A lazy ``from . import _C`` inside ``plans/`` names ``overlap.plans._C``, which does not exist."""
    path = tmp_path / "auto.py"
    path.write_text("from .plan import Plan\n\n\ndef f():\n    from . import _C\n    from .. import signals\n")
    found = _missing("overlap.plans.auto", path)
    assert len(found) == 1 and "imports _C from overlap.plans" in found[0], found


# ----------------------------------------------------------------------------------------------
# bench/ uses the package's layers, never a private module or name
# ----------------------------------------------------------------------------------------------


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_uses(path: Path) -> list[str]:
    """Imports of a private module or name of `overlap` in script `path`, and private attributes read from
    a name it imported from `overlap`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out, bound = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "overlap":
                    bound.add(alias.asname or "overlap")
                    if any(_private(p) for p in alias.name.split(".")):
                        out.append(f"{path}:{node.lineno}: imports {alias.name}")
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "overlap":
            for alias in node.names:
                bound.add(alias.asname or alias.name)
                if any(_private(p) for p in [*node.module.split("."), alias.name]):
                    out.append(f"{path}:{node.lineno}: imports {alias.name} from {node.module}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name) \
                and node.value.id in bound:
            out.append(f"{path}:{node.lineno}: reads {node.value.id}.{node.attr}")
    return out


def test_bench_uses_no_private_module_or_name():
    """The scripts of bench/ (its packages included) and the GPU check's (tests/gpu: check, preflight, timings)."""
    gpu_check = [ROOT / "tests" / "gpu" / f"{name}.py" for name in ("check", "preflight", "timings")]
    found = [line for path in sorted([*(ROOT / "bench").glob("**/*.py"), *gpu_check]) for line in _private_uses(path)]
    assert not found, "bench/ and the GPU check reach into private parts of overlap:\n" + "\n".join(found)


def test_the_checker_finds_private_uses_in_a_script(tmp_path):
    path = tmp_path / "script.py"
    path.write_text("import torch._dynamo\nfrom overlap import _C, symm\nfrom overlap.ops.moe.layout import MoELayout\n"
                    "from overlap.ops import _gather\n\n\ndef f():\n    return symm._HEAPS, symm.heap_for, torch._C\n")
    found = _private_uses(path)
    assert len(found) == 3 and "_C" in found[0] and "_gather" in found[1] and "symm._HEAPS" in found[2], found
