"""Tensor- and sequence-parallel problems of real dense models: the Llama-3 presets of ``overlap bench --shape``.

A preset is one transformer layer of a model, cut for tensor parallelism over the ranks (TP = the
world size ``W``) with Megatron's sequence parallelism, ``S`` tokens per micro-batch. Its four
projections are the problems of the three tensor-parallel ops, in the ``m x k x n`` convention of
`cases` (``m = S/W``, this rank's slice of the sequence):

==========  =====================================  ========================  ====================
layer       op                                     m x k x n (per rank)      what
==========  =====================================  ========================  ====================
qkv         all_gather_matmul                      S/W x H x (Q+2KV)/W       fused Q, K, V
attn-out    matmul_reduce_scatter, _all_reduce     S/W x H/W x H             attention output
mlp-up      all_gather_matmul                      S/W x H x 2F/W            gate and up, fused
mlp-down    matmul_reduce_scatter, _all_reduce     S/W x F/W x H             down
==========  =====================================  ========================  ====================

``H`` hidden, ``F`` FFN width, ``Q = heads * head_dim = H`` and ``KV = kv_heads * head_dim``
(grouped-query attention: Llama-3 has 8 KV heads). ``matmul_all_reduce`` is tensor parallelism
without sequence parallelism: the same GEMMs, the output all-reduced over the whole sequence
``S = W*m``. Heads, KV heads, ``F`` and ``S`` must divide by ``W`` (Megatron's rule: whole heads
per rank); otherwise the preset does not apply to that many ranks (`tp_problems` says why).

The real models (`LLAMA3_8B`, `LLAMA3_70B`):

* Llama-3 8B: hidden 4096, FFN 14336 (gated SiLU), 32 heads and 8 KV heads of 128; 4096 tokens
  per micro-batch.
* Llama-3 70B: hidden 8192, FFN 28672, 64 heads and 8 KV heads of 128; 8192 tokens per
  micro-batch (its training sequence length).

Presets (`TP_PRESETS`): ``llama3-8b-full`` and ``llama3-70b-full`` are those (the GPU defaults);
``llama3-8b`` and ``llama3-70b`` are the CPU versions, every width (hidden, FFN, head dim) at
1/16 and the tokens at 1/4, heads kept (`CPU_WIDTH_SCALE`, `CPU_TOKEN_SCALE`).

Small calls, where a plain collective and ``torch.matmul`` are hard to beat (`DECODE_TOKENS`, `PREFILL_TOKENS`):
``llama3-8b-decode`` and ``llama3-70b-decode`` are one decode step of a batch of 16 sequences (16 tokens: 1 to 16
rows per rank on 16 down to 1 ranks), widths at 1/16; ``llama3-8b-prefill`` a short prompt, 128 tokens at the
same widths (a 512-token prompt at the token scale of ``llama3-8b``); ``-full`` versions at the real widths.

Why that scale. Per byte it receives, a projection does ``2*W/(W-1) * n / itemsize`` FLOPs
(all-gather: ``n`` the output columns per rank) or ``2*W/(W-1) * k / itemsize`` (reduce-scatter:
``k`` the reduction per rank); the tokens cancel. For Llama-3 8B at TP=8 in bf16 that is ~880
(qkv), ~590 (attn-out), ~4100 (mlp-up) and ~2050 (mlp-down) FLOPs per byte, against ~2000 for an
H100 over NVLink (~800 TFLOP/s, ~400 GB/s): attention's projections are communication-bound,
mlp-up compute-bound, mlp-down balanced. 2 CPU ranks (one torch thread each: ~50-120 GFLOP/s fp32
GEMMs, gloo's collectives ~0.1-0.5 GB/s) balance at a few hundred FLOPs per byte; the widths at
1/16 in fp32 on 2 ranks give 192 (qkv), 128 (attn-out), 896 (mlp-up) and 448 (mlp-down): the same
order and the same roles. Measured on the build machine (2 ranks, forward, the plain collective
alone against the GEMM alone, medians of three runs on a machine shared with other jobs, hence the
ranges): qkv 1.2-3.1 against 0.9-1.2 ms, attn-out 3.3-5.9 against 0.8-2.9 ms (all-reduce: 2.6-3.6
against 0.8-1.5), mlp-up 1.9-3.6 against 5-12 ms, mlp-down 2.5-5.8 against 2.3-5.3 ms (all-reduce:
1.4-2.1 against 2.1-3.3): the roles of the GPU, each projection with enough of both costs for
overlap to matter. The tokens set only the duration: at 1/4 a call takes milliseconds to tens of
milliseconds. The 70B versions (twice the tokens, twice the widths) cost ~7-8x the 8B's GEMMs: on
request, not in the defaults.

Sequence parallelism (DeepSpeed-Ulysses, `SP_PRESETS`, `sp_problems`): Llama-3 8B's attention over a long
sequence of ``S`` tokens, the sequence sharded over the ``W`` ranks and attention run on a shard of the heads:
``qkv`` (``matmul_all_to_all``, ``S/W x H x (Q+2KV)``: q, k and v packed as one weight, every head) and
``attn-out`` (``all_to_all_matmul``, ``S/W x Q x H``). Heads, KV heads and ``S`` must divide by ``W`` (whole heads
per rank: Llama-3's 8 KV heads bound the group at 8). Per byte a rank receives, the QKV side does
``2*W/(W-1) * k / itemsize`` FLOPs and the output side ``2*W/(W-1) * n / itemsize`` (``k`` and ``n`` the hidden
size): ~4700 in bf16 at SP=8 for the 8B model, compute-heavy on an H100 over NVLink; at 1/16 width in fp32 on 2
ranks, 256, the tensor-parallel presets' order. ``llama3-8b-32k`` and ``llama3-8b-128k`` are the CPU versions
(widths at 1/16, tokens at 1/32: 1024 and 4096 tokens); ``llama3-8b-32k-full`` and ``llama3-8b-128k-full`` the real
sizes (the GPU defaults, not yet run on a GPU).
"""

from __future__ import annotations

import dataclasses

#: the CPU presets' widths (hidden, FFN, head dim) are the real ones divided by this
CPU_WIDTH_SCALE = 16
#: ... and their tokens per micro-batch divided by this
CPU_TOKEN_SCALE = 4

#: (layer, ops it is a problem of), in the order a layer runs them: tensor parallelism (Megatron's column and
#: row layers) and, for every projection, its weight sharded by rows over the ranks (FSDP), gathered by
#: ``all_gather_weight_matmul``
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("qkv", ("all_gather_matmul", "all_gather_weight_matmul")),
    ("attn-out", ("matmul_reduce_scatter", "matmul_all_reduce", "all_gather_weight_matmul")),
    ("mlp-up", ("all_gather_matmul", "all_gather_weight_matmul")),
    ("mlp-down", ("matmul_reduce_scatter", "matmul_all_reduce", "all_gather_weight_matmul")),
)


@dataclasses.dataclass(frozen=True)
class DenseModel:
    """One dense transformer layer: `hidden`, `ffn` width (`gated`: gate and up projections fused, as
    in SwiGLU), `heads` query heads and `kv_heads` key/value heads of `head_dim`, `tokens` per micro-batch."""

    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    tokens: int
    gated: bool = True

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name != "gated" and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{f.name} must be an int >= 1, got {v!r}")
        if self.heads * self.head_dim != self.hidden:
            raise ValueError(f"heads x head_dim ({self.heads} x {self.head_dim}) must equal hidden ({self.hidden})")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must divide by kv_heads ({self.kv_heads})")

    def scaled(self, width: int, tokens: int) -> DenseModel:
        """The same layer with hidden, FFN and head dim divided by `width`, tokens by `tokens` (heads kept)."""
        for name, value, by in (("hidden", self.hidden, width), ("ffn", self.ffn, width),
                                ("head_dim", self.head_dim, width), ("tokens", self.tokens, tokens)):
            if value % by:
                raise ValueError(f"{name} ({value}) does not divide by {by}")
        return dataclasses.replace(self, hidden=self.hidden // width, ffn=self.ffn // width,
                                   head_dim=self.head_dim // width, tokens=self.tokens // tokens)

    @property
    def spec(self) -> str:
        return (f"hidden {self.hidden}, ffn {self.ffn}{' (gated)' if self.gated else ''}, "
                f"{self.heads} heads / {self.kv_heads} KV heads of {self.head_dim}, {self.tokens} tokens")


LLAMA3_8B = DenseModel(hidden=4096, ffn=14336, heads=32, kv_heads=8, head_dim=128, tokens=4096)
LLAMA3_70B = DenseModel(hidden=8192, ffn=28672, heads=64, kv_heads=8, head_dim=128, tokens=8192)

_CPU = f"widths at 1/{CPU_WIDTH_SCALE}, tokens at 1/{CPU_TOKEN_SCALE}"

#: tokens of the decode presets: one step of 16 sequences
DECODE_TOKENS = 16
#: tokens of the short-prompt prefill preset at CPU widths
PREFILL_TOKENS = 128


def _tokens(model: DenseModel, tokens: int, width: int = 1) -> DenseModel:
    """`model` with `tokens` per micro-batch and its widths divided by `width`."""
    return dataclasses.replace(model.scaled(width, 1), tokens=tokens)


#: name -> (layer, what it is); the scaling is explained in the module docstring
TP_PRESETS: dict[str, tuple[DenseModel, str]] = {
    "llama3-8b": (LLAMA3_8B.scaled(CPU_WIDTH_SCALE, CPU_TOKEN_SCALE), f"Llama-3 8B ({LLAMA3_8B.spec}), {_CPU}"),
    "llama3-70b": (LLAMA3_70B.scaled(CPU_WIDTH_SCALE, CPU_TOKEN_SCALE), f"Llama-3 70B ({LLAMA3_70B.spec}), {_CPU}"),
    "llama3-8b-full": (LLAMA3_8B, "Llama-3 8B at full size"),
    "llama3-70b-full": (LLAMA3_70B, "Llama-3 70B at full size"),
    "llama3-8b-decode": (_tokens(LLAMA3_8B, DECODE_TOKENS, CPU_WIDTH_SCALE),
                         f"Llama-3 8B decoding {DECODE_TOKENS} sequences, widths at 1/{CPU_WIDTH_SCALE}"),
    "llama3-70b-decode": (_tokens(LLAMA3_70B, DECODE_TOKENS, CPU_WIDTH_SCALE),
                          f"Llama-3 70B decoding {DECODE_TOKENS} sequences, widths at 1/{CPU_WIDTH_SCALE}"),
    "llama3-8b-prefill": (_tokens(LLAMA3_8B, PREFILL_TOKENS, CPU_WIDTH_SCALE),
                          f"Llama-3 8B on a {PREFILL_TOKENS}-token prompt, widths at 1/{CPU_WIDTH_SCALE}"),
    "llama3-8b-full-decode": (_tokens(LLAMA3_8B, DECODE_TOKENS), f"Llama-3 8B decoding {DECODE_TOKENS} sequences"),
    "llama3-70b-full-decode": (_tokens(LLAMA3_70B, DECODE_TOKENS), f"Llama-3 70B decoding {DECODE_TOKENS} sequences"),
}


def tp_problem(model: DenseModel, world_size: int) -> str | None:
    """Why `model` cannot be cut for tensor parallelism over `world_size` ranks, or None."""
    W = world_size
    bad = [f"{what} ({v})" for what, v in (("heads", model.heads), ("kv_heads", model.kv_heads),
                                           ("ffn", model.ffn), ("tokens", model.tokens)) if v % W]
    if bad:
        return f"{', '.join(bad)} do not divide by the tensor-parallel size {W} (the ranks)"
    return None


def tp_problems(model: DenseModel, world_size: int) -> list[tuple[str, str, tuple[int, int, int]]]:
    """``[(layer, op, (m, k, n)), ...]`` of `model` at TP = `world_size` (``all_gather_weight_matmul``: its
    weights sharded over `world_size` ranks), in `LAYERS` order, per op in the order the layer lists them
    (see the module docstring). Raises ValueError where `tp_problem` gives a reason."""
    why = tp_problem(model, world_size)
    if why:
        raise ValueError(why)
    W, H, hd = world_size, model.hidden, model.head_dim
    m = model.tokens // W  # tensor parallelism: a slice of the sequence; FSDP: each rank's own batch
    whole = {  # (in, out) features of each projection's whole weight
        "qkv": (H, (model.heads + 2 * model.kv_heads) * hd),
        "attn-out": (H, H),
        "mlp-up": (H, (2 if model.gated else 1) * model.ffn),
        "mlp-down": (model.ffn, H),
    }

    from ..plans import op_spec  # (here: the command line imports this module without torch)

    def dims(layer: str, op: str) -> tuple[int, int, int]:
        k, n = whole[layer]
        # the op table says which dim a rank holds a slice of: the row-parallel ops take every rank's rows
        # of the input (their reduction is split), the others a slice of the weight's output features
        return (m, k // W, n) if op_spec(op).in_rows(1, W) > 1 else (m, k, n // W)

    return [(layer, op, dims(layer, op)) for layer, ops in LAYERS for op in ops]


def layer_split(model: DenseModel, layer: str, world_size: int) -> tuple[int, ...]:
    """The weights a fused projection is made of, as its columns per rank: q, k and v of ``qkv``, gate and up of a
    gated ``mlp-up`` (the several-weight form of `tp_problems`' fused ``n``; empty for the other layers)."""
    W, hd = world_size, model.head_dim
    if layer == "qkv":
        return (model.heads * hd // W, model.kv_heads * hd // W, model.kv_heads * hd // W)
    if layer == "mlp-up" and model.gated:
        return (model.ffn // W, model.ffn // W)
    return ()


def parse_tp_preset(text: str) -> str | None:
    """The `TP_PRESETS` name `text` spells (case and surrounding blanks ignored), or None."""
    name = text.strip().lower()
    return name if name in TP_PRESETS else None


# ----------------------------------------------------------------------------------------------
# Sequence parallelism (DeepSpeed-Ulysses): the attention projections of a long-context layer
# ----------------------------------------------------------------------------------------------

#: (layer, op) of a sequence-parallel layer's attention, in the order it runs them: the q/k/v projections then the
#: all-to-all to heads (``matmul_all_to_all``), the all-to-all back then the output projection (``all_to_all_matmul``)
SP_LAYERS: tuple[tuple[str, str], ...] = (("qkv", "matmul_all_to_all"), ("attn-out", "all_to_all_matmul"))

#: the CPU sequence-parallel presets' tokens are the real sequence's divided by this (widths: `CPU_WIDTH_SCALE`)
SP_CPU_TOKEN_SCALE = 32


def _sequence(model: DenseModel, tokens: int, width: int = 1, token_scale: int = 1) -> DenseModel:
    """`model` over a sequence of `tokens` (divided by `token_scale`), its widths divided by `width`."""
    return dataclasses.replace(model.scaled(width, 1), tokens=tokens // token_scale)


_SP_CPU = f"widths at 1/{CPU_WIDTH_SCALE}, tokens at 1/{SP_CPU_TOKEN_SCALE}"

#: name -> (layer, what it is): Llama-3 8B's attention over a long sequence, cut for sequence parallelism over the
#: ranks (SP = the world size ``W``, `sp_problems`). ``-full``: the real sizes (the GPU defaults); the others scaled
#: for CPU ranks, widths at 1/16 as the tensor-parallel presets (`CPU_WIDTH_SCALE`: the same balance of compute and
#: communication per projection) and the tokens at 1/32 (`SP_CPU_TOKEN_SCALE`: 1024 tokens for 32k, 512 rows per
#: rank on 2 ranks, a call of a few milliseconds; the tokens cancel out of that balance, so they set the duration)
SP_PRESETS: dict[str, tuple[DenseModel, str]] = {
    "llama3-8b-32k": (_sequence(LLAMA3_8B, 32768, CPU_WIDTH_SCALE, SP_CPU_TOKEN_SCALE),
                      f"Llama-3 8B attention over a 32k-token sequence, {_SP_CPU}"),
    "llama3-8b-128k": (_sequence(LLAMA3_8B, 131072, CPU_WIDTH_SCALE, SP_CPU_TOKEN_SCALE),
                       f"Llama-3 8B attention over a 128k-token sequence, {_SP_CPU}"),
    "llama3-8b-32k-full": (_sequence(LLAMA3_8B, 32768), "Llama-3 8B attention over a 32k-token sequence, full size"),
    "llama3-8b-128k-full": (_sequence(LLAMA3_8B, 131072),
                            "Llama-3 8B attention over a 128k-token sequence, full size"),
}


def sp_problem(model: DenseModel, world_size: int) -> str | None:
    """Why `model`'s attention cannot be cut for sequence parallelism over `world_size` ranks, or None: every rank
    gets whole query and key/value heads (Ulysses' rule; the key/value heads bound the group's size) and an equal
    shard of the sequence."""
    W = world_size
    bad = [f"{what} ({v})" for what, v in (("heads", model.heads), ("kv_heads", model.kv_heads),
                                           ("tokens", model.tokens)) if v % W]
    if bad:
        return f"{', '.join(bad)} do not divide by the sequence-parallel size {W} (the ranks)"
    return None


def sp_problems(model: DenseModel, world_size: int) -> list[tuple[str, str, tuple[int, int, int]]]:
    """``[(layer, op, (m, k, n)), ...]`` of `model`'s attention at SP = `world_size`, in `SP_LAYERS` order, in the
    sequence-parallel ops' ``m x k x n`` (`overlap.plans.sp_ops`): ``m = S/W`` rows of this rank's sequence shard;
    ``qkv``: ``k`` = hidden, ``n = (heads + 2*kv_heads) * head_dim``, q, k and v packed as one weight (the same bytes
    and FLOPs as three: each destination's columns of every weight travel as one block); ``attn-out``: ``k =
    heads * head_dim``, ``n`` = hidden. Raises ValueError where `sp_problem` gives a reason."""
    why = sp_problem(model, world_size)
    if why:
        raise ValueError(why)
    m, hd = model.tokens // world_size, model.head_dim
    dims = {"qkv": (m, model.hidden, (model.heads + 2 * model.kv_heads) * hd),
            "attn-out": (m, model.heads * hd, model.hidden)}
    return [(layer, op, dims[layer]) for layer, op in SP_LAYERS]


def parse_sp_preset(text: str) -> str | None:
    """The `SP_PRESETS` name `text` spells (case and surrounding blanks ignored), or None."""
    name = text.strip().lower()
    return name if name in SP_PRESETS else None
