"""GPU machines by name: the cost model's `Profile` of a described cluster, before any GPU hour is spent.

A preset (`PRESETS`, `machine`) holds a GPU's vendor figures (`Machine`: dense BF16 and FP8 peaks, FP32, HBM
bandwidth, the GPU-to-GPU link per direction, the NIC per GPU of the vendor's reference system, SMs), each with its
source, and a family's `Efficiency`: what the model needs beyond peaks (the share of a peak a GEMM or a transfer
reaches, per-message latencies, the slowdown of a GEMM beside a transfer by SMs or by copy engines), each constant
with its reasoning. `profile_of` turns both into a `Profile`; `cluster` adds the `Topology` of ``G`` GPUs per
node on ``N`` nodes (the group is every GPU of the cluster: describe a tensor-parallel group of 8 as one node of 8).

A profile measured on the machine (the GPU check, ``overlap tune --probe``) replaces the preset's numbers:
`measured_profile` finds one of the preset's GPU in the profile cache, and ``overlap predict`` and
``overlap tune --machine`` use it where it exists (they say which). docs/cost-model.md says what the model assumes
and where it is wrong; docs/results/model-vs-published.md holds it against published GPU figures.

Link classes: the GPU-to-GPU fabric of a node is the ``nvlink`` class whatever its vendor (AMD's Infinity Fabric
included); ``pcie`` is GPU-to-GPU over the host's PCIe switches; ``network`` one NIC per GPU.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from .machine import GemmFit, LinkFit, Profile, Topology
from .optable import MX_DTYPE

G = 1e9  # GB/s, GFLOP/s
T = 1e12  # TFLOP/s, TB/s


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """What a family of GPUs reaches of its peaks, and the costs peaks do not show (one per family: Ampere, Hopper,
    Blackwell, CDNA 3). Fractions multiply a `Machine`'s peak; seconds are per message, chunk, launch or call.

    gemm, gemm_fp8, gemm_fp32: a large GEMM's share of the dense BF16, FP8 and FP32 peaks.
    memory: a streaming kernel's share of HBM bandwidth (a small GEMM that reads its weight is bound by it).
    link_p2p, link_copy: the GPU fabric's share of its per-direction bandwidth through NCCL (SM kernels) and
        through copy engines; pcie and network: PCIe's and the NIC's share.
    link_latency_s, copy_latency_s, pcie_latency_s, network_latency_s: one message's fixed cost.
    gemm_overhead_s: one GEMM launch (and its tail wave) beyond its flops.
    per_chunk_s: one more chunk's flag, wait or stream operation.
    sm_gemm_slowdown: a GEMM beside an SM-driven transfer (NCCL's kernels take SMs); copy_gemm_slowdown: beside a
        copy-engine transfer (it takes HBM bandwidth only); comm_slowdown: a transfer beside a GEMM.
    call_s: the host's fixed cost of one call per strategy (checks, handshake, launches).
    """

    gemm: float
    gemm_fp8: float
    gemm_fp32: float
    memory: float
    link_p2p: float
    link_copy: float
    pcie: float
    network: float
    link_latency_s: float
    copy_latency_s: float
    pcie_latency_s: float
    network_latency_s: float
    gemm_overhead_s: float
    per_chunk_s: float
    sm_gemm_slowdown: float
    copy_gemm_slowdown: float
    comm_slowdown: float
    call_s: dict[str, float]


#: The fixed host cost of one call per strategy on a GPU: not measured (no GPU has run the probe); a plain NCCL
#: collective's launch and the op's Python for ``reference``, the handshake and stream-ordered flags besides for the
#: others. Python-level costs of 10-40 us per call are what eager PyTorch ops of this kind cost on a fast host.
GPU_CALL_S = {"reference": 15e-6, "pipelined": 40e-6, "symm": 40e-6, "hierarchical": 60e-6, "fused": 35e-6}

#: NVIDIA Hopper (H100, H800, H200, H20). Reasoning and sources, constant by constant:
#: * gemm 0.78: a cuBLAS BF16 GEMM of 8192^3 was measured at ~800 TFLOP/s on an H100 SXM (0.81 of the 989 dense
#:   peak); smaller and odd shapes reach less, so 0.78 across the sizes training runs. gemm_fp8 0.65 (FP8 GEMMs
#:   reach a smaller share of their peak); gemm_fp32 0.80 (CUDA-core FP32: torch's default for float32 matmul).
#: * memory 0.80: a streaming kernel reaches ~2.7 of the H100's 3.35 TB/s.
#: * link_p2p 0.82: NCCL's bus bandwidth on 8 NVSwitch-connected H100s is ~370 GB/s of 450 per direction (NCCL
#:   maintainers' figure without NVLink SHARP); DeepEP's README counts ~160 GB/s as the H800's NVLink maximum (of
#:   200) and measures 153-158 GB/s. link_copy 0.84: a copy-engine peer copy was measured at ~376 GB/s one way on
#:   an H100 (its 256-byte payloads beat SM copies' 128).
#: * pcie 0.75 (of a PCIe 5.0 x16 link's 64 GB/s per direction); network 0.92: nccl-tests across nodes report
#:   46-48 GB/s bus bandwidth per 400 Gb/s InfiniBand NIC (50 GB/s line rate; DeepEP counts ~50 GB/s as its maximum).
#: * latencies: 3 us per NCCL message step within a node (~6 us for a two-GPU all-reduce, 10-34 us for a
#:   single-channel ring of 2 to 8 A100s), 4 us per copy-engine copy (launch and engine start), 8 us per PCIe
#:   message, 10 us per network message (IB RDMA's few us of wire latency plus NCCL's proxy); 6 us a GEMM launch and
#:   tail; 2 us a chunk's flag.
#: * interference: NCCL kernels occupy 8-32 of 132 SMs: a GEMM beside them runs ~10-30% slower in the overlap
#:   papers' figures (one H100 report saw a GEMM's utilization drop from ~80% to ~47% beside a 24-block NCCL
#:   all-gather); 1.25. A copy-engine transfer takes no SM, only HBM bandwidth (AMD's MI300X study recovers 72% of
#:   the ideal overlap with collectives on DMA engines against 21% on compute units): 1.03 on a compute-bound GEMM;
#:   a transfer beside a GEMM 1.05 (HBM and L2 traffic).
HOPPER = Efficiency(
    gemm=0.78, gemm_fp8=0.65, gemm_fp32=0.80, memory=0.80, link_p2p=0.82, link_copy=0.84, pcie=0.75, network=0.92,
    link_latency_s=3e-6, copy_latency_s=4e-6, pcie_latency_s=8e-6, network_latency_s=10e-6, gemm_overhead_s=6e-6,
    per_chunk_s=2e-6, sm_gemm_slowdown=1.25, copy_gemm_slowdown=1.03, comm_slowdown=1.05, call_s=GPU_CALL_S)

#: NVIDIA Ampere (A100): a larger share of a smaller peak (cuBLAS BF16 reaches ~250-270 of 312 TFLOP/s dense: 0.82);
#: NCCL's bus bandwidth on 8 NVSwitch-connected A100s is ~230 GB/s of 300 per direction (0.77); PCIe 4.0;
#: HDR 200 Gb/s NICs. Latencies and interference as Hopper's, launches a little slower.
AMPERE = dataclasses.replace(HOPPER, gemm=0.82, gemm_fp8=0.82, gemm_fp32=0.85, link_p2p=0.77, link_copy=0.80,
                             gemm_overhead_s=7e-6)

#: NVIDIA Blackwell (B200): vendor peaks at 1000 W; early cuBLAS figures reach ~0.65 of the dense BF16 peak and
#: ~0.60 of FP8's (less of a new part's peak than Hopper's); NVLink 5 through NVSwitch as Hopper's NVLink 4.
BLACKWELL = dataclasses.replace(HOPPER, gemm=0.65, gemm_fp8=0.60)

#: AMD CDNA 3 (MI300X): hipBLASLt's large BF16 GEMMs reach roughly half the 1307 TFLOP/s dense peak (recollected
#: public measurements at ~600-700, not verified here) and ~0.45 of FP8's (907 TFLOP/s was measured in FP8 at a
#: clock fixed at 1005 MHz); RCCL over the fully connected Infinity Fabric mesh reaches
#: ~0.70 of the 7 links' aggregate per direction for all-gathers and all-to-alls (one pair's transfer is bound by its
#: single 64 GB/s link: the model pools the links, optimistic for a ring's single neighbor); SDMA copy engines as
#: RCCL; launches and messages a little slower than NVIDIA's; a GEMM beside an SM-driven transfer slows more than on
#: Hopper (AMD's MI300X study: compute-unit collectives recover 21% of the ideal overlap, DMA-engine ones 72%).
CDNA3 = dataclasses.replace(HOPPER, gemm=0.50, gemm_fp8=0.45, gemm_fp32=0.70, memory=0.75, link_p2p=0.70,
                            link_copy=0.70, link_latency_s=5e-6, copy_latency_s=6e-6, gemm_overhead_s=8e-6,
                            sm_gemm_slowdown=1.4, copy_gemm_slowdown=1.05)


@dataclasses.dataclass(frozen=True)
class Machine:
    """One GPU's vendor figures (per GPU; dense, no sparsity) and its reference system's node.

    bf16_flops, fp8_flops (0: no FP8 tensor cores; FP8 calls then run at the BF16 rate), fp32_flops (CUDA-core
    FP32, no tensor cores) in FLOP/s; hbm_Bps; link_Bps: the GPU's fabric bandwidth per direction (all its links);
    link: what that fabric is; pcie_Bps per direction; nic_Bps: the network per GPU in the reference system; sms:
    streaming multiprocessors (compute units on AMD); gpus_per_node of the reference system; device_names: what
    ``torch.cuda.get_device_name`` says for it (a measured profile of that name replaces the preset); sources:
    where the figures come from; mx: whether its tensor cores multiply MX blocks (e8m0 scales per 32 elements:
    Blackwell's block-scaled FP8), so that an MX GEMM runs at the FP8 rate; without them `torch._scaled_mm` refuses
    MX scales and `overlap.ops.fp8.scaled_mm` dequantizes to float32 (the FP32 rate).
    """

    name: str
    about: str
    bf16_flops: float
    fp8_flops: float
    fp32_flops: float
    hbm_Bps: float
    link_Bps: float
    link: str
    pcie_Bps: float
    nic_Bps: float
    sms: int
    efficiency: Efficiency
    device_names: tuple[str, ...]
    sources: str
    gpus_per_node: int = 8
    mx: bool = False


#: Every preset, by the name ``--machine`` takes. Figures per GPU, dense (vendors print sparse tensor peaks at
#: twice these).
PRESETS: dict[str, Machine] = {m.name: m for m in (
    Machine("h100-sxm", "NVIDIA H100 SXM5 80GB, 8 per HGX/DGX node, NVLink 4 through NVSwitch, 400 Gb/s per GPU",
            bf16_flops=989 * T, fp8_flops=1979 * T, fp32_flops=67 * T, hbm_Bps=3.35 * T, link_Bps=450 * G,
            link="NVLink 4 (18 links, 900 GB/s both directions)", pcie_Bps=64 * G, nic_Bps=50 * G, sms=132,
            efficiency=HOPPER, device_names=("NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM5 80GB"),
            sources="NVIDIA H100 Tensor Core GPU datasheet (SXM column: BF16 1,979 and FP8 3,958 TFLOPS with "
            "sparsity, FP32 67 TFLOPS, 3.35 TB/s, NVLink 900 GB/s, PCIe Gen5 128 GB/s); NVIDIA DGX H100 datasheet "
            "(8x ConnectX-7 400 Gb/s for the compute fabric); NVIDIA Hopper architecture whitepaper (132 SMs)"),
    Machine("h800", "NVIDIA H800 SXM5 80GB, 8 per node, NVLink 400 GB/s, 400 Gb/s per GPU (DeepEP's test machine)",
            bf16_flops=989 * T, fp8_flops=1979 * T, fp32_flops=67 * T, hbm_Bps=3.35 * T, link_Bps=200 * G,
            link="NVLink 4, cut to 400 GB/s both directions", pcie_Bps=64 * G, nic_Bps=50 * G, sms=132,
            efficiency=HOPPER, device_names=("NVIDIA H800", "NVIDIA H800 80GB HBM3"),
            sources="secondary spec tables (the H100 SXM's compute and memory, NVLink 400 GB/s both directions; no "
            "NVIDIA datasheet was found); DeepEP README (H800 with ~160 GB/s NVLink maximum and ConnectX-7 400 Gb/s "
            "RDMA NICs, ~50 GB/s)"),
    Machine("h200", "NVIDIA H200 SXM 141GB, 8 per HGX node, NVLink 4 through NVSwitch, 400 Gb/s per GPU",
            bf16_flops=989 * T, fp8_flops=1979 * T, fp32_flops=67 * T, hbm_Bps=4.8 * T, link_Bps=450 * G,
            link="NVLink 4 (900 GB/s both directions)", pcie_Bps=64 * G, nic_Bps=50 * G, sms=132,
            efficiency=HOPPER, device_names=("NVIDIA H200", "NVIDIA H200 141GB HBM3e"),
            sources="NVIDIA H200 Tensor Core GPU datasheet (SXM: BF16 1,979 and FP8 3,958 TFLOPS with sparsity, "
            "FP32 67 TFLOPS, 141 GB at 4.8 TB/s, NVLink 900 GB/s, PCIe Gen5 128 GB/s); HGX H200 reference "
            "networking 400 Gb/s per GPU"),
    Machine("a100-sxm", "NVIDIA A100 SXM4 80GB, 8 per DGX A100, NVLink 3 through NVSwitch, 200 Gb/s per GPU",
            bf16_flops=312 * T, fp8_flops=0.0, fp32_flops=19.5 * T, hbm_Bps=2.039 * T, link_Bps=300 * G,
            link="NVLink 3 (12 links, 600 GB/s both directions)", pcie_Bps=32 * G, nic_Bps=25 * G, sms=108,
            efficiency=AMPERE, device_names=("NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM4-40GB"),
            sources="NVIDIA A100 Tensor Core GPU datasheet (SXM 80GB: BF16 312 TFLOPS dense, 624 sparse, FP32 19.5 "
            "TFLOPS, 2,039 GB/s, NVLink 600 GB/s, PCIe Gen4 64 GB/s); DGX A100 datasheet (8x ConnectX-6 HDR 200 "
            "Gb/s); NVIDIA Ampere whitepaper (108 SMs)"),
    Machine("h20", "NVIDIA H20 96GB, 8 per HGX node, NVLink 4 through NVSwitch, 400 Gb/s per GPU",
            bf16_flops=148 * T, fp8_flops=296 * T, fp32_flops=44 * T, hbm_Bps=4.0 * T, link_Bps=450 * G,
            link="NVLink 4 (900 GB/s both directions)", pcie_Bps=64 * G, nic_Bps=50 * G, sms=78,
            efficiency=HOPPER, device_names=("NVIDIA H20",),
            sources="third-party spec tables of the HGX H20 (per GPU: BF16 148 and FP8 296 TFLOPS dense, FP32 44 "
            "TFLOPS, 96 GB HBM3 at 4.0 TB/s, NVLink 900 GB/s, PCIe Gen5; 78 SMs); 400 Gb/s per GPU assumed (the "
            "HGX reference networking)"),
    Machine("b200", "NVIDIA B200 180GB, 8 per HGX/DGX B200, NVLink 5 through NVSwitch, 400 Gb/s per GPU",
            bf16_flops=2250 * T, fp8_flops=4500 * T, fp32_flops=75 * T, hbm_Bps=8.0 * T, link_Bps=900 * G,
            link="NVLink 5 (18 links, 1.8 TB/s both directions)", pcie_Bps=64 * G, nic_Bps=50 * G, sms=148,
            efficiency=BLACKWELL, device_names=("NVIDIA B200",),
            sources="NVIDIA HGX B200 datasheet (8 GPUs: FP8 72 PFLOPS and FP16/BF16 36 PFLOPS with sparsity, i.e. "
            "4.5 and 2.25 PFLOPS dense per GPU; NVLink 5 1.8 TB/s per GPU; FP32 75 TFLOPS per GPU); DGX B200 page "
            "(64 TB/s HBM3e over 8 GPUs, 8 TB/s each; an HGX datasheet prints 7.7; 8x ConnectX-7 400 Gb/s); 148 "
            "SMs as commonly reported (not verified in a first-party source); MX FP8 at the FP8 rate (NVIDIA "
            "Blackwell architecture: block-scaled tensor cores)", mx=True),
    Machine("mi300x", "AMD Instinct MI300X 192GB, 8 per OAM platform, Infinity Fabric mesh, 400 Gb/s per GPU",
            bf16_flops=1307.4 * T, fp8_flops=2614.9 * T, fp32_flops=163.4 * T, hbm_Bps=5.3 * T, link_Bps=448 * G,
            link="Infinity Fabric (xGMI): 7 links of 64 GB/s per direction, one to each peer", pcie_Bps=64 * G,
            nic_Bps=50 * G, sms=304, efficiency=CDNA3, device_names=("AMD Instinct MI300X",),
            sources="AMD Instinct MI300X datasheet (BF16 1,307.4 and FP8 2,614.9 TFLOPS dense, FP32 vector 163.4 "
            "TFLOPS, 192 GB HBM3 at 5.3 TB/s, 304 compute units, 7 Infinity Fabric links of 128 GB/s both "
            "directions, 896 GB/s aggregate, PCIe Gen5 x16 128 GB/s; AMD CDNA 3 white paper, Table 2); 400 Gb/s per "
            "GPU assumed (the NVIDIA systems' networking; AMD's platform leaves the NIC to the system vendor)"),
)}


def machine(name: str) -> Machine:
    """The preset `name` (case and ``_``/``-`` ignored); ValueError naming the presets for another."""
    key = name.strip().lower().replace("_", "-")
    if key not in PRESETS:
        raise ValueError(f"unknown machine {name!r}; presets: {', '.join(PRESETS)}")
    return PRESETS[key]


def profile_of(m: Machine) -> Profile:
    """The cost model's `Profile` of preset `m`: its peaks times its family's `Efficiency` (an MX GEMM at the FP8
    rate where the GPU multiplies MX blocks, `Machine.mx`, else at the FP32 rate: dequantized)."""
    e = m.efficiency
    bf16 = GemmFit(e.gemm * m.bf16_flops, e.gemm_overhead_s, memory_Bps=e.memory * m.hbm_Bps)
    fp8 = GemmFit(e.gemm_fp8 * m.fp8_flops, e.gemm_overhead_s, memory_Bps=e.memory * m.hbm_Bps) if m.fp8_flops \
        else bf16
    fp32 = GemmFit(e.gemm_fp32 * m.fp32_flops, e.gemm_overhead_s, memory_Bps=e.memory * m.hbm_Bps)
    return Profile(
        links={"nvlink": {"p2p": LinkFit(e.link_latency_s, e.link_p2p * m.link_Bps),
                          "copy": LinkFit(e.copy_latency_s, e.link_copy * m.link_Bps)},
               "pcie": {"p2p": LinkFit(e.pcie_latency_s, e.pcie * m.pcie_Bps),
                        "copy": LinkFit(e.pcie_latency_s, e.pcie * m.pcie_Bps)},
               "network": {"p2p": LinkFit(e.network_latency_s, e.network * m.nic_Bps)}},
        gemm={"bfloat16": bf16, "float16": bf16, "float8_e4m3fn": fp8, MX_DTYPE: fp8 if m.mx else fp32,
              "float32": fp32},
        gemm_slowdown=e.sm_gemm_slowdown, copy_gemm_slowdown=e.copy_gemm_slowdown, comm_slowdown=e.comm_slowdown,
        per_chunk_s=e.per_chunk_s, device=m.device_names[0], call_s=dict(e.call_s),
        machine=f"preset {m.name}: {m.about} (vendor peaks x documented efficiencies, not measured)")


def for_device(name: str) -> Machine | None:
    """The preset whose GPU ``torch.cuda.get_device_name`` calls `name` (`Machine.device_names`), else None."""
    return next((m for m in PRESETS.values() if name in m.device_names), None)


def topology_of_cluster(gpus_per_node: int, nodes: int = 1) -> Topology:
    """The `Topology` of every GPU of `nodes` nodes of `gpus_per_node` GPUs each, as one group: each rank's peers
    on its node over the GPU fabric (``nvlink``), the others over the network. ValueError below one."""
    for what, value in (("gpus_per_node", gpus_per_node), ("nodes", nodes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{what} must be an int >= 1, got {value!r}")
    links = (("nvlink", gpus_per_node - 1),) if gpus_per_node > 1 else ()
    if nodes > 1:
        links += (("network", gpus_per_node * (nodes - 1)),)
    return Topology("cuda", gpus_per_node * nodes, nodes, gpus_per_node, links)


@dataclasses.dataclass(frozen=True)
class Cluster:
    """A described cluster: its preset, the group's `topology`, the `profile` the model uses (the preset's, or a
    measured one that replaces it: `measured` names its file)."""

    machine: Machine
    topology: Topology
    profile: Profile
    measured: str = ""

    @property
    def about(self) -> str:
        t = self.topology
        where = f"measured profile {self.measured}" if self.measured else "preset figures (not measured)"
        return f"{self.machine.name}: {t.num_nodes} node(s) x {t.ranks_per_node[0]} GPU(s), {where}"


def cluster(name: str, gpus_per_node: int | None = None, nodes: int = 1, profile: Profile | None = None,
            cache: str | Path | None = None) -> Cluster:
    """The cluster ``--machine NAME --gpus-per-node G --nodes N`` describes (`gpus_per_node` default: the
    preset's node). Its profile: `profile` where given, else a measured profile of the preset's GPU found in
    `cache` (`measured_profile`; None: not looked for), each `completed` by the preset's numbers; else the
    preset's (`profile_of`)."""
    m = machine(name)
    topology = topology_of_cluster(m.gpus_per_node if gpus_per_node is None else gpus_per_node, nodes)
    measured = ""
    if profile is None and cache is not None:
        found = measured_profile(m, cache)
        if found is not None:
            measured, profile = found
    return Cluster(m, topology, profile_of(m) if profile is None else completed(profile, profile_of(m)), measured)


def completed(measured: Profile, preset: Profile) -> Profile:
    """`measured` with what it lacks taken from `preset`: the link classes and transports it has no fit for (a
    probe on one GPU measures GEMMs alone), the dtypes it has no GEMM fit for, the HBM rate of a GEMM fit that has
    none (the probe fits square GEMMs: their memory roofline is the preset's), the strategies it has no per-call
    cost for; and, where it measured no link at all, the preset's interference and per-chunk cost (a probe
    measures those only beside a transfer)."""
    links = {c: {**preset.links.get(c, {}), **fits} for c, fits in measured.links.items()}
    links = {**{c: fits for c, fits in preset.links.items() if c not in links}, **links}
    scalars = {} if measured.links else {f: getattr(preset, f) for f in ("gemm_slowdown", "comm_slowdown",
                                                                         "copy_gemm_slowdown", "per_chunk_s")}
    gemm = {**preset.gemm, **{d: fit if fit.memory_Bps or d not in preset.gemm else  # (the probe fits no HBM rate)
                              dataclasses.replace(fit, memory_Bps=preset.gemm[d].memory_Bps)
                              for d, fit in measured.gemm.items()}}
    return dataclasses.replace(measured, links=links, gemm=gemm, call_s={**preset.call_s, **measured.call_s},
                               **scalars)


def measured_profile(m: Machine, cache: str | Path) -> tuple[str, Profile] | None:
    """A profile the probe measured on preset `m`'s GPU (its `Profile.device` one of `Machine.device_names`) in
    the profile cache folder `cache` (``overlap.tune.cache``'s files, quick probes left out): ``(path, profile)``
    of the newest, or None. Files that do not load are skipped."""
    folder = Path(cache)
    if not folder.is_dir():
        return None
    found = []
    for path in folder.glob("profile-*.json"):
        if path.stem.endswith("-quick"):
            continue
        try:
            profile = Profile.from_json(json.loads(path.read_text()), where=f"profile {path}")
        except (OSError, ValueError):
            continue
        if profile.device in m.device_names:
            found.append((path.stat().st_mtime, str(path), profile))
    if not found:
        return None
    _, path, profile = max(found)
    return path, profile


__all__ = ["AMPERE", "BLACKWELL", "CDNA3", "HOPPER", "PRESETS", "Cluster", "Efficiency", "Machine", "cluster",
           "completed", "for_device", "machine", "measured_profile", "profile_of", "topology_of_cluster"]
