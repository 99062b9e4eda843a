"""Probes: what a machine's links, GEMMs and their interference cost, fitted into a `plan.Profile`.

`probe` is a collective: every rank of the group calls it and returns the same Profile. Its steps,
separated by bounded store barriers so that none overlaps the next:

1. **Links.** The ranks exchange the link class each sees to every peer (`GroupInfo.link_class`).
   For every class present, the first rank pair in rank order linked by it ping-pongs messages of
   several sizes; the lower rank times round trips (one-way = half; the first round trip per size
   is a warm-up). Transports: ``"p2p"`` (torch.distributed isend/irecv: gloo or NCCL) and, in a
   group of one node, ``"copy"``: through the group's symmetric heap (`overlap.symm`) a rank copies
   the message into its peer's slot and sets a ready flag; the peer waits on it and answers the same
   way (a memcpy through POSIX shared memory on CPU ranks, a peer-to-peer copy on GPUs).
   ``t = latency + bytes / bandwidth`` is fitted to the median one-way time per size (`fit_link`).
2. **GEMMs.** All ranks at once time ``torch.mm`` of ``n x n`` operands at a few ``n`` per dtype
   (float32, bfloat16 on CPU; bfloat16, float16, float32 on GPUs, float32 under the user's TF32
   setting); ``t = overhead + flops / peak`` is fitted (`fit_gemm`). Square shapes only: the
   Profile holds one fit per dtype.
3. **Interference.** Every rank exchanges a message with its ring neighbours (send to rank+1,
   receive from rank-1, p2p) again and again on a helper thread (its own stream on GPUs), alone and
   while the main thread runs GEMMs back to back; GEMMs are timed alone too. gemm_slowdown = GEMM
   time beside the exchanges / alone, comm_slowdown = exchange time beside GEMMs / alone (medians,
   clamped to >= 1).
4. **Chunking.** That ring exchange posted whole and in 8 chunks at once, as ``pipelined`` posts them
   (`overlap.comm.exchange_chunked`): per_chunk_s = (t8 - t1) / 7, clamped to >= 0.
5. **Calls.** Batches of back-to-back forward calls of a tiny ``all_gather_matmul`` (`CALL_PROBLEM`: 16 rows
   per rank) per strategy that can run on the group (`call_strategies`), warmed up (so in the steady state
   where the strategy has one), interleaved: call_s[strategy] = the median time of a call minus what the cost
   model predicts for it from the fits above, clamped to >= 0: the fixed per-call cost (checks, plan,
   handshake or its post, dispatch, wake-ups) that decides small calls (`overlap.plans.costmodel.call_cost`).

**Combining the ranks.** Each rank publishes the median of each of its measurements through the
store (`overlap.rendezvous.exchange`); a measurement's value is the MAXIMUM over ranks (a collective runs
at its slowest rank's pace; ranks that took no part, like the responder of a ping-pong, report
nothing). Every rank then fits the same numbers with the same pure-Python arithmetic (`fit_line`),
so the Profiles are equal bit for bit; device and machine are rank 0's.

**No hang.** Every wait on a peer has the deadline `timeout` (default ``OVERLAP_TIMEOUT_S``): store
rendezvous, heap handshakes and flags, torch.distributed work (`overlap.comm.wait_work`), the helper
thread. A dead or absent peer raises `OverlapTimeout` or `OverlapError` naming op ``probe``; the
group is unusable afterwards, as after any failed call. On GPUs, NCCL waits are stream-ordered and
bounded by the process group's timeout (NCCL's watchdog), as in the ops.

**Side effects.** The copy probe sizes the group's heap for its largest message; a heap the probe
created is released at the end (`overlap.release`, which also forgets the group's `GroupInfo`: the
group's next `world.group_info` is a collective rendezvous again).

**Cache.** One JSON file per machine configuration (`cache_path`) under ``OVERLAP_CACHE_DIR``, else
``~/.cache/overlap``. `probe_cached` reads it on rank 0 and hands rank 0's answer to every rank, or
probes and saves (rank 0 writes, atomically).

This module holds the two collectives, `probe` and `probe_cached`, and the fit of the combined
measurements; the steps are in `steps`, the cache files in `overlap.tune.cache`, the fits and
`format_profile` in `fits` (all re-exported here).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import socket
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from ... import envs, rendezvous, world
from ...plans import LinkFit, Plan, Problem, Profile, predict, topology_of
from ...world import GroupInfo
from ..cache import cache_dir, cache_path, check_cache_dir, device_name, load_cached, save_cached
from ..fits import TRANSPORTS, fit_gemm, fit_line, fit_link, format_profile
from .steps import (
    CALL_PROBLEM,
    CHUNKS,
    OP,
    Probe,
    config_for,
    link_pairs,
    measure_calls,
    measure_chunking,
    measure_gemms,
    measure_interference,
    measure_links,
)

__all__ = ["cache_dir", "cache_path", "fit_gemm", "fit_line", "fit_link", "format_profile", "load_cached", "probe",
           "probe_cached", "save_cached"]  # the fits and format_profile live in `fits`, the cache files in `cache`

log = logging.getLogger("overlap")


# ----------------------------------------------------------------------------------------------
# The probe
# ----------------------------------------------------------------------------------------------


def _profile(values: dict[str, float], pairs: dict[str, tuple[int, int]], facts: list[dict],
             info: GroupInfo) -> Profile:
    """Fit the combined measurements (the same on every rank, hence the same Profile)."""
    points: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for key, t in values.items():
        kind, what, size = (key.split("/") + ["", ""])[:3]
        if kind in TRANSPORTS or kind == "gemm":
            points.setdefault((kind, what), []).append((int(size), t))
    links: dict[str, dict[str, LinkFit]] = {}
    for cls in pairs:
        for transport in TRANSPORTS:
            pts = sorted(points.get((transport, cls), []))
            if len(pts) >= 2:
                links.setdefault(cls, {})[transport] = fit_link([n for n, _ in pts], [t for _, t in pts])
    gemm = {}
    for (kind, name), pts in sorted(points.items()):
        if kind == "gemm" and len(pts) >= 2:
            pts.sort()
            gemm[name] = fit_gemm([2.0 * n**3 for n, _ in pts], [t for _, t in pts])

    def ratio(beside: str, alone: str) -> float:
        b, a = values.get(beside, 0.0), values.get(alone, 0.0)
        return max(1.0, b / a) if a > 0 else 1.0

    t1, tn = values.get("chunk/1", 0.0), values.get(f"chunk/{CHUNKS}", 0.0)
    first = facts[0]
    machine = f"{first['host']}: {info.world_size} rank(s) on {len(set(info.nodes))} node(s), {info.backend}"
    if info.device.type != "cuda":
        machine += f", {first['threads']} torch thread(s) per rank"
    profile = Profile(
        links=links, gemm=gemm,
        gemm_slowdown=ratio("busy/gemm_beside", "busy/gemm_alone"),
        comm_slowdown=ratio("busy/comm_beside", "busy/comm_alone"),
        per_chunk_s=max(0.0, (tn - t1) / (CHUNKS - 1)) if t1 > 0 and tn > 0 else 0.0,
        device=first["device"], machine=machine,
    )
    return dataclasses.replace(profile, call_s=_call_costs(values, profile, info))


def _call_costs(values: dict[str, float], profile: Profile, info: GroupInfo) -> dict[str, float]:
    """Per strategy: the measured time of a `CALL_PROBLEM` call minus what `profile` (without call costs) predicts
    for it, clamped to >= 0 (`Profile.call_s`)."""
    m, k, n = CALL_PROBLEM
    problem = Problem("all_gather_matmul", m, k, n, "bfloat16" if info.device.type == "cuda" else "float32")
    topology = topology_of(info)
    out = {}
    for key, t in sorted(values.items()):
        kind, _, strategy = key.partition("/")
        if kind != "call":
            continue
        try:
            modelled = predict(problem, Plan(strategy), topology, profile).total_s
        except ValueError:  # (a link class or GEMM fit the probe could not measure)
            continue
        out[strategy] = max(0.0, t - modelled) if math.isfinite(modelled) else t
    return out


def probe(group: dist.ProcessGroup | None = None, *, quick: bool = False, timeout: float | None = None,
          progress: Callable[[str], None] | None = None) -> Profile:
    """Measure this group's links, GEMM rates, interference and chunking cost (see the module docstring).

    A collective: every rank of `group` (default: the default group) calls it, and every rank
    returns the same `plan.Profile`. ``quick=True`` measures fewer sizes with fewer repeats (about
    1 s on 2 CPU ranks; for tests); the default takes a few seconds there (3-6 s on a 2-core VM). `timeout` bounds every
    wait on a peer (default ``OVERLAP_TIMEOUT_S``). ``progress(text)`` is called on this rank before
    each step with what it measures. A group of one rank measures GEMMs only (no links, factors 1).

    Raises ValueError for a bad `timeout`, `OverlapTimeout`/`OverlapError` where a peer is dead or
    does not take part (the group is unusable afterwards).
    """
    pg = world.resolve_group(group)
    timeout = envs.resolve_timeout(timeout)
    token = rendezvous.CALLER.set(OP)
    try:
        start = time.perf_counter()
        info = world.group_info(pg, timeout)
        cfg = config_for(info.device, quick)
        p = Probe(pg, info, timeout, progress)
        classes = [info.link_class(q) if q != info.rank else "" for q in range(info.world_size)]
        facts = p.exchange("facts", {"links": classes, "host": socket.gethostname(),
                                     "device": device_name(info.device), "threads": torch.get_num_threads()})
        pairs = link_pairs([f["links"] for f in facts])
        with torch.no_grad():
            if info.world_size > 1:
                measure_links(p, cfg, pairs)
            measure_gemms(p, cfg)
            if info.world_size > 1:
                measure_interference(p, cfg)
                measure_chunking(p, cfg)
                measure_calls(p, cfg)
        p.say("combining the ranks' measurements")
        values: dict[str, float] = {}
        for row in p.exchange("values", p.values):
            for key, t in row.items():
                values[key] = max(values.get(key, 0.0), t)
        profile = _profile(values, pairs, facts, info)
        log.info("overlap.probe: measured %s in %.1f s", profile.machine, time.perf_counter() - start)
        return profile
    finally:
        rendezvous.CALLER.reset(token)


# ----------------------------------------------------------------------------------------------
# The probe, or the cached profile
# ----------------------------------------------------------------------------------------------


def probe_cached(group: dist.ProcessGroup | None = None, *, refresh: bool = False, quick: bool = False,
                 timeout: float | None = None, progress: Callable[[str], None] | None = None) -> Profile:
    """The group's cached profile, else a fresh `probe` saved to the cache. A collective.

    Rank 0 reads its machine's file (unless `refresh`) and hands what it found, or "none", to every
    rank through the store, so every rank returns the same Profile and all probe or none does.
    After a probe rank 0 writes the file (`save_cached`). Raises as `probe`, and OSError naming OVERLAP_CACHE_DIR
    on every rank, before probing, where rank 0 could not save the profile there (`check_cache_dir`).
    """
    pg = world.resolve_group(group)
    timeout = envs.resolve_timeout(timeout)
    token = rendezvous.CALLER.set(OP)
    try:
        info = world.group_info(pg, timeout)
        shared = None
        if info.rank == 0 and not refresh:
            cached = load_cached(info, quick=quick)
            shared = cached.to_json() if cached is not None else None
        if info.rank == 0 and shared is None:
            try:  # a probe of seconds whose profile could not be saved: fail now, on every rank
                check_cache_dir()
            except OSError as exc:
                shared = {"cache_error": [exc.errno, exc.strerror]}
        shared = rendezvous.exchange(pg, "probe-cache", shared, timeout)[0]
    finally:
        rendezvous.CALLER.reset(token)
    if shared and "cache_error" in shared:
        raise OSError(*shared["cache_error"])
    if shared:
        if progress is not None:
            progress("machine profile from the cache")
        return Profile.from_json(shared)
    profile = probe(pg, quick=quick, timeout=timeout, progress=progress)
    # (the probe may have released a heap it created, and with it the group's GroupInfo: rendezvous)
    save_cached(profile, world.group_info(pg, timeout), quick=quick)
    return profile
