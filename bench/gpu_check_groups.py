"""The one-GPU check's sections in groups (bench/gpu_check.py): the registry (`GROUPS`), the listing of a group's
sections without running them, `--only`'s resolution, and the run of one group in this process (the process
`gpu_check_runner` starts for it).

A group is the sections of one concept that one process runs: its module's entry function
``entry(rep: Report, dev: Device) -> None`` calls ``rep.run(section_name, fn, skip=...)`` once per section and does
nothing else with the device, so that a listing (a `Report` with ``dry`` set and a stand-in device that has only
``cuda``) names every section the real run would run, in the same order. Each group runs in its own process: a
sticky CUDA error or a stuck queue in one cannot poison the next, and a process that dies is replaced by a fresh
one for the rest of its group. Correctness groups run first, in `GROUPS` order; the timing groups
(``timing=True``) after all of them.

Imports overlap only through the section modules, imported when a group is listed or run (after the
self-install).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
import types
from typing import Any

import torch
from gpu_check_common import EXIT_RESTART, Report, log
from gpu_check_report import DOC_NAME, device_facts, load_doc, report_sink


@dataclasses.dataclass(frozen=True)
class Group:
    """Sections that run in one process: `entry` of bench module `module` (see the module docstring)."""

    name: str
    module: str
    entry: str
    what: str
    timing: bool = False  # timing groups run after every correctness group
    env: tuple[tuple[str, str], ...] = ()  # the environment of its process besides the run's (e.g. a connection count)


# The registry. A new group is one line: correctness groups before the `timing=True` ones (the runner runs every
# correctness group before any timing group whatever the order here, but keep them apart for the reader).
GROUPS: tuple[Group, ...] = (
    Group("ag", "gpu_check_tp_ag", "run_all_gather_checks", "a-c: the fused all-gather GEMM kernel"),
    Group("streams", "gpu_check_tp_ag", "run_stream_checks", "d, e: stream-ordered signals, the symm pipeline"),
    Group("rs", "gpu_check_tp_rs", "run_reduce_scatter_checks", "f: the fused reduce-scatter kernels"),
    Group("moe", "gpu_check_moe", "run_moe_checks", "g: the fused MoE grouped-GEMM kernels"),
    Group("a2a", "gpu_check_moe", "run_a2a_checks", "h: overlap.signals' MoE all-to-all kernels"),
    Group("ops", "gpu_check_ops", "run_ops_section",
          "i: every op x {symm, fused}, fwd and fwd+bwd, through the public API, in processes sharing the device"),
    Group("ops1", "gpu_check_ops", "run_ops_section_one_queue", "i again under CUDA_DEVICE_MAX_CONNECTIONS=1",
          env=(("CUDA_DEVICE_MAX_CONNECTIONS", "1"),)),
    Group("queues", "gpu_check_streams", "run_queue_checks_default",
          "j: the symm waits (registered host words, watchdog, no SM) under CUDA_DEVICE_MAX_CONNECTIONS=32"),
    Group("queues1", "gpu_check_streams", "run_queue_checks_one_queue", "j again under CUDA_DEVICE_MAX_CONNECTIONS=1",
          env=(("CUDA_DEVICE_MAX_CONNECTIONS", "1"),)),
    Group("time_ag", "gpu_check_tp_ag", "run_all_gather_timings", "copy, signal, all-gather GEMM timings", True),
    Group("time_rs", "gpu_check_tp_rs", "run_reduce_scatter_timings", "reduce-scatter/all-reduce timings", True),
    Group("time_moe", "gpu_check_moe", "run_moe_timings", "MoE grouped-GEMM timings", True),
)


def ordered_groups() -> list[Group]:
    """Every correctness group, then every timing group, each in registry order."""
    return [g for g in GROUPS if not g.timing] + [g for g in GROUPS if g.timing]


def group_named(name: str) -> Group:
    for g in GROUPS:
        if g.name == name:
            return g
    raise ValueError(f"no group {name!r}; groups: {', '.join(g.name for g in GROUPS)}")


def entry_of(group: Group) -> Any:
    return getattr(importlib.import_module(group.module), group.entry)


# ==============================================================================================
# Listing and --only
# ==============================================================================================


def list_sections(group: Group, cuda: bool, args: argparse.Namespace) -> list[tuple[str, str | None]]:
    """``(section, static skip reason or None)`` of every section `group` runs on a GPU (`cuda`) or the CPU,
    in order, without running any: its entry with a dry `Report` and a stand-in device."""
    rep = Report(args)
    rep.dry = []
    dev = types.SimpleNamespace(cuda=cuda, device=torch.device("cuda" if cuda else "cpu"), sm_count=0)
    entry_of(group)(rep, dev)
    names = [name for name, _ in rep.dry]
    assert len(set(names)) == len(names), f"group {group.name}: duplicate section names {names}"
    return rep.dry


def resolve_only(only: list[str], listing: dict[str, list[tuple[str, str | None]]]) -> list[str] | None:
    """The sections ``--only`` selects (None: all). Each word is a group name (all its sections), a section's
    exact name (that section alone), or a prefix of section names (every one it starts). Raises ValueError
    for a word that names nothing."""
    if not only:
        return None
    every = [name for sections in listing.values() for name, _ in sections]
    chosen: list[str] = []
    for word in only:
        if word in listing:
            hits = [name for name, _ in listing[word]]
        elif word in every:
            hits = [word]
        else:
            hits = [name for name in every if name.startswith(word)]
        if not hits:
            raise ValueError(f"--only {word!r} names no group or section (--list shows them)")
        chosen += [h for h in hits if h not in chosen]
    return chosen


def print_listing(listing: dict[str, list[tuple[str, str | None]]]) -> None:
    for g in ordered_groups():
        if g.name not in listing:
            continue
        print(f"{g.name}: {g.what}{' (timing)' if g.timing else ''}")
        for name, skip in listing[g.name]:
            print(f"    {name}" + (f"    [SKIP: {skip}]" if skip else ""))


# ==============================================================================================
# One group in this process
# ==============================================================================================


def run_group(args: argparse.Namespace) -> int:
    """Run group ``args.group`` here: the sections the record does not hold yet, each recorded in ``--out`` as it
    ends (and the running one as it starts). Returns 0 when the group is done, EXIT_RESTART when a section left
    this process unusable (the runner starts a fresh one for the rest); stops itself at the deadline."""
    from gpu_check_virtual import Device

    group = group_named(args.group)
    doc_path = os.path.join(args.out, DOC_NAME)
    doc = load_doc(doc_path)
    rep = Report(args)
    rep.group, rep.stop_when_poisoned = group.name, True
    rep.selected_names = set(doc["selected"]) if doc["selected"] is not None else None
    rep.done = {s["name"] for s in doc["sections"]}
    rep.sink = report_sink(doc, [doc_path])
    connections = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    rep.log(f"group {group.name} ({group.what}) in process {os.getpid()}; CUDA_DEVICE_MAX_CONNECTIONS="
            f"{connections} when torch was imported")
    cuda = not args.cpu_smoke
    if cuda:
        device_facts(doc, True)
        device = torch.device("cuda", torch.cuda.current_device())
        rep.log(f"GPU {doc['gpu']}, {doc['sm_count']} SMs")
    else:
        device = torch.device("cpu")
    torch.manual_seed(args.seed)
    rep.arm_deadline()
    entry_of(group)(rep, Device(device, rep))
    sys.stdout.flush()
    if rep.poisoned:
        log(f"group {group.name}: this process is unusable ({rep.poisoned}); the rest of the group runs in a "
            "fresh one", rep.started)
        return EXIT_RESTART
    return 0
