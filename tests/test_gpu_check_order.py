"""The one-GPU check's device work, replayed without a GPU: it cannot deadlock itself through shared hardware
queues, and its racing checks still race.

Every correctness section of the GPU configuration (groups "ag", "streams", "rs", "moe", "a2a", and "queues"
and "queues1", checks j, whose host stores and host watchdog are modelled too) and the signal timing run here
against a recording device: fake streams and events, overlap.signals' stream operations and the kernel launches
replaced by recorders that log, in host order, what each enqueues on which stream (a flag produced, a wait on a
flag, a spinning kernel, a gate held or opened, an event recorded or waited for, a host store, a watchdog entry, a
host synchronization). A small model of the device then replays each section's log:

* **one hardware queue for every stream** (the worst case; ``CUDA_DEVICE_MAX_CONNECTIONS=1``): a queue starts
  its commands in issue order; a command starts once its stream's previous command is complete; a stream wait
  holds the queue until its flag is set; a kernel, once started, runs until the flags it waits for are set.
  Every command must complete with no wait timing out (bounded waits count as unbounded here; only the waits
  meant to time out, and the delay kernels, complete by themselves);
* **a queue per stream** (``CUDA_DEVICE_MAX_CONNECTIONS=32``): the same, and in the racing sections every
  waiter stream's first wait is armed (spinning, or a stream wait at its queue's head) before the first flag
  it waits for is produced: the race the section exists for happens (e. races through its rank-dependent
  delays, which the model does not time).

The host issues commands in order; a host synchronization (`Device.settle`) lets it go on only once the events
it polls are complete, and a gate opens when the host reaches its ``open`` (a host store to pinned memory).
CUDA's lazy loading is modelled too (`support.device_model`): the first launch of a kernel (a Triton kernel by
name, dtype and tile; each of ``_C``'s kernels; a cuBLAS GEMM by dtype and shape) in a section is a host
synchronization on every device command issued before it, as if the section ran first in a fresh process; so a
kernel a section races behind a gate must have been launched once before the gate (`Device.warm`).
What this cannot prove: how the hardware maps streams to queues, kernel timing, memory ordering (the GPU run does).
"""

from __future__ import annotations

import contextlib
import sys
import types
from pathlib import Path

import pytest
import torch
from support.device_model import FakeEvent, FakeStream, Op, Recorder, fake_signals, race_kept, replay

ROOT = Path(__file__).resolve().parents[1]


RACING = ("b.racing", "d.", "f.rs racing", "f.ar1 racing", "g.moe dispatch racing", "g.moe combine racing",
          "h.moe a2a")


@pytest.fixture(scope="module")
def replays():
    """{section: (ops, one-queue result, per-stream result)} of every GPU correctness section."""
    sys.path.insert(0, str(ROOT / "bench"))
    mp = pytest.MonkeyPatch()
    try:
        yield run_sections(mp)
    finally:
        mp.undo()
        sys.path.remove(str(ROOT / "bench"))


def run_sections(mp: pytest.MonkeyPatch) -> dict[str, tuple]:
    import argparse

    import gpu_check_common
    import gpu_check_moe
    import gpu_check_moe_a2a
    import gpu_check_moe_combine
    import gpu_check_moe_dispatch
    import gpu_check_moe_group
    import gpu_check_streams
    import gpu_check_tp_ag
    import gpu_check_tp_group
    import gpu_check_tp_rs
    import gpu_check_virtual as virtual

    holder = {"rec": Recorder()}

    def rec() -> Recorder:
        return holder["rec"]

    sig = types.SimpleNamespace()  # forwards to the current recorder's fakes
    for name in ("cuda_stream_write_value32", "cuda_stream_wait_value32", "cuda_wait_flag_bounded", "signal_store",
                 "moe_dispatch_rows", "moe_combine_rows", "watchdog_arm", "cuda_host_register", "cuda_host_unregister",
                 "watchdog_cancel", "watchdog_fired"):
        setattr(sig, name, lambda *a, _n=name: getattr(fake_signals(rec(), virtual.SHORT_TIMEOUT_NS), _n)(*a))
    for module in (virtual, gpu_check_moe_a2a, gpu_check_moe_combine, gpu_check_tp_rs, gpu_check_streams):
        mp.setattr(module, "signals", sig)

    @contextlib.contextmanager
    def on_stream(stream):
        rec().current.append(stream)
        try:
            yield
        finally:
            rec().current.pop()

    mp.setattr(torch.cuda, "Stream", lambda *a, **k: FakeStream(rec()))
    mp.setattr(torch.cuda, "Event", lambda *a, **k: FakeEvent(rec(), *a, **k))
    mp.setattr(torch.cuda, "stream", on_stream)
    mp.setattr(torch.cuda, "current_stream", lambda *a, **k: rec().current[-1] if rec().current else rec().default)

    def fake_poll(events, timeout_s):
        rec().add(Op("sync", None, deps=tuple(e.op for e in events if e.op is not None)))
        return True

    mp.setattr(virtual, "poll", fake_poll)
    queue_checks(mp, rec, gpu_check_streams)

    def keys_of(tensors):
        return frozenset(rec().tensor_key(t) for t in tensors)

    def spin(kernel, keys, epoch, timeout_ns):
        kind = "done" if timeout_ns <= virtual.SHORT_TIMEOUT_NS else "spin"
        rec().launch(Op(kind, rec().stream_now(), keys, epoch), kernel)

    def produce(kernel, keys, epoch):
        rec().launch(Op("produce", rec().stream_now(), keys, epoch), kernel)

    # A kernel is known by its name, dtype and tile: each such variant is code of its own to load.
    mp.setattr(gpu_check_tp_ag, "launch_gather", lambda g, r, c, epoch, t, tile: spin(
        ("all_gather_matmul", g.b.dtype, tile), keys_of(g.flags), epoch, t))
    mp.setattr(gpu_check_tp_ag, "launch_weight_gather", lambda g, r, c, a, epoch, t, tile: spin(
        ("all_gather_weight_matmul", a.dtype, tile), keys_of(g.flags), epoch, t))
    mp.setattr(gpu_check_tp_rs, "launch_reduce", lambda g, r, epoch, t, watchdog=True: spin(
        ("reduce_chunks", g.outs[r].dtype, g.tile), keys_of(g.flags), epoch, t))
    mp.setattr(gpu_check_tp_rs, "launch_scatter", lambda g, r, epoch: produce(
        ("matmul_scatter", g.a[r].dtype, g.tile), keys_of([g.flags[r]]), epoch))

    def moe_wait(g, c, epoch, t, watchdog=True):
        if c.runs:
            sources = [g.pads[s] for s in range(g.world_size) if sum(g.handles[c.rank].recv_counts[s])]
            spin(("grouped_matmul_wait", g.cfg.dtype), keys_of(sources), epoch, t)

    mp.setattr(gpu_check_moe_dispatch, "launch_wait", moe_wait)
    mp.setattr(gpu_check_moe_combine, "launch_scatter", lambda g, c, epoch: produce(
        ("grouped_matmul_scatter", g.cfg.dtype), keys_of([g.pads[c.rank]]), epoch))

    def gemm(original):  # torch's GEMMs: cuBLAS kernels, one per dtype and shape
        def run(a, b, *args, **kwargs):
            rec().launch(Op("gemm", rec().stream_now()), ("cublas", a.dtype, tuple(a.shape), tuple(b.shape)))
            return original(a, b, *args, **kwargs)
        return run

    for name in ("mm", "matmul"):
        mp.setattr(torch, name, gemm(getattr(torch, name)))

    def track(cls, attr):  # register every group's flag tensors with the recorder
        original = cls.create.__func__

        def create(kls, *a, **k):
            g = original(kls, *a, **k)
            rec().flag_tensors += list(getattr(g, attr))
            for t in getattr(g, attr):  # the values the flags start at (a warm-up waits on them)
                rec().add(Op("init", None, frozenset([rec().tensor_key(t)]), int(t.min())))
            if attr == "pads":
                rec().moe_groups.append(g)
            return g

        mp.setattr(cls, "create", classmethod(create))

    track(gpu_check_tp_group.GatherGroup, "flags")
    track(gpu_check_tp_group.ScatterGroup, "flags")
    track(gpu_check_moe_group.MoEGroup, "pads")
    original_gate = virtual.Device.gate

    def gate(self):
        g = original_gate(self)
        rec().gate_words[g.words[0].data_ptr()] = len(rec().gate_words) + 1
        return g

    mp.setattr(virtual.Device, "gate", gate)
    original_warm = virtual.Device.warm

    def warm(self, what, launch):
        rec().warming = True
        try:
            original_warm(self, what, launch)
        finally:
            rec().warming = False

    mp.setattr(virtual.Device, "warm", warm)

    args = argparse.Namespace(started_at=None, time_limit=1e9, only=[], out="unused")
    results: dict[str, tuple] = {}

    class Rep(gpu_check_common.Report):
        """Runs each section under a fresh recorder; the results (wrong here: nothing computes) stay quiet."""

        def add(self, name, status, value="", **kw):
            self.results.append(gpu_check_common.Result(name, status, value))

        def run(self, section, fn, skip=None, check_time=True):
            if skip is not None:
                return False
            holder["rec"] = Recorder()
            holder["rec"].delay_words = {dev._delay_words[0].data_ptr()}
            fn()
            ops = holder["rec"].ops
            results[section] = (ops, replay(ops, one_queue=True), replay(ops, one_queue=False),
                                [r for r in self.results if r.status == "SKIP"])
            return False

    rep = Rep(args)
    dev = virtual.Device(torch.device("cpu"), rep)
    dev.cuda, dev.sm_count, dev.tile = True, 132, virtual.Tile(128, 128, 64)
    entries = (gpu_check_tp_ag.run_all_gather_checks, gpu_check_tp_ag.run_stream_checks,
               gpu_check_tp_rs.run_reduce_scatter_checks, gpu_check_moe.run_moe_checks, gpu_check_moe.run_a2a_checks,
               gpu_check_streams.run_queue_checks_default, gpu_check_streams.run_queue_checks_one_queue)
    for entry in entries:
        entry(rep, dev)
    rep.run("time signal", lambda: virtual.time_signals(rep, dev, pairs=3))
    return results


def queue_checks(mp: pytest.MonkeyPatch, rec, streams) -> None:
    """Checks j (gpu_check_streams) under the recorder: their own queue setting assumed, pinned buffers as plain
    host memory, the spinning kernel a `spin` on its release word, the bounded synchronize a host sync on
    everything issued, small GEMMs, and no host polling (the model decides what completes)."""
    mp.setattr(streams, "_wrong_connections", lambda rep, name, expected: False)
    mp.setattr(streams, "_until", lambda predicate, timeout_s: True)
    g = torch.Generator().manual_seed(0)
    mp.setattr(streams, "_gemm_inputs", lambda dev: (torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g),
                                                     torch.empty(8, 8)))
    for name in ("zeros", "full"):
        original = getattr(torch, name)
        mp.setattr(torch, name, lambda *a, _f=original, pin_memory=False, **k: _f(*a, **k))

    class Occupy:
        def __getitem__(self, grid):
            def launch(release, started, timeout_ns, num_warps):
                rec().launch(Op("spin", rec().stream_now(), frozenset([rec().tensor_key(release)]), 1), "_occupy")
            return launch

    mp.setattr(streams, "_occupy", Occupy())

    def synchronize(dev, timeout_s):
        rec().add(Op("sync", None, deps=tuple(i for i, op in enumerate(rec().ops) if op.stream is not None)))
        return True, None

    mp.setattr(streams, "_bounded_synchronize", synchronize)


def test_every_gpu_correctness_section_was_replayed(replays):
    prefixes = {name.split(" ")[0].split("=")[0] for name in replays}
    for prefix in ("a.ordered", "b.racing", "c.timeout", "d.cuda_wait_flag_bounded", "d.cuda_stream_wait_value32",
                   "e.symm-pipeline", "f.rs", "f.ar2", "f.ar1", "g.moe", "h.moe", "time", "j.32-queue",
                   "j.1-queue"):
        assert prefix in prefixes, sorted(replays)
    assert len(replays) >= 40, sorted(replays)
    for section, (ops, *_rest, skips) in replays.items():
        assert not skips, (section, skips)  # nothing skipped itself: each ran its GPU path here
        assert any(op.kind in ("spin", "swait", "done", "produce") for op in ops), (section, ops)


def test_no_section_deadlocks_with_one_hardware_queue(replays):
    stuck = {section: one[3] for section, (ops, one, per, _) in replays.items() if not one[0]}
    assert not stuck, stuck


def test_the_racing_sections_race_with_a_queue_per_stream(replays):
    problems = {}
    for section, (ops, _one, per, _) in replays.items():
        assert per[0], (section, per[3])
        if section.startswith(RACING):
            found = race_kept(ops, per[1], per[2])
            if found:
                problems[section] = found
    assert not problems, problems
    racing = [s for s in replays if s.startswith(RACING)]
    assert len(racing) >= 12, racing


def test_only_the_watchdog_frees_the_queue_a_wait_nobody_publishes_blocks(replays):
    """Checks j: the waits of register+wait and no starvation are released by their publish (a stream write issued
    before the wait, a host store) with the watchdog entries removed; the wait nobody publishes blocks the one
    queue, the work of the other stream behind it, and the host's synchronize, until the watchdog fires."""
    names = [f"j.{q}-queue {c}" for q in ("32", "1") for c in ("register+wait", "watchdog release", "no starvation")]
    assert all(n in replays for n in names), sorted(replays)
    for name in names:
        ops = replays[name][0]
        assert any(op.kind == "watch" for op in ops) and any(op.kind == "swait" for op in ops), (name, ops)
        unwatched = [Op("note", None) if op.kind == "watch" else op for op in ops]
        if "watchdog release" in name:
            assert not replay(unwatched, one_queue=True)[0] and not replay(unwatched, one_queue=False)[0], name
        else:
            assert replay(unwatched, one_queue=True)[0] and replay(unwatched, one_queue=False)[0], name


def test_the_model_finds_a_waiter_issued_before_its_producer():
    """The replay's own check: a spinning consumer and its end event issued before the publisher, on one queue."""
    flag = ("flags", 0)
    ops = [Op("spin", 1, frozenset([flag]), 5), Op("record", 1), Op("produce", 2, frozenset([flag]), 5)]
    assert not replay(ops, one_queue=True)[0] and replay(ops, one_queue=False)[0]
    gated = [Op("hold", 2, gate=1), Op("produce", 2, frozenset([flag]), 5), Op("spin", 1, frozenset([flag]), 5),
             Op("record", 1), Op("open", None, gate=1)]
    assert replay(gated, one_queue=True)[0] and replay(gated, one_queue=False)[0]
    assert not race_kept(gated, *replay(gated, one_queue=False)[1:3])
    ungated = [Op("produce", 2, frozenset([flag]), 5), Op("spin", 1, frozenset([flag]), 5), Op("record", 1)]
    assert race_kept(ungated, *replay(ungated, one_queue=False)[1:3])  # producers first without a gate: no race


def test_the_model_finds_a_first_launch_behind_a_gate():
    """Lazy loading in the replay: a kernel's first launch drains the device first, so behind a closed gate (which
    only the host, blocked in that launch, could open) it never returns; launched once before the gate, it
    does."""
    flag = ("flags", 0)

    def section(warm: bool) -> list[Op]:
        rec = Recorder()
        if warm:
            rec.add(Op("init", None, frozenset([flag]), 4))
            rec.warming = True
            rec.launch(Op("spin", 1, frozenset([flag]), 4), "consumer")  # on the stale flag: no wait
            rec.warming = False
        rec.launch(Op("hold", 2, gate=1), "gate")
        rec.add(Op("produce", 2, frozenset([flag]), 5))
        rec.launch(Op("spin", 1, frozenset([flag]), 5), "consumer")
        rec.add(Op("open", None, gate=1))
        return rec.ops

    cold, warmed = section(warm=False), section(warm=True)
    for one_queue in (True, False):
        done, *_, why = replay(cold, one_queue=one_queue)
        assert not done and "first launch of consumer" in why, why
        assert replay(warmed, one_queue=one_queue)[0], replay(warmed, one_queue=one_queue)[3]
    assert not race_kept(warmed, *replay(warmed, one_queue=False)[1:3])  # the warm-up's wait races nothing
