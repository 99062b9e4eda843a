"""overlap.hooks.torch_tp on CPU ranks: overlap's parallel styles against torch's own and an unsharded model.

A pre-norm transformer block over ``[s, b, h]`` (attention: qkv column-wise, out row-wise; MLP: up
column-wise, down row-wise) is parallelized twice, once with torch's ``ColwiseParallel``/
``RowwiseParallel`` and once with overlap's, with the same arguments, on a CPU ``DeviceMesh`` over the
gloo world. Both must give the unsharded block's outputs, input gradients, parameter gradients (full
tensors, same ``DTensor`` placements as torch's) and parameters after an SGD step, and the same outputs
on the next forward (the step reached the shards the styles compute with). Layouts:

* ``"sp"``: sequence parallelism, Megatron's: the block's input and output are this rank's slice of the
  sequence (dim 0); the norms use torch's ``SequenceParallel(sequence_dim=0)`` in both copies, so the
  column-wise layers receive ``DTensor`` inputs (``Shard(0)``). Runs `all_gather_matmul` and
  `matmul_reduce_scatter` (the row-wise bias gradient needs the sum over ranks' rows).
* ``"replicated"``: torch's default layouts: replicated block input and output, `matmul_all_reduce` in
  the row-wise layers; ``up`` returns a ``DTensor`` (``use_local_output=False``) that ``down`` takes.

torch's styles run every layout here on CPU/gloo, so every case is compared with them.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

# Import overlap before any DTensor op runs in a rank: torch's DTensor imports Triton (through inductor),
# and overlap must set TRITON_INTERPRET before Triton is first imported for interpreted `fused` to work
# (in this pool's later tasks too).
import overlap
from tests.support.harness import FALLBACK_TIMEOUT_S
from tests.support.tp_oracle import scaled

HIDDEN, HEADS, FFN, BATCH = 12, 6, 24, 2  # heads and FFN divide by 2 and 3: whole heads per rank
HEAD_DIM = HIDDEN // HEADS
FP32 = dict(rtol=1e-5, atol=1e-5)


class Block(nn.Module):
    """A pre-norm transformer block over ``[s, b, h]``. The qkv projection's outputs are ordered
    ``[head, (q, k, v), head_dim]``, so a column shard holds whole heads and attention runs per rank."""

    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.qkv, self.out = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.up, self.down = nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)

    def forward(self, x_SBH):
        x_SBH = x_SBH + self.out(self._attention(self.qkv(self.norm1(x_SBH))))
        return x_SBH + self.down(F.gelu(self.up(self.norm2(x_SBH))))

    @staticmethod
    def _attention(qkv):
        s, b, _ = qkv.shape  # all of the sequence, this rank's heads
        q, k, v = qkv.reshape(s, b, -1, 3, HEAD_DIM).unbind(3)
        probs = (torch.einsum("sbnd,tbnd->bnst", q, k) / HEAD_DIM**0.5).softmax(-1)
        return torch.einsum("bnst,tbnd->sbnd", probs, v).reshape(s, b, -1)


def _mesh(world_size):
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh("cpu", list(range(world_size)))


def _plan(kind, layout, **kw):
    """The parallelize plan of `Block` with torch's styles (``kind="torch"``) or overlap's."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import SequenceParallel

    if kind == "torch":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    else:
        from overlap.hooks.torch_tp import ColwiseParallel, RowwiseParallel
    if layout == "sp":
        return {
            "norm1": SequenceParallel(sequence_dim=0),
            "qkv": ColwiseParallel(input_layouts=Shard(0), **kw),
            "out": RowwiseParallel(output_layouts=Shard(0), **kw),
            "norm2": SequenceParallel(sequence_dim=0),
            "up": ColwiseParallel(input_layouts=Shard(0), **kw),
            "down": RowwiseParallel(output_layouts=Shard(0), **kw),
        }
    return {
        "qkv": ColwiseParallel(**kw),
        "out": RowwiseParallel(**kw),
        "up": ColwiseParallel(use_local_output=False, **kw),
        "down": RowwiseParallel(**kw),
    }


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _placements(t):
    return tuple(getattr(t, "placements", ()))


def _close(actual, expected, what):
    torch.testing.assert_close(actual, expected, **scaled(FP32, expected), msg=lambda m: f"{what}: {m}")


def _step(model, x, g, lr=0.5):
    """Forward, backward of ``sum(y * g)``, one SGD step; returns (y, x.grad, {name: (grad, placements)})."""
    x = x.clone().requires_grad_()
    y = model(x)
    (y * g).sum().backward()
    grads = {n: (_full(p.grad).clone(), _placements(p.grad)) for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    opt.step()
    return y.detach().clone(), x.grad, grads


def compare_with_torch(rank, world_size, seed, layout, strategies):
    """Every rank: the unsharded block, torch's styles, overlap's styles per strategy; compare all."""
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = _mesh(world_size)
    seq = 2 * world_size
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(seq, BATCH, HIDDEN, generator=gen)
    g = torch.randn(seq, BATCH, HIDDEN, generator=gen)
    x2 = torch.randn(seq, BATCH, HIDDEN, generator=gen)
    torch.manual_seed(seed)
    block = Block()
    mine = (lambda t: t.chunk(world_size)[rank]) if layout == "sp" else (lambda t: t)

    full = copy.deepcopy(block)
    y_full, dx_full, grads_full = _step(full, x, g)
    with torch.no_grad():
        y2_full = full(x2)

    theirs = parallelize_module(copy.deepcopy(block), mesh, _plan("torch", layout))
    y_t, dx_t, grads_t = _step(theirs, mine(x), mine(g))
    with torch.no_grad():
        y2_t = theirs(mine(x2))
    # torch's styles against the unsharded block: the oracle itself is right.
    _close(y_t, mine(y_full), f"rank {rank} torch's output")
    _close(dx_t, mine(dx_full), f"rank {rank} torch's input grad")

    done = []
    for strategy in strategies:
        ctx = f"rank {rank}/{world_size} layout={layout} strategy={strategy}"
        ours = parallelize_module(copy.deepcopy(block), mesh, _plan("overlap", layout, strategy=strategy))
        y_o, dx_o, grads_o = _step(ours, mine(x), mine(g))
        assert type(y_o) is torch.Tensor, (ctx, type(y_o))  # local output, as torch's
        _close(y_o, mine(y_full), f"{ctx}: output")
        _close(y_o, y_t, f"{ctx}: output vs torch's")
        _close(dx_o, mine(dx_full), f"{ctx}: input grad")
        assert grads_o.keys() == grads_t.keys() == grads_full.keys(), ctx
        for name, (grad, placements) in grads_o.items():
            assert placements == grads_t[name][1], f"{ctx}: {name}.grad placements {placements} != torch's"
            _close(grad, grads_full[name][0], f"{ctx}: {name}.grad vs unsharded")
            _close(grad, grads_t[name][0], f"{ctx}: {name}.grad vs torch's")
        params_t, params_full = dict(theirs.named_parameters()), dict(full.named_parameters())
        for name, p in ours.named_parameters():
            assert _placements(p) == _placements(params_t[name]), (ctx, name, p.placements)
            _close(_full(p.detach()), params_full[name].detach(), f"{ctx}: {name} after the step")
        with torch.no_grad():
            y2_o = ours(mine(x2))
        _close(y2_o, mine(y2_full), f"{ctx}: forward after the step")
        _close(y2_o, y2_t, f"{ctx}: forward after the step vs torch's")
        done.append(strategy)
    return done


STRATEGIES = ["reference", "pipelined", "symm", "fused", "auto"]  # fused: interpreted, tiny shapes only


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("layout", ["sp", "replicated"])
def test_block_matches_torch_styles_and_unsharded(pools, seed, world_size, layout):
    results = pools(world_size).run(compare_with_torch, seed, layout, STRATEGIES, timeout=120)
    assert results == [STRATEGIES] * world_size


# ----------------------------------------------------------------------------------------------
# Sharded parameters, DTensor outputs, strategy pass-through, bad input
# ----------------------------------------------------------------------------------------------


def api_task(rank, world_size, seed):
    import warnings

    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel as TorchCol
    from torch.distributed.tensor.parallel import RowwiseParallel as TorchRow
    from torch.distributed.tensor.parallel import parallelize_module

    from overlap.hooks.torch_tp import ColwiseParallel, RowwiseParallel
    from tests.support.tp_oracle import expect_error

    mesh = _mesh(world_size)
    out = {}
    torch.manual_seed(seed)
    mlp = nn.Sequential(nn.Linear(8, 6), nn.GELU(), nn.Linear(6, 8))

    # State dicts: the same keys, placements and local shards as with torch's styles.
    theirs = parallelize_module(copy.deepcopy(mlp), mesh, {"0": TorchCol(input_layouts=Shard(0)),
                                                           "2": TorchRow(output_layouts=Shard(0))})
    ours = parallelize_module(copy.deepcopy(mlp), mesh, {"0": ColwiseParallel(input_layouts=Shard(0), strategy="symm"),
                                                         "2": RowwiseParallel(output_layouts=Shard(0),
                                                                              strategy="pipelined")})
    sd_t, sd_o = theirs.state_dict(), ours.state_dict()
    assert sd_t.keys() == sd_o.keys(), (sd_t.keys(), sd_o.keys())
    for key, t in sd_t.items():
        o = sd_o[key]
        assert isinstance(o, DTensor) and o.placements == t.placements, (key, o)
        assert torch.equal(o.to_local(), t.to_local()), key

    # Layers without a bias, both sequence-parallel styles: the same as torch's.
    no_bias = nn.Sequential(nn.Linear(8, 6, bias=False), nn.GELU(), nn.Linear(6, 8, bias=False))
    x_mine, g_mine = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    for kind, plan in (("torch", {"0": TorchCol(input_layouts=Shard(0)), "2": TorchRow(output_layouts=Shard(0))}),
                       ("overlap", {"0": ColwiseParallel(input_layouts=Shard(0)),
                                    "2": RowwiseParallel(output_layouts=Shard(0))})):
        model = parallelize_module(copy.deepcopy(no_bias), mesh, plan)
        out[kind] = _step(model, x_mine, g_mine)
    _close(out["overlap"][0], out["torch"][0], f"rank {rank}: no bias: output")
    for name, (grad, _) in out.pop("overlap")[2].items():
        _close(grad, out["torch"][2][name][0], f"rank {rank}: no bias: {name}.grad")
    del out["torch"]

    # The strategy reaches the op: a plan the op refuses (one_shot on all_gather_matmul) raises there.
    bad = parallelize_module(copy.deepcopy(mlp), mesh, {"0": ColwiseParallel(
        input_layouts=Shard(0), plan=overlap.Plan("pipelined", one_shot=True))})
    out["plan_passed"] = expect_error(bad, torch.randn(2, 3, 8))

    # use_local_output=False: DTensors with the output layout; a DTensor input gets a DTensor gradient.
    dt = parallelize_module(copy.deepcopy(mlp), mesh, {
        "0": ColwiseParallel(input_layouts=Shard(0), use_local_output=False),
        "2": RowwiseParallel(output_layouts=Shard(0), use_local_output=False)})
    x = distribute_tensor(torch.randn(2 * world_size, 3, 8), mesh, [Shard(0)]).requires_grad_()
    y = dt(x)
    assert isinstance(y, DTensor) and y.placements == (Shard(0),), y
    assert y.shape == (2 * world_size, 3, 8), y.shape
    y.to_local().sum().backward()
    assert isinstance(x.grad, DTensor) and x.grad.placements == (Shard(0),), x.grad

    # Bad input: raised on every rank before any communication.
    out["two_args"] = expect_error(ours[0], torch.randn(2, 3, 8), torch.randn(2))
    out["not_a_tensor"] = expect_error(ours[0], [1.0])
    out["twice"] = expect_error(ColwiseParallel()._apply, ours[0], mesh)
    out["row_last_dim"] = expect_error(parallelize_module(nn.Linear(8, 4), mesh, RowwiseParallel(
        output_layouts=Shard(2))), torch.randn(2, 3, 8 // world_size))
    # What torch's styles take, overlap's take: a DTensor with another placement than input_layouts (used as it
    # is), an nn.Embedding and uneven features (torch's own style), as torch's give them.
    replicated = distribute_tensor(torch.randn(2 * world_size, 3, 8), mesh, [Replicate()])
    y_o, y_t = ours(replicated), theirs(replicated)
    _close(y_o, y_t, f"rank {rank}: a replicated DTensor input")
    out["dtensor_other_placement"] = tuple(y_o.shape)
    out["embedding"] = ColwiseParallel()
    parallelize_module(nn.Embedding(4, 8), mesh, out["embedding"])
    out["embedding"] = out["embedding"].fused
    uneven = ColwiseParallel()
    with warnings.catch_warnings(record=True) as caught:  # a plain layer left unfused is named, never silently
        warnings.simplefilter("always")
        parallelize_module(nn.Linear(8, 2 * world_size + 1), mesh, uneven)
        parallelize_module(nn.Embedding(4, 8), mesh, ColwiseParallel())  # (an embedding: nothing of overlap's)
    out["uneven"] = uneven.fused
    out["unfused_said"] = [str(w.message) for w in caught if "unfused" in str(w.message)]

    # The pool's group is still usable after all of that.
    y = ours(torch.randn(2, 3, 8))
    out["then_ok"] = tuple(y.shape)
    return out


@pytest.mark.exact
def test_api_and_bad_input(pools, seed):
    for rank, res in enumerate(pools(2).run(api_task, seed, timeout=60)):
        ctx = f"rank {rank}"
        assert res["plan_passed"][0] == "ValueError" and "one_shot" in res["plan_passed"][1], (ctx, res)
        assert res["two_args"][0] == "TypeError", (ctx, res["two_args"])
        assert res["not_a_tensor"][0] == "TypeError", (ctx, res["not_a_tensor"])
        assert res["twice"][0] == "ValueError" and "already" in res["twice"][1], (ctx, res["twice"])
        kind, msg, secs = res["row_last_dim"]
        assert kind == "ValueError" and "last dim" in msg and secs < FALLBACK_TIMEOUT_S, (ctx, kind, msg)
        # a replicated DTensor input: nothing gathered, the row-wise layer scatters the whole sequence, as torch's
        assert res["dtensor_other_placement"] == (2, 3, 8), (ctx, res["dtensor_other_placement"])
        assert res["embedding"] is False and res["uneven"] is False, (ctx, res)
        said = res["unfused_said"]
        assert len(said) == 1 and "ColwiseParallel" in said[0] and "out_features=5 do not divide over 2" in said[0]
        assert res["then_ok"] == (2, 3, 8), (ctx, res["then_ok"])


def test_constructor_takes_torch_layouts_and_rejects_bad_arguments():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor import parallel as torch_tp

    from overlap.hooks.torch_tp import ColwiseParallel, RowwiseParallel

    for style in (ColwiseParallel(input_layouts=Shard(1)), ColwiseParallel(output_layouts=Replicate()),
                  RowwiseParallel(input_layouts=Replicate()), RowwiseParallel(output_layouts=Shard(1))):
        assert isinstance(style, (torch_tp.ColwiseParallel, torch_tp.RowwiseParallel))  # torch's, subclassed
    for make, match in [
        (lambda: ColwiseParallel(strategy="bogus"), "strategy"),
        (lambda: RowwiseParallel(timeout=0), "timeout"),
    ]:
        with pytest.raises(ValueError, match=match):
            make()
    with pytest.raises(TypeError):
        ColwiseParallel(input_layouts="shard")
    style = RowwiseParallel(output_layouts=Shard(0), strategy="symm", timeout=5)
    assert style.output_layouts == (Shard(0),) and style.input_layouts == (Shard(-1),)
    assert "strategy='symm'" in repr(style) and "timeout=5" in repr(style)
    assert ColwiseParallel().input_layouts == (Replicate(),)  # torch's default


# ----------------------------------------------------------------------------------------------
# Every layout torch's styles take: the same results as torch's, fused where there is something to fuse
# ----------------------------------------------------------------------------------------------


def _layout_cases(W):
    """(name, kind, module, style kwargs, this rank's input (of rank and the whole input), overlap's path?, and
    whether one of overlap's TP ops runs in forward: a replicated column-wise input is a plain local GEMM)."""
    from torch.distributed.tensor import Replicate, Shard

    def seq(dim):
        return lambda r, x: x.chunk(W, dim)[r]

    def feat(r, x):
        return x.chunk(W, -1)[r]

    whole = lambda r, x: x  # noqa: E731
    return [
        ("col Shard(1) batch-first", "col", nn.Linear(6, 6), dict(input_layouts=Shard(1)), seq(1), True, True),
        ("col Shard(0)", "col", nn.Linear(6, 6), dict(input_layouts=Shard(0)), seq(0), True, True),
        ("col Shard(-2)", "col", nn.Linear(6, 6), dict(input_layouts=Shard(-2)), seq(1), True, True),
        ("col LM head Shard(1) -> Replicate", "col", nn.Linear(6, 6, bias=False),
         dict(input_layouts=Shard(1), output_layouts=Replicate()), seq(1), True, True),
        ("col loss parallel Shard(1) -> DTensor Shard(-1)", "col", nn.Linear(6, 6, bias=False),
         dict(input_layouts=Shard(1), use_local_output=False), seq(1), True, True),
        ("col replicated", "col", nn.Linear(6, 6), {}, whole, True, False),
        ("col features sharded in", "col", nn.Linear(6, 6), dict(input_layouts=Shard(2)), feat, True, False),
        ("col uneven features (torch's)", "col", nn.Linear(6, 2 * W + 1), dict(input_layouts=Shard(1)), seq(1),
         False, False),
        ("row Shard(1) batch-first", "row", nn.Linear(6, 6), dict(output_layouts=Shard(1)), feat, True, True),
        ("row Shard(0)", "row", nn.Linear(6, 6), dict(output_layouts=Shard(0)), feat, True, True),
        ("row replicated", "row", nn.Linear(6, 6), {}, feat, True, True),
        ("row replicated in, Shard(1) out", "row", nn.Linear(6, 6),
         dict(input_layouts=Replicate(), output_layouts=Shard(1)), whole, True, True),
        ("row Shard(-1) out (torch's)", "row", nn.Linear(6, 6), dict(output_layouts=Shard(-1)), feat, False, False),
    ]


def layouts_task(rank, world_size, seed):
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor import parallel as torch_tp
    from torch.distributed.tensor.parallel import parallelize_module

    from overlap.hooks import torch_tp as ours_tp
    from overlap.ops import library

    mesh = _mesh(world_size)
    W = world_size
    gen = torch.Generator().manual_seed(seed)
    done = []
    for name, kind, module, kwargs, local_of, fused, runs_op in _layout_cases(W):
        x = torch.randn(2 * W, 2 * W, 6, generator=gen)  # (dims 0 and 1 both split over the ranks)
        theirs_style = (torch_tp.ColwiseParallel if kind == "col" else torch_tp.RowwiseParallel)(**kwargs)
        ours_style = (ours_tp.ColwiseParallel if kind == "col" else ours_tp.RowwiseParallel)(**kwargs)
        results = []
        for style in (theirs_style, ours_style):
            m = parallelize_module(copy.deepcopy(module), mesh, style)
            xi = local_of(rank, x).clone().requires_grad_()
            before = sum(library.CALLS[op] for op in ("all_gather_matmul", "matmul_reduce_scatter",
                                                      "matmul_all_reduce"))
            y = m(xi)
            calls = sum(library.CALLS[op] for op in ("all_gather_matmul", "matmul_reduce_scatter",
                                                     "matmul_all_reduce")) - before
            y_full = y.full_tensor() if isinstance(y, DTensor) else y
            g = torch.randn(y_full.shape, generator=torch.Generator().manual_seed(seed + 1))
            (y_full * g).sum().backward()
            grads = {n: (_full(p.grad), _placements(p.grad), _placements(p)) for n, p in m.named_parameters()}
            results.append((isinstance(y, DTensor), _placements(y), y_full.detach(), xi.grad, grads, calls))
        (t_type, t_pl, t_y, t_dx, t_grads, _), (o_type, o_pl, o_y, o_dx, o_grads, o_calls) = results
        ctx = f"rank {rank}/{W} {name}"
        assert ours_style.fused is fused, (ctx, ours_style.fused)
        assert (o_calls > 0) is runs_op, (ctx, o_calls)  # overlap's op ran where it fuses, none where torch's did
        assert o_type == t_type and o_pl == t_pl, (ctx, o_type, t_type, o_pl, t_pl)  # a DTensor where torch's is
        _close(o_y, t_y, f"{ctx}: output")
        _close(o_dx, t_dx, f"{ctx}: input grad")
        assert o_grads.keys() == t_grads.keys(), ctx
        for pname, (grad, grad_pl, pl) in o_grads.items():
            assert (grad_pl, pl) == t_grads[pname][1:], (ctx, pname, grad_pl, pl, t_grads[pname][1:])
            _close(grad, t_grads[pname][0], f"{ctx}: {pname}.grad")
        done.append(name)

    # Embeddings are torch's styles' (nothing to fuse): torchtitan's token embedding, and a column-wise one.
    for name, style_kw, kind in (("row embedding Replicate -> Shard(1)", dict(input_layouts=Replicate(),
                                                                             output_layouts=Shard(1)), "row"),
                                 ("col embedding", {}, "col")):
        ids = torch.randint(0, 10, (2, 2 * W), generator=gen)
        emb = nn.Embedding(10, 6)
        outs = []
        for mod in (torch_tp, ours_tp):
            style = (mod.ColwiseParallel if kind == "col" else mod.RowwiseParallel)(**style_kw)
            m = parallelize_module(copy.deepcopy(emb), mesh, style)
            y = m(ids)
            y.sum().backward()
            outs.append((y.detach(), _full(m.weight.grad), getattr(style, "fused", None)))
        assert outs[1][2] is False, name
        _close(outs[1][0], outs[0][0], f"rank {rank} {name}: output")
        _close(outs[1][1], outs[0][1], f"rank {rank} {name}: weight grad")
        done.append(name)
    # A DTensor input is taken with the placement it has, as torch's style takes it.
    lin = nn.Linear(6, 6)
    for placement in (Replicate(), Shard(1), Shard(0)):
        x = distribute_tensor(torch.randn(2 * W, 2 * W, 6, generator=gen), mesh, [placement])
        y_t, y_o = (parallelize_module(copy.deepcopy(lin), mesh, mod.ColwiseParallel(input_layouts=Shard(0)))(x)
                    for mod in (torch_tp, ours_tp))
        _close(y_o, y_t, f"rank {rank} DTensor input {placement}")
        done.append(f"dtensor {placement}")
    return done


@pytest.mark.parametrize("world_size", [2, 3])
def test_styles_match_torch_on_every_layout_they_take(pools, seed, world_size):
    for rank, done in enumerate(pools(world_size).run(layouts_task, seed, timeout=240)):
        assert len(done) == len(_layout_cases(world_size)) + 5, (rank, done)


def swap_task(rank, world_size, seed):
    """`use_overlap_styles` on a module that imported torch's styles: its plan then runs overlap's ops."""
    import types

    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import parallel as torch_tp
    from torch.distributed.tensor.parallel import parallelize_module

    from overlap.hooks.torch_tp import ColwiseParallel, RowwiseParallel, use_overlap_styles
    from overlap.ops import library

    client = types.ModuleType("client")  # a parallelize module as torchtitan writes one
    client.ColwiseParallel, client.RowwiseParallel = torch_tp.ColwiseParallel, torch_tp.RowwiseParallel

    def parallelize(model, mesh):
        return parallelize_module(model, mesh, {"0": client.ColwiseParallel(input_layouts=Shard(1)),
                                                "2": client.RowwiseParallel(output_layouts=Shard(1))})

    client.parallelize = parallelize
    mesh = _mesh(world_size)
    torch.manual_seed(seed)
    mlp = nn.Sequential(nn.Linear(6, 6), nn.GELU(), nn.Linear(6, 6))
    x = torch.randn(2, 2 * world_size, 6).chunk(world_size, 1)[rank]
    before = library.CALLS["all_gather_matmul"] + library.CALLS["matmul_reduce_scatter"]
    with use_overlap_styles(client):
        assert client.ColwiseParallel is ColwiseParallel and client.RowwiseParallel is RowwiseParallel
        ours = client.parallelize(copy.deepcopy(mlp), mesh)
    assert client.ColwiseParallel is torch_tp.ColwiseParallel  # restored
    y_o = ours(x)
    ran = library.CALLS["all_gather_matmul"] + library.CALLS["matmul_reduce_scatter"] - before
    y_t = client.parallelize(copy.deepcopy(mlp), mesh)(x)
    _close(y_o, y_t, f"rank {rank}: swapped styles vs torch's")
    with pytest.raises(RuntimeError), use_overlap_styles(client):
        raise RuntimeError("inside")
    assert client.RowwiseParallel is torch_tp.RowwiseParallel  # restored on an error too
    return ran


def test_use_overlap_styles_swaps_and_restores(pools, seed):
    assert pools(2).run(swap_task, seed, timeout=120) == [2, 2]  # one gather and one scatter per rank


def test_use_overlap_styles_rejects_what_it_cannot_swap():
    import types

    from overlap.hooks.torch_tp import use_overlap_styles

    with pytest.raises(TypeError, match="modules"), use_overlap_styles("torchtitan"):
        pass
    with pytest.raises(ValueError, match="nothing to swap"), use_overlap_styles(types.ModuleType("empty")):
        pass


class _ScaledLinear(nn.Linear):
    """An ``nn.Linear`` subclass with its own forward (a LoRA or quantized layer's kind): not ``x @ W.T + b``."""

    def forward(self, x):
        return super().forward(x) * 2 + 1


def own_forward_task(rank, world_size, seed):
    """A layer with its own forward (a subclass's, or one set on the instance) under overlap's styles: torch's
    own style runs that forward (no op of overlap's replaces it), with a warning naming it; a plain layer beside
    it still fuses."""
    import types
    import warnings

    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import parallel as torch_tp
    from torch.distributed.tensor.parallel import parallelize_module

    from overlap.hooks import torch_tp as ours
    from overlap.ops import library

    mesh = _mesh(world_size)
    torch.manual_seed(seed)
    x = torch.randn(2, 2 * world_size, 6).chunk(world_size, 1)[rank]
    out = {}
    for kind in ("subclass", "instance"):
        mlp = nn.Sequential(nn.Linear(6, 6), nn.GELU(), _ScaledLinear(6, 6) if kind == "subclass" else nn.Linear(6, 6))
        if kind == "instance":
            mlp[2].forward = types.MethodType(lambda self, t: nn.Linear.forward(self, t) * 2 + 1, mlp[2])

        def plan(styles):
            return {"0": styles.ColwiseParallel(input_layouts=Shard(1)),
                    "2": styles.RowwiseParallel(output_layouts=Shard(1))}

        before = {op: library.CALLS[op] for op in ("all_gather_matmul", "matmul_reduce_scatter")}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mine = parallelize_module(copy.deepcopy(mlp), mesh, plan(ours))
        y_o = mine(x)
        ran = {op: library.CALLS[op] - n for op, n in before.items()}
        y_t = parallelize_module(copy.deepcopy(mlp), mesh, plan(torch_tp))(x)
        _close(y_o, y_t, f"rank {rank} {kind}: a layer's own forward vs torch's style")
        said = [str(w.message) for w in caught if "own forward" in str(w.message)]
        out[kind] = (ran, said)
    return out


def test_a_layer_with_its_own_forward_keeps_it(pools, seed):
    for res in pools(2).run(own_forward_task, seed, timeout=120):
        for kind, where in (("subclass", "_ScaledLinear.forward"), ("instance", "set on the instance")):
            ran, said = res[kind]
            assert ran == {"all_gather_matmul": 1, "matmul_reduce_scatter": 0}, (kind, ran)
            assert len(said) == 1 and where in said[0] and "RowwiseParallel" in said[0], (kind, said)
