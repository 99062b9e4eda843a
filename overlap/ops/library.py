"""The ops as `torch.library` custom ops: what torch.compile sees of a call.

A public op (``overlap.all_gather_matmul``, ...) is a thin function that turns its arguments into the
values a custom op can take (tensors, strings, numbers) and calls ``torch.ops.overlap.<name>``; the custom
op runs the op's whole eager path (checks, plan, handshake, strategy). The compiler sees:

* a **fake implementation** per op (output shapes and dtypes only: no rank communicates while a graph is
  traced, and a dynamic sequence length stays symbolic);
* **registered autograd** whose backward is itself a custom op (``<name>_backward``), so the backward's
  transfers are as opaque to the compiler as the forward's;
* an **ordered effect** on every op (`torch._higher_order_ops.effects`): AOTAutograd threads an effect
  token through them, so a compiled graph issues the calls on every rank in the program's order and never
  drops one whose result is unused; peers that run the same program meet in the same calls. (The MoE
  dispatch without ``max_tokens_per_rank``, whose output size depends on data, is a plain side effect: see
  `define`; with it, ``moe_dispatch_bounded`` has static sizes and is ordered: `overlap.ops.moe.bound`.)

Arguments that a custom op cannot take are passed as text: the group by its name
(`torch.distributed.ProcessGroup.group_name`, ``""`` for the default group), the plan as `plan_arg`
writes it. A call whose arguments are not of the accepted types never reaches the custom op: the op's own
checks raise the error on this rank and tell the peers (`overlap.ops.context.preamble`).
"""

from __future__ import annotations

import collections
import functools
import itertools
import os
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..plans import Plan, PlanFile

NAMESPACE = "overlap"

try:  # the ordered effect; private in torch, present with these names from 2.4 through 2.13
    from torch._higher_order_ops.effects import _EffectType, _register_effectful_op
except ImportError:  # pragma: no cover - a torch without effect tokens: eager is unaffected
    _EffectType = _register_effectful_op = None


def group_arg(group: Any) -> str | None:
    """The custom op's text for `group` (None: not a process group, the op's checks will say so)."""
    if group is None:
        return ""
    if isinstance(group, dist.ProcessGroup):
        return group.group_name
    return None


def group_of(name: str) -> dist.ProcessGroup | None:
    """The process group `group_arg` named (None: the default group)."""
    if not name:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


_PLAN_FILES: weakref.WeakValueDictionary[str, PlanFile] = weakref.WeakValueDictionary()


def plan_arg(plan: Any) -> str | None:
    """The custom op's text for an op's ``plan=`` (None: not a plan, the op's checks will say so).

    ``""`` no plan; ``"plan:..."`` a `Plan` (or a dict of its fields) by `Plan.encode`; ``"path:..."`` a plan
    file's path; ``"file:<id>"`` a `PlanFile` object, held in a per-process table while it lives."""
    if plan is None:
        return ""
    if isinstance(plan, Plan):
        return "plan:" + plan.encode()
    if isinstance(plan, Mapping):
        try:
            return "plan:" + Plan(**plan).encode()
        except (TypeError, ValueError):
            return None
    if isinstance(plan, (str, os.PathLike)):
        return "path:" + os.fspath(plan)
    if isinstance(plan, PlanFile):
        key = f"file:{id(plan)}"
        _PLAN_FILES[key] = plan
        return key
    return None


@functools.lru_cache(maxsize=256)
def _decoded(text: str) -> Plan:
    """`Plan.decode`, once per text (plans are immutable)."""
    return Plan.decode(text)


def plan_of(text: str) -> Plan | PlanFile | str | None:
    """The ``plan=`` value `plan_arg` wrote."""
    kind, _, rest = text.partition(":")
    if not text:
        return None
    if kind == "plan":
        return _decoded(rest)
    if kind == "path":
        return rest
    plan_file = _PLAN_FILES.get(text)
    if plan_file is None:
        raise ValueError(f"overlap: the plan file object of this call ({text}) no longer exists")
    return plan_file


def call_args(group: Any, strategy: Any, plan: Any, timeout: Any) -> tuple[str, str, str, float | None] | None:
    """``(group, strategy, plan, timeout)`` as custom-op arguments, or None where one of them is of a type
    the ops do not take (the caller then lets the op's checks raise on this rank)."""
    g, p = group_arg(group), plan_arg(plan)
    ok_timeout = timeout is None or (isinstance(timeout, (int, float)) and not isinstance(timeout, bool))
    if g is None or p is None or not isinstance(strategy, str) or not ok_timeout:
        return None
    return g, strategy, p, None if timeout is None else float(timeout)


def tensors(*values: Any) -> bool:
    """Whether every value is a tensor (else the op's checks raise, as the custom op would not)."""
    return all(isinstance(v, torch.Tensor) for v in values)


def needs_grad(*values: torch.Tensor) -> bool:
    """Whether autograd will ask this call for a gradient (plans are tuned for forward or forward+backward)."""
    return torch.is_grad_enabled() and any(v.requires_grad for v in values)


def define(name: str, schema: str, impl: Callable, fake: Callable, backward: Callable | None = None,
           setup_context: Callable | None = None, ordered: bool = True) -> Any:
    """Define ``overlap::<name>`` with `schema` (no ``self`` name), its implementation, its fake and, where
    given, its autograd (`backward`, `setup_context` as `torch.library.register_autograd` takes them), as an
    ordered side effect (`ordered`), else as a side effect graphs never drop but may order by their data
    alone. Defined once per process (a re-imported module keeps the first definition: torch 2.11 refuses a
    second fake). Returns the op's overload packet (``torch.ops.overlap.<name>``)."""
    packet = getattr(torch.ops, NAMESPACE)
    if not hasattr(packet, name):
        op = torch.library.custom_op(f"{NAMESPACE}::{name}", _counted(name, impl), mutates_args=(), schema=schema)
        op.register_fake(fake)
        if backward is not None:
            op.register_autograd(backward, setup_context=setup_context)
        if ordered and _register_effectful_op is not None:
            _register_effectful_op(getattr(packet, name).default, _EffectType.ORDERED)
        else:
            torch.fx.node.has_side_effect(getattr(packet, name).default)
    return getattr(packet, name)


# ----------------------------------------------------------------------------------------------
# Host objects a graph passes between custom ops: a key tensor names each
# ----------------------------------------------------------------------------------------------

_KEPT: dict[int, Any] = {}
_SERIAL = itertools.count(1)
_LOCK = threading.Lock()


def keep(obj: Any) -> torch.Tensor:
    """A new key (int64 ``[1]`` CPU tensor) for `obj`, a host object a later custom op needs (a forward's call
    context for its backward, a dispatch's layout for its combine). The entry lives as long as the key tensor:
    a graph, an autograd node or a handle that holds the key keeps it. Serials are never reused."""
    with _LOCK:
        serial = next(_SERIAL)
        _KEPT[serial] = obj
    key = torch.full((1,), serial, dtype=torch.int64)
    weakref.finalize(key, _drop, serial)
    return key


def _drop(serial: int) -> None:
    with _LOCK:
        _KEPT.pop(serial, None)


def kept(key: Any, what: str) -> Any:
    """The object `keep` gave `key` (TypeError for a tensor that is no key, ValueError for a key this process
    does not hold); `what` names the caller in the message."""
    if not isinstance(key, torch.Tensor) or key.numel() != 1 or key.dtype != torch.int64 or key.is_cuda:
        raise TypeError(f"overlap.{what}: expected the int64 key tensor an overlap op returned")
    serial = int(key.numpy()[0])  # a CPU tensor: no device synchronization
    with _LOCK:
        obj = _KEPT.get(serial)
    if obj is None:
        raise ValueError(f"overlap.{what}: key #{serial} is not known in this process (it was made elsewhere)")
    return obj


def kept_objects(kind: type) -> int:
    """How many objects of `kind` this process keeps (tests: nothing leaks)."""
    with _LOCK:
        return sum(isinstance(obj, kind) for obj in _KEPT.values())


CALLS: collections.Counter[str] = collections.Counter()
"""How many times each custom op ran in this process (eager or compiled), by name."""
RECENT: collections.deque[str] = collections.deque(maxlen=64)
"""The names of the last custom ops that ran in this process, oldest first (the order a graph issued them)."""


def _counted(name: str, impl: Callable) -> Callable:
    def run(*args: Any, **kwargs: Any) -> Any:
        CALLS[name] += 1
        RECENT.append(name)
        return impl(*args, **kwargs)

    run.__name__ = run.__qualname__ = getattr(impl, "__name__", name)
    return run


def world_size(group_name: str) -> int:
    """The size of the group `group_arg` named, for a fake implementation (no communication)."""
    pg = group_of(group_name)
    return dist.get_world_size(pg)


# ----------------------------------------------------------------------------------------------
# What every op's forward and backward return besides its results
# ----------------------------------------------------------------------------------------------


def context_out(cc: Any, needs_grad: bool) -> torch.Tensor:
    """A forward's second output: the key of its call context where a backward will run (its plan, deadline and
    signature, exactly: the backward never resolves them again), else an empty tensor."""
    return keep(cc) if needs_grad else torch.empty(0, dtype=torch.int64)


def context_fake(needs_grad: bool) -> torch.Tensor:
    return torch.empty(1 if needs_grad else 0, dtype=torch.int64)


def grads_out(grad_a: torch.Tensor | None, grad_b: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor):
    """A backward op's outputs: a 0-element tensor stands for a gradient nobody asked for."""
    return (grad_a if grad_a is not None else a.new_empty(0), grad_b if grad_b is not None else b.new_empty(0))
