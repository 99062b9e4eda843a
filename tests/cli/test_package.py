"""Tier 1, the `overlap` package without ranks: what ``import overlap`` sets up (lazily: Triton's interpreter where
no GPU exists) and its ops called with no process group."""

from __future__ import annotations

import os

import pytest
import torch

import overlap


def test_ops_need_an_initialized_group():
    a = torch.randn(2, 3)
    with pytest.raises(RuntimeError, match="torch.distributed"):
        overlap.all_gather_matmul(a, torch.randn(3, 2))


def test_triton_runs_interpreted_where_no_gpu():
    import os

    if not torch.cuda.is_available():
        assert os.environ.get("TRITON_INTERPRET") == "1"


def _fresh(code: str) -> str:
    """Run `code` in a fresh interpreter (no TRITON_INTERPRET from the caller); its stdout."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_import_is_lazy_and_every_public_name_resolves():
    out = _fresh(
        "import sys, os\n"
        "import overlap\n"
        "print('torch' in sys.modules, os.environ.get('TRITON_INTERPRET'))\n"
        "assert set(overlap.__all__) <= set(dir(overlap)), dir(overlap)\n"
        "for name in overlap.__all__:\n"
        "    assert getattr(overlap, name) is not None, name\n"
        "print(overlap.nn.ExpertParallelMLP.__name__, overlap.hooks.__name__, overlap.moe.dispatch.__name__)\n"
        "assert overlap.ops.library.NAMESPACE and overlap.world.LINK_CLASSES  # submodules as attributes too\n"
        "print(os.environ.get('TRITON_INTERPRET'))\n"
    )
    lines = out.splitlines()
    assert lines[0] == "False None", out  # import overlap: no torch, nothing set yet
    assert lines[1] == "ExpertParallelMLP overlap.hooks dispatch", out
    if not torch.cuda.is_available():
        assert lines[2] == "1", out  # set on first use, before any kernel was defined


def test_import_after_torch_sets_triton_interpret_at_once():
    out = _fresh("import torch, os\nimport overlap\nprint(os.environ.get('TRITON_INTERPRET'))\n")
    if not torch.cuda.is_available():
        assert out.strip() == "1", out


def test_unknown_attribute_raises_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        overlap.nothing_here  # noqa: B018


def test_log_lines_carry_the_rank_once_distributed_is_up(tmp_path):
    import logging

    import torch.distributed as dist

    handler = next(h for h in logging.getLogger("overlap").handlers if isinstance(h, logging.StreamHandler))
    record = logging.LogRecord("overlap", logging.INFO, __file__, 1, "auto chose %s", ("symm",), None)
    before = handler.format(record)
    assert before == "[overlap INFO] auto chose symm", before
    choice = logging.LogRecord("overlap", logging.INFO, __file__, 1, "overlap.%s: auto chose %s for %s (%s)",
                               ("moe", "pipelined[network=2,shm=4]", "sig(plan=pipelined[network=2,shm=4])",
                                "default heuristic"), None)
    assert handler.format(choice) == ("[overlap INFO] overlap.moe: auto chose pipelined (shm x4, network x2) for "
                                      "sig(plan=pipelined[network=2,shm=4]) (default heuristic)")
    assert choice.getMessage().startswith("overlap.moe: auto chose pipelined[network=2,shm=4] for")  # untouched
    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        assert handler.format(record) == "[overlap INFO rank 0] auto chose symm"
    finally:
        dist.destroy_process_group()


def test_plan_labels_are_readable():
    from overlap.logs import readable_plan

    assert overlap.Plan("symm").label(("shm",)) == "symm (shm x1)"
    assert overlap.Plan("symm", num_chunks={"shm": 2}).label() == "symm (shm x2)"
    assert overlap.Plan("pipelined", num_chunks={"shm": 4, "network": 2}).label() == "pipelined (shm x4, network x2)"
    assert overlap.Plan("reference").label(("shm",)) == "reference"
    fused = overlap.Plan("fused", block_m=128, block_n=64, block_k=32, one_shot=True)
    assert fused.label() == "fused (tile 128x64x32, one-shot)"
    assert overlap.Plan("symm").describe() == "symm[]"  # the signature's text is unchanged
    for plan in (overlap.Plan("symm"), overlap.Plan("pipelined", num_chunks={"shm": 4, "network": 2}), fused):
        assert readable_plan(plan.describe()) == plan.label(), plan
    assert readable_plan("not a plan") == "not a plan"
