"""Fits and printing of machine profiles: pure functions, no ranks (used by `probe`).

`fit_line` is plain Python arithmetic, so the same measurements give the same bits on every rank:
that is how `probe` makes every rank's Profile equal without sending the Profile around.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..plans import GemmFit, LinkFit, Profile
from ..plans.machine import MAX_PROFILE_RATE, TRANSPORTS
from ..world import LINK_CLASSES

# ----------------------------------------------------------------------------------------------
# Fits (pure Python: the same inputs give the same bits on every rank)
# ----------------------------------------------------------------------------------------------


def fit_line(xs: Sequence[float], ts: Sequence[float]) -> tuple[float, float]:
    """``(intercept, slope)`` of ``t = intercept + slope * x``, least squares in relative error.

    Each point is weighted by ``1 / t**2``, so a fit over sizes that span decades fits the small
    ones (the latency) as well as the large ones (the bandwidth). Raises ValueError for a length
    mismatch, fewer than two distinct ``x``, or a time that is not positive and finite.
    """
    if len(xs) != len(ts):
        raise ValueError(f"fit_line: {len(xs)} sizes but {len(ts)} times")
    if len(set(xs)) < 2:
        raise ValueError(f"fit_line: need at least two distinct sizes, got {list(xs)}")
    bad = [t for t in ts if not (math.isfinite(t) and t > 0)]
    if bad:
        raise ValueError(f"fit_line: times must be positive and finite, got {bad}")
    scale = max(abs(x) for x in xs)  # conditioning: fit in x / max|x|
    s = sx = sxx = st = sxt = 0.0
    for x, t in zip(xs, ts):
        w, u = 1.0 / (t * t), x / scale
        s += w
        sx += w * u
        sxx += w * u * u
        st += w * t
        sxt += w * u * t
    slope = (s * sxt - sx * st) / (s * sxx - sx * sx)
    return (st - slope * sx) / s, slope / scale


def fit_link(sizes: Sequence[int], times: Sequence[float]) -> LinkFit:
    """`LinkFit` of one-way transfer times (seconds) at message sizes (bytes), by `fit_line`.

    Always positive and finite: where noise makes the fitted slope non-positive the bandwidth is the
    best one measured (bytes / time), and it is at most `MAX_PROFILE_RATE` (a profile file's bound); a
    latency the fit puts at or below 1% of the fastest transfer is taken as the smallest
    ``t - bytes / bandwidth`` over the points, at least that 1%.
    """
    latency, slope = fit_line(sizes, times)
    bandwidth = min(1.0 / slope if slope > 0 else max(n / t for n, t in zip(sizes, times)), MAX_PROFILE_RATE)
    floor = 0.01 * min(times)
    if not latency > floor:
        latency = max(floor, min(t - n / bandwidth for n, t in zip(sizes, times)))
    return LinkFit(latency_s=latency, bandwidth_Bps=bandwidth)


def fit_gemm(flops: Sequence[float], times: Sequence[float]) -> GemmFit:
    """`GemmFit` of GEMM times (seconds) at flop counts, by `fit_line`: peak = 1 / slope (the best
    measured rate where noise makes the slope non-positive; at most `MAX_PROFILE_RATE`), overhead = the intercept,
    at least 0."""
    overhead, slope = fit_line(flops, times)
    peak = min(1.0 / slope if slope > 0 else max(f / t for f, t in zip(flops, times)), MAX_PROFILE_RATE)
    return GemmFit(peak_flops=peak, overhead_s=max(0.0, overhead))


# ----------------------------------------------------------------------------------------------
# Printing
# ----------------------------------------------------------------------------------------------


def format_profile(profile: Profile) -> str:
    """A human-readable table of `profile`: links (latency in us, bandwidth in GB/s = 1e9 B/s per
    transport), GEMM peak (TFLOP/s) and overhead per dtype, interference factors, the per-chunk cost, the fixed cost
    of a call per strategy."""
    lines = [f"machine profile: {profile.machine or 'unknown machine'} ({profile.device})", ""]
    if profile.links:
        lines.append(f"{'link':<8} {'transport':<9} {'latency (us)':>12} {'bandwidth (GB/s)':>16}")
        order = {c: i for i, c in enumerate(LINK_CLASSES)}
        for cls in sorted(profile.links, key=lambda c: (order.get(c, len(order)), c)):
            fits = profile.links[cls]
            for transport in sorted(fits, key=lambda t: (TRANSPORTS.index(t) if t in TRANSPORTS else 9, t)):
                f = fits[transport]
                lines.append(f"{cls:<8} {transport:<9} {f.latency_s * 1e6:>12.2f} {f.bandwidth_Bps / 1e9:>16.3f}")
    else:
        lines.append("links: none measured (a group of one rank)")
    lines.append("")
    if profile.gemm:
        lines.append(f"{'GEMM dtype':<10} {'peak (TFLOP/s)':>14} {'overhead (us)':>13}")
        for name, g in profile.gemm.items():
            lines.append(f"{name:<10} {g.peak_flops / 1e12:>14.3f} {g.overhead_s * 1e6:>13.2f}")
        lines.append("")
    lines.append(f"interference: a GEMM runs x{profile.gemm_slowdown:.2f} beside a transfer, "
                 f"a transfer x{profile.comm_slowdown:.2f} beside a GEMM")
    lines.append(f"cost of one more chunk: {profile.per_chunk_s * 1e6:.2f} us")
    if profile.call_s:
        costs = ", ".join(f"{s} {t * 1e6:.0f}" for s, t in profile.call_s.items())
        lines.append(f"fixed cost of a call (us): {costs}")
    return "\n".join(lines)
