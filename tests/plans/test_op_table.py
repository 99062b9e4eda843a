"""The op table (`overlap.plans.optable`) and the workloads (`overlap.workloads`): every entry consistent with
itself and with its workload, seeded inputs that every rank can regenerate, an op added by one entry, and no
switch on op names anywhere else in the code."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from overlap.ops.tp.entry import tp_problem
from overlap.plans import OPS, Plan, Problem, costmodel, op_spec, ops_of
from overlap.workloads import WORKLOADS, SeededDraw, workload

ROOT = Path(__file__).resolve().parents[2]


def _problem(op: str, backward: bool, world_size: int) -> Problem:
    moe = OPS[op].family == "moe"
    return Problem(op, 6, 10, 14, "float32", backward, 2 * world_size if moe else 0, 2 if moe else 0)


def _topology(world_size: int) -> costmodel.Topology:
    if world_size == 1:
        return costmodel.Topology("cpu", 1, 1, 1, ())
    first, second = (world_size + 1) // 2, world_size // 2  # two nodes; this rank on the first
    links = tuple((c, n) for c, n in (("shm", first - 1), ("network", second)) if n)
    return costmodel.Topology("cpu", world_size, 2, (first, second), links)


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("backward", [False, True])
def test_every_entry_agrees_with_itself(op, world_size, backward):
    """Inputs of the rows the entry states, an oracle of the output's shape, bytes per link that add up
    to the bytes, an ``m`` recovered from the input's rows, no chunking under reference."""
    spec, work, p = op_spec(op), workload(op), _problem(op, backward, world_size)
    draw = SeededDraw(5, 0, "cpu", torch.float32)
    every = [work.inputs(p, world_size, draw.for_rank(q)) for q in range(world_size)]
    for q, inputs in enumerate(every):
        a = inputs.leaves[0]
        assert a.shape == (spec.in_rows(p.m, world_size), spec.in_cols(p.k, world_size)), (op, q, a.shape)
        assert spec.rows_per_rank(a.shape[0], world_size) == p.m
        assert (inputs.grad_out is not None) == backward
        if backward:
            cols = spec.out_cols(p.n, world_size) if spec.family != "moe" else p.k
            assert inputs.grad_out.shape == (spec.out_rows(p.m, world_size), cols)
    expected = work.oracle(p, every, world_size - 1)
    out = expected[0]
    assert out.what == "out" and out.value.shape[0] == spec.out_rows(p.m, world_size), (op, out.value.shape)
    if spec.family != "moe":
        assert out.value.shape[1] == spec.out_cols(p.n, world_size), (op, out.value.shape)
    assert [e.what for e in expected[1:]] == ([f"grad_{n}" for n in ("a", "b")] if spec.family != "moe" else
                                              ["grad_x", "grad_w1", "grad_w2", "grad_topk_weights"])[:len(expected) - 1]
    assert len(expected) == (1 + len(every[0].leaves) if backward else 1)
    for e, leaf in zip(expected[1:], every[-1].leaves):
        assert e.value.shape == leaf.shape, (op, e.what, e.value.shape, leaf.shape)
    topology = _topology(world_size)
    assert sum(spec.bytes_per_link(p, topology).values()) == spec.comm_bytes(p, world_size)
    assert spec.flops(p, world_size) > 0 and spec.chunked("reference", backward, topology) == ()
    assert spec.rows_per_rank(spec.in_rows(p.m, world_size) + 1, world_size) in (None, p.m + 1)


def test_every_op_has_one_workload():
    """The table and the workloads name the same ops, in the same order."""
    assert list(WORKLOADS) == list(OPS) and all(w.name == name for name, w in WORKLOADS.items())


@pytest.mark.exact
def test_seeded_draws_are_per_rank_and_reproducible():
    """Any rank regenerates any rank's tensors; ``shared`` ones are the same on every rank."""
    d0, d1 = SeededDraw(3, 0, "cpu", torch.float32), SeededDraw(3, 1, "cpu", torch.float32)
    assert torch.equal(d0.fp32("a", 4, 5), d1.for_rank(0).fp32("a", 4, 5))
    assert not torch.equal(d0.fp32("a", 4, 5), d1.fp32("a", 4, 5))
    assert not torch.equal(d0.fp32("a", 4, 5), d0.fp32("b", 4, 5))
    assert torch.equal(d0.fp32("g", 7, shared=True), d1.fp32("g", 7, shared=True))
    assert d0.normal("a", 3, 3, scale=0.5).dtype == torch.float32
    assert SeededDraw(3, 0, "cpu", torch.bfloat16).normal("a", 2).dtype == torch.bfloat16
    p = _problem("matmul_all_reduce", True, 2)  # a replicated output: one gradient on every rank
    g0, g1 = (workload(p.op).inputs(p, 2, d).grad_out for d in (d0, d1))
    assert torch.equal(g0, g1)


def test_an_op_is_added_by_one_entry(monkeypatch):
    """A new entry (here a renamed copy of all_gather_matmul) is a Problem, a plan file key, a prediction,
    a candidate list and ``auto``'s problem of a call, with no other code changed."""
    twin = dataclasses.replace(OPS["all_gather_matmul"], name="twin_gather_matmul")
    monkeypatch.setitem(OPS, "twin_gather_matmul", twin)
    p, q = Problem("twin_gather_matmul", 8, 16, 24), Problem("all_gather_matmul", 8, 16, 24)
    assert p.key.startswith("twin_gather_matmul:8x16x24") and "twin_gather_matmul" in ops_of("tp")
    topology, profile = _topology(4), costmodel.default_profile("cpu")
    assert costmodel.candidates(p, topology) == costmodel.candidates(q, topology)
    for plan in costmodel.candidates(p, topology):
        assert costmodel.predict(p, plan, topology, profile) == costmodel.predict(q, plan, topology, profile)
    a, b = torch.zeros(16, 16), torch.zeros(16, 24)
    assert tp_problem("twin_gather_matmul", 16, a, b, 2) == Problem("twin_gather_matmul", 16, 16, 24)
    with pytest.raises(ValueError, match="one_shot applies only to matmul_all_reduce"):
        costmodel.predict(p, Plan("symm", one_shot=True), topology, profile)


# ----------------------------------------------------------------------------------------------
# No switch on op names outside the table and the ops' own modules
# ----------------------------------------------------------------------------------------------

#: where an op's name may be compared or keyed: the table, its families' functions, the op modules, the
#: workloads (one per op, keyed by its name); and
#: the GPU check's timings, which time each op's kernels on the op's problems of a real model
OWNERS = {"overlap/plans/optable.py", "overlap/plans/tp_ops.py", "overlap/plans/moe_op.py", "tests/gpu/timings.py",
          "overlap/workloads/__init__.py", "overlap/workloads/tp.py", "overlap/workloads/moe.py",
          # the package's export list and the command line's torch-free mirror of the table (checked
          # against OPS where the torch side loads): lists of names, not switches on them
          "overlap/__init__.py", "overlap/benchmarks/names.py"}


def _switches(path: Path, names: set[str]) -> list[str]:
    """Comparisons with an op's name and dict keys that are one (a comparison with a family is not a
    switch on names: ``spec.family == "moe"``)."""
    out, where = [], path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        found = []
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(isinstance(s, ast.Attribute) and s.attr == "family" or isinstance(s, ast.Name) and s.id == "family"
                   for s in sides):
                continue
            found = [c.value for s in sides for c in ast.walk(s) if isinstance(c, ast.Constant) and c.value in names]
        elif isinstance(node, ast.Dict):
            found = [k.value for k in node.keys if isinstance(k, ast.Constant) and k.value in names]
        out += [f"{where}:{node.lineno}: {v!r}" for v in found]
    return out


def test_no_switch_on_op_names_outside_the_table():
    names = set(OPS)
    gpu_check = [ROOT / "tests" / "gpu" / f"{name}.py" for name in ("check", "preflight", "timings")]
    files = [p for p in sorted([*ROOT.glob("overlap/**/*.py"), *ROOT.glob("kernels/*.py"), *ROOT.glob("bench/**/*.py"),
                                *gpu_check])
             if str(p.relative_to(ROOT)) not in OWNERS and not str(p.relative_to(ROOT)).startswith("overlap/ops/")]
    found = [line for path in files for line in _switches(path, names)]
    assert not found, "switches on op names outside the op table:\n" + "\n".join(found)


def test_the_switch_finder_finds_one(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text('def f(op, spec):\n    if op == "matmul_all_reduce":\n        return {"moe": 1}\n'
                    '    return spec.family == "moe"\n')
    found = _switches(path, set(OPS))
    assert [f.split(": ")[1] for f in found] == ["'matmul_all_reduce'", "'moe'"], found


@pytest.mark.parametrize("op", list(OPS))
def test_a_float64_oracle_stays_float64(op):
    """On float64 inputs the oracles' sums over ranks and experts stay float64 (the GPU check's reference):
    a sum in fp32 would differ from the float64 sum by ~1e-7."""
    p = dataclasses.replace(_problem(op, True, 3), dtype="float64")
    draw = SeededDraw(11, 0, "cpu", torch.float64)
    every = [workload(op).inputs(p, 3, draw.for_rank(q)) for q in range(3)]
    expected = workload(op).oracle(p, every, 1)
    assert all(e.value.dtype == torch.float64 for e in expected), [(e.what, e.value.dtype) for e in expected]
    if op_spec(op).family == "tp":  # out against the plain float64 sum of every rank's partial
        if op == "all_gather_matmul":
            want = torch.cat([e.leaves[0] for e in every]) @ every[1].leaves[1]
        elif op == "all_gather_weight_matmul":
            want = every[1].leaves[0] @ torch.cat([e.leaves[1] for e in every], dim=1)
        else:
            rows = slice(p.m, 2 * p.m) if op == "matmul_reduce_scatter" else slice(None)
            want = sum(e.leaves[0][rows] @ e.leaves[1] for e in every)
        torch.testing.assert_close(expected[0].value, want, rtol=1e-13, atol=1e-13)



def test_an_op_without_a_strategy_never_gets_it(monkeypatch):
    """An entry's `OpSpec.strategies`: the cost model predicts inf for the others, candidates leave them out,
    ``auto``'s heuristic turns them into symm (here where it would pick fused) and forcing one raises."""
    from overlap.plans import auto
    from overlap.world import GroupInfo

    op = "twin_without_fused"
    twin = dataclasses.replace(OPS["all_gather_weight_matmul"], name=op, strategies=("reference", "pipelined", "symm"))
    monkeypatch.setitem(OPS, op, twin)
    p = Problem(op, 256, 64, 32, "bfloat16")
    topology = costmodel.Topology("cuda", 4, 1, (4,), (("nvlink", 3),))
    assert all(plan.strategy != "fused" for plan in costmodel.candidates(p, topology))
    assert costmodel.predict(p, Plan("fused"), topology, costmodel.default_profile("cuda")).total_s == float("inf")
    info = GroupInfo(0, 4, (0, 1, 2, 3), ("n",) * 4, (1, 2, 3, 4), "nccl", torch.device("cuda", 0), (True,) * 4)
    monkeypatch.setattr(auto, "gpu_symmetric_memory", lambda: True)
    monkeypatch.delenv("OVERLAP_PLAN", raising=False)
    assert auto.resolve_auto("all_gather_matmul", "sig", info, 256, "bfloat16").strategy == "fused"
    assert auto.resolve_auto(op, "sig", info, 256, "bfloat16").strategy == "symm"
    with pytest.raises(ValueError, match="not implemented for this op"):
        auto.fit_plan(op, Plan("fused"), info)


# ----------------------------------------------------------------------------------------------
# One name per op across the layers
# ----------------------------------------------------------------------------------------------

#: the public functions of the MoE op modules (`overlap.ops.moe.dispatch`, `overlap.ops.moe.combine`)
MOE_OPS = {"dispatch": ("dispatch", "dispatch_grouped_matmul"), "combine": ("combine", "grouped_matmul_combine")}


def _top_functions(path: Path) -> list[str]:
    return [n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)]


def test_one_name_per_op_across_layers():
    """A TP op of the table is its op module (`overlap/ops/tp/<op>.py`, defining the public function), its
    workload and its custom op; every kernel file but the shared ones is named for the op whose fused form it
    holds (a TP or sequence-parallel op of the table, or the MoE grouped-GEMM op), and every ``launch_*`` lives in
    such a file."""
    import overlap
    import overlap.moe

    for name in ops_of("tp"):
        assert name in _top_functions(ROOT / "overlap" / "ops" / "tp" / f"{name}.py"), name
        assert getattr(overlap, name).__module__ == f"overlap.ops.tp.{name}", name
        assert name in WORKLOADS and hasattr(torch.ops.overlap, name), name
    for module, functions in MOE_OPS.items():
        defined = _top_functions(ROOT / "overlap" / "ops" / "moe" / f"{module}.py")
        assert all(f in defined and getattr(overlap.moe, f).__module__ == f"overlap.ops.moe.{module}"
                   for f in functions), (module, defined)
    op_names = set(ops_of("tp")) | set(ops_of("sp")) | {f for functions in MOE_OPS.values() for f in functions}
    shared = {"__init__", "host", "flags", "compat", "slots", "all_to_all"}
    launchers, tile_tables = {}, {}
    for path in sorted((ROOT / "kernels").glob("*.py")):
        for fn in _top_functions(path):
            if fn.startswith("launch_"):
                launchers[fn] = path.stem
            if fn.endswith("_tile_table"):
                tile_tables[fn] = path.stem
        if path.stem not in shared:
            assert path.stem in op_names, f"kernels/{path.name} is named for no op"
            assert any(fn.startswith("launch_") for fn in _top_functions(path)), f"kernels/{path.name}: no launcher"
    misplaced = {fn: where for fn, where in launchers.items() if where not in op_names}
    assert launchers and not misplaced, f"launchers outside their op's kernel file: {misplaced}"
    # the launch data beside its launcher: each tile table in the kernel file of its op, none under ops/
    assert tile_tables == {"dispatch_tile_table": "dispatch_grouped_matmul",
                           "combine_tile_table": "grouped_matmul_combine"}, tile_tables
    elsewhere = [str(p.relative_to(ROOT)) for p in (ROOT / "overlap").rglob("*.py")
                 if any(fn.endswith("_tile_table") or fn in ("header_bytes", "region_stride", "region_bytes")
                        for fn in _top_functions(p))]
    assert not elsewhere, f"launch data outside kernels/: {elsewhere}"
