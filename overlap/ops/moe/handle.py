"""`MoEHandle`: what a dispatch returns for its combine and the backward, as torch.compile can trace it.

A dispatch's layout (`overlap.ops.moe.layout.MoELayout`: counts per rank and expert, the send order, the
call context) lives on the host, in a per-process table; the handle holds the key of its entry as a small
CPU tensor, which the MoE custom ops take as an input. The handle is a pytree (its tensors: the key and,
with a bound, the layout's device tensors; the expert counts and the bound as static fields), so a compiled
graph passes it from a dispatch to its combine like any tensor. The entry is dropped when the key tensor is
freed (the handle and every saved backward that holds it gone).

In eager code the handle also answers the layout's questions (``tokens_per_expert``, ``expert_offsets``,
``num_recv``, ``plan``, ...) from the table; inside a compiled region those are data-dependent host values
and are not available. A dispatch with ``max_tokens_per_rank`` (`overlap.ops.moe.bound`) puts
``tokens_per_expert``, ``expert_offsets`` and ``num_recv`` into the handle as int64 tensors on the tokens'
device, readable in a compiled region too; their host lists stay at ``handle.layout``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.utils._pytree as pytree

from .. import library
from .layout import MoELayout


def register(layout: MoELayout) -> torch.Tensor:
    """A new key tensor for `layout` (`overlap.ops.library.keep`): the entry lives as long as the tensor."""
    return library.keep(layout)


def layout_of(key: torch.Tensor, op: str) -> MoELayout:
    """The layout a key tensor names (ValueError for a key this process does not hold)."""
    layout = library.kept(key, f"moe.{op}: the handle's key")
    if not isinstance(layout, MoELayout):
        raise TypeError(f"overlap.moe.{op}: the handle's key names no dispatch")
    return layout


def live_layouts() -> int:
    """How many dispatch layouts this process holds (tests: handles are not leaked)."""
    return library.kept_objects(MoELayout)


@dataclasses.dataclass(frozen=True)
class MoEHandle:
    """The layout of one dispatch, for the matching combine and the backward (from `overlap.moe.dispatch`).

    Fields: ``key`` (int64 ``[1]`` CPU tensor naming the layout in this process), ``num_experts``,
    ``num_local_experts``, ``top_k``. In eager code every attribute of the layout can be read here:
    ``tokens_per_expert`` (``[L]``, rows of each local expert in the dispatch's output), ``expert_offsets``
    (``[L][W]``, first row of block ``(expert, source)``), ``num_recv``, ``recv_counts``, ``send_counts``,
    ``num_tokens``, ``plan``, ``group``, ``timeout``.

    With a bound (``max_tokens_per_rank``, else None), ``device_layout`` holds ``(tokens_per_expert [L],
    expert_offsets [L, W], num_recv [])`` as int64 tensors on the tokens' device, and the three attributes
    of those names are these tensors (the host lists: ``handle.layout``).
    """

    key: torch.Tensor
    num_experts: int
    num_local_experts: int
    top_k: int
    max_tokens_per_rank: int | None = None
    device_layout: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def layout(self) -> MoELayout:
        """The dispatch's host layout (eager code only)."""
        return layout_of(self.key, "handle")

    @property
    def tokens_per_expert(self) -> Any:
        return self._device_or_host(0, "tokens_per_expert")

    @property
    def expert_offsets(self) -> Any:
        return self._device_or_host(1, "expert_offsets")

    @property
    def num_recv(self) -> Any:
        return self._device_or_host(2, "num_recv")

    def _device_or_host(self, i: int, name: str) -> Any:
        if self.device_layout is not None:
            return self.device_layout[i]
        return getattr(layout_of(self.key, "handle"), name)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in ("key", "num_experts", "num_local_experts", "top_k",
                                            "max_tokens_per_rank", "device_layout"):
            raise AttributeError(name)
        return getattr(layout_of(self.key, "handle"), name)


def _flatten(h: MoEHandle) -> tuple[list[torch.Tensor], tuple[int, int, int, int | None]]:
    return [h.key, *(h.device_layout or ())], (h.num_experts, h.num_local_experts, h.top_k, h.max_tokens_per_rank)


def _unflatten(children: Any, context: tuple[int, int, int, int | None]) -> MoEHandle:
    children = list(children)
    return MoEHandle(children[0], *context, tuple(children[1:]) if len(children) > 1 else None)


try:
    pytree.register_pytree_node(MoEHandle, _flatten, _unflatten, serialized_type_name="overlap.moe.MoEHandle")
except ValueError:  # pragma: no cover - registered already (the module imported twice)
    pass
