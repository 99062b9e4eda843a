"""The protocol's roles (`tests.protocol.spec`) against what the code does: the ordering operations of each Triton
kernel's sm_90 PTX (compiled ahead of time, as its launcher launches it), of the CUDA sources and of the host
primitives the CPU ranks use, in order. A kernel or function whose sequence differs from its role fails, naming the
instruction or call."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.protocol import spec
from tests.protocol.sequences import UNORDERED, Step, cpp_sequence, function_body

ROOT = Path(__file__).resolve().parents[2]
PRODUCERS = ("matmul_scatter_kernel", "grouped_matmul_scatter_kernel")
CONSUMERS = ("all_gather_matmul_kernel", "all_gather_weight_matmul_kernel", "reduce_chunks_kernel",
             "grouped_matmul_wait_kernel")


def _rows(report: list[dict], kernel: str) -> list[dict]:
    rows = [r for r in report if r["kernel"] == kernel]
    assert rows, f"{kernel} is not in the AOT report"
    return rows


def _steps(row: dict) -> list[Step]:
    return [Step(**s) for s in row["sync"]]


def _ordering(steps: list[Step]) -> list[Step]:
    """The steps that write a word of the protocol or order something (no barrier, no fence, no unordered load)."""
    return [s for s in steps if s.kind in ("rmw", "store") or (s.kind == "load" and s.sem != UNORDERED)]


def _expect_in_order(steps: list[Step], ops: tuple[spec.Op, ...], where: str) -> None:
    """`ops`, in order, as the ordering steps of `steps`, one each (nothing else that orders between them)."""
    got = _ordering(steps)
    want = [op for op in ops if op.kind != "barrier" and (op.kind == "rmw" or op.sem not in (spec.PLAIN, spec.RELAXED)
                                                          or op.what in ("counter",))]
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


def test_the_host_and_device_waits_compare_epochs_as_a_wrapping_difference():
    """``flag_reached`` (host) and the device wait take ``int32(uint32(flag) - uint32(value)) >= 0``; the Triton wait
    an int32 difference (`kernels/flags.py`): the protocol's `reached`."""
    host = function_body(_source("csrc/include/overlap/signal.h"), "inline bool flag_reached(")
    assert "static_cast<int32_t>(static_cast<uint32_t>(flag) - static_cast<uint32_t>(value)) >= 0" in host, host
    device = function_body(_source("csrc/include/overlap/cuda_signal.cuh"), "wait_flag_geq_bounded(")
    assert "static_cast<int32_t>(static_cast<uint32_t>(flag_load_acquire(flag)) -" in device, device
    triton = _source("kernels/flags.py")
    assert "stop = ((ready - epoch) >= 0)" in triton and "((ready - epoch) < 0)" in triton
