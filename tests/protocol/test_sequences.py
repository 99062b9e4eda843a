"""The protocol's roles (`tests.protocol.spec`) against what the code does: the ordering operations of each Triton
kernel's sm_90 PTX (compiled ahead of time, as its launcher launches it), of the CUDA sources and of the host
primitives the CPU ranks use, in order. A kernel or function whose sequence differs from its role fails, naming the
instruction or call."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.protocol import spec
from tests.protocol.sequences import UNORDERED, Step, cpp_sequence, function_body, ptx_sequence

ROOT = Path(__file__).resolve().parents[2]
PRODUCERS = ("matmul_scatter_kernel", "grouped_matmul_scatter_kernel", "matmul_all_to_all_kernel")
CONSUMERS = ("all_gather_matmul_kernel", "all_gather_weight_matmul_kernel", "reduce_chunks_kernel",
             "grouped_matmul_wait_kernel", "gather_blocks_kernel", "all_to_all_matmul_kernel")


def _rows(report: list[dict], kernel: str) -> list[dict]:
    rows = [r for r in report if r["kernel"] == kernel]
    assert rows, f"{kernel} is not in the AOT report"
    return rows


def _steps(row: dict) -> list[Step]:
    return [Step(**s) for s in row["sync"]]


def _ordering(steps: list[Step]) -> list[Step]:
    """The steps that write a word of the protocol or order something (no barrier, no fence, no unordered load)."""
    return [s for s in steps if s.kind in ("rmw", "store") or (s.kind == "load" and s.sem != UNORDERED)]


def _expect_in_order(steps: list[Step], ops: tuple[spec.Op, ...], where: str, plain_counter: bool = False) -> None:
    """`ops`, in order, as the ordering steps of `steps`, one each (nothing else that orders between them);
    `plain_counter`: the code resets the counter with a plain store, which PTX does not show among its ordering
    operations."""
    got = _ordering(steps)
    want = [op for op in ops if op.kind != "barrier" and (op.kind == "rmw" or op.sem not in (spec.PLAIN, spec.RELAXED)
                                                          or (op.what == "counter" and not plain_counter))]
    described = [f"{s.text} (line {s.line})" for s in got]
    assert len(got) == len(want), f"{where}: the protocol's {[op.describe() for op in want]}, the code {described}"
    for op, step in zip(want, got, strict=True):
        assert step.matches(op), f"{where}: {step.text} (line {step.line}) where the protocol has {op.describe()}"


@pytest.mark.parametrize("kernel", PRODUCERS)
def test_a_producer_kernel_counts_then_releases_as_the_protocol_does(aot_report, kernel):
    """The tile's count (acq_rel, system scope), the last tile's counter reset (unordered) and its publish (release,
    system scope), in this order; a CTA barrier before the count; no plain global store after the release."""
    for row in _rows(aot_report, kernel):
        where = f"{kernel} {row['dtype']}"
        steps = _steps(row)
        _expect_in_order(steps, spec.PRODUCER_TILE, where)
        count = next(i for i, s in enumerate(steps) if s.kind == "rmw" and s.sem == spec.ACQ_REL)
        assert any(s.kind == "barrier" for s in steps[:count]), f"{where}: no CTA barrier before the count"
        assert row["plain_stores_after_release"] == [], f"{where}: stores after the flag's release: " \
                                                        f"{row['plain_stores_after_release']}"


@pytest.mark.parametrize("kernel", CONSUMERS)
def test_a_waiting_kernel_acquires_its_flag_as_the_protocol_does(aot_report, kernel):
    """Every ordering operation of a waiting kernel is the flag's acquire at system scope (the error word is plain),
    and a reducing barrier follows the first one (the CTA leaves the wait together)."""
    flag = spec.CONSUMER_WAIT[0]
    for row in _rows(aot_report, kernel):
        where = f"{kernel} {row['dtype']}"
        steps = _steps(row)
        ordering = _ordering(steps)
        assert ordering, f"{where}: no acquire of the flag"
        for step in ordering:
            assert step.matches(flag), f"{where}: {step.text} (line {step.line}) where the protocol has only " \
                                       f"{flag.describe()}"
        first = steps.index(ordering[0])
        assert any(s.kind == "barrier" and "red" in s.text for s in steps[first:]), \
            f"{where}: no reducing barrier after the flag's acquire"


def test_the_cuda_dispatch_kernels_ptx_publishes_as_the_protocol_does(tmp_path):
    """nvcc's sm_90a PTX of the MoE dispatch kernel (csrc/cuda/moe_a2a.cu): a system fence and a CTA barrier before
    the count (acq_rel, system), then the flag's release at system scope (the counter's reset is a plain store)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH")
    ptx = tmp_path / "moe_a2a.ptx"
    proc = subprocess.run([nvcc, "-arch=sm_90a", "-ptx", "-I", str(ROOT / "csrc" / "include"),
                           str(ROOT / "csrc" / "cuda" / "moe_a2a.cu"), "-o", str(ptx)], capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    parts = re.split(r"^\.visible \.entry (\S+)\(", ptx.read_text(), flags=re.M)
    bodies = [body for name, body in zip(parts[1::2], parts[2::2], strict=True) if "moe_dispatch_rows_kernel" in name]
    assert len(bodies) == 1, parts[1::2]
    steps = ptx_sequence(bodies[0])
    _expect_in_order(steps, spec.PRODUCER_TILE, "moe_dispatch_rows_kernel (nvcc sm_90a)", plain_counter=True)
    count = next(i for i, s in enumerate(steps) if s.kind == "rmw")
    before = steps[:count]
    fenced = any(s.kind == "fence" and s.scope == spec.SYS for s in before)
    assert fenced and any(s.kind == "barrier" for s in before), \
        f"moe_dispatch_rows_kernel: no system fence and barrier before the count: {[s.text for s in before]}"


def _source(path: str) -> str:
    return (ROOT / path).read_text()


def test_the_cuda_dispatch_publishes_as_the_protocol_does():
    """The MoE dispatch kernel's publish (csrc): the copies, a system fence and the block barrier, the count
    (acq_rel, system), the counter reset (plain), the flag (release, system)."""
    source = _source("csrc/include/overlap/moe_a2a.cuh")
    start = source.index("---- publish:")  # the dispatch kernel's publish, to its flag
    steps = cpp_sequence(source[start : source.index("flag_store_release", start) + 80], plain_words=("counters",))
    _expect_in_order(steps, spec.PRODUCER_TILE, "moe_a2a.cuh dispatch")
    count = next(i for i, s in enumerate(steps) if s.kind == "rmw")
    assert any(s.kind == "barrier" for s in steps[:count]), "moe_a2a.cuh dispatch: no barrier before the count"


@pytest.mark.parametrize("path, name, step", [
    ("csrc/include/overlap/signal.h", "flag_store_release", Step("store", spec.RELEASE, spec.SYS, "")),
    ("csrc/include/overlap/signal.h", "flag_load_acquire", Step("load", spec.ACQUIRE, spec.SYS, "")),
    ("csrc/include/overlap/signal.h", "flag_fetch_add_acq_rel", Step("rmw", spec.ACQ_REL, spec.SYS, "")),
    ("csrc/include/overlap/cuda_signal.cuh", "flag_load_acquire", Step("load", spec.ACQUIRE, spec.SYS, "")),
    ("csrc/include/overlap/cuda_signal.cuh", "flag_store_release", Step("store", spec.RELEASE, spec.SYS, "")),
])
def test_the_primitives_order_as_their_names_say(path, name, step):
    """The host primitives the CPU ranks' flags use (`overlap.signals`: ``signal_store`` is ``flag_store_release``,
    the waits ``flag_load_acquire``) and the device ones of the CUDA kernels."""
    source = _source(path)
    start = source.index(f" {name}(")
    body = function_body(source[start - 200 :], f" {name}(")
    got = [s for s in cpp_sequence(body) if s.text != name]
    assert len(got) == 1 and (got[0].kind, got[0].sem, got[0].scope) == (step.kind, step.sem, step.scope), \
        f"{path} {name}: {got}"


def test_the_watchdog_reports_first_then_releases():
    """The host watchdog (csrc/watchdog.cpp) as `spec.WATCHDOG`: the error word, then the flag raised by a
    compare-and-swap that releases (so whoever the raise lets through sees the error word), never lowered."""
    source = _source("csrc/watchdog.cpp")
    run = function_body(source, "void run()")
    assert run.index("set_if_zero(e.err") < run.index("raise_to(e.word"), run
    for name, role_op in (("set_if_zero(", spec.WATCHDOG[0]), ("raise_to(", spec.WATCHDOG[1])):
        steps = [s for s in cpp_sequence(function_body(source, f"static void {name}")) if s.kind == "rmw"]
        assert steps and all(s.matches(role_op) for s in steps), f"watchdog.cpp {name}: {steps}"
    assert "!flag_reached(seen, value)" in function_body(source, "static void raise_to(")  # never lowered


def test_the_code_decides_on_values_as_the_protocol_does():
    """The two decisions on values: which tile is the last (the count returns ``tiles - 1``), and when a flag has
    reached an epoch (a wrapping difference compared with 0), in every implementation."""
    offset = spec.PROTOCOL.last_tile_offset
    triton = _source("kernels/flags.py")
    assert [int(n) for n in re.findall(r"if seen == target - (\d+):", triton)] == [offset], "kernels/flags.py"
    cuda = _source("csrc/include/overlap/moe_a2a.cuh")
    assert [int(n) for n in re.findall(r"== ctas - (\d+)\)", cuda)] == [offset], "moe_a2a.cuh"
    bounds = [int(n) for n in re.findall(r"\(ready - epoch\) [<>]=? (-?\d+)", triton)]
    assert bounds and set(bounds) == {-spec.PROTOCOL.reach_slack}, f"kernels/flags.py compares with {bounds}"


def test_the_host_and_device_waits_compare_epochs_as_a_wrapping_difference():
    """``flag_reached`` (host) and the device wait take ``int32(uint32(flag) - uint32(value)) >= 0``; the Triton wait
    an int32 difference (`kernels/flags.py`): the protocol's `reached`."""
    host = function_body(_source("csrc/include/overlap/signal.h"), "inline bool flag_reached(")
    assert "static_cast<int32_t>(static_cast<uint32_t>(flag) - static_cast<uint32_t>(value)) >= 0" in host, host
    device = function_body(_source("csrc/include/overlap/cuda_signal.cuh"), "wait_flag_geq_bounded(")
    assert "static_cast<int32_t>(static_cast<uint32_t>(flag_load_acquire(flag)) -" in device, device
    triton = _source("kernels/flags.py")
    assert "stop = ((ready - epoch) >= 0)" in triton and "((ready - epoch) < 0)" in triton


def test_the_cpu_ranks_publish_and_wait_through_the_ordering_primitives():
    """The CPU ranks' path (`overlap.symm`): a flag is published by ``signals.signal_store`` and waited for by
    ``signals.signal_wait_all``, which are ``flag_store_release`` and loops of ``flag_wait_geq`` (acquire loads,
    `flag_reached`) in ``csrc/signal.cpp``; the calls' ready and done flags go through them (never a plain write of
    a pad word from Python)."""
    source = _source("csrc/signal.cpp")
    store = cpp_sequence(function_body(source, "void signal_store("))
    assert [s.text for s in store] == ["flag_store_release"] and store[0].matches(spec.HOST_PRODUCER[1]), store
    wait = function_body(source, "int64_t signal_wait_all_until(")
    assert "flag_wait_geq(" in wait and "flag_reached(flag_load_acquire(" in wait, wait
    geq = function_body(_source("csrc/include/overlap/signal.h"), "inline bool flag_wait_geq(")
    assert "flag_reached(flag_load_acquire(addr), value)" in geq, geq
    assert all(s.matches(spec.HOST_CONSUMER[0]) for s in cpp_sequence(geq) if s.kind == "load"), geq
    call = _source("overlap/symm/call.py")
    ready = call[call.index("    def signal_ready(") : call.index("    def wait_ready(")]
    assert "signals().signal_store(addr, self.word)" in ready, ready
    wait_ready = call[call.index("    def wait_ready(") : call.index("    def finish(")]
    assert "handshake.wait_checked(" in wait_ready, wait_ready
    finish = call[call.index("    def finish(") :]
    assert "signals().signal_store(addr, self.word)" in finish, finish
    free = call[call.index("    def wait_slot_free(") : call.index("    def signal_ready(")]
    assert "if prev <= 0 or not self.uses_heap:" in free and "wait_checked(self.check, addrs, prev," in free, free
