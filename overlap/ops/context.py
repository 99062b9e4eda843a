"""The call context of every op, built by one preamble, and the per-call handshake.

Every op starts the same way (`preamble`): resolve the group and the deadline, learn the group's facts,
check the arguments, choose the plan and write the call's signature; the result is a `CallContext`
that the op's strategies take instead of a run of positional values. A local mistake (bad shapes,
dtypes, plan, timeout) is posted to the peers through the handshake, so no rank waits for a call another
rank left, and then raised on this rank (`CallContext.fail`). `CallContext.begin` is the handshake
itself: every rank's signature is checked (on one node through the symmetric heap's pad, across nodes through
the nodes' pads and messages between counterparts, `overlap.ops.hierarchical.agreement`, or on GPUs by a collective)
and the heap is sized for the call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable
from typing import Any, NoReturn

import torch

from .. import comm, envs, rendezvous, symm, world
from ..errors import OverlapMismatchError, OverlapTimeout, warn_once
from ..plans import Plan
from ..stages import stage
from .hierarchical import agreement

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclasses.dataclass(frozen=True)
class CallContext:
    """One call of an op on this rank: everything its strategies need besides the tensors.

    op: the op's name in messages (``"all_gather_matmul"``, ``"moe.dispatch"``, ``"....backward"``);
    pg, info: the process group and its facts (`overlap.world.GroupInfo`); timeout: the deadline of every
    wait, in seconds; plan: the resolved `Plan` (None until the preamble chose it); signature: the text
    every rank of the call must agree on. Sub-calls (a backward's transfers) are `derive`d from it.
    """

    op: str
    pg: Any
    info: world.GroupInfo
    timeout: float
    plan: Plan | None = None
    signature: str = ""

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def world_size(self) -> int:
        return self.info.world_size

    def derive(self, **changes: Any) -> CallContext:
        """This context with some fields replaced (`op`, `signature`, `plan`, ...)."""
        return dataclasses.replace(self, **changes)

    def begin(self, need_bytes: int = 0, steady: bool = False, plain: bool = False, in_data: bool = False):
        """The handshake on every rank: check the signatures, size the heap for `need_bytes` per slot.

        Returns the call (`overlap.symm.Call` on one node; across nodes `overlap.ops.hierarchical.agreement`'s) whose
        ``finish()`` must run when this rank is done with the call, also on error paths. `steady`: the
        strategy waits on every peer's flags through the `Call` and `need_bytes` is fixed by the signature,
        so a warmed signature skips the rendezvous (`overlap.symm.handshake`). `plain`: the call runs only plain
        collectives through `overlap.comm` (``reference``), which go ahead without the rendezvous where the
        group's recent calls predict the call (`overlap.symm.plain`; CPU ranks of one node). `in_data`: across nodes
        the strategy carries the agreement in its messages to its counterparts (``hierarchical``'s TP ops: no
        rendezvous, `overlap.ops.hierarchical.agreement.InData`); otherwise CPU ranks across nodes make the full
        handshake of `overlap.ops.hierarchical.agreement` and GPU ranks a collective one."""
        rendezvous.CALLER.set(self.op)
        info = self.info
        with record("handshake"), stage("handshake"):
            if info.single_node:
                if need_bytes > 0 and info.device.type == "cuda":
                    warn_device_connections(self.op)
                return symm.heap_for(self.pg, self.timeout).begin(self.op, self.signature, need_bytes, self.timeout,
                                                                  steady=steady, plain=plain)
            if info.device.type == "cpu":
                return agreement.begin(self.op, self.pg, info, self.signature, self.timeout, in_data)
            return _collective_handshake(self.op, self.pg, info, self.signature, self.timeout, post_only=False)

    def fail(self, exc: Exception) -> NoReturn:
        """Post a poisoned signature, so that peers already waiting in this call raise at once instead of
        at their deadline, then raise `exc` (this rank's own mistake) without waiting for anyone."""
        rendezvous.CALLER.set(self.op)
        signature = f"<invalid input on rank {self.rank}: {exc}>"
        try:
            if self.info.single_node:
                symm.heap_for(self.pg, self.timeout).begin(self.op, signature, 0, self.timeout, post_only=True)
            elif self.info.device.type == "cpu":
                agreement.announce_failure(self.op, self.pg, self.info, signature, self.timeout)
            else:
                _collective_handshake(self.op, self.pg, self.info, signature, self.timeout, post_only=True)
        except OverlapTimeout:
            pass  # the peers are stuck elsewhere; the user's own mistake is still the error to see
        raise exc

    def wait(self, work, peer: int | str, chunk: int | str) -> None:
        """`overlap.comm.wait_work` with this call's op, rank, deadline and group (for the blame)."""
        comm.wait_work(work, self.op, self.rank, peer, chunk, self.timeout, self.info)


def preamble(op: str, group, timeout: float | None,
             decide: Callable[[CallContext], tuple[Plan, str, Any]]) -> tuple[CallContext, Any]:
    """Every op's preamble: the group, the deadline and the group's facts, then ``decide(context)``, the
    op's own checks, which return ``(plan, signature, payload)`` (payload: whatever the op keeps of its
    checks, e.g. its inputs cast for autocast). Returns ``(context with plan and signature, payload)``.

    A TypeError/ValueError raised by `decide` or a bad `timeout` is a local mistake: posted to the peers,
    then raised here (`CallContext.fail`)."""
    # CPU ranks share their cores with the backend's threads: one of this process's may still be finishing the
    # collective before this call (a barrier's, the last op's final send) while its peer waits for it. Give it
    # the core now rather than after this call's Python and first spin-wait (right after a barrier, every
    # other call found its peer ~0.4 ms late without it: `bench/overhead.py --barrier`). ~1 us.
    os.sched_yield()
    with record("preamble"), stage("preamble"):
        return _preamble(op, group, timeout, decide)


def _preamble(op: str, group, timeout: float | None, decide: Callable[[CallContext], tuple[Plan, str, Any]]):
    pg = world.resolve_group(group)
    rendezvous.CALLER.set(op)  # set-up rendezvous of this call (group facts, heap) name the op on timeout
    error = None
    try:
        timeout = envs.resolve_timeout(timeout)
    except ValueError as exc:
        error = exc
    if error is not None:  # (outside the handler: a bad OVERLAP_TIMEOUT_S raises alone, not chained to `error`)
        timeout = envs.timeout_s()
    cc = CallContext(op, pg, world.group_info(pg, timeout), timeout)
    try:
        if error is not None:
            raise error
        plan, signature, payload = decide(cc)
    except (TypeError, ValueError) as exc:
        cc.fail(exc)
    return cc.derive(plan=plan, signature=signature), payload


def fail_before(op: str, group, timeout: float | None, error: Exception) -> NoReturn:
    """Raise `error`, a mistake a module found before calling `op` on `group`, on this rank, and tell the peers
    already waiting in `op` at once (`CallContext.fail`); `timeout` as the op takes it (None: OVERLAP_TIMEOUT_S)."""
    timeout = envs.resolve_timeout(timeout)
    pg = world.resolve_group(group)
    CallContext(op, pg, world.group_info(pg, timeout), timeout).fail(error)


def record(name: str) -> contextlib.AbstractContextManager:
    """A profiler range ``overlap.<name>`` (NVTX on GPUs) while a profiler runs; nothing otherwise (a range
    costs a few microseconds per call even with no profiler)."""
    if not torch._C._autograd._profiler_enabled():
        return contextlib.nullcontext()
    return torch.profiler.record_function(f"overlap.{name}")


def no_autocast(device_type: str) -> contextlib.AbstractContextManager:
    """Autocast off inside an op (its operands are cast already; its GEMMs run in their dtype), where it is on."""
    if not torch.is_autocast_enabled(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


def describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)}:{str(t.dtype).removeprefix('torch.')}"


def autocast_inputs(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Cast floating inputs to the autocast dtype where autocast is on (torch's rule for matmul)."""
    device_type = tensors[0].device.type if isinstance(tensors[0], torch.Tensor) else "cpu"
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    # torch's autocast casts fp32/fp16/bf16 matmul inputs and leaves float64 alone.
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype in (torch.float32, torch.float16,
                                                                             torch.bfloat16) else t
                 for t in tensors)


# ----------------------------------------------------------------------------------------------
# The handshake across nodes of GPU ranks (one node: `overlap.symm.SymmHeap.begin`; CPU:
# `overlap.ops.hierarchical.agreement`)
# ----------------------------------------------------------------------------------------------


class _CollectiveCall:
    """Handshake result for groups that span nodes (no symmetric heap)."""

    def __init__(self, epoch: int):
        self.epoch = epoch

    def finish(self) -> None:
        pass


_HEADER_BYTES = 256


def _collective_handshake(op: str, pg, info: world.GroupInfo, signature: str, timeout: float,
                          post_only: bool) -> _CollectiveCall:
    if not post_only and world.capturing():
        raise RuntimeError(f"overlap.{op}: cannot be captured in a CUDA graph: a group across nodes agrees on "
                           "every call with a collective whose result the host reads. Run overlap's ops "
                           "outside the captured region.")
    symm.handshake.COUNTS["rendezvous"] += 1
    epoch = agreement.next_number(pg)
    raw = signature.encode()[:_HEADER_BYTES].ljust(_HEADER_BYTES, b"\0")
    mine = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(info.device)
    every = torch.empty(info.world_size * _HEADER_BYTES, dtype=torch.uint8, device=info.device)
    work = comm.all_gather_async(every, mine, pg)
    comm.wait_work(work, op, info.rank, "any", "signature", timeout, info)  # host-side check: needs the data
    if post_only:
        return _CollectiveCall(epoch)
    rows = [bytes(row) for row in every.view(info.world_size, _HEADER_BYTES).cpu().numpy()]  # (across nodes)
    differ = {p: row.rstrip(b"\0").decode(errors="replace") for p, row in enumerate(rows) if row != raw}
    if differ:
        raise OverlapMismatchError.of(op, epoch, info.rank, signature, differ)
    return _CollectiveCall(epoch)


def warn_device_connections(op: str) -> None:
    """Tell once per process, at the first GPU call that uses the symmetric heap (``symm``, ``fused``),
    where CUDA_DEVICE_MAX_CONNECTIONS is not 1, what the setting changes. overlap reads it and never sets it:
    it must be set before CUDA initializes, and it changes every stream of the process, the user's own
    included. Correctness and bounded waits hold under any value (docs/protocol.md, "Waits on GPUs")."""
    value = envs.cuda_device_max_connections()
    if value == 1:
        return
    now = "unset (the driver's default: several hardware queues)" if value is None else f"{value}"
    warn_once(
        f"overlap.{op}: CUDA_DEVICE_MAX_CONNECTIONS is {now}. "
        "overlap's GPU symm/fused paths are correct and bounded under any value: the symm pipelines' flag "
        "waits are stream-ordered (no SM; a GEMM cannot starve them), each bounded by a host watchdog, the "
        "fused kernels' waits bounded in-kernel, and every flag a peer waits for is issued before this rank's"
        " waits of the same phase. What the value changes is speed: with 1 (one hardware queue, which "
        "Megatron-core requires for its sequence-parallel overlap) the GPU starts work of different streams "
        "in issue order, so a transfer peers wait for is not queued behind a GEMM, but a flag wait also holds"
        " back every later stream's work of the process until the flag arrives; with several queues the side "
        "stream's transfers may start behind a GEMM. Measure both (not yet measured on a GPU). overlap never "
        "sets it itself. (Shown once per process.)",
        RuntimeWarning, key="CUDA_DEVICE_MAX_CONNECTIONS", stacklevel=3,
    )
