"""The agreed search and plan files on CPU ranks: `tune` end to end, `auto` following a plan file, ranks
holding different plans, files of another topology, plans measured slower than reference.

Cost-model properties and plan-file round trips are in `test_plan_model`; probes in `test_probe`;
the emulated two-node cluster in `test_emulated_cluster`; the `overlap tune` command in `test_cli`.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _capture():
    log = logging.getLogger("overlap")
    handler = _Capture()
    log.addHandler(handler)
    old = log.level
    log.setLevel(logging.INFO)
    return handler, lambda: (log.removeHandler(handler), log.setLevel(old))


def tune_task(rank, world_size, tmp):
    """`tune` on every rank: the same file on every rank, a plan per problem, never slower than reference
    as measured; `auto` then runs the tuned plans (the log says so) and gives reference's numbers."""
    import overlap
    from overlap import plans as plan_mod
    from overlap.plans import planfile
    from overlap.tune.search import tune

    problems = [plan_mod.Problem("all_gather_matmul", 32, 128, 96, "float32"),
                plan_mod.Problem("matmul_reduce_scatter", 16, 64, 128, "float32", backward=True),
                plan_mod.Problem("moe", 24, 32, 48, "float32", experts=2 * world_size, top_k=2)]
    seen = []
    pf, outcomes = tune(problems, measure=2, repeats=3, warmup=1,
                        progress=lambda text, done, total: seen.append((done, total, text)))
    assert seen and seen[-1][0] == seen[-1][1], seen[-3:]
    assert any("measuring" in t for _, _, t in seen), seen[:5]
    for o in outcomes:
        assert o.chosen.measured_s <= o.reference.measured_s, (o.problem.key, o.chosen, o.reference)
        assert all(not t.error for t in o.trials), [t.error for t in o.trials]
        assert [t.plan for t in o.trials][0] == overlap.Plan("reference")
    path = os.path.join(tmp, "plans.json")
    if rank == 0:
        pf.save(path)
    torch.distributed.barrier()
    loaded = planfile.PlanFile.load(path)
    assert loaded.entries.keys() == {p.key for p in problems}
    # auto follows the file (plan= and OVERLAP_PLAN alike), and the results are right.
    handler, restore = _capture()
    try:
        a = torch.randn(32, 128)
        b = torch.randn(128, 96)
        want = overlap.all_gather_matmul(a, b, strategy="reference")
        got = overlap.all_gather_matmul(a, b, plan=path)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        os.environ["OVERLAP_PLAN"] = path
        try:
            got = overlap.all_gather_matmul(a, b)
        finally:
            del os.environ["OVERLAP_PLAN"]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    finally:
        restore()
    chosen = loaded.lookup(problems[0]).describe()
    assert any(f"auto chose {chosen}" in line and "plan file" in line for line in handler.lines), handler.lines
    return [(o.problem.key, o.chosen.plan.describe(), o.chosen.measured_s, o.reference.measured_s) for o in outcomes]


def test_tune_end_to_end(pools, tmp_path):
    results = pools(2).run(tune_task, str(tmp_path), timeout=300)
    assert results[0] == results[1], "ranks ended on different plans or times"


def _file(world_size, entries, topology=None, profile=None):
    from overlap import plans as plan_mod
    from overlap.plans import planfile

    topo = topology or plan_mod.Topology("cpu", world_size, 1, world_size, (("shm", world_size - 1),))
    pf = planfile.PlanFile.new(topo, topo.world_size, profile)
    for problem, plan, measured, reference in entries:
        pf.add(planfile.Entry(problem, plan, measured, reference, None))
    return pf


def plans_task(rank, world_size):
    import overlap
    from overlap import OverlapMismatchError
    from overlap import plans as plan_mod

    a, b = torch.randn(8, 16), torch.randn(16, 12)
    problem = plan_mod.Problem("all_gather_matmul", 8, 16, 12, "float32")
    want = overlap.all_gather_matmul(a, b, strategy="reference")
    outcome = {}
    # A plan measured slower than reference: auto runs reference.
    slow = _file(world_size, [(problem, overlap.Plan("pipelined", num_chunks={"shm": 3}), 2.0, 1.0)])
    handler, restore = _capture()
    try:
        torch.testing.assert_close(overlap.all_gather_matmul(a, b, plan=slow), want, rtol=1e-5, atol=1e-5)
    finally:
        restore()
    outcome["slower"] = [line for line in handler.lines if "auto chose" in line]
    # Ranks holding different plans: OverlapMismatchError on every rank, naming both plans, no hang.
    mine = overlap.Plan("pipelined", num_chunks={"shm": 1 + rank})
    differ = _file(world_size, [(problem, mine, 1.0, 2.0)])
    try:
        overlap.all_gather_matmul(a, b, plan=differ, timeout=20)
        outcome["differ"] = "no error"
    except OverlapMismatchError as exc:
        outcome["differ"] = str(exc)
    # A file of another topology: ValueError on every rank before any data moves; the group goes on.
    other = plan_mod.Topology("cpu", 2 * world_size, 2, world_size, (("shm", world_size - 1), ("network", world_size)))
    foreign = _file(world_size, [(problem, mine, 1.0, 2.0)], topology=other)
    try:
        overlap.all_gather_matmul(a, b, plan=foreign)
        outcome["foreign"] = "no error"
    except ValueError as exc:
        outcome["foreign"] = str(exc)
    torch.testing.assert_close(overlap.all_gather_matmul(a, b), want, rtol=1e-5, atol=1e-5)
    # A shape the file lacks: the cost model's choice with the file's profile.
    modelled = _file(world_size, [], profile=plan_mod.default_profile("cpu"))
    handler, restore = _capture()
    try:
        torch.testing.assert_close(overlap.all_gather_matmul(a, b, plan=modelled), want, rtol=1e-5, atol=1e-5)
    finally:
        restore()
    outcome["model"] = [line for line in handler.lines if "auto chose" in line]
    return outcome


def test_plan_files_drive_auto_and_disagreement_is_an_error(pools):
    for rank, out in enumerate(pools(2).run(plans_task, timeout=120)):
        assert out["slower"] and "auto chose reference[]" in out["slower"][0], (rank, out["slower"])
        assert "shm=1" in out["differ"] and "shm=2" in out["differ"], (rank, out["differ"])
        assert "re-tune on this topology" in out["foreign"], (rank, out["foreign"])
        assert out["model"] and "cost model" in out["model"][0], (rank, out["model"])


def moe_plan_file_task(rank, world_size):
    """Ranks with different token counts (16 and 17) and a plan file with an entry of the layer at 16 tokens
    and one at 32: every rank must take the same entry (the most tokens), whatever its own count."""
    import overlap
    from overlap import plans as plan_mod

    E, H, F = 2 * world_size, 8, 12
    x = torch.randn(16 + rank, H)
    idx = torch.randint(0, E, (16 + rank, 2))
    w1, w2 = torch.randn(2, H, F), torch.randn(2, F, H)
    wts = torch.rand(16 + rank, 2)
    at16 = overlap.Plan("symm", num_chunks={"shm": 1})
    at32 = overlap.Plan("pipelined", num_chunks={"shm": 2})
    pf = _file(world_size, [(plan_mod.Problem("moe", m, H, F, "float32", False, E, 2), plan, 1.0, 2.0)
                            for m, plan in ((16, at16), (32, at32))])
    handler, restore = _capture()
    try:
        h, handle = overlap.moe.dispatch_grouped_matmul(x, idx, w1, E, plan=pf, timeout=20)
        y = overlap.moe.grouped_matmul_combine(h, w2, wts, handle, plan=pf, timeout=20)
    finally:
        restore()
    want_h, want_handle = overlap.moe.dispatch_grouped_matmul(x, idx, w1, E, strategy="reference")
    want = overlap.moe.grouped_matmul_combine(want_h, w2, wts, want_handle, strategy="reference")
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    return handle.plan.describe(), [line for line in handler.lines if "auto chose" in line]


def test_moe_calls_take_the_same_plan_file_entry_on_every_rank(pools):
    for rank, (plan, log) in enumerate(pools(2).run(moe_plan_file_task, timeout=120)):
        assert plan == "pipelined[shm=2]", (rank, plan, log)
        assert log and all("pipelined[shm=2]" in line and "plan file" in line for line in log), (rank, log)


@pytest.mark.parametrize("op", ["matmul_reduce_scatter", "moe"])
def test_problem_keys_of_calls_match_the_tuner(op):
    """The key a call looks up is the key `tune` writes for the same shape (so tuned entries are found)."""
    from overlap import plans as plan_mod
    from overlap.ops.moe import entry as moe_entry
    from overlap.ops.tp import entry

    if op == "moe":
        p = moe_entry.moe_problem(24, 32, 48, 8, 2, torch.float32, True)
        want = plan_mod.Problem("moe", 24, 32, 48, "float32", True, 8, 2)
    else:
        a, b = torch.zeros(3 * 16, 64), torch.zeros(64, 128)
        p = entry.tp_problem(op, a.shape[0], a, b, 3)
        want = plan_mod.Problem(op, 16, 64, 128, "float32", False)
    assert p == want and p.key == want.key


def test_plan_file_without_the_shape_says_so_once(tmp_path, caplog):
    """A plan file that lacks a call's shape: auto falls back (the cost model with the file's profile, or the
    heuristic), and says so once per file and shape, at warning level, naming both; on the group's first rank."""
    from overlap import world
    from overlap.plans import Plan, Problem, auto, default_profile, topology_of
    from overlap.plans.planfile import Entry, PlanFile

    def group(nodes, rank=0):
        return world.GroupInfo(rank=rank, world_size=len(nodes), global_ranks=tuple(range(len(nodes))),
                               nodes=tuple(nodes), pids=tuple(range(len(nodes))), backend="gloo",
                               device=torch.device("cpu"), peer_access=(False,) * len(nodes))

    topology = topology_of(group(["a", "a"]))
    path = tmp_path / "plans.json"
    f = PlanFile.new(topology, 2, default_profile("cpu"))
    f.add(Entry(Problem("all_gather_matmul", 8, 16, 12), Plan("symm")))
    f.save(path)
    missing = Problem("all_gather_matmul", 8, 16, 24)
    sig = "a=(8, 16):float32, b=(16, 24)"
    with caplog.at_level("WARNING", logger="overlap"):
        for rank in (0, 0, 1):
            auto.resolve_auto("all_gather_matmul", sig, group(["a", "a"], rank), 8, "float32", 0, missing, str(path))
        auto.resolve_auto("all_gather_matmul", sig, group(["a", "a"]), 8, "float32", 0, Problem(
            "all_gather_matmul", 8, 16, 12), str(path))  # in the file: nothing to say
    said = [r for r in caplog.records if r.name == "overlap" and r.levelname == "WARNING"]
    assert len(said) == 1, [r.getMessage() for r in said]
    text = said[0].getMessage()
    assert str(path) in text and missing.key in text and "cost model" in text, text
