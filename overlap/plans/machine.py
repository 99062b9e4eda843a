"""What the cost model knows of a machine and of a group: the machine `Profile` (link fits per link class and
transport, GEMM fits per dtype; measured by `overlap.tune.probe`, or `overlap.plans.costmodel.default_profile`) and
the `Topology` of a group (`topology_of`). `overlap.plans.costmodel` re-exports every name.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..links import LINK_CLASSES

if TYPE_CHECKING:
    from ..world import GroupInfo

# ----------------------------------------------------------------------------------------------
# Machine profile: what the cost model knows about a machine (measured by `overlap.tune.probe`)
# ----------------------------------------------------------------------------------------------

PROFILE_VERSION = 1

#: the transports of a link class in `Profile.links`
TRANSPORTS = ("p2p", "copy")

# Sanity bounds of a profile's numbers, which `Profile.from_json` checks every number of a file against (the probe
# never measures past them: `overlap.tune.fits` caps its rates):
#: a latency, an overhead, the cost of a chunk or of a call: a day is no machine's
MAX_PROFILE_SECONDS = 86400.0
#: a link's bytes/s, a GEMM's flop/s: 1e21 is far past any machine's
MAX_PROFILE_RATE = 1e21
#: a slowdown factor under interference
MAX_PROFILE_SLOWDOWN = 1e4


@dataclasses.dataclass(frozen=True)
class LinkFit:
    """Time of one transfer of ``n`` bytes over a link: ``latency_s + n / bandwidth_Bps``."""

    latency_s: float
    bandwidth_Bps: float

    def time(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth_Bps


@dataclasses.dataclass(frozen=True)
class GemmFit:
    """GEMM time for one dtype: ``overhead_s + max(flops / peak_flops, nbytes / memory_Bps)`` (a launch or call
    overhead, then the slower of the compute and the memory roofline), so small GEMMs run below peak and a GEMM of
    few rows is bound by reading its weight. `memory_Bps` 0: not modelled (the probe does not measure it; CPU
    profiles), the flops alone decide."""

    peak_flops: float
    overhead_s: float
    memory_Bps: float = 0.0

    def time(self, flops: float, nbytes: float = 0.0) -> float:
        return self.overhead_s + self.work(flops, nbytes)

    def work(self, flops: float, nbytes: float = 0.0) -> float:
        """The seconds beyond the overhead: the compute or the memory roofline, whichever is slower."""
        return max(flops / self.peak_flops, nbytes / self.memory_Bps if self.memory_Bps else 0.0)

    def to_json(self) -> dict:
        return {"peak_flops": self.peak_flops, "overhead_s": self.overhead_s,
                **({"memory_Bps": self.memory_Bps} if self.memory_Bps else {})}


@dataclasses.dataclass(frozen=True)
class Profile:
    """What the cost model knows about a machine; JSON round-trip with `to_json`/`from_json`.

    links: per link class (`world.LINK_CLASSES`), per transport: ``"p2p"`` (torch.distributed
        point-to-point: gloo/NCCL) and ``"copy"`` (one-sided copies into/out of a peer's symmetric
        buffer: shared memory or copy engine; ranks of one node only).
    gemm: per dtype name (``"float32"``, ``"bfloat16"``, ...).
    gemm_slowdown: factor (>= 1) on a GEMM's time while a transfer runs beside it; comm_slowdown the
        reverse (CPU ranks share cores with gloo's threads; GPUs share memory bandwidth). copy_gemm_slowdown: the
        GEMM's factor beside a ``copy`` transfer where it differs (a GPU's copy engines take no SMs, NCCL's kernels
        do); 0: `gemm_slowdown` for both.
    per_chunk_s: fixed cost of one more chunk (a message, a flag, a kernel launch).
    call_s: per strategy, the fixed host cost of one call beyond its transfers and GEMMs (checks, plan,
        signature, handshake or its steady-state post, dispatch, the waits' wake-ups): what a call costs that
        moves and multiplies almost nothing (`overlap.tune.probe` times one; a strategy missing costs 0, as in
        a profile saved before the probe measured them: probe again, ``overlap info --probe``, to add them).
    device: ``"cpu"`` or the GPU's name; machine: where it was measured (informative).
    """

    links: dict[str, dict[str, LinkFit]]
    gemm: dict[str, GemmFit]
    gemm_slowdown: float = 1.0
    comm_slowdown: float = 1.0
    per_chunk_s: float = 0.0
    device: str = "cpu"
    machine: str = ""
    call_s: dict[str, float] = dataclasses.field(default_factory=dict)
    copy_gemm_slowdown: float = 0.0

    def gemm_slowdown_for(self, transport: str) -> float:
        """The factor on a GEMM beside a transfer of `transport` (``p2p`` or ``copy``)."""
        return self.copy_gemm_slowdown if transport == "copy" and self.copy_gemm_slowdown else self.gemm_slowdown

    def to_json(self) -> dict:
        return {
            "version": PROFILE_VERSION, "device": self.device, "machine": self.machine,
            "links": {c: {t: dataclasses.asdict(f) for t, f in ts.items()} for c, ts in self.links.items()},
            "gemm": {d: f.to_json() for d, f in self.gemm.items()},
            "gemm_slowdown": self.gemm_slowdown, "comm_slowdown": self.comm_slowdown, "per_chunk_s": self.per_chunk_s,
            "call_s": dict(self.call_s),
            **({"copy_gemm_slowdown": self.copy_gemm_slowdown} if self.copy_gemm_slowdown else {}),
        }

    @classmethod
    def from_json(cls, data: Any, where: str = "machine profile") -> Profile:
        """The profile `to_json` wrote. Every field is checked where it enters: ValueError naming `where` (the
        file: ``profile /path``) and the field (``links.nvlink.p2p.bandwidth_Bps``) for a missing, unknown or
        malformed field or a number that is not finite, in range (rates > 0, times >= 0, slowdowns > 0, each under
        its sanity bound: `MAX_PROFILE_SECONDS`, `MAX_PROFILE_RATE`, `MAX_PROFILE_SLOWDOWN`), or is a string or a
        bool; and for another version (probe again)."""
        if not isinstance(data, Mapping):
            raise ValueError(f"{where}: must be a JSON object, got {type(data).__name__}")
        if data.get("version") != PROFILE_VERSION:
            raise ValueError(f"{where}: version {data.get('version')!r} is not {PROFILE_VERSION}: probe again "
                             "(overlap info --probe)")
        known = {"version", "device", "machine", "links", "gemm", "gemm_slowdown", "comm_slowdown", "per_chunk_s",
                 "call_s", "copy_gemm_slowdown"}
        _fields(data, "", where, known, required=("links", "gemm"))
        links = {}
        for c, ts in _mapping(data["links"], "links", where).items():
            if c not in LINK_CLASSES:
                raise ValueError(f"{where}: links.{c} is no link class ({', '.join(LINK_CLASSES)})")
            links[c] = {}
            for t, f in _mapping(ts, f"links.{c}", where).items():
                if t not in TRANSPORTS:
                    raise ValueError(f"{where}: links.{c}.{t} is no transport ({', '.join(TRANSPORTS)})")
                at = f"links.{c}.{t}"
                _fields(f, at, where, {"latency_s", "bandwidth_Bps"})
                links[c][t] = LinkFit(latency_s=_seconds(f["latency_s"], f"{at}.latency_s", where),
                                      bandwidth_Bps=_rate(f["bandwidth_Bps"], f"{at}.bandwidth_Bps", where))
        gemm = {}
        for d, f in _mapping(data["gemm"], "gemm", where).items():
            at = f"gemm.{d}"
            _fields(f, at, where, {"peak_flops", "overhead_s", "memory_Bps"}, required=("peak_flops", "overhead_s"))
            gemm[d] = GemmFit(peak_flops=_rate(f["peak_flops"], f"{at}.peak_flops", where),
                              overhead_s=_seconds(f["overhead_s"], f"{at}.overhead_s", where),
                              memory_Bps=_number(f.get("memory_Bps", 0.0), f"{at}.memory_Bps", where, True,
                                                 MAX_PROFILE_RATE))
        for name in ("device", "machine"):
            if name in data and not isinstance(data[name], str):
                raise ValueError(f"{where}: {name} must be a string, got {data[name]!r}")
        return cls(
            links=links, gemm=gemm,
            gemm_slowdown=_number(data.get("gemm_slowdown", 1.0), "gemm_slowdown", where, False, MAX_PROFILE_SLOWDOWN),
            comm_slowdown=_number(data.get("comm_slowdown", 1.0), "comm_slowdown", where, False, MAX_PROFILE_SLOWDOWN),
            copy_gemm_slowdown=_number(data.get("copy_gemm_slowdown", 0.0), "copy_gemm_slowdown", where, True,
                                       MAX_PROFILE_SLOWDOWN),
            per_chunk_s=_seconds(data.get("per_chunk_s", 0.0), "per_chunk_s", where), device=data.get("device", "cpu"),
            machine=data.get("machine", ""),
            call_s={s: _seconds(t, f"call_s.{s}", where)
                    for s, t in _mapping(data.get("call_s", {}), "call_s", where).items()},
        )


def _mapping(value: Any, field: str, where: str) -> Mapping:
    if not isinstance(value, Mapping):
        raise ValueError(f"{where}: {field} must be a JSON object, got {value!r}")
    return value


def _fields(value: Any, field: str, where: str, known: set[str], required: tuple[str, ...] | None = None) -> None:
    """`value` is an object with every field of `required` (default: all of `known`) and none but `known`."""
    value = _mapping(value, field or "the profile", where)
    at = f"{field}." if field else ""
    missing = [f for f in (sorted(known) if required is None else required) if f not in value]
    if missing:
        raise ValueError(f"{where}: {at}{missing[0]} is missing")
    unknown = sorted(str(f) for f in value if f not in known)
    if unknown:
        raise ValueError(f"{where}: {at}{unknown[0]} is not a field (known: {', '.join(sorted(known))})")


def _number(value: Any, field: str, where: str, zero_ok: bool, bound: float) -> float:
    """`value` as a float: a JSON number (no string, no bool), finite, > 0 (>= 0 with `zero_ok`), <= `bound`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not (value >= 0 if zero_ok else value > 0) or value > bound:
        raise ValueError(f"{where}: {field} must be a finite number {'>=' if zero_ok else '>'} 0 and at most "
                         f"{bound:g}, got {value!r}")
    return float(value)


def _seconds(value: Any, field: str, where: str) -> float:
    return _number(value, field, where, True, MAX_PROFILE_SECONDS)


def _rate(value: Any, field: str, where: str) -> float:
    return _number(value, field, where, False, MAX_PROFILE_RATE)


# ----------------------------------------------------------------------------------------------
# Topology: a group as the cost model sees it
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Topology:
    """A group as one rank sees it (`topology_of`); identical on every rank of a symmetric topology.

    device: ``"cpu"`` or ``"cuda"``; ranks_per_node: the rank count of every node, largest first (an
    int means that many on each node); links: ``(link class, number of this rank's peers over it)``,
    in `LINK_CLASSES` order (a dict is accepted). Raises ValueError where the counts do not add up.
    """

    device: str
    world_size: int
    num_nodes: int
    ranks_per_node: tuple[int, ...] | int
    links: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        per_node, links = self.ranks_per_node, dict(self.links)
        per_node = (per_node,) * self.num_nodes if isinstance(per_node, int) else tuple(sorted(per_node, reverse=True))
        object.__setattr__(self, "ranks_per_node", per_node)
        object.__setattr__(self, "links", tuple((c, links[c]) for c in LINK_CLASSES if c in links))
        adds_up = sum(links.values()) == self.world_size - 1 == sum(per_node) - 1 and len(per_node) == self.num_nodes
        if self.device not in ("cpu", "cuda") or not set(links) <= set(LINK_CLASSES) \
                or min(links.values(), default=1) < 1 or not adds_up:
            raise ValueError(f"Topology: device {self.device!r} (cpu or cuda), {self.world_size} ranks on {per_node}, "
                             f"peers {links} (link classes {LINK_CLASSES}) do not add up")

    @property
    def signature(self) -> str:
        """Canonical text, e.g. ``cpu:nodes=2:ranks=4:links=network*2,shm*1`` (plan files record it)."""
        uneven = len(set(self.ranks_per_node)) > 1
        per_node = ":per_node=" + ",".join(map(str, self.ranks_per_node)) if uneven else ""
        links = ",".join(f"{c}*{n}" for c, n in sorted(self.links))
        return f"{self.device}:nodes={self.num_nodes}:ranks={self.world_size}{per_node}:links={links}"

    @property
    def slowest_link(self) -> str:
        """The class a ring is chunked for (as `GroupInfo.slowest_link`)."""
        return self.links[-1][0] if self.links else ("shm" if self.device == "cpu" else "nvlink")


def topology_of(info: GroupInfo) -> Topology:
    """The `Topology` of a group from this rank's `GroupInfo` (no communication)."""
    peers = collections.Counter(info.link_class(p) for p in range(info.world_size) if p != info.rank)
    per_node = collections.Counter(info.nodes)
    return Topology(device="cuda" if info.device.type == "cuda" else "cpu", world_size=info.world_size,
                    num_nodes=len(per_node), ranks_per_node=tuple(per_node.values()), links=tuple(peers.items()))
