"""A model of a GPU's hardware queues for `tests/gpu/cpu/test_gpu_check_order.py`: recorded operations (`Op`,
`Recorder`, fake streams, events and signals) and their replay with one queue for every stream or one queue per stream
(`replay`), and whether the racing checks still race (`race_kept`).

It also models CUDA's lazy loading (the default since CUDA 12.2): the first launch of a kernel whose code is not
loaded yet waits, on the host, for the device to drain before it loads it (`Recorder.launch` records a ``load``:
a host synchronization on every device operation issued before it). Each section is recorded as if it ran first
in a fresh process (``--only``, or a group restarted after a crash), so a kernel a section launches behind a
gate must have been launched once by that section before the gate closed."""

from __future__ import annotations

import dataclasses
import itertools
import types

import torch


@dataclasses.dataclass
class Op:
    kind: str  # produce, init, spin, swait, hold, open, delay, done, record, dep, sync, load, gemm, watch, note
    stream: int | None  # None: a host operation (open, sync)
    keys: frozenset = frozenset()  # flags produced or awaited
    value: int = 0
    deps: tuple[int, ...] = ()  # ops that must be complete first (events, wait_stream, a sync's events)
    gate: int = 0  # the gate a hold waits on / an open opens
    note: object = None  # what a ``load`` loads (for the messages)
    warm: bool = False  # issued by a warm-up (`Device.warm`): it loads kernels, it races nothing


class Recorder:
    """The log of one section, and the fakes that write it."""

    def __init__(self):
        self.ops: list[Op] = []
        self.flag_tensors: list[torch.Tensor] = []
        self.gate_words: dict[int, int] = {}  # address of a gate word -> gate id
        self.delay_words: set[int] = set()
        self.moe_groups: list = []
        self.ids = itertools.count(1)
        self.current: list[FakeStream] = []
        self.default = FakeStream(self)
        self.loaded: dict = {}  # kernel -> the ``load`` op of its first launch
        self.warming = False  # inside `Device.warm`

    def launch(self, op: Op, kernel) -> int:
        """Record a kernel launch; its first launch in the section first loads the kernel (lazy loading: the host
        waits until every device operation issued so far is complete)."""
        if kernel not in self.loaded:
            issued = tuple(i for i, o in enumerate(self.ops) if o.stream is not None)
            self.loaded[kernel] = self.add(Op("load", None, deps=issued, note=kernel))
        return self.add(op)

    def key(self, addr: int):
        for i, t in enumerate(self.flag_tensors):
            if t.data_ptr() <= addr < t.data_ptr() + t.numel() * t.element_size():
                return ("flags", i)
        return ("word", addr)

    def tensor_key(self, t: torch.Tensor):
        return self.key(t.data_ptr())

    def stream_now(self) -> int:
        return (self.current[-1] if self.current else self.default).cuda_stream

    def last_on(self, stream: int) -> int | None:
        return next((i for i in reversed(range(len(self.ops))) if self.ops[i].stream == stream), None)

    def add(self, op: Op) -> int:
        op.warm = self.warming
        self.ops.append(op)
        return len(self.ops) - 1


class FakeStream:
    def __init__(self, rec: Recorder, *args, **kwargs):
        self.rec, self.cuda_stream = rec, next(rec.ids)

    def wait_stream(self, other: FakeStream) -> None:
        last = self.rec.last_on(other.cuda_stream)
        self.rec.add(Op("dep", self.cuda_stream, deps=() if last is None else (last,)))

    def wait_event(self, event: FakeEvent) -> None:
        self.rec.add(Op("dep", self.cuda_stream, deps=() if event.op is None else (event.op,)))


class FakeEvent:
    def __init__(self, rec: Recorder, enable_timing: bool = False):
        self.rec, self.op = rec, None

    def record(self, stream: FakeStream | None = None) -> None:
        s = stream.cuda_stream if stream is not None else self.rec.stream_now()
        self.op = self.rec.add(Op("record", s))

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: FakeEvent) -> float:
        return 1.0


def fake_signals(rec: Recorder, short_ns: int):
    def write(addr, value, stream):
        rec.add(Op("produce", stream, frozenset([rec.key(addr)]), value))

    def stream_wait(addr, value, stream):
        rec.add(Op("swait", stream, frozenset([rec.key(addr)]), value))

    def bounded(addr, value, timeout_ns, err_addr, stream):  # _C's bounded wait kernel
        if addr in rec.gate_words:
            op = Op("hold", stream, gate=rec.gate_words[addr])
        elif addr in rec.delay_words:
            op = Op("delay", stream)
        elif timeout_ns <= short_ns:
            op = Op("done", stream)  # meant to time out: it completes by itself
        else:
            op = Op("spin", stream, frozenset([rec.key(addr)]), value)
        rec.launch(op, "_C wait_flag_bounded")

    def store(addr, value):
        if addr in rec.gate_words:
            rec.add(Op("open", None, gate=rec.gate_words[addr]))
        else:  # a host store that releases a stream wait (checks j)
            rec.add(Op("produce", None, frozenset([rec.key(addr)]), value))

    def arm(word_addr, value, timeout_s, err_addr, abort_addr, peer):
        rec.add(Op("watch", None, frozenset([rec.key(word_addr)]), value))

    def dispatch_rows(*args):
        # (src_rows, row_index, num_sends, row_bytes, dst_table, block_offsets, chunk_offsets, num_blocks,
        #  groups_per_dest, num_chunks, rows_per_chunk, counters, flag_addrs, epoch, stream): the kernel releases
        #  flags of its source's pad (the counters name the source).
        counters, epoch, stream = args[11], args[13], args[14]
        source = next(g for g in rec.moe_groups for c in g.counters if c.data_ptr() == counters)
        s = next(i for i, c in enumerate(source.counters) if c.data_ptr() == counters)
        rec.launch(Op("produce", stream, frozenset([rec.tensor_key(source.pads[s])]), epoch), "_C moe_dispatch_rows")

    def combine_rows(*args):
        rec.launch(Op("record", args[-1]), "_C moe_combine_rows")

    return types.SimpleNamespace(cuda_stream_write_value32=write, cuda_stream_wait_value32=stream_wait,
                                 cuda_wait_flag_bounded=bounded, signal_store=store, moe_dispatch_rows=dispatch_rows,
                                 moe_combine_rows=combine_rows, has_cuda=True, watchdog_arm=arm,
                                 cuda_host_register=lambda addr, nbytes, device: addr,
                                 cuda_host_unregister=lambda addr: None, watchdog_cancel=lambda addr, nbytes: 0,
                                 watchdog_fired=lambda: 0)


# ----------------------------------------------------------------------------------------------
# The device model
# ----------------------------------------------------------------------------------------------


def replay(ops: list[Op], one_queue: bool) -> tuple[bool, dict[int, int], list[int], str]:
    """(every command completed, the step at which each device command started (a stream wait: reached its
    queue's head), completion order, why not).

    The host issues one operation at a time and the device runs until it can go no further before the next one
    (a slow host: the producers held by a gate then really wait for the host to open it). A host store
    (``produce`` with no stream) sets its flag when the host reaches it; a host synchronization that cannot
    return first fires every watchdog entry armed before it (``watch``: the host watchdog raises the word at
    its deadline while the host blocks)."""
    started: dict[int, int] = {}
    armed: dict[int, int] = {}  # stream waits: when each reached its queue's head (it holds its stream from then)
    complete: set[int] = set()
    running: set[int] = set()
    flags: dict = {}
    opened: set[int] = set()
    order: list[int] = []
    issued = 0
    watches: list[int] = []  # armed watchdog entries not fired yet
    prev_on_stream: dict[int, int | None] = {}
    last: dict[int, int] = {}
    for i, op in enumerate(ops):
        if op.stream is not None:
            prev_on_stream[i] = last.get(op.stream)
            last[op.stream] = i

    def holds(op: Op) -> bool:
        return all(flags.get(k, -(1 << 62)) >= op.value for k in op.keys)

    def finish(i: int) -> None:
        complete.add(i)
        order.append(i)
        if ops[i].kind in ("produce", "init"):  # (init: a flag's value when its group was made)
            for k in ops[i].keys:
                flags[k] = max(flags.get(k, -(1 << 62)), ops[i].value)

    def run_device() -> None:
        progress = True
        while progress:
            progress = False
            for i in sorted(running):  # kernels that spin until their flags (or their gate)
                op = ops[i]
                if (op.kind == "hold" and op.gate in opened) or (op.kind == "spin" and holds(op)):
                    running.discard(i)
                    finish(i)
                    progress = True
            device = [i for i in range(issued) if ops[i].stream is not None]
            queues = [device] if one_queue else [[i for i in device if ops[i].stream == s] for s in last]
            for queue in queues:
                for i in queue:
                    if i in started:
                        continue
                    op, before = ops[i], prev_on_stream[i]
                    if before is not None and before not in complete:
                        break  # the queue's head waits for the previous command of its stream
                    if op.kind == "swait" and i not in armed:
                        armed[i] = len(started) + len(armed)  # at its queue's head: the stream is held on it
                    if (op.kind == "swait" and not holds(op)) or (op.kind == "dep" and
                                                                  not all(d in complete for d in op.deps)):
                        break  # a stream wait holds its queue
                    started[i] = len(started) + len(armed)
                    progress = True
                    if op.kind in ("spin", "hold"):
                        running.add(i)  # started: it leaves the queue and spins
                    else:
                        finish(i)

    for i, op in enumerate(ops):
        run_device()
        if op.kind in ("sync", "load") and not all(d in complete for d in op.deps) and watches:
            for w in watches:  # the host blocks past the deadlines: the watchdog releases the words
                for k in ops[w].keys:
                    flags[k] = max(flags.get(k, -(1 << 62)), ops[w].value)
            watches.clear()
            run_device()
        if op.kind in ("sync", "load") and not all(d in complete for d in op.deps):
            missing = [j for j in range(i) if ops[j].stream is not None and j not in complete]
            what = f"the first launch of {op.note} (lazy loading drains the device)" if op.kind == "load" else \
                "host sync"
            return False, started, order, f"{what} at op {i} never returns; stuck: " + \
                str([(j, ops[j].kind, ops[j].stream) for j in missing[:6]])
        issued = i + 1
        if op.kind == "open":
            opened.add(op.gate)
        if op.kind == "watch":
            watches.append(i)
        if op.stream is None:
            if op.kind in ("produce", "init"):
                finish(i)
            else:
                complete.add(i)
    run_device()
    missing = [i for i, op in enumerate(ops) if i not in complete]
    why = "" if not missing else f"stuck: {[(i, ops[i].kind, ops[i].stream) for i in missing[:6]]}"
    return not missing, {**started, **armed}, order, why


def race_kept(ops: list[Op], started: dict[int, int], order: list[int]) -> list[str]:
    """Per waiter stream, its first wait must be armed before the first producer of a flag it waits for."""
    problems = []
    waits = [i for i, op in enumerate(ops) if op.kind in ("spin", "swait") and op.keys and not op.warm]
    for stream in sorted({ops[i].stream for i in waits}):
        first = next(i for i in waits if ops[i].stream == stream)
        producers = [i for i in order if ops[i].kind == "produce" and ops[i].keys & ops[first].keys
                     and not ops[i].warm]
        if producers and (first not in started or started[first] > started[producers[0]]):
            problems.append(f"stream {stream}: its first wait (op {first}) starts after op {producers[0]} produced "
                            "its flag: no race")
    return problems


# ----------------------------------------------------------------------------------------------
# The sections under the recorder
# ----------------------------------------------------------------------------------------------

# The sections whose waiters must all be armed before their producers run. (e. races through its rank-dependent
# delays, which the model does not time: rank r's side stream starts waiting after its own shard is published.)
