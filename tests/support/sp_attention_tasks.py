"""Rank tasks of tests/integrations/test_sequence_parallel_attention.py: `overlap.nn.SequenceParallelAttention` against
the unparallelized attention layer.

The unparallelized layer (`Plain`) is four ``nn.Linear`` (q, k, v, o, created in that order) around attention written
out by hand (scores, causal mask, softmax, weighted values; key/value head ``j // (H / Hkv)`` for query head ``j``).
Every rank builds it and the module after the same ``torch.manual_seed``: their parameters must be equal. The
oracle runs `Plain` in float64 on the whole sequence, from the parameters and inputs rounded to the tested dtype;
each rank checks its shard of the output and of the input gradient, and every parameter's gradient summed over the
ranks (``all_reduce``: each rank's ``.grad`` is its share) against the oracle's.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import torch
import torch.distributed as dist

from tests.support.tp_oracle import expect_error, scaled

FP32 = dict(rtol=1e-5, atol=1e-5)
BF16_REL = 2e-2  # relative norm of the error


@dataclasses.dataclass(frozen=True)
class Case:
    """Head counts per rank (the layer has ``heads_per * W`` heads): every count divides by any world size."""

    heads_per: int
    kv_per: int
    head_dim: int | None  # None: hidden / heads (hidden is then ``heads * 4``)
    hidden: int | None
    causal: bool
    bias: bool
    seq_dim: int
    s_per: int  # positions per rank
    batch: int
    custom: bool = False  # pass `RecordingAttention` as ``attention``

    def sizes(self, W: int) -> tuple[int, int, int, int]:
        """``(hidden, heads, kv_heads, head_dim)`` at world size `W`."""
        heads, kv = self.heads_per * W, self.kv_per * W
        hidden = self.hidden if self.hidden is not None else heads * 4
        return hidden, heads, kv, self.head_dim if self.head_dim is not None else hidden // heads


CASES = [
    Case(2, 2, None, None, causal=True, bias=False, seq_dim=0, s_per=3, batch=2),  # MHA, default head_dim
    Case(2, 1, 3, 10, causal=True, bias=True, seq_dim=1, s_per=4, batch=2),  # GQA 2, batch-first
    Case(4, 1, 4, 12, causal=False, bias=True, seq_dim=0, s_per=3, batch=2),  # GQA 4
    Case(3, 1, 5, 8, causal=True, bias=False, seq_dim=1, s_per=3, batch=3, custom=True),  # GQA 3, own attention
]


class Plain(torch.nn.Module):
    """The unparallelized layer, sequence-first ``[s, b, hidden]``."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = torch.nn.Linear(hidden, heads * head_dim, bias=bias)
        self.k_proj = torch.nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = torch.nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = torch.nn.Linear(heads * head_dim, hidden, bias=bias)

    def forward(self, x: torch.Tensor, causal: bool) -> torch.Tensor:
        s, b, _ = x.shape
        d = self.head_dim

        def split(t, n):  # [s, b, n*d] -> [b, n, s, d]
            return t.view(s, b, n, d).permute(1, 2, 0, 3)

        q = split(self.q_proj(x), self.heads)
        k, v = (split(p(x), self.kv_heads) for p in (self.k_proj, self.v_proj))
        group = self.heads // self.kv_heads
        k = torch.stack([k[:, j // group] for j in range(self.heads)], dim=1)
        v = torch.stack([v[:, j // group] for j in range(self.heads)], dim=1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d)
        if causal:
            scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        ctx = torch.softmax(scores, dim=-1) @ v  # [b, H, s, d]
        return self.o_proj(ctx.permute(2, 0, 1, 3).reshape(s, b, self.heads * d))


class RecordingAttention:
    """A local attention of the module's ``attention=`` contract, in plain math: checks the layout it is given (``q``
    ``[b, H/W, s, d]``, ``k``/``v`` ``[b, Hkv/W, s, d]``, not repeated) and counts its calls."""

    def __init__(self, want_q: tuple, want_kv: tuple):
        self.want_q, self.want_kv, self.calls = want_q, want_kv, 0

    def __call__(self, q, k, v, causal):
        assert tuple(q.shape) == self.want_q, (tuple(q.shape), self.want_q)
        assert tuple(k.shape) == tuple(v.shape) == self.want_kv, (tuple(k.shape), tuple(v.shape), self.want_kv)
        self.calls += 1
        group = q.shape[1] // k.shape[1]
        k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
        scores = (q @ k.transpose(-1, -2)).float() / math.sqrt(q.shape[-1])
        if causal:
            s = q.shape[2]
            scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        return torch.softmax(scores, dim=-1).to(v.dtype) @ v


def _layout(t: torch.Tensor, seq_dim: int) -> torch.Tensor:
    """Sequence-first `t` in the case's layout."""
    return t if seq_dim == 0 else t.transpose(0, 1).contiguous()


def _shard(t: torch.Tensor, seq_dim: int, rank: int, s_per: int) -> torch.Tensor:
    return t.narrow(seq_dim, rank * s_per, s_per).contiguous()


def _check(what: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, norm: float | None = None) -> None:
    """fp32: `FP32`, ``atol`` scaled to `want`'s RMS; bf16: the error's norm below `BF16_REL` of `want`'s (of `norm`
    where given: a tensor whose exact value is 0)."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    got = got.double()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, **scaled(FP32, want), msg=lambda m: f"{what}: {m}")
        return
    rel = ((got - want).norm() / (want.norm() if norm is None else norm)).item()
    assert rel < BF16_REL, f"{what}: relative norm of the error {rel:.3g} >= {BF16_REL}"


def describe(t: torch.Tensor) -> str:
    return f"{t.dtype}{list(t.shape)}"


def check_case(rank: int, world_size: int, strategy: str, dtype: torch.dtype, seed: int, case: Case) -> None:
    from overlap.nn import SequenceParallelAttention

    W = world_size
    hidden, heads, kv, head_dim = case.sizes(W)
    s, b, d = case.s_per * W, case.batch, case.seq_dim
    where = f"rank {rank}/{W} {strategy} {dtype} seed {seed} {case}"
    torch.manual_seed(seed)
    plain = Plain(hidden, heads, kv, head_dim, case.bias)
    attention = None
    if case.custom:
        attention = RecordingAttention((b, heads // W, s, head_dim), (b, kv // W, s, head_dim))
    torch.manual_seed(seed)
    module = SequenceParallelAttention(hidden, heads, kv, None if case.head_dim is None else head_dim,
                                       causal=case.causal, bias=case.bias, attention=attention, seq_dim=d,
                                       strategy=strategy)
    names = [n for n, _ in plain.named_parameters()]
    assert names == [n for n, _ in module.named_parameters()], (where, names)
    for name, p in plain.named_parameters():
        assert torch.equal(p, module.get_parameter(name)), f"{where}: {name} differs from the plain layer's"
    module.to(dtype)

    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(s, b, hidden, generator=gen, dtype=torch.float64).to(dtype)  # the whole sequence
    g = torch.randn(s, b, hidden, generator=gen, dtype=torch.float64).to(dtype)
    ref = copy.deepcopy(plain).to(dtype).double()
    x64 = x.double().requires_grad_(True)
    y64 = ref(x64, case.causal)
    y64.backward(g.double())

    xi = _shard(_layout(x, d), d, rank, case.s_per).requires_grad_(True)
    y = module(xi)
    assert y.dtype == dtype and y.shape == xi.shape, (where, describe(y), describe(xi))
    y.backward(_shard(_layout(g, d), d, rank, case.s_per))
    _check(f"{where}: output", y, _shard(_layout(y64.detach(), d), d, rank, case.s_per), dtype)
    _check(f"{where}: input grad", xi.grad, _shard(_layout(x64.grad, d), d, rank, case.s_per), dtype)
    for name, p in ref.named_parameters():
        got = module.get_parameter(name).grad
        total = torch.zeros_like(p) if got is None else got.double()
        dist.all_reduce(total)
        if name == "k_proj.bias":  # 0 exactly (q . b_k added to every score of a query leaves its softmax)
            _check(f"{where}: {name}.grad summed over ranks", total, p.grad, dtype, ref.q_proj.bias.grad.norm())
            continue
        _check(f"{where}: {name}.grad summed over ranks", total, p.grad, dtype)
        assert p.grad.abs().max() > 1e-3, f"{where}: the oracle's {name}.grad is ~0"

    with torch.no_grad():
        y_eval = module(xi.detach())
    _check(f"{where}: output under no_grad", y_eval, _shard(_layout(y64.detach(), d), d, rank, case.s_per), dtype)
    if attention is not None:
        assert attention.calls == 2, (where, attention.calls)


def check_cases(rank: int, world_size: int, strategy: str, dtype: torch.dtype, seed: int) -> int:
    """Every case of `CASES` on this rank; returns how many ran."""
    for i, case in enumerate(CASES):
        check_case(rank, world_size, strategy, dtype, seed + 1000 * i, case)
    return len(CASES)


def bad_args_task(rank: int, world_size: int) -> dict:
    """Construction errors (before any communication) and forward errors (on the rank that made them; its peers raise
    at once); then a good call on the same group. Returns ``{label: (exception type name or None, message, s)}``."""
    from overlap.nn import SequenceParallelAttention as SPA

    W = world_size
    results = {
        "heads_not_divisible": expect_error(SPA, 4 * (W + 1), W + 1),
        "kv_heads_not_divisible": expect_error(SPA, 2 * W * (W + 1), 2 * W * (W + 1), kv_heads=W + 1),
        "heads_by_kv_heads": expect_error(SPA, 12 * W, 3 * W, kv_heads=2 * W),
        "hidden_by_heads": expect_error(SPA, 4 * W + 1, 2 * W),
        "heads_zero": expect_error(SPA, 8, 0),
        "hidden_bool": expect_error(SPA, True, W),
        "seq_dim": expect_error(SPA, 8 * W, 2 * W, seq_dim=2),
        "hierarchical": expect_error(SPA, 8 * W, 2 * W, strategy="hierarchical"),
        "unknown_strategy": expect_error(SPA, 8 * W, 2 * W, strategy="fastest"),
        "attention_not_callable": expect_error(SPA, 8 * W, 2 * W, attention="sdpa"),
    }
    hidden = 8 * W
    torch.manual_seed(0)
    m = SPA(hidden, 2 * W, W, strategy="pipelined", timeout=20)
    good = torch.randn(2, 3, hidden)
    results["x_hidden_on_rank_0"] = expect_error(m, torch.randn(2, 3, hidden + 1) if rank == 0 else good)
    results["x_two_dims_on_rank_0"] = expect_error(m, torch.randn(2, hidden) if rank == 0 else good)
    wrong = SPA(hidden, 2 * W, W, attention=lambda q, k, v, causal: q[..., :-1], timeout=20)
    results["attention_shape"] = expect_error(wrong, good)
    results["then_ok"] = (None, str(tuple(m(good).shape)), 0.0)
    return results
