"""`overlap.hooks.megatron.patch` on Megatron-core's ``MoELayer``: against Megatron's own all-to-all dispatcher.

Megatron's MoE layer runs on gloo CPU ranks with its CUDA plumbing stubbed (`tests.support.megatron_moe`), its MoE
logic untouched. Each case runs the layer with Megatron's dispatcher, then patched, on the same ranks, inputs
and parameters: the output and the gradients of the input, the router and every expert weight (and the shared
experts') agree within ``rtol=atol=1e-5`` (fp32), Megatron's all-to-all does not run in the patched layer, and
`unpatch` gives Megatron's layer back. W=2: EP2; W=4: EP4 x TP1 and EP2 x TP2 (expert tensor parallel 1, with
sequence parallelism).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.support import megatron_groups

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[test]')")

SEQ, BATCH = 6, 2  # tokens per rank: s x b


class Holder(torch.nn.Module):
    """A model around one MoE layer (`patch` takes the model that contains the layer)."""

    def __init__(self, layer):
        super().__init__()
        self.moe = layer

    def forward(self, x):
        y, bias = self.moe(x)
        assert bias is None
        return y


def _dispatcher_calls():
    """A counter of Megatron's all-to-alls in its token dispatcher (installed while the task runs)."""
    from megatron.core.transformer.moe import token_dispatcher

    counts = {"all_to_all": 0}
    original = token_dispatcher.all_to_all

    def counted(*args, **kwargs):
        counts["all_to_all"] += 1
        return original(*args, **kwargs)

    token_dispatcher.all_to_all = counted
    return counts, lambda: setattr(token_dispatcher, "all_to_all", original)


def _inputs(rank, seed, hidden, hot=None):
    """This rank's ``(x, grad of the output)``, ``[SEQ, BATCH, hidden]``."""
    gen = torch.Generator().manual_seed(seed + 100 + rank)
    x = torch.randn(SEQ, BATCH, hidden, generator=gen)
    if hot is not None:
        x[..., 0] = 3.0  # with the router's first column (`_send_all_to`): every token to the `hot` experts
    return x, torch.randn(SEQ, BATCH, hidden, generator=gen)


def _send_all_to(layer, experts):
    """The router's first column: 4 for `experts`, -4 for the others (inputs' feature 0 is 3): a logit gap of 24
    against the others' ~1. (Not larger: the input's gradient sums the router's column times the logits'
    gradients, which cancel, so its rounding grows with the column.)"""
    with torch.no_grad():
        col = torch.full((layer.config.num_moe_experts,), -4.0)
        col[list(experts)] = 4.0
        layer.router.weight[:, 0] = col


def _run(model, x, g):
    """Forward and backward; the output, the input's gradient and every parameter's gradient (then zeroed)."""
    x = x.clone().requires_grad_(True)
    y = model(x)
    y.backward(g)
    grads = {}
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        grads[name] = p.grad.clone()
        p.grad = None
    return y.detach(), x.grad, grads


def _counted_runs(megatrons, ours, x, g):
    """`_run` of Megatron's model, then of the patched one, each with its count of Megatron's all-to-alls."""
    counts, restore = _dispatcher_calls()
    try:
        want = _run(megatrons, x, g)
        a2a = [counts["all_to_all"]]
        got = _run(ours, x, g)
        a2a.append(counts["all_to_all"] - a2a[0])
    finally:
        restore()
    return want, got, a2a


def _excess(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest ``|got - want| - rtol * |want|`` (rtol 1e-5): at most atol (1e-5) where they agree as
    ``torch.testing.assert_close(rtol=1e-5, atol=1e-5)`` asks."""
    if got.numel() == 0:
        return 0.0
    return ((got - want).abs() - 1e-5 * want.abs()).max().item()


def patched_vs_megatron(rank, world_size, seed, tp, options, hot=None):
    """Megatron's layer, then patched, on the same inputs: the largest differences (and the dispatcher's
    all-to-all counts with each)."""
    import overlap.hooks.megatron as om
    from tests.support.megatron_moe import cuda_plumbing, moe_config, moe_layer, parallel_state

    with cuda_plumbing():
        parallel_state(tp, world_size // tp)
        config = moe_config(tp, world_size // tp, **options)
        model = Holder(moe_layer(config, seed))
        if hot is not None:
            _send_all_to(model.moe, hot)
        x, g = _inputs(rank, seed, config.hidden_size, hot)
        counts, restore = _dispatcher_calls()
        try:
            y_ref, gx_ref, grads_ref = _run(model, x, g)
            a2a = [counts["all_to_all"]]
            keys = list(model.state_dict())
            replaced = om.patch(model)
            # the MoE layer, and the (not overlapped) shared experts' parallel linears as any dense layer's
            assert type(replaced[0].replacement).__name__ == "OverlapMoELayer", replaced
            assert all(r.name.startswith("moe.shared_experts.linear_fc") for r in replaced[1:]), replaced
            assert len(replaced) == (3 if options.get("moe_shared_expert_intermediate_size")
                                     and not options.get("moe_shared_expert_overlap") else 1), replaced
            assert isinstance(model.moe, type(replaced[0].original))
            assert list(model.state_dict()) == keys
            y, gx, grads = _run(model, x, g)
            a2a.append(counts["all_to_all"] - a2a[0])
            om.unpatch(model, replaced)
            assert type(model.moe).__name__ == "MoELayer"
            y_back, _, _ = _run(model, x, g)
        finally:
            restore()
    errors = {"out": _excess(y, y_ref), "grad x": _excess(gx, gx_ref), "unpatched out": _excess(y_back, y_ref)}
    assert grads.keys() == grads_ref.keys(), (grads.keys(), grads_ref.keys())
    for name, grad in grads.items():
        errors[f"grad {name}"] = _excess(grad, grads_ref[name])
    if hot is not None:  # the experts no token went to: exactly zero gradients
        first = rank * config.num_moe_experts // world_size
        for name, grad in grads.items():
            if ".local_experts." in name and first + int(name.split(".local_experts.")[1].split(".")[0]) not in hot:
                errors[f"empty expert {name}"] = grad.abs().max().item() + grads_ref[name].abs().max().item()
        local = range(first, first + config.num_moe_experts // world_size)
        assert any(k.startswith("empty expert") for k in errors) == any(e not in hot for e in local), list(errors)
    return errors, a2a


def _check(results):
    for rank, (errors, a2a) in enumerate(results):
        bad = {k: v for k, v in errors.items() if not v <= 1e-5}
        assert not bad, f"rank {rank}: {bad}"
        assert a2a[0] > 0 and a2a[1] == 0, f"rank {rank}: Megatron's all-to-alls (Megatron's run, patched): {a2a}"


#: Megatron configurations (TransformerConfig fields over `tests.support.megatron_moe.moe_config`'s defaults)
CASES = {
    "top1": {"moe_router_topk": 1, "moe_router_pre_softmax": True},
    "top2-aux-z": {"moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.1, "moe_z_loss_coeff": 0.01},
    "top8": {"num_moe_experts": 8, "moe_router_topk": 8},
    "swiglu-shared": {"gated_linear_unit": True, "activation_func": torch.nn.functional.silu,
                      "moe_shared_expert_intermediate_size": 20},
    "shared-gated-overlapped": {"moe_shared_expert_intermediate_size": 20, "moe_shared_expert_gate": True,
                                "moe_shared_expert_overlap": True},
    "pre-softmax-scaled": {"moe_router_pre_softmax": True, "moe_router_topk_scaling_factor": 2.5},
    "sigmoid-expert-bias": {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
                            "moe_router_topk_scaling_factor": 1.5},
    "capacity-drop": {"moe_expert_capacity_factor": 0.5, "moe_router_load_balancing_type": "aux_loss",
                      "moe_aux_loss_coeff": 0.01},
    "probs-on-input": {"moe_router_topk": 1, "moe_router_pre_softmax": True, "moe_apply_probs_on_input": True},
    "probs-on-input-drop": {"moe_router_topk": 1, "moe_router_pre_softmax": True, "moe_apply_probs_on_input": True,
                            "moe_expert_capacity_factor": 0.5},
}


@pytest.mark.parametrize("case", list(CASES))
def test_patched_moe_layer_matches_megatron_ep2(pools, seed, case):
    _check(pools(2).run(patched_vs_megatron, seed, 1, CASES[case], timeout=180))


#: (TP, case) at W=4: EP4 x TP1 and EP2 x TP2 (sequence parallel)
CASES_W4 = [(tp, case) for tp in (1, 2) for case in ("top2-aux-z", "top8", "swiglu-shared", "shared-gated-overlapped",
                                                   "capacity-drop")]


@pytest.mark.parametrize("tp,case", CASES_W4)
def test_patched_moe_layer_matches_megatron_w4(pools, seed, tp, case):
    _check(pools(4).run(patched_vs_megatron, seed, tp, CASES[case], timeout=240))


@pytest.mark.parametrize("hot", [(0, 1), (0, 2)], ids=["rank1-gets-nothing", "one-expert-per-rank-empty"])
@pytest.mark.parametrize("case", ["top2-aux-z", "swiglu-shared"])
def test_experts_that_get_no_token(pools, seed, case, hot):
    """Every token of every rank to the experts `hot` (2 experts per rank): with ``(0, 1)`` rank 1 receives
    nothing and every expert of it is empty, with ``(0, 2)`` one expert of each rank is. Their gradients are
    zeros (not None), as Megatron's. (A rank that passes no token at all cannot be compared: Megatron's router
    fails on an empty input.)"""
    _check(pools(2).run(patched_vs_megatron, seed, 1, CASES[case], hot=hot, timeout=180))


def grouped_layout(rank, world_size, seed, options):
    """The legacy ``GroupedMLP`` (built with its kernel package's availability check stubbed: the package has no
    CPU build, and Megatron's forward of it cannot run here), patched, against Megatron's ``SequentialMLP`` layer
    holding the same expert weights in its layout, run by Megatron: the replacement reads ``weight1``/``weight2``
    as Megatron lays them out."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe import grouped_gemm_util
    from megatron.core.transformer.spec_utils import build_module

    import overlap.hooks.megatron as om
    from tests.support.megatron_moe import cuda_plumbing, moe_config, moe_layer, parallel_state

    with cuda_plumbing():
        parallel_state(1, world_size)
        config = moe_config(1, world_size, **options)
        sequential = Holder(moe_layer(config, seed))
        check = grouped_gemm_util.assert_grouped_gemm_is_available
        grouped_gemm_util.assert_grouped_gemm_is_available = lambda: None
        try:
            spec = get_moe_module_spec(use_te=False, num_experts=config.num_moe_experts, moe_grouped_gemm=True,
                                       moe_use_legacy_grouped_gemm=True)
            grouped = Holder(build_module(spec, config=config))
        finally:
            grouped_gemm_util.assert_grouped_gemm_is_available = check
        assert type(grouped.moe.experts).__name__ == "GroupedMLP"
        L, H = grouped.moe.num_local_experts, config.hidden_size
        local = sequential.moe.experts.local_experts
        with torch.no_grad():
            grouped.moe.router.weight.copy_(sequential.moe.router.weight)
            grouped.moe.experts.weight1.view(L, H, -1).copy_(torch.stack([e.linear_fc1.weight.t() for e in local]))
            grouped.moe.experts.weight2.view(L, -1, H).copy_(torch.stack([e.linear_fc2.weight.t() for e in local]))
        om.patch(grouped)
        x, g = _inputs(rank, seed, H)
        (y_ref, gx_ref, grads_ref), (y, gx, grads), a2a = _counted_runs(sequential, grouped, x, g)
    w1 = torch.stack([grads_ref[f"moe.experts.local_experts.{j}.linear_fc1.weight"].t() for j in range(L)])
    w2 = torch.stack([grads_ref[f"moe.experts.local_experts.{j}.linear_fc2.weight"].t() for j in range(L)])
    return {"out": _excess(y, y_ref), "grad x": _excess(gx, gx_ref),
            "grad router": _excess(grads["moe.router.weight"], grads_ref["moe.router.weight"]),
            "grad weight1": _excess(grads["moe.experts.weight1"].view(L, H, -1), w1),
            "grad weight2": _excess(grads["moe.experts.weight2"].view(L, -1, H), w2)}, a2a


@pytest.mark.parametrize("case", ["top2-aux-z", "swiglu-shared"])
def test_grouped_experts_are_read_in_megatrons_layout(pools, seed, case):
    options = {k: v for k, v in CASES[case].items() if "shared" not in k}
    _check(pools(2).run(grouped_layout, seed, options, timeout=180))


# ----------------------------------------------------------------------------------------------
# Checkpoints, specs, refusals
# ----------------------------------------------------------------------------------------------


def _tensors(model):
    """The tensors of `model`'s state dict (Megatron's layers add ``_extra_state`` entries that are None)."""
    return {k: v for k, v in model.state_dict().items() if torch.is_tensor(v)}


def checkpoints_and_specs(rank, world_size, seed):
    """A state dict saved before patching loads after it (strict) and back; a layer built from
    `replace_in_spec`'s spec has Megatron's keys, shapes and dtypes and, given Megatron's parameters, its
    numbers."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.spec_utils import build_module

    import overlap.hooks.megatron as om
    from tests.support.megatron_moe import cuda_plumbing, moe_config, moe_layer, parallel_state

    with cuda_plumbing():
        parallel_state(1, world_size)
        config = moe_config(1, world_size, **CASES["swiglu-shared"])
        model = Holder(moe_layer(config, seed))
        saved = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
        replaced = om.patch(model)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        model.load_state_dict(saved, strict=True)  # saved before patching, loaded into the patched model
        assert all(torch.equal(v, saved[k]) for k, v in _tensors(model).items())
        after = {k: (v.shape, v.dtype) for k, v in _tensors(model).items()}
        assert after.keys() == saved.keys()
        om.unpatch(model, replaced)
        assert after == {k: (v.shape, v.dtype) for k, v in _tensors(model).items()}

        spec = om.replace_in_spec(get_moe_module_spec(use_te=False, num_experts=config.num_moe_experts))
        torch.manual_seed(seed)
        built = Holder(build_module(spec, config=config))
        assert type(built.moe).__name__ == "OverlapMoELayer", type(built.moe)
        with warnings.catch_warnings(record=True) as caught:  # patching it again: its experts are not named
            warnings.simplefilter("always")
            again = om.patch(built)
        assert not [str(w.message) for w in caught if "local_experts" in str(w.message)], caught
        assert all(type(r.replacement).__name__ != "OverlapMoELayer" for r in again), again
        om.unpatch(built, again)
        assert {k: (v.shape, v.dtype) for k, v in _tensors(built).items()} == after
        built.load_state_dict(saved, strict=True)
        x, g = _inputs(rank, seed, config.hidden_size)
        (y_ref, gx_ref, grads_ref), (y, gx, grads), a2a = _counted_runs(model, built, x, g)
    errors = {"out": _excess(y, y_ref), "grad x": _excess(gx, gx_ref)}
    errors.update({f"grad {k}": _excess(v, grads_ref[k]) for k, v in grads.items()})
    return errors, a2a


def test_checkpoints_load_across_the_patch_and_specs_build_the_replacement(pools, seed):
    _check(pools(2).run(checkpoints_and_specs, seed, timeout=180))


def refusals(rank, world_size, options, etp):
    """`patch` on a layer with an unsupported option: NotImplementedError naming it, nothing replaced."""
    from megatron.core import parallel_state as ps

    import overlap.hooks.megatron as om
    from tests.support.megatron_moe import cuda_plumbing, moe_config, moe_layer

    with cuda_plumbing():
        megatron_groups.reset(ps)
        ps.initialize_model_parallel(expert_model_parallel_size=world_size // etp, expert_tensor_parallel_size=etp)
        config = moe_config(1, world_size // etp, expert_tensor_parallel_size=etp, **options)
        model = Holder(moe_layer(config, 0))
        before = dict(model.named_modules())
        try:
            om.patch(model)
        except NotImplementedError as exc:
            message = str(exc)
        else:
            message = None
        assert dict(model.named_modules()) == before
    return message


@pytest.mark.parametrize("options,etp,named", [
    ({"moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True}, 1,
     "moe_pad_expert_input_to_capacity"),
    ({}, 2, "expert_tensor_parallel_size=2"),
], ids=["pad-to-capacity", "expert-tensor-parallel"])
def test_patch_refuses_what_it_does_not_implement(pools, options, etp, named):
    messages = pools(2).run(refusals, options, etp, timeout=120)
    assert all(m is not None and named in m for m in messages), messages


# ----------------------------------------------------------------------------------------------
# A small Megatron GPT with MoE layers: training steps
# ----------------------------------------------------------------------------------------------

VOCAB, GPT_SEQ, STEPS = 64, 8, 4


def _gpt(config, seed):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    torch.manual_seed(seed)
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=GPT_SEQ)


def _train(model, batches, dp_group):
    """`STEPS` Adam steps, the replicated parameters' gradients averaged over the data-parallel ranks (the
    experts' are each rank's own: expert data parallel 1); the losses (this rank's mean per step)."""
    import torch.distributed as dist

    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    mask = torch.triu(torch.ones(1, 1, GPT_SEQ, GPT_SEQ, dtype=torch.bool), diagonal=1)  # True: masked out
    position = torch.arange(GPT_SEQ).unsqueeze(0)
    losses = []
    for tokens, labels in batches:
        loss = model(tokens, position.expand_as(tokens), mask, labels=labels).mean()
        loss.backward()
        for p in model.parameters():
            if p.grad is not None and getattr(p, "allreduce", True):
                dist.all_reduce(p.grad, group=dp_group)
                p.grad /= dist.get_world_size(dp_group)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def gpt_training(rank, world_size, seed, options):
    """Megatron's GPT with MoE layers trained `STEPS` steps, then the same from the same start patched."""
    import overlap.hooks.megatron as om
    from tests.support.megatron_moe import cuda_plumbing, moe_config, parallel_state

    with cuda_plumbing():
        ps = parallel_state(1, world_size)
        config = moe_config(1, world_size, num_layers=2, hidden_dropout=0.0, attention_dropout=0.0, **options)
        gen = torch.Generator().manual_seed(seed + 1000 + rank)
        batches = [(torch.randint(0, VOCAB, (2, GPT_SEQ), generator=gen),
                    torch.randint(0, VOCAB, (2, GPT_SEQ), generator=gen)) for _ in range(STEPS)]
        model = _gpt(config, seed)
        start = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
        dp = ps.get_data_parallel_group()
        want = _train(model, batches, dp)
        missing = model.load_state_dict(start, strict=False).missing_keys
        assert all(k.endswith("._extra_state") for k in missing), missing  # Megatron's None entries
        replaced = om.patch(model)
        moe = [r for r in replaced if type(r.replacement).__name__ == "OverlapMoELayer"]
        assert len(moe) == config.num_layers, replaced
        got = _train(model, batches, dp)
    return want, got


@pytest.mark.parametrize("case", ["top2-aux-z", "swiglu-shared"])
def test_gpt_with_moe_layers_trains_as_megatron(pools, seed, case):
    """A 2-layer Megatron ``GPTModel`` with MoE MLPs (EP2): the same losses over `STEPS` Adam steps."""
    options = dict(CASES[case], moe_token_dispatcher_type="alltoall")
    for rank, (want, got) in enumerate(pools(2).run(gpt_training, seed, options, timeout=240)):
        note = f"rank {rank}: losses {got} vs Megatron's {want}"
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-5,
                                   msg=lambda m, note=note: f"{note}: {m}")


# ----------------------------------------------------------------------------------------------
# Routing that changes every step: nothing re-planned or re-allocated
# ----------------------------------------------------------------------------------------------


def fresh_routing_steps(rank, world_size, seed, steps):
    """`steps` forward+backward steps of a patched layer in the bounded mode (``patch(...,
    max_tokens_per_rank=)``), fresh tokens (so a fresh routing) each step: per step after the first, the
    host rendezvous, heap growths and distinct plan problems resolved; and the rows each step sent."""
    import overlap.hooks.megatron as om
    from overlap import symm
    from overlap.ops.moe import entry
    from overlap.symm import heap
    from tests.support.megatron_moe import cuda_plumbing, moe_config, moe_layer, parallel_state

    with cuda_plumbing():
        parallel_state(1, world_size)
        config = moe_config(1, world_size, **CASES["top2-aux-z"])
        model = Holder(moe_layer(config, seed))
        om.patch(model, max_tokens_per_rank=SEQ * BATCH)  # auto: symm on one node's CPU ranks
        seen = {"grow": 0, "problems": set()}
        grow, resolve = heap.SymmHeap._grow, entry.resolve_auto

        def counted_grow(self, *args, **kwargs):
            seen["grow"] += 1
            return grow(self, *args, **kwargs)

        def recorded_resolve(*args, **kwargs):
            seen["problems"].add(kwargs.get("problem"))
            return resolve(*args, **kwargs)

        heap.SymmHeap._grow, entry.resolve_auto = counted_grow, recorded_resolve
        try:
            per_step, routings = [], []
            for step in range(steps):
                before = (symm.host_sync_counts()["rendezvous"], seen["grow"], len(seen["problems"]))
                x, g = _inputs(rank, seed + 31 * step, config.hidden_size)
                _run(model, x, g)
                probs, routing_map = model.moe.router(x.reshape(-1, x.shape[-1]))
                routings.append(routing_map.sum(0).tolist())
                after = (symm.host_sync_counts()["rendezvous"], seen["grow"], len(seen["problems"]))
                per_step.append([a - b for a, b in zip(after, before, strict=True)])
        finally:
            heap.SymmHeap._grow, entry.resolve_auto = grow, resolve
    return per_step, routings


def test_fresh_routing_every_step_is_not_replanned_or_reallocated(pools, seed):
    """10 steps of fresh routing through ``patch(model, max_tokens_per_rank=...)``: after step 1, no host
    rendezvous, no heap growth and no new plan problem (so the same plan, no plan-file or cost-model lookup
    that the first step did not make); the routing did change."""
    steps = 10
    for rank, (per_step, routings) in enumerate(pools(2).run(fresh_routing_steps, seed, steps, timeout=240)):
        assert per_step[0][2] > 0, f"rank {rank}: auto resolved no plan: {per_step}"
        assert all(d == [0, 0, 0] for d in per_step[1:]), f"rank {rank}: (rendezvous, growths, problems) {per_step}"
        assert len({tuple(r) for r in routings}) > 1, f"rank {rank}: the routing never changed: {routings}"


# ----------------------------------------------------------------------------------------------
# The docs' snippet
# ----------------------------------------------------------------------------------------------


def _docs_snippet() -> str:
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "integrations.md").read_text()
    section = text.split("\n## MoE in Megatron-core\n", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def docs_snippet(rank, world_size, code):
    """The snippet of docs/integrations.md, as written, with Megatron's CUDA plumbing stubbed."""
    import math

    from megatron.core import parallel_state as ps

    from tests.support.megatron_moe import cuda_plumbing

    with cuda_plumbing():
        megatron_groups.reset(ps)
        namespace: dict = {}
        exec(compile(code, "docs/integrations.md", "exec"), namespace)
        model = namespace["model"]
        experts = [p for n, p in model.named_parameters() if ".local_experts." in n]
        assert experts and all(p.grad is not None for p in experts)
        return math.isfinite(namespace["loss"].item())


def test_the_docs_snippet_runs(pools):
    code = _docs_snippet()
    assert "om.patch(model)" in code
    assert all(pools(2).run(docs_snippet, code, timeout=180))
