"""Published GPU measurements of communication/GEMM overlap, as their sources give them (read, never copied: each
row quotes its numbers and names where they are). `bench.published` holds the cost model against them.

Shapes are written in this project's convention (`overlap.plans.Problem`: every rank's GEMM is
``[W*m, k] @ [k, n]``); each row's `note` says how the source's shape maps to it. Times are seconds. A row's `role`
is ``calibrate`` (the constants of `overlap.plans.presets` were chosen with it in view) or ``held-out`` (never
looked at while choosing them: its error is the one that counts).
"""

from __future__ import annotations

import dataclasses

from overlap.plans import Problem


@dataclasses.dataclass(frozen=True)
class Published:
    """One published measurement.

    kind: ``op`` (one op of the table, `problems` a single problem: fused against unfused), ``layer`` (the sum of
    `problems`, each fused against unfused: a tensor-parallel MLP), ``concurrent`` (a GEMM and an independent
    all-gather, one after the other against side by side: `problems` is the all-gather's ``all_gather_matmul``
    whose GEMM is the independent one) or ``bandwidth`` (communication alone: `fused_s` holds the published
    bandwidth in bytes/s, `unfused_s` None). A row read from a figure of ratios has no times: its `speedup`.
    strategy: the strategy of this project the published fused code corresponds to (``fused``: one kernel whose
    tiles wait for their chunk, as Flux and Triton-distributed; ``symm``: copy-engine transfers beside a GEMM,
    as PyTorch's symmetric-memory async-TP).
    machine: a preset of `overlap.plans.presets`, `link_Bps` overriding its fabric (the A800 is an A100 whose
    NVLink is cut to 400 GB/s both directions), `nodes` and `gpus_per_node` the cluster.
    """

    name: str
    source: str
    quote: str
    machine: str
    kind: str
    problems: tuple[Problem, ...]
    unfused_s: float | None
    fused_s: float | None
    strategy: str = "fused"
    role: str = "held-out"
    link_Bps: float = 0.0
    gpus_per_node: int = 8
    nodes: int = 1
    note: str = ""
    speedup: float = 0.0  # published unfused/fused where the source gives the ratio alone (times None)
    band: tuple[float, float] = ()  # (speedup, times) a row outside the goal is held to, with `why`; () the goal's
    why: str = ""

    @property
    def published_speedup(self) -> float | None:
        if self.speedup:
            return self.speedup
        return self.unfused_s / self.fused_s if self.unfused_s and self.fused_s else None


FLUX_OLD = "bytedance/flux README.md at commit 239a13d (2024-07), section Performance (8 GPUs, TP=8, torch+nccl)"
KRAKEN_AG = "meta-pytorch/kraken pull request 2 (2025-06), 8xH100 table (microseconds)"
KRAKEN_RS = "meta-pytorch/kraken pull request 19 (2025-07), 8xH100, bf16 (milliseconds)"
TD_E2E = "ByteDance-Seed/Triton-distributed docs/getting-started/e2e/e2e_dense.md, Perf on 8xH800 (milliseconds)"
TORCH_CE = "pytorch/pytorch pull request 172714 (2026-01), bench_overlapped_matmul_allgather.py on 8xH100"
DEEPEP = ("deepseek-ai/DeepEP docs/legacy.md (the V1 README's tables): normal kernels on H800, 4096 tokens, hidden "
          "7168, top-8, FP8 dispatch, BF16 combine")

TD_FIG = ("ByteDance-Seed/Triton-distributed README.md, Performance, figure '{}' (relative performance against "
          "PyTorch+NCCL = 1.0, bars read from the figure, +-0.03; its Triton-distributed bars)")
CE_FLOOR = ("the published kernel takes ~0.3 ms at every size (0.308, 0.315, 0.410 ms for 512 to 2048 rows): a "
            "fixed cost of that kernel (a cross-rank barrier, copy-engine setup) ten times the model's per-call "
            "constant; at 2048 rows, where the GEMM outweighs it, the model agrees")
A800_LINK = 200e9  # NVLink 400 GB/s both directions


def _td_ag(M: int, N: int, K: int, speedup: float) -> Published:
    """A bar of Triton-distributed's single-node AllGather GEMM figure: M rows gathered over 8 ranks, N columns
    split over them (its test script's convention), K the reduction."""
    return Published(f"td-ag-h800-{M}x{N}x{K}", TD_FIG.format("AllGather GEMM on single node of H800x8"),
                     f"bar m{M}_n{N}_k{K}: {speedup}", "h800", "op",
                     (Problem("all_gather_matmul", M // 8, K, N // 8, "bfloat16"),), None, None, speedup=speedup,
                     note="M global (M/8 rows per rank), N split over the ranks; dtype not stated, bf16 assumed")


def _td_rs(M: int, N: int, K: int, speedup: float) -> Published:
    """A bar of Triton-distributed's single-node GEMM ReduceScatter figure: M rows reduce-scattered over 8 ranks, K
    split over them, N columns."""
    return Published(f"td-rs-h800-{M}x{N}x{K}", TD_FIG.format("GEMM ReduceScatter on single node of H800x8"),
                     f"bar m{M}_n{N}_k{K}: {speedup}", "h800", "op",
                     (Problem("matmul_reduce_scatter", M // 8, K // 8, N, "bfloat16"),), None, None,
                     speedup=speedup, note="M global (M/8 rows per rank out), K split over the ranks; dtype not "
                     "stated, bf16 assumed")


ROWS: tuple[Published, ...] = (
    # ---- Flux: 4096 x 12288 x 49152 global (fp16), TP=8: per rank m=512 rows of a, the weight's n/8 columns ----
    Published("flux-ag-h800", FLUX_OLD, "AG+Gemm(H800) 4096 12288 49152: torch 1.429 ms (GEMM 0.846, NCCL 0.583), "
              "flux 0.957 ms", "h800", "op", (Problem("all_gather_matmul", 512, 12288, 6144, "float16"),),
              1.429e-3, 0.957e-3, role="calibrate",
              note="M=4096 gathered from 512 rows per rank, K=12288, N=49152 split over 8 ranks"),
    Published("flux-rs-h800", FLUX_OLD, "Gemm+RS(H800) 4096 49152 12288: torch 1.408 ms (GEMM 0.818, NCCL 0.590), "
              "flux 0.932 ms", "h800", "op", (Problem("matmul_reduce_scatter", 512, 6144, 12288, "float16"),),
              1.408e-3, 0.932e-3,
              note="M=4096 rows reduce-scattered to 512 per rank, K=49152 split over 8 ranks (6144 each), N=12288"),
    Published("flux-ag-a800", FLUX_OLD, "AG+Gemm(A800) 4096 12288 49152: torch 3.099 ms (GEMM 2.438, NCCL 0.662), "
              "flux 2.469 ms", "a100-sxm", "op", (Problem("all_gather_matmul", 512, 12288, 6144, "float16"),),
              3.099e-3, 2.469e-3, link_Bps=A800_LINK, note="as flux-ag-h800, on A800s (A100, NVLink 400 GB/s)"),
    Published("flux-rs-a800", FLUX_OLD, "Gemm+RS(A800) 4096 49152 12288: torch 3.100 ms (GEMM 2.453, NCCL 0.646), "
              "flux 2.508 ms", "a100-sxm", "op", (Problem("matmul_reduce_scatter", 512, 6144, 12288, "float16"),),
              3.100e-3, 2.508e-3, link_Bps=A800_LINK, note="as flux-rs-h800, on A800s"),
    # ---- PyTorch symmetric memory's fused_all_gather_matmul (kraken's torch_symm_mem column): M per rank ----
    Published("symm-ag-h100-128", KRAKEN_AG, "(128, 6656, 4096) bf16: nccl 141.984 us, torch_symm_mem 277.184 us",
              "h100-sxm", "op", (Problem("all_gather_matmul", 128, 4096, 6656, "bfloat16"),), 141.984e-6,
              277.184e-6, strategy="symm", note="(M, N, K): A is the per-rank shard [M, K], B [K, N]"),
    Published("symm-ag-h100-512", KRAKEN_AG, "(512, 6656, 4096) bf16: nccl 514.496 us, torch_symm_mem 455.776 us",
              "h100-sxm", "op", (Problem("all_gather_matmul", 512, 4096, 6656, "bfloat16"),), 514.496e-6,
              455.776e-6, strategy="symm", role="calibrate", note="as symm-ag-h100-128"),
    Published("symm-ag-h100-512-16k", KRAKEN_AG, "(512, 6656, 16384) bf16: nccl 1810.432 us, torch_symm_mem "
              "1633.312 us", "h100-sxm", "op", (Problem("all_gather_matmul", 512, 16384, 6656, "bfloat16"),),
              1810.432e-6, 1633.312e-6, strategy="symm", note="as symm-ag-h100-128"),
    # ---- a copy-engine GEMM + reduce-scatter kernel (kraken's Triton-CE column): (M, N, K), K per rank ----
    Published("ce-rs-h100-512", KRAKEN_RS, "(512, 4096, 14336): Torch+NCCL 0.133653 ms, Triton-CE 0.307717 ms",
              "h100-sxm", "op", (Problem("matmul_reduce_scatter", 64, 14336, 4096, "bfloat16"),), 0.133653e-3,
              0.307717e-3, strategy="fused", band=(2.0, 0.65), why=CE_FLOOR,
              note="a persistent GEMM kernel (one launch, tiles in order) whose outputs copy engines move: this "
              "project's fused is its analog (one kernel), not symm (a GEMM per chunk); per rank [M, K] @ [K, N] then "
              "the [M, N] output reduce-scattered: "
              "m = M/8"),
    Published("ce-rs-h100-1024", KRAKEN_RS, "(1024, 4096, 14336): Torch+NCCL 0.223621 ms, Triton-CE 0.314597 ms",
              "h100-sxm", "op", (Problem("matmul_reduce_scatter", 128, 14336, 4096, "bfloat16"),), 0.223621e-3,
              0.314597e-3, strategy="fused", band=(0.75, 0.45), why=CE_FLOOR, note="as ce-rs-h100-512"),
    Published("ce-rs-h100-2048", KRAKEN_RS, "(2048, 4096, 14336): Torch+NCCL 0.422704 ms, Triton-CE 0.40987 ms",
              "h100-sxm", "op", (Problem("matmul_reduce_scatter", 256, 14336, 4096, "bfloat16"),), 0.422704e-3,
              0.40987e-3, strategy="fused", note="as ce-rs-h100-512"),
    # ---- Triton-distributed: Qwen3-32B's MLP (hidden 5120, intermediate 25600) at TP=8, M=2048 tokens ----
    Published("td-mlp-h800", TD_E2E, "MLP M=2048 (AllGather-GEMM + GEMM-ReduceScatter): torch 1.076972 ms, "
              "Dist-Triton 0.8854406 ms", "h800", "layer",
              (Problem("all_gather_matmul", 256, 5120, 6400, "bfloat16"),
               Problem("matmul_reduce_scatter", 256, 3200, 5120, "bfloat16")), 1.076972e-3, 0.8854406e-3,
              band=(0.15, 0.6), why="both published times are about twice the model's: the page prints M=2048 but not "
              "how the layer's tokens split, nor the dtype, and its times include the activation and the layer's "
              "other kernels; the ratio agrees",
              note="gate and up fused (2 x 25600 / 8 columns), down 25600 / 8 = 3200 per rank; the activation "
              "between them is not modelled (in both times); dtype not stated, bf16 assumed"),
    # ---- a GEMM and an independent all-gather: one after the other, side by side (SM and copy-engine NCCL) ----
    Published("concurrent-h100-sm", TORCH_CE, "m=n=k=8192 fp16, all-gather 64 MiB: sequential 2.96 ms, overlap "
              "w/o CE 2.02 ms", "h100-sxm", "concurrent",
              (Problem("all_gather_matmul", 8192 // 8, 8192, 8192, "float16"),), 2.96e-3, 2.02e-3,
              strategy="pipelined", role="calibrate",
              note="the GEMM is 8192^3 (a [8*1024, 8192] @ [8192, 8192]); the all-gather's 64 MiB are each rank's "
              "(8192 x 4096 fp16), independent of the GEMM: the row checks interference, not a pipeline"),
    Published("concurrent-h100-ce", TORCH_CE, "m=n=k=8192 fp16, all-gather 64 MiB: sequential 2.96 ms, overlap "
              "with CE 1.77 ms", "h100-sxm", "concurrent",
              (Problem("all_gather_matmul", 8192 // 8, 8192, 8192, "float16"),), 2.96e-3, 1.77e-3, strategy="symm",
              role="calibrate", note="as concurrent-h100-sm, the all-gather on copy engines"),
    # ---- Triton-distributed's figures: ratios only ----
    _td_ag(8192, 11008, 4096, 1.32), _td_ag(8192, 14336, 4096, 1.30), _td_ag(8192, 28672, 8192, 1.59),
    _td_ag(8192, 53248, 16384, 1.41), _td_ag(8192, 29568, 8192, 1.65),
    _td_rs(8192, 4096, 11008, 1.06), _td_rs(8192, 4096, 14336, 1.09), _td_rs(8192, 3584, 14336, 1.06),
    _td_rs(8192, 4608, 36864, 1.42), _td_rs(8192, 8192, 28672, 1.55), _td_rs(8192, 8192, 29568, 1.58),
    # ---- DeepEP's normal kernels: communication alone, bandwidth per GPU (bytes/s) ----
    Published("deepep-intranode-dispatch", DEEPEP, "Intranode 8: dispatch 153 GB/s (NVLink)", "h800", "bandwidth",
              (), None, 153e9, strategy="nvlink", note="the NVLink fit's bandwidth (NCCL-like SM transfers)"),
    Published("deepep-intranode-combine", DEEPEP, "Intranode 8: combine 158 GB/s (NVLink)", "h800", "bandwidth",
              (), None, 158e9, strategy="nvlink", note="as deepep-intranode-dispatch"),
    Published("deepep-internode-16", DEEPEP, "Internode 16: dispatch 43 GB/s (RDMA), combine 43 GB/s", "h800",
              "bandwidth", (), None, 43e9, strategy="network", nodes=2, note="the network fit's bandwidth"),
    Published("deepep-internode-64", DEEPEP, "Internode 64: dispatch 51 GB/s (RDMA), combine 50 GB/s", "h800",
              "bandwidth", (), None, 51e9, strategy="network", nodes=8, note="as deepep-internode-16"),
)
