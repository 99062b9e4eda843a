"""The GPU tests' device work (tests/gpu), replayed without a GPU: it cannot deadlock itself through shared
hardware queues, and its racing tests still race.

Every GPU test that drives the device through virtual ranks (the all-gather, reduce-scatter and MoE kernels, the
stream signals, the symm pipeline, the MoE all-to-all kernels, and the host waits, whose host stores and host
watchdog are modelled too) and the signal timing of tests/gpu/timings.py run here against a recording device: fake
streams and events, overlap.signals' stream operations and the kernel launches replaced by recorders that log, in
host order, what each enqueues on which stream (a flag produced, a wait on a flag, a spinning kernel, a gate held
or opened, an event recorded or waited for, a host store, a watchdog entry, a host synchronization). A small model
of the device then replays each test's log:

* **one hardware queue for every stream** (the worst case; ``CUDA_DEVICE_MAX_CONNECTIONS=1``): a queue starts
  its commands in issue order; a command starts once its stream's previous command is complete; a stream wait
  holds the queue until its flag is set; a kernel, once started, runs until the flags it waits for are set.
  Every command must complete with no wait timing out (bounded waits count as unbounded here; only the waits
  meant to time out, and the delay kernels, complete by themselves);
* **a queue per stream** (``CUDA_DEVICE_MAX_CONNECTIONS=32``): the same, and in the racing tests every waiter
  stream's first wait is armed (spinning, or a stream wait at its queue's head) before the first flag it waits
  for is produced: the race the test exists for happens (the symm pipeline races through its rank-dependent
  delays, which the model does not time).

The host issues commands in order; a host synchronization (`Device.settle`) lets it go on only once the events
it polls are complete, and a gate opens when the host reaches its ``open`` (a host store to pinned memory).
CUDA's lazy loading is modelled too (`tests.support.device_model`): the first launch of a kernel (a Triton kernel by
name, dtype and tile; each of ``_C``'s kernels; a cuBLAS GEMM by dtype and shape) in a test is a host
synchronization on every device command issued before it, as if the test ran first in a fresh process; so a
kernel a test races behind a gate must have been launched once before the gate (`Device.warm`).
What this cannot prove: how the hardware maps streams to queues, kernel timing, memory ordering (the GPU run does).
"""

from __future__ import annotations

import contextlib
import math
import tempfile
import types
from pathlib import Path

import pytest
import torch

from tests.support.device_model import FakeEvent, FakeStream, Op, Recorder, fake_signals, race_kept, replay

RACING = ("all-gather racing", "stream signals", "reduce-scatter racing", "moe dispatch racing",
          "moe combine racing", "moe all-to-all")
HOST_WAITS = ("host waits register+wait", "host waits watchdog release", "host waits no starvation")


@pytest.fixture(scope="module")
def replays():
    """{test: (ops, one-queue result, per-stream result, skip reason)} of every GPU test that uses the device."""
    mp = pytest.MonkeyPatch()
    try:
        yield run_tests(mp)
    finally:
        mp.undo()


def run_tests(mp: pytest.MonkeyPatch) -> dict[str, tuple]:
    from tests.gpu import moe_ranks, timings, tp_ranks, virtual
    from tests.gpu import test_all_gather_kernels as ag
    from tests.gpu import test_host_waits as host_waits
    from tests.gpu import test_moe_all_to_all as a2a
    from tests.gpu import test_moe_combine_kernel as combine
    from tests.gpu import test_moe_dispatch_kernel as dispatch
    from tests.gpu import test_reduce_scatter_kernels as rs
    from tests.gpu import test_stream_signals as stream_signals
    from tests.gpu import test_symm_pipeline as symm_pipeline

    holder = {"rec": Recorder()}

    def rec() -> Recorder:
        return holder["rec"]

    sig = types.SimpleNamespace()  # forwards to the current recorder's fakes
    for name in ("cuda_stream_write_value32", "cuda_stream_wait_value32", "cuda_wait_flag_bounded", "signal_store",
                 "moe_dispatch_rows", "moe_combine_rows", "watchdog_arm", "cuda_host_register", "cuda_host_unregister",
                 "watchdog_cancel", "watchdog_fired"):
        setattr(sig, name, lambda *a, _n=name: getattr(fake_signals(rec(), virtual.SHORT_TIMEOUT_NS), _n)(*a))
    for module in (virtual, a2a, combine, rs, host_waits, stream_signals):
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
    host_wait_fakes(mp, rec, host_waits)

    def keys_of(tensors):
        return frozenset(rec().tensor_key(t) for t in tensors)

    def spin(kernel, keys, epoch, timeout_ns):
        kind = "done" if timeout_ns <= virtual.SHORT_TIMEOUT_NS else "spin"
        rec().launch(Op(kind, rec().stream_now(), keys, epoch), kernel)

    def produce(kernel, keys, epoch):
        rec().launch(Op("produce", rec().stream_now(), keys, epoch), kernel)

    # A kernel is known by its name, dtype and tile: each such variant is code of its own to load.
    mp.setattr(ag, "launch_gather", lambda g, r, c, epoch, t, tile: spin(
        ("all_gather_matmul", g.b.dtype, tile), keys_of(g.flags), epoch, t))
    mp.setattr(ag, "launch_weight_gather", lambda g, r, c, a, epoch, t, tile: spin(
        ("all_gather_weight_matmul", a.dtype, tile), keys_of(g.flags), epoch, t))
    mp.setattr(rs, "launch_reduce", lambda g, r, epoch, t, watchdog=True: spin(
        ("reduce_chunks", g.outs[r].dtype, g.tile), keys_of(g.flags), epoch, t))
    mp.setattr(rs, "launch_scatter", lambda g, r, epoch: produce(
        ("matmul_scatter", g.a[r].dtype, g.tile), keys_of([g.flags[r]]), epoch))

    def moe_wait(g, c, epoch, t, watchdog=True):
        if c.runs:
            sources = [g.pads[s] for s in range(g.world_size) if sum(g.routes[c.rank].recv_counts[s])]
            spin(("grouped_matmul_wait", g.cfg.dtype), keys_of(sources), epoch, t)

    mp.setattr(dispatch, "launch_wait", moe_wait)
    mp.setattr(combine, "launch_scatter", lambda g, c, epoch: produce(
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

    track(tp_ranks.GatherGroup, "flags")
    track(tp_ranks.ScatterGroup, "flags")
    track(moe_ranks.MoEGroup, "pads")
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

    dev = virtual.Device(torch.device("cpu"))
    dev.cuda, dev.sm_count, dev.tile = True, 132, virtual.Tile(128, 128, 64)
    results: dict[str, tuple] = {}

    def record(name: str, fn) -> None:
        """Run one test's device work under a fresh recorder; what it computes is wrong here (nothing runs), so
        its verdict is not asked; a skip is kept (none may skip: each runs its GPU path here)."""
        holder["rec"] = Recorder()
        holder["rec"].delay_words = {dev._delay_words[0].data_ptr()}
        skipped = None
        try:
            fn()
        except pytest.skip.Exception as exc:
            skipped = str(exc)
        except AssertionError:
            pass
        ops = holder["rec"].ops
        results[name] = (ops, replay(ops, one_queue=True), replay(ops, one_queue=False), skipped)

    bf16 = torch.bfloat16
    for c in [*tp_ranks.cases_for(dev, ag.ORDERED), *tp_ranks.cases_for(dev, ag.RUNS)]:
        record(f"all-gather ordered {c}", lambda c=c: ag.check_ordered(dev, *c))
    for c in tp_ranks.cases_for(dev, ag.WEIGHT_ORDERED):
        record(f"all-gather weight ordered {c}", lambda c=c: ag.check_weight_ordered(dev, *c))
    for c in tp_ranks.cases_for(dev, ag.RACING):
        record(f"all-gather racing {c}", lambda c=c: ag.check_racing(dev, *c))
    record("all-gather timeout", lambda: ag.check_timeout(dev, bf16))
    record("stream signals flag wait", lambda: stream_signals.check_flag_wait_kernel(dev))
    record("stream signals stream wait", lambda: stream_signals.check_stream_wait(dev))
    for w in (2, 4):  # after the stream signals, as in a run (`Device.idle` drains every stream made before)
        record(f"symm pipeline W={w}", lambda w=w: symm_pipeline.check_symm_pipeline(dev, w, (256, 512, 384), bf16))
    for c in [*tp_ranks.cases_for(dev, rs.ORDERED), *tp_ranks.cases_for(dev, rs.RUNS)]:
        record(f"reduce-scatter ordered {c}", lambda c=c: rs.check_ordered(dev, *c))
    for c in tp_ranks.cases_for(dev, rs.RACING):
        record(f"reduce-scatter racing {c}", lambda c=c: rs.check_racing(dev, *c))
    record("reduce-scatter timeout", lambda: rs.check_timeout(dev, bf16))
    for case in moe_ranks.ORDERED:
        record(f"moe dispatch ordered {case}",
               lambda c=case: dispatch.check_dispatch_ordered(dev, moe_ranks.ordered_config(dev, c)))
        record(f"moe combine ordered {case}",
               lambda c=case: combine.check_combine_ordered(dev, moe_ranks.ordered_config(dev, c)))
        record(f"moe all-to-all {case}", lambda c=case: a2a.check_a2a_kernels(dev, moe_ranks.ordered_config(dev, c)))
    record("moe dispatch racing", lambda: dispatch.check_dispatch_racing(dev, moe_ranks.racing_config(dev)))
    record("moe dispatch timeout", lambda: dispatch.check_dispatch_timeout(dev, moe_ranks.timeout_config(dev)))
    record("moe combine racing", lambda: combine.check_combine_racing(dev, moe_ranks.racing_config(dev)))
    record(HOST_WAITS[0], lambda: host_waits.check_register_and_wait(dev))
    record(HOST_WAITS[1], lambda: host_waits.check_watchdog_release(dev))
    record(HOST_WAITS[2], lambda: host_waits.check_no_starvation(dev))
    mp.setattr(timings, "signals", sig)
    with tempfile.TemporaryDirectory() as tmp:
        plan = timings.Timings(Path(tmp) / "timings.json", until=math.inf)
        record("timing stream-ordered signal", lambda: timings.time_signal(plan, dev, pairs=3))
    return results


def host_wait_fakes(mp: pytest.MonkeyPatch, rec, host_waits) -> None:
    """The host-wait tests under the recorder: pinned buffers as plain host memory, the spinning kernel a `spin`
    on its release word, the bounded synchronize a host sync on everything issued, small GEMMs, and no host
    polling (the model decides what completes)."""
    mp.setattr(host_waits, "_until", lambda predicate, timeout_s: True)
    g = torch.Generator().manual_seed(0)
    mp.setattr(host_waits, "_gemm_inputs", lambda dev: (torch.randn(8, 8, generator=g),
                                                        torch.randn(8, 8, generator=g), torch.empty(8, 8)))
    for name in ("zeros", "full"):
        original = getattr(torch, name)
        mp.setattr(torch, name, lambda *a, _f=original, pin_memory=False, **k: _f(*a, **k))

    class Occupy:
        def __getitem__(self, grid):
            def launch(release, started, timeout_ns, num_warps):
                rec().launch(Op("spin", rec().stream_now(), frozenset([rec().tensor_key(release)]), 1), "_occupy")
            return launch

    mp.setattr(host_waits, "_occupy", Occupy())

    def synchronize(dev, timeout_s):
        rec().add(Op("sync", None, deps=tuple(i for i, op in enumerate(rec().ops) if op.stream is not None)))
        return True, None

    mp.setattr(host_waits, "_bounded_synchronize", synchronize)


def test_every_gpu_test_of_the_device_was_replayed(replays):
    kinds = {" ".join(name.split(" ")[:2]) for name in replays}
    for kind in ("all-gather ordered", "all-gather weight", "all-gather racing", "all-gather timeout", "stream signals",
                 "symm pipeline", "reduce-scatter ordered", "reduce-scatter racing", "reduce-scatter timeout",
                 "moe dispatch", "moe combine", "moe all-to-all", "host waits", "timing stream-ordered"):
        assert kind in kinds, sorted(replays)
    assert len(replays) >= 40, sorted(replays)
    for name, (ops, _one, _per, skipped) in replays.items():
        assert skipped is None, (name, skipped)  # nothing skipped itself: each ran its GPU path here
        assert any(op.kind in ("spin", "swait", "done", "produce") for op in ops), (name, ops)


def test_nothing_deadlocks_with_one_hardware_queue(replays):
    stuck = {name: one[3] for name, (ops, one, per, _) in replays.items() if not one[0]}
    assert not stuck, stuck


def test_the_racing_tests_race_with_a_queue_per_stream(replays):
    problems = {}
    for name, (ops, _one, per, _) in replays.items():
        assert per[0], (name, per[3])
        if name.startswith(RACING):
            found = race_kept(ops, per[1], per[2])
            if found:
                problems[name] = found
    assert not problems, problems
    racing = [s for s in replays if s.startswith(RACING)]
    assert len(racing) >= 10, racing


def test_only_the_watchdog_frees_the_queue_a_wait_nobody_publishes_blocks(replays):
    """The host waits: register+wait and no starvation are released by their publish (a stream write issued before
    the wait, a host store) with the watchdog entries removed; the wait nobody publishes blocks the one queue, the
    work of the other stream behind it, and the host's synchronize, until the watchdog fires."""
    for name in HOST_WAITS:
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


def test_epoch_words_are_made_with_their_group_never_inside_a_gated_window(monkeypatch):
    """Every epoch word a group's launches read exists once the group does (an allocation and its fill behind a
    closed gate could wait on the device the gate holds); an epoch it has no word for is refused, not made late;
    and no GPU test makes one itself (`overlap.kernels.epoch_word` is called by `virtual.EpochWords` alone)."""
    import ast

    from tests.gpu import tp_ranks, virtual

    dev = virtual.Device(torch.device("cpu"))
    g = tp_ranks.GatherGroup.create(dev, 2, 16, 32, 16, torch.float32, stale=6)
    monkeypatch.setattr(virtual, "epoch_word", lambda *a: pytest.fail("an epoch word made after its group"))
    assert [int(g.epochs(e)) for e in (6, 7, 8)] == [6, 7, 8]
    with pytest.raises(AssertionError, match=r"epoch 9 has no word: .* stale=6 has words for \[6, 7, 8\]"):
        g.epochs(9)
    callers = []
    for path in sorted((Path(__file__).resolve().parents[1]).glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == \
                    "epoch_word":
                callers.append(path.name)
    assert callers == ["virtual.py"], callers
