"""Drop-in expert-parallel MoE MLP: a top-k router and experts spread over an expert-parallel group.

``ExpertParallelMLP`` routes each token to ``top_k`` experts, runs ``act(x @ w1[e]) @ w2[e]`` on the rank
that holds expert ``e`` and returns the routing-weighted sum, with the all-to-alls overlapped with the
experts' GEMMs: `overlap.moe.dispatch_grouped_matmul` (dispatch fused with the first grouped GEMM), the
activation, then `overlap.moe.grouped_matmul_combine` (second grouped GEMM fused with the combine)::

    mlp = overlap.nn.ExpertParallelMLP(hidden_size=1024, ffn_hidden_size=4096, num_experts=64, top_k=2,
                                       group=ep_group, activation="silu_glu")
    y = mlp(x)  # x: [s, b, 1024] or [tokens, 1024], this rank's own tokens; y has x's shape

Legend: ``H`` hidden size, ``F`` ffn hidden size, ``E`` experts, ``W`` ranks of the expert-parallel
group, ``L = E / W`` local experts (rank ``r`` holds experts ``r*L ... (r+1)*L - 1``), ``K`` top-k.

Parameters and initialization (the same model whatever ``W``):

* ``router``: ``nn.Linear(H, E, bias=False)``, replicated. Drawn from the default torch RNG by
  ``nn.Linear``'s own initialization, so it is equal on every rank when every rank seeds the default
  RNG alike (as for any replicated parameter); keep it in sync like one.
* ``w1``: ``[L, H, F]`` (``[L, H, 2F]`` for ``activation="silu_glu"``, gate columns first) and ``w2``:
  ``[L, F, H]``, this rank's experts. After the router, one base seed is drawn from the default RNG
  (kept as ``init_seed``; equal on every rank seeded alike); expert ``e`` (global id) draws its ``w1``
  then its ``w2`` from a CPU generator seeded with ``base_seed + e``, uniform in ``+-1/sqrt(fan_in)``
  (``fan_in`` = ``H`` for ``w1``, ``F`` for ``w2``: the bound of ``nn.Linear``'s default). So expert ``e``
  starts from the same values at any ``W``.

fp8 (``fp8="rowwise" | "block128" | "mxfp8"`` or an `overlap.Fp8Recipe` of one): the tokens are quantized once on
their rank and dispatched as fp8 rows with their scales (about half of bf16's bytes), and the first GEMM multiplies
them by ``w1`` quantized at the same granularity (`overlap.ops.moe.fp8`); the activation, the second GEMM and the
combine run in the parameters' dtype. The backward runs in the parameters' dtype (the recipe's high-precision
gradients), or with ``+grads`` (``Fp8Recipe(granularity, grads=True)``) the first GEMM's two backward GEMMs in fp8
(`overlap.ops.moe.fp8`; ``mxfp8`` then needs ``w1``'s width a multiple of 32).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as Fn
from torch.nn import Parameter

from .. import envs, world
from ..ops.context import describe, fail_before
from ..ops.fp8_recipe import Fp8Recipe
from ..ops.moe import fp8 as moe_fp8
from ..ops.moe.combine import grouped_matmul_combine
from ..ops.moe.dispatch import OP_DISPATCH_MM, dispatch_grouped_matmul
from ..plans import Plan
from ..plans.auto import as_plan


def _silu_glu(h: torch.Tensor) -> torch.Tensor:
    f = h.shape[-1] // 2
    return Fn.silu(h[..., :f]) * h[..., f:]


#: activation name -> (function of the first GEMM's output, columns of w1 per ffn column)
ACTIVATIONS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], int]] = {
    "gelu": (Fn.gelu, 1),
    "relu": (torch.relu, 1),
    "silu": (Fn.silu, 1),
    "silu_glu": (_silu_glu, 2),
}


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"overlap.nn.ExpertParallelMLP: {name} must be a positive int, got {value!r}")
    return value


class ExpertParallelMLP(torch.nn.Module):
    """A mixture-of-experts MLP with its experts split over an expert-parallel group (see the module docstring).

    Args:
        hidden_size: ``H``, the tokens' width.
        ffn_hidden_size: ``F``, each expert's inner width.
        num_experts: ``E``, over all ranks; must divide by the group's size.
        top_k: ``K``, experts per token, ``1 <= K <= E``.
        group: the expert-parallel group (default: the world). Every rank of it must build the module with
            the same arguments and call it the same number of times.
        activation: ``"gelu"``, ``"relu"``, ``"silu"`` or ``"silu_glu"`` (``silu(h[:, :F]) * h[:, F:]`` with
            ``w1`` of ``2F`` columns).
        strategy, plan, timeout: of the MoE ops (defaults: ``"auto"``, none, ``OVERLAP_TIMEOUT_S``); a plan
            with ``migrate`` moves those experts' weights to those nodes' tokens (`overlap.ops.moe.migration`).
        max_tokens_per_rank: None (exact row counts), or ``B``, the most tokens (``s * b`` for 3-D inputs)
            any rank passes to one forward, the same on every rank: the MoE ops then run with static shapes
            (`overlap.ops.moe.bound`; torch.compile needs no data-dependent size), and a forward with more
            tokens on any rank raises ValueError on every rank.
        fp8: None, or the dispatch's fp8 granularity: ``"rowwise"``, ``"block128"``, ``"mxfp8"`` (``hidden_size``
            a multiple of 32) or an `overlap.Fp8Recipe` of one, ``grads=True`` for fp8 gradients (the module
            docstring).
        dtype, device: of the parameters (defaults: torch's default dtype, CPU).

    Forward: ``x`` ``[T, H]`` or ``[s, b, H]`` holds this rank's own tokens (``T`` may differ between ranks,
    0 included); returns the same shape and dtype (the autocast dtype under autocast). Routing (`route`):
    ``softmax`` of the router's logits in fp32, top-k, the chosen probabilities renormalized to sum to 1
    (fp32).

    Gradients: ``w1``/``w2`` get the gradient of every token routed to them, from every rank. The
    replicated ``router`` gets this rank's own contribution only (docs/conventions.md): sum it over the ranks
    with the data-parallel reduction, as for any replicated parameter. ``w1``/``w2`` are marked
    ``allreduce = False`` (Megatron's flag for expert-parallel parameters).

    Raises:
        ValueError: in ``__init__``, before any communication: ``num_experts`` not divisible by the group's
            size, ``top_k`` out of ``[1, num_experts]``, an unknown activation, sizes that are not positive
            ints, a bad strategy/plan/timeout, an fp8 granularity the dispatch does not take (``tensorwise``),
            ``mxfp8`` fp8 gradients with a ``w1`` width that is not a multiple of 32.
            In ``forward``: ``x`` not ``[T, H]``/``[s, b, H]`` (the peers' calls then raise at once, as for the
            ops' own input errors).
        TypeError: a plan of the wrong type, ``fp8`` of another type; ``x`` of a dtype other than the parameters'
            outside autocast.
        The ops' errors (OverlapMismatchError, OverlapTimeout) as documented in `overlap.moe`.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_experts: int, top_k: int, *,
                 group: dist.ProcessGroup | None = None, activation: str = "gelu", strategy: str = "auto",
                 plan: Plan | dict | None = None, timeout: float | None = None, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, max_tokens_per_rank: int | None = None,
                 fp8: str | Fp8Recipe | None = None):
        super().__init__()
        name = "overlap.nn.ExpertParallelMLP"
        self.fp8 = moe_fp8.recipe_for("nn.ExpertParallelMLP", fp8, hidden_size if isinstance(hidden_size, int)
                                      else None)
        self.hidden_size = _positive_int("hidden_size", hidden_size)
        self.ffn_hidden_size = _positive_int("ffn_hidden_size", ffn_hidden_size)
        self.num_experts = _positive_int("num_experts", num_experts)
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
            raise ValueError(f"{name}: top_k must be an int in [1, num_experts={num_experts}], got {top_k!r}")
        self.top_k = top_k
        if activation not in ACTIVATIONS:
            raise ValueError(f"{name}: unknown activation {activation!r}; known: {sorted(ACTIVATIONS)}")
        self.activation = activation
        moe_fp8.check_width("nn.ExpertParallelMLP", self.fp8, ACTIVATIONS[activation][1] * self.ffn_hidden_size)
        self.group = world.resolve_group(group)
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        if num_experts % self.world_size:
            raise ValueError(f"{name}: num_experts ({num_experts}) must divide by the expert-parallel world size "
                             f"({self.world_size}): experts are split evenly and contiguously over ranks")
        self.num_local_experts = num_experts // self.world_size
        as_plan(strategy, plan)  # a bad strategy or plan raises here, not at the first forward
        envs.resolve_timeout(timeout)
        self.strategy, self.plan, self.timeout = strategy, plan, timeout
        if max_tokens_per_rank is not None:
            _positive_int("max_tokens_per_rank", max_tokens_per_rank)
        self.max_tokens_per_rank = max_tokens_per_rank

        factory = {"dtype": dtype, "device": device}
        L, H, F = self.num_local_experts, hidden_size, ffn_hidden_size
        self.router = torch.nn.Linear(H, num_experts, bias=False, **factory)  # default RNG, nn.Linear's init
        self.w1 = Parameter(torch.empty(L, H, ACTIVATIONS[activation][1] * F, **factory))
        self.w2 = Parameter(torch.empty(L, F, H, **factory))
        self.w1.allreduce = self.w2.allreduce = False
        self._init_experts()

    # -- initialization ---------------------------------------------------------------------------

    def reset_parameters(self) -> None:
        """Draw every parameter again, as ``__init__`` does (router, then the experts' base seed)."""
        self.router.reset_parameters()
        self._init_experts()

    def _init_experts(self) -> None:
        """Expert ``e`` from a generator seeded with ``base_seed + e``; the base seed from the default RNG."""
        self.init_seed = int(torch.randint(0, 2**62, (1,)).item())
        H, F = self.hidden_size, self.ffn_hidden_size
        first = self.rank * self.num_local_experts
        with torch.no_grad():
            for j in range(self.num_local_experts):
                gen = torch.Generator().manual_seed(self.init_seed + first + j)
                for w, fan_in in ((self.w1, H), (self.w2, F)):
                    bound = fan_in**-0.5
                    values = torch.empty(w.shape[1:], dtype=torch.float32).uniform_(-bound, bound, generator=gen)
                    w[j].copy_(values)

    # -- forward ------------------------------------------------------------------------------------

    def route(self, x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing of tokens ``[T, H]``: ``(topk_idx [T, K] int64 global expert ids, topk_weights [T, K] fp32)``.

        ``probs = softmax(router(x).float())``; the top-k probabilities (in descending order), divided by
        their sum. The weights carry the router's gradient. Local: no communication."""
        probs = torch.softmax(self.router(x2d).float(), dim=-1)
        vals, idx = torch.topk(probs, self.top_k, dim=-1)
        return idx, vals / vals.sum(dim=-1, keepdim=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, H]`` or ``[s, b, H]`` tokens of this rank -> the MoE output, same shape and dtype (as torch's
        matmul under autocast). Every rank of the group calls it, with its own number of tokens."""
        self._check_input(x)
        x2d = x.reshape(-1, self.hidden_size)
        topk_idx, topk_weights = self.route(x2d)
        kwargs = {"strategy": self.strategy, "plan": self.plan, "timeout": self.timeout}
        h, handle = dispatch_grouped_matmul(x2d, topk_idx, self.w1, self.num_experts, group=self.group,
                                            max_tokens_per_rank=self.max_tokens_per_rank, fp8=self.fp8, **kwargs)
        h = ACTIVATIONS[self.activation][0](h)
        y = grouped_matmul_combine(h, self.w2, topk_weights, handle, **kwargs)
        return y.view(x.shape[:-1] + (y.shape[-1],))

    def _check_input(self, x) -> None:
        """Local checks of ``x``; a mistake raises here and makes the peers' dispatch raise at once."""
        name = "overlap.nn.ExpertParallelMLP"
        error = None
        if not isinstance(x, torch.Tensor):
            error = TypeError(f"{name}: x must be a tensor, got {type(x).__name__}")
        elif x.dim() not in (2, 3) or x.shape[-1] != self.hidden_size:
            error = ValueError(f"{name}: x must be [tokens, {self.hidden_size}] or [s, b, {self.hidden_size}], "
                               f"got {describe(x)}")
        elif x.dtype != self.w1.dtype and not torch.is_autocast_enabled(x.device.type):
            error = TypeError(f"{name}: x ({x.dtype}) and the parameters ({self.w1.dtype}) must have one dtype "
                              "outside autocast")
        if error is None:
            return
        fail_before(f"moe.{OP_DISPATCH_MM}", self.group, self.timeout, error)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
                f"num_experts={self.num_experts}, num_local_experts={self.num_local_experts}, top_k={self.top_k}, "
                f"activation={self.activation!r}, EP={self.world_size}, strategy={self.strategy!r}"
                + ("" if self.max_tokens_per_rank is None else f", max_tokens_per_rank={self.max_tokens_per_rank}")
                + ("" if self.fp8 is None else f", fp8={self.fp8.text!r}"))
