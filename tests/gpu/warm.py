"""The GPU check's warm stage: every Triton kernel variant the GPU tests and timings launch, compiled before the first
test, in parallel processes (one per core), into the Triton cache the tests then read.

Which variants: every GPU-sized case of the kernel tests and every timing is built on the CPU at its GPU size
(`SizingDevice`: CPU tensors, a GPU's tiles, no streams) and launched through the helpers the tests call
(`tests.gpu.tp_ranks`, `tests.gpu.moe_ranks`) under `tests.support.launch_specs.recording`: nothing runs, and each
launch gives the variant Triton would compile for it (its specialization key and its compile inputs). Launches with one
key share one variant. Not enumerated: the ops on one device (test_ops_on_one_device.py: rank processes calling the
ops, whose kernels compile at their first call inside that module's budget) and the timeout tests' one-off shapes.

On a GPU the variants compile for the device's own target into Triton's cache (``TRITON_CACHE_DIR`` or its default):
the same compile inputs give the same cache key, so a test's launch loads the compiled kernel instead of compiling
it. On the CPU they compile ahead of time for sm_90, which is how CI tests this stage.

Usage (from the repository's root)::

    python3 -m tests.gpu.warm --out warm.json [--jobs N] [--until WALL_TIME] [--list]

The record (rewritten as each variant ends): the target, the jobs, the seconds (enumeration and all), and per variant
its kernel, tile, warps and stages, pointer types, the launches that use it, its seconds and its status (``compiled``,
``failed: ...``, or ``not reached`` where the time ran out); and every launch enumerated (``launches``).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "0"  # before any kernel is defined: an interpreted kernel does not compile

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import hashlib  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import multiprocessing  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import CUDABackend  # noqa: E402

from tests.gpu.check import machine_cores  # noqa: E402
from tests.gpu.virtual import GPU_TILE, KERNEL_TIMEOUT_NS, Device  # noqa: E402
from tests.support.launch_specs import TARGET, Launch, as_jit, recording, specialize  # noqa: E402

KEEP_S = 2.0  # what the stage keeps before its --until: writing the record


class SizingDevice(Device):
    """The CPU, sized as a GPU: groups made here hold CPU tensors of the GPU cases' sizes with a GPU's tiles, no
    streams, and nothing to wait for (the kernels are recorded, never run)."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.cuda, self.tile, self.sm_count = True, GPU_TILE, 132

    def stream(self) -> None:
        return None

    def settle(self, streams: list, flags: list, what: str) -> None:
        pass

    def publish(self, flag: torch.Tensor, value: int, stream: Any) -> None:
        flag[0] = value


def target() -> GPUTarget:
    """This machine's GPU's target where it has one, else sm_90 (Hopper)."""
    if torch.cuda.is_available():
        from triton.runtime import driver

        return driver.active.get_current_target()
    return TARGET


def arch_name(t: GPUTarget) -> str:
    return f"sm_{t.arch}" if t.backend == "cuda" else f"{t.backend}:{t.arch}"


# ==============================================================================================
# The launches of the tests and the timings
# ==============================================================================================


def launches(dev: SizingDevice, backend: CUDABackend) -> Iterator[tuple[str, Callable[[], list[Launch]]]]:
    """(label, launch) for every GPU-sized case of the kernel tests and every timing, in the order they run; a
    launch makes its group and calls the tests' launch helpers (recorded), or returns what it specialized itself."""
    from tests.gpu import moe_ranks, test_all_gather_kernels, test_host_waits, test_moe_combine_kernel, timings
    from tests.gpu import test_reduce_scatter_kernels as rs_tests
    from tests.gpu.tp_ranks import (
        GatherGroup,
        Layout,
        ScatterGroup,
        cases_for,
        launch_gather,
        launch_reduce,
        new_consumer,
        shape_id,
    )
    from tests.gpu.tp_ranks import launch_scatter as tp_scatter

    def gather(w: int, shape: tuple, dtype: torch.dtype, layout: str = "w.t()", runs: int = 0,
               tiles: tuple = (dev.tile,), ranks: int | None = None) -> list[Launch]:
        m, k, n = shape
        g = GatherGroup.create(dev, w, m, k, n, dtype, stale=6, b_layout=layout, runs=runs)
        for r in range(w if ranks is None else ranks):
            for tile in tiles:
                launch_gather(g, r, new_consumer(g), 7, KERNEL_TIMEOUT_NS, tile)
        return []

    def weight_gather(w: int, shape: tuple, dtype: torch.dtype) -> list[Launch]:
        m, k, n = shape
        g = GatherGroup.create(dev, w, n, k, 16, dtype, stale=6)
        a = torch.empty(m, k, dtype=dtype)
        for r in range(w):
            out = torch.empty(m, w * n, dtype=dtype)
            c = test_all_gather_kernels.Consumer(out, torch.zeros(1, dtype=torch.int32),
                                                 torch.zeros(1, dtype=torch.int32))
            test_all_gather_kernels.launch_weight_gather(g, r, c, a, 7, KERNEL_TIMEOUT_NS, dev.tile)
        return []

    def scatter(kind: str, w: int, shape: tuple, dtype: torch.dtype, layout: str = "w.t()", runs: int = 0,
                num_chunks: int = 2, ranks: int | None = None) -> list[Launch]:
        rows, k, n = shape
        g = ScatterGroup.create(dev, Layout(kind, w, rows, runs), k, n, dtype, num_chunks, stale=6, b_layout=layout)
        for r in range(w if ranks is None else ranks):
            tp_scatter(g, r, 7)
            launch_reduce(g, r, 7, KERNEL_TIMEOUT_NS)
        return []

    def dispatch(cfg: moe_ranks.Config, tiles: tuple = (None,), ranks: int | None = None) -> list[Launch]:
        g = moe_ranks.MoEGroup.create(dev, cfg, stale=6, owners=None if ranks is None else list(range(ranks)))
        w = moe_ranks.expert_weights(cfg, cfg.hidden, cfg.ffn, dev.device)
        for r in range(cfg.world_size if ranks is None else ranks):
            for tile in tiles:
                c = moe_ranks.wait_call(g, r, w, tile)
                if c.runs:
                    moe_ranks.launch_wait(g, c, 7, KERNEL_TIMEOUT_NS)
        return []

    def combine(cfg: moe_ranks.Config) -> list[Launch]:
        g = moe_ranks.MoEGroup.create(dev, cfg, stale=6)
        for c in test_moe_combine_kernel.combine_inputs(g).calls:
            if c.table.shape[0]:
                moe_ranks.launch_scatter(g, c, 7)
        return []

    def combine_timed(cfg: moe_ranks.Config) -> list[Launch]:
        g = moe_ranks.MoEGroup.create(dev, cfg, stale=6, owners=[])
        h = g.routes[0]
        y = torch.empty(h.num_recv, cfg.ffn, dtype=cfg.dtype)
        w = moe_ranks.expert_weights(cfg, cfg.ffn, cfg.hidden, dev.device)
        c = moe_ranks.scatter_call(g, 0, y, w, dst=[0] * cfg.world_size)  # the addresses are not specialized on
        moe_ranks.launch_scatter(g, c, 7)
        return []

    def occupy() -> list[Launch]:
        release, started = torch.zeros(1, dtype=torch.int32), torch.zeros(64, dtype=torch.int32)
        return [specialize(as_jit(test_host_waits._occupy), (64,),
                           (release, started, test_host_waits.OCCUPY_TIMEOUT_NS), {"num_warps": 1}, backend)]

    ag = test_all_gather_kernels
    for w, shape, dtype, layout in cases_for(dev, ag.ORDERED):
        yield (f"all-gather ordered {ag.describe(w, shape, dtype, layout)}",
               lambda a=(w, shape, dtype, layout): gather(*a))
    for w, shape, dtype, layout, runs in cases_for(dev, ag.RUNS):
        yield (f"all-gather runs {ag.describe(w, shape, dtype, layout, runs)}",
               lambda a=(w, shape, dtype, layout, runs): gather(*a))
    for w, shape, dtype in cases_for(dev, ag.WEIGHT_ORDERED):
        yield f"weight all-gather {ag.describe(w, shape, dtype)}", lambda a=(w, shape, dtype): weight_gather(*a)
    for w, shape, dtype in cases_for(dev, ag.RACING):
        yield f"all-gather racing {ag.describe(w, shape, dtype)}", lambda a=(w, shape, dtype): gather(*a)
    for kind, w, shape, dtype, layout in cases_for(dev, rs_tests.ORDERED):
        yield (f"{kind} ordered {rs_tests.describe(kind, w, shape, dtype, layout)}",
               lambda a=(kind, w, shape, dtype, layout): scatter(*a))
    for kind, w, shape, dtype, layout, runs in cases_for(dev, rs_tests.RUNS):
        yield (f"{kind} runs {rs_tests.describe(kind, w, shape, dtype, layout, runs)}",
               lambda a=(kind, w, shape, dtype, layout, runs): scatter(*a))
    for kind, w, shape, dtype in cases_for(dev, rs_tests.RACING):
        yield f"{kind} racing {rs_tests.describe(kind, w, shape, dtype)}", lambda a=(kind, w, shape, dtype): scatter(*a)
    moe_configs = [(f"MoE {case}", gpu) for case, (gpu, _) in moe_ranks.ORDERED.items()]
    moe_configs += [("MoE racing", moe_ranks.RACING[0]), ("MoE timeout", moe_ranks.TIMEOUT[0])]
    for name, cfg in moe_configs:
        yield f"{name} dispatch {cfg.describe()}", lambda c=cfg: dispatch(c)
        yield f"{name} combine {cfg.describe()}", lambda c=cfg: combine(c)
    yield "the spinning kernel of test_host_waits", occupy
    shapes = timings.tp_shapes()
    for label, (m, k, n) in shapes["ag"]:
        yield (f"timing: all-gather {label} {shape_id((m, k, n))}",
               lambda a=((m, k, n), torch.bfloat16): gather(timings.W, *a, tiles=timings.AG_TILES, ranks=1))
    for kind in ("rs", "ar1"):
        for label, shape in shapes[kind]:
            yield (f"timing: {kind} {label} {shape_id(shape)}",
                   lambda a=(kind, timings.W, shape, torch.bfloat16): scatter(*a, num_chunks=1, ranks=1))
    for name in timings.MOE_TIMED:
        cfg = timings.moe_config(name)
        yield f"timing: MoE dispatch {name}", lambda c=cfg: dispatch(c, (None, *timings.MOE_TILES), ranks=1)
        yield f"timing: MoE combine {name}", lambda c=cfg: combine_timed(c)


@dataclasses.dataclass
class Variant:
    """One compiled variant: what `compile` needs (picklable, for a worker process) and what the record says."""

    module: str
    kernel: str
    key: str  # a short hash of Triton's specialization key
    signature: dict[str, str]
    constexprs: dict
    attrs: dict
    options: dict[str, Any]
    tile: dict[str, int]
    used_by: list[str]
    status: str = "not reached"
    seconds: float = 0.0

    @classmethod
    def of(cls, launch: Launch, label: str) -> Variant:
        tile = {name: launch.bound[name] for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K") if name in launch.bound}
        return cls(launch.jit.fn.__module__, launch.kernel, hashlib.sha1(launch.key.encode()).hexdigest()[:12],
                   dict(launch.signature), dict(launch.constexprs), dict(launch.attrs), dict(launch.options), tile,
                   [label])

    @classmethod
    def problem(cls, label: str, why: str) -> Variant:
        return cls("", "", "", {}, {}, {}, {}, {}, [label], status=f"failed: {why}")

    def record(self) -> dict[str, Any]:
        pointers = sorted({t[1:] for t in self.signature.values() if t.startswith("*")})
        return {"kernel": self.kernel, "key": self.key, "tile": self.tile, "num_warps": self.options.get("num_warps"),
                "num_stages": self.options.get("num_stages"), "pointers": pointers, "used_by": self.used_by,
                "status": self.status, "seconds": round(self.seconds, 2)}


def variants(backend: CUDABackend, until: float = math.inf, labels: list[str] | None = None
             ) -> Iterator[tuple[Variant, bool]]:
    """Every variant the launches of `launches` make, as they are found: (variant, new), new the first time its key
    is seen (later launches add their labels to its ``used_by``). A launch that cannot be recorded, or is not
    reached by `until`, is a `Variant` of kernel ``""`` whose status says why. `labels` gets every launch's label."""
    dev = SizingDevice()
    found: dict[tuple[str, str, str], Variant] = {}
    for label, launch in launches(dev, backend):
        if labels is not None:
            labels.append(label)
        if time.time() > until:
            yield Variant.problem(label, "not enumerated (the time ran out)"), False
            continue
        try:
            with recording(backend) as recorders:
                made = launch()
            made += [one for r in recorders.values() for one in r.launches]
        except Exception as exc:  # noqa: BLE001 - one case that cannot be sized here leaves the others
            yield Variant.problem(label, f"{type(exc).__name__}: {exc}"[:300]), False
            continue
        for one in made:
            v = Variant.of(one, label)
            seen = found.get((v.module, v.kernel, v.key))
            if seen is None:
                found[(v.module, v.kernel, v.key)] = v
                yield v, True
            elif label not in seen.used_by:
                seen.used_by.append(label)


# ==============================================================================================
# Compiling, in parallel
# ==============================================================================================


def compile_variant(v: Variant, t: GPUTarget) -> tuple[str, float]:
    """Compile `v` for `t` into Triton's cache (in a worker process); returns its status and seconds."""
    from triton import compile as triton_compile
    from triton.compiler import ASTSource

    began = time.time()
    try:
        jit = as_jit(getattr(importlib.import_module(v.module), v.kernel))
        triton_compile(ASTSource(fn=jit, signature=v.signature, constexprs=v.constexprs, attrs=v.attrs), target=t,
                       options=v.options)
        return "compiled", time.time() - began
    except Exception as exc:  # noqa: BLE001 - said in the record; the test that launches it fails with the cause
        return f"failed: {type(exc).__name__}: {exc}"[:400], time.time() - began


class Record:
    """The stage's record, rewritten as it goes."""

    def __init__(self, path: Path, t: GPUTarget, jobs: int):
        self.path, self.began = path, time.time()
        self.doc: dict[str, Any] = {"arch": arch_name(t), "native": torch.cuda.is_available(), "jobs": jobs,
                                    "enumerate_s": None, "seconds": None, "complete": False, "launches": [],
                                    "variants": []}

    def save(self, found: list[Variant]) -> None:
        self.doc.update(seconds=round(time.time() - self.began, 1), variants=[v.record() for v in found],
                        compiled=sum(v.status == "compiled" for v in found),
                        failed=sum(v.status.startswith("failed") for v in found))
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.doc, indent=1, default=str))
        os.replace(tmp, self.path)


def warm(out: Path, jobs: int, until: float) -> dict[str, Any]:
    """The stage: the variants compiled by `jobs` processes as the enumeration finds them, until wall time `until`
    (less `KEEP_S`)."""
    t = target()
    rec = Record(out, t, jobs)
    found: list[Variant] = []
    rec.save(found)
    print(f"warm: compiling for {arch_name(t)} with {jobs} processes as the variants are found", flush=True)
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        pending: dict[int, Any] = {}

        def collect() -> None:
            for i in [i for i, r in pending.items() if r.ready()]:
                v = found[i]
                v.status, v.seconds = pending.pop(i).get()
                print(f"warm: {v.kernel} {v.key} {v.status} ({v.seconds:.1f} s)", flush=True)
                rec.save(found)

        for v, new in variants(CUDABackend(t), until - KEEP_S, rec.doc["launches"]):
            if new:
                pending[len(found)] = pool.apply_async(compile_variant, (v, t))
            if new or v.kernel == "":
                found.append(v)
            collect()
        rec.doc["enumerate_s"] = round(time.time() - rec.began, 1)
        while pending and time.time() < until - KEEP_S:
            collect()
            time.sleep(0.05)
        pool.terminate()  # what is still compiling when the time runs out: its test compiles it
    rec.doc["complete"] = not pending and all(v.kernel for v in found)
    rec.save(found)
    return rec.doc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m tests.gpu.warm", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="gpu_warm.json", help="the record, rewritten as each variant ends")
    p.add_argument("--jobs", type=int, default=machine_cores(), help="compiling processes (default: the cores)")
    p.add_argument("--until", type=float, default=math.inf, help="wall time (time.time()) by which the stage ends")
    p.add_argument("--list", action="store_true", help="print the variants and the launches using them, compile none")
    args = p.parse_args(argv)
    if args.jobs < 1:
        p.error(f"--jobs must be at least 1, got {args.jobs}")
    if args.list:
        found = [v for v, new in variants(CUDABackend(target())) if new or not v.kernel]
        for v in found:
            print(f"{v.kernel} {v.key} {v.tile} warps={v.options.get('num_warps')}: {'; '.join(v.used_by)}"
                  if v.kernel else f"not enumerated: {v.used_by[0]}: {v.status}")
        return 0 if all(v.kernel for v in found) else 1
    doc = warm(Path(args.out), args.jobs, args.until)
    print(f"warm: {doc['compiled']} of {len(doc['variants'])} variants compiled for {doc['arch']} in {doc['seconds']} s"
          + (f", {doc['failed']} failed" if doc["failed"] else "") + (", incomplete" if not doc["complete"] else ""),
          flush=True)
    return 0 if doc["complete"] and not doc["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
