"""An exhaustive model checker of the flag protocol (`tests.protocol.spec`): every interleaving of its actors, for a
few ranks, chunks and two consecutive calls, under a weak memory model.

The actors: each source rank's producer tiles (tile 0 of a chunk has two warps), the consumer's waits (one rank
consumes; the ranks are symmetric), the clock (the deadline passes at some point, or never), the host watchdog
(stream-ordered waits), the consumer's done word and its host unmapping its heap.

The memory model is the adversary. A thread sees another's write only where the write happens before its read:
program order, a CTA barrier (the warps' writes become the releasing thread's), a release (or the release half of an
acq_rel) on a word read by an acquire (or acq_rel) of the same word; a release at ``gpu`` scope reaches no thread on
another device; read-modify-writes of one word form one chain, so a count carries every earlier count's release;
a kernel's writes reach the next kernel of its stream. Every other read may return the stale value, and does here.
Atomic words (flags, counters) are coherent: a read-modify-write reads the latest value.

A tile is one step (its operations only change what other threads may learn through the words it releases, so the
order of its own operations is kept in the messages those words carry, not in interleavings).

Properties, on every reachable state: a consumer uses a chunk only where every tile's write of the call happens
before its read, and no later call's write was issued before it (``early read``); every count finds the counter
below the tile count, and every chunk's counter is zero when its kernel ends (``counter``); no write reaches a heap
its owner unmapped (``released heap``); a state where nothing can move has every rank finished or raised (``hang``:
a wait that ends neither by its data nor by its deadline), and with a dead peer the consumer raised.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Iterator

from tests.protocol.spec import ACQ_REL, ACQUIRE, GPU, PROTOCOL, RELEASE, Op, Protocol, int32

RUN, DONE, RAISED = "run", "done", "raised"
ERR = ("err",)  # the error word's write by the watchdog (a write id)


@dataclasses.dataclass(frozen=True)
class Config:
    """`ranks` sources (rank 0, the consumer, is one of them), `chunks` chunks per source, `tiles` tiles per chunk,
    `calls` consecutive calls from epoch `first_epoch`; `dead`: a rank whose producers never run; `stream`: the
    consumer's waits are stream-ordered (no deadline of their own: the host watchdog releases them)."""

    ranks: int = 2
    chunks: int = 2
    tiles: int = 2
    calls: int = 2
    first_epoch: int = 7
    dead: int | None = None
    stream: bool = False
    rebase: bool = False  # the epochs re-based between the first two calls: the second runs at epoch 1

    def epoch(self, k: int) -> int:
        if self.rebase and k >= 1:
            return k
        return int32(self.first_epoch + k)

    def describe(self) -> str:
        return (f"W={self.ranks} chunks={self.chunks} tiles={self.tiles} calls={self.calls} epoch={self.first_epoch}"
                + (f" dead={self.dead}" if self.dead is not None else "") + (" stream" if self.stream else "")
                + (" rebase" if self.rebase else ""))


@dataclasses.dataclass
class Result:
    config: Config
    states: int
    transitions: int
    seconds: float
    violation: str | None  # the first property violated
    trace: list[str]  # the steps that lead there, shortest first

    def summary(self) -> str:
        return (f"{self.config.describe()}: {self.states} states, {self.transitions} transitions, "
                f"{self.seconds:.2f} s: " + ("OK" if self.violation is None else f"VIOLATION {self.violation}"))


class Violation(Exception):
    pass


# State: (clock, consumer call, consumer status, consumer's known writes, done word, released, sources).
# A source: (call, status, chunks); a chunk: (counter, counter's message, flag, flag's message, tiles done (a tuple
# of bools), read by the consumer, latest call issued per tile, the watchdog's next step on the chunk's wait).
# A message: the writes a release put on a word.


def releases(op: Op, local: bool) -> bool:
    """Whether `op` releases to a reader on this device (`local`) or another."""
    return op.sem in (RELEASE, ACQ_REL) and (local or op.scope != GPU)


class Model:
    def __init__(self, protocol: Protocol, config: Config):
        self.p, self.c = protocol, config

    def initial(self) -> tuple:
        c = self.c
        stale = c.epoch(-1)
        chunk = (0, frozenset(), stale, frozenset(), (False,) * c.tiles, False, (0,) * c.tiles, 0)
        sources = tuple((0, RUN, (chunk,) * c.chunks) for _ in range(c.ranks))
        return (0, 0, RUN, frozenset(), stale, False, sources, False)

    def canonical(self, state: tuple) -> tuple:
        """Symmetry: the chunks of a source and the live remote ranks are interchangeable (a write id names its
        source and chunk, so those are renamed to their place in the sorted order first)."""
        *head, known, done, released, sources, rebased = state
        keyed = []
        for s, (_, _, chunks) in enumerate(sources):
            order = sorted(range(len(chunks)), key=lambda i: self._chunk_key(chunks[i], known, s, i))
            keyed.append((s, order))
        fixed = [0] if self.c.dead is None else sorted({0, self.c.dead})
        movable = sorted((s for s in range(len(sources)) if s not in fixed),
                         key=lambda s: self._source_key(sources[s], known, s, dict(keyed)[s]))
        new_s = {old: new for new, old in enumerate(fixed + movable)}
        new_c = {s: {old: new for new, old in enumerate(order)} for s, order in keyed}

        def rename(writes: frozenset) -> frozenset:
            return frozenset(w if w == ERR else (new_s[w[0]], new_c[w[0]][w[1]], *w[2:]) for w in writes)

        out = []
        for old in fixed + movable:
            call, status, chunks = sources[old]
            out.append((call, status, tuple((n, rename(nm), f, rename(fm), td, rd, iss, w)
                                            for n, nm, f, fm, td, rd, iss, w in (chunks[i] for i in new_c[old]))))
        return (*head, rename(known), done, released, tuple(out), rebased)

    @staticmethod
    def _chunk_key(chunk: tuple, known: frozenset, s: int, ci: int) -> tuple:
        n, nm, f, fm, td, rd, iss, w = chunk

        def local(writes: frozenset) -> tuple:
            return tuple(sorted(w[2:] for w in writes if w != ERR and w[:2] == (s, ci)))

        return (n, f, td, rd, iss, w, local(nm), local(fm), local(known), len(nm), len(fm))

    def _source_key(self, source: tuple, known: frozenset, s: int, order: list[int]) -> tuple:
        call, status, chunks = source
        return (call, status, tuple(self._chunk_key(chunks[i], known, s, i) for i in order))

    # ---- steps ----

    def steps(self, state: tuple) -> Iterator[tuple[str, tuple]]:
        clock, ccall, cstatus, known, done, released, sources, rebased = state
        if clock == 0:
            yield "the deadline passes", (1, *state[1:])
        for s, (call, status, _) in enumerate(sources):
            if s != self.c.dead and status == RUN and call < self.c.calls:
                yield from self.producer_steps(state, s)
        if cstatus == RUN:
            yield from self.consumer_steps(state)
        if not released and (cstatus == DONE or (cstatus == RAISED and self.p.release_after_error)):
            yield "rank 0's host unmaps its heap", (*state[:5], True, *state[6:])
        if self.c.rebase and not rebased and ccall == 1 and cstatus == RUN:
            yield from self.rebase_step(state)

    def producer_steps(self, state: tuple, s: int) -> Iterator[tuple[str, tuple]]:
        clock, ccall, cstatus, known, done, released, sources, rebased = state
        call, status, chunks = sources[s]
        c = self.c
        if c.rebase and call == 1 and not rebased:  # the re-base comes between the two calls
            if clock == 1:
                yield f"rank {s} gives up waiting for the re-base", self.with_source(state, s, (call, RAISED, chunks))
            return
        rebased_now = c.rebase and call == 1
        if call > 0 and not rebased_now and not self.p.reached(done, c.epoch(call - 1)):  # the slot-free wait
            if clock == 1:
                yield f"rank {s} gives up waiting for the slot of call {call + 1}", \
                    self.with_source(state, s, (call, RAISED, chunks))
            return
        if all(all(ch[4]) for ch in chunks):  # the kernel ends; the next call's kernel follows it in its stream
            for ci, ch in enumerate(chunks):
                if ch[0] != 0:
                    raise Violation(f"counter: rank {s} chunk {ci}'s counter is {ch[0]}, not zero, when call "
                                    f"{call + 1}'s kernel ends (the next call's first count reads it)")
            fresh = tuple((n, nm, f, fm, (False,) * c.tiles, rd, iss, w) for n, nm, f, fm, _, rd, iss, w in chunks)
            yield f"rank {s}'s kernel of call {call + 1} ends", self.with_source(state, s, (call + 1, RUN, fresh))
            return
        for ci, chunk in enumerate(chunks):
            for ti in range(c.tiles):
                if not chunk[4][ti]:
                    what, new_chunk = self.tile(state, s, ci, ti, chunk, call)
                    yield f"rank {s} chunk {ci} tile {ti} {what}", self.with_chunk(state, s, ci, new_chunk)

    def tile(self, state: tuple, s: int, ci: int, ti: int, chunk: tuple, call: int) -> tuple[str, tuple]:
        """One tile, its operations in program order: its warps' writes, the barrier, the count, the last tile's
        reset and publish. Returns what it did and the chunk after it."""
        c, p = self.c, self.p
        counter, cmsg, flag, fmsg, tiles_done, read, issued, wd = chunk
        warps = 2 if ti == 0 else 1
        mine = {0: set(), 1: set()}  # each warp's writes that happen before its next operation
        wrote = False
        if warps == 2:
            mine[1].add((s, ci, ti, 1, call))  # warp 1: its data store, then the barrier (where there is one)
            wrote = True
        last, did = False, []
        for op in p.producer:
            if op.what == "data" and op.kind == "store":
                mine[0].add((s, ci, ti, 0, call))
                wrote = True
            elif op.kind == "barrier":
                mine[0] |= mine[1]
            elif op.what == "count":
                if not 0 <= counter < c.tiles:
                    raise Violation(f"counter: rank {s} chunk {ci} tile {ti} counts at {counter} (not reset, or past "
                                    f"{c.tiles} tiles)")
                last = counter == c.tiles - p.last_tile_offset
                if op.sem in (ACQUIRE, ACQ_REL):
                    mine[0] |= cmsg
                if releases(op, local=True):  # the counter is read by tiles on this device only
                    cmsg = cmsg | mine[0]
                counter += 1
                did.append(f"counts ({counter} of {c.tiles})")
            elif op.what == "counter" and last:
                counter = 0
            elif op.what == "flag" and last:
                flag = c.epoch(call)
                fmsg = frozenset(mine[0]) if releases(op, local=s == 0) else frozenset()
                did.append(f"publishes epoch {flag}")
        if wrote and state[5]:
            raise Violation(f"released heap: rank {s} chunk {ci} tile {ti} writes into rank 0's unmapped heap")
        issued = tuple(call + 1 if i == ti else v for i, v in enumerate(issued))
        done = tuple(True if i == ti else v for i, v in enumerate(tiles_done))
        return ", ".join(did) or "runs", (counter, frozenset(cmsg), flag, fmsg, done, read, issued, wd)

    def consumer_steps(self, state: tuple) -> Iterator[tuple[str, tuple]]:
        clock, ccall, cstatus, known, done, released, sources, rebased = state
        c, p = self.c, self.p
        epoch = c.epoch(ccall)
        if c.rebase and ccall == 1 and not rebased:
            return  # (the re-base first)
        waiting = [(s, ci) for s, src in enumerate(sources) for ci, ch in enumerate(src[2]) if not ch[5]]
        if not waiting:  # every chunk read: the done word, the reads fresh for the next call
            fresh = tuple((call, status, tuple((*ch[:5], False, ch[6], 0) for ch in chunks))
                          for call, status, chunks in sources)
            status = DONE if ccall + 1 == c.calls else RUN
            yield f"rank 0 finishes call {ccall + 1} (done word {epoch})", \
                (clock, ccall + 1, status, known, epoch, released, fresh, rebased)
            return
        for s, ci in waiting:
            counter, cmsg, flag, fmsg, tiles_done, read, issued, wd = sources[s][2][ci]
            where = f"rank 0's wait on rank {s} chunk {ci}"
            if p.reached(flag, epoch):
                sees = known | fmsg if p.consumer_flag.sem in (ACQUIRE, ACQ_REL) else known
                if p.checks_err and ERR in sees:
                    yield f"{where} passes, reads the error word and raises", (clock, ccall, RAISED, sees,
                                                                                *state[4:])
                    continue
                missing = [(t, w) for t in range(c.tiles) for w in range(2 if t == 0 else 1)
                           if (s, ci, t, w, ccall) not in sees]
                if missing:
                    raise Violation(f"early read: {where} passes at epoch {flag} and reads the chunk, but the writes "
                                    f"of call {ccall + 1} by (tile, warp) {missing} do not happen before its read")
                if any(v > ccall + 1 for v in issued):
                    raise Violation(f"early read: {where} reads call {ccall + 1}'s chunk after a later call began "
                                    "writing it")
                yield f"{where} passes at epoch {flag} and reads the chunk", self.with_chunk(
                    (clock, ccall, cstatus, sees, *state[4:]), s, ci, (counter, cmsg, flag, fmsg, tiles_done, True,
                                                                        issued, wd))
            elif clock == 1 and not c.stream and p.deadline:
                yield f"{where} gives up at its deadline, error word set", (clock, ccall, RAISED, *state[3:])
            elif clock == 1 and c.stream and wd < len(p.watchdog):
                yield from self.watchdog_step(state, s, ci, epoch, wd)

    def rebase_step(self, state: tuple) -> Iterator[tuple[str, tuple]]:
        """The epochs' re-base between the calls (`overlap.symm.heap.SymmHeap._rebase`): once every rank is quiet (the
        consumer finished call 1, every live producer's kernel of it ended; the first pad barrier), every flag,
        counter and done word is cleared and the epochs restart from 1 (the second barrier: one step here). A
        dead peer never reaches the barrier: the consumer gives up past the deadline."""
        clock, ccall, cstatus, known, done, released, sources, rebased = state
        quiet = all(call >= 1 or s == self.c.dead for s, (call, _, _) in enumerate(sources))
        if self.c.dead is not None and clock == 1:
            yield "rank 0 gives up waiting for the re-base", (clock, ccall, RAISED, *state[3:])
            return
        if not quiet:
            return
        if self.p.rebase_clears:
            sources = tuple((call, status, tuple((0, frozenset(), 0, frozenset(), td, rd, iss, w)
                                                 for _, _, _, _, td, rd, iss, w in chunks))
                            for call, status, chunks in sources)
        yield "the ranks re-base the epochs (flags, counters and done words cleared)", \
            (clock, ccall, cstatus, known, 0, released, sources, True)

    def watchdog_step(self, state: tuple, s: int, ci: int, epoch: int, wd: int) -> Iterator[tuple[str, tuple]]:
        """The host watchdog's next operation (`wd`) on this wait's entry (`spec.WATCHDOG`): the error word; the flag
        raised by a compare-and-swap, whose message carries the error word where it releases and comes after it."""
        op = self.p.watchdog[wd]
        where = f"the watchdog of rank 0's wait on rank {s} chunk {ci}"
        counter, cmsg, flag, fmsg, tiles_done, read, issued, _ = state[6][s][2][ci]
        if op.what == "err":
            yield f"{where} stores the error word", self.with_chunk(
                state, s, ci, (counter, cmsg, flag, fmsg, tiles_done, read, issued, wd + 1))
            return
        stored = any(o.what == "err" for o in self.p.watchdog[:wd])
        message = frozenset([ERR]) if stored and releases(op, local=False) else frozenset()
        yield f"{where} raises the flag to {epoch}", self.with_chunk(
            state, s, ci, (counter, cmsg, epoch, fmsg | message, tiles_done, read, issued, wd + 1))

    # ---- state updates ----

    @staticmethod
    def with_source(state: tuple, s: int, source: tuple) -> tuple:
        sources = list(state[6])
        sources[s] = source
        return (*state[:6], tuple(sources), *state[7:])

    def with_chunk(self, state: tuple, s: int, ci: int, chunk: tuple) -> tuple:
        call, status, chunks = state[6][s]
        chunks = list(chunks)
        chunks[ci] = chunk
        return self.with_source(state, s, (call, status, tuple(chunks)))

    def check_terminal(self, state: tuple) -> None:
        clock, ccall, cstatus, known, done, released, sources, rebased = state
        if cstatus == RUN:
            raise Violation(f"hang: rank 0 waits in call {ccall + 1} and nothing can move (no data, no deadline)")
        stuck = [s for s, (call, status, _) in enumerate(sources)
                 if s != self.c.dead and status == RUN and call < self.c.calls]
        if stuck:
            raise Violation(f"hang: ranks {stuck} wait and nothing can move")
        if self.c.dead is not None and cstatus != RAISED:
            raise Violation(f"rank 0 finished without raising although rank {self.c.dead} is dead")


def check(config: Config, protocol: Protocol = PROTOCOL, limit: int = 1_000_000) -> Result:
    """Every state reachable from the start (breadth first, up to `limit` states, symmetric states once), each
    property checked; the first violation found, with the shortest sequence of steps to it."""
    began = time.perf_counter()
    model = Model(protocol, config)
    start = model.initial()
    parents: dict[tuple, tuple[tuple | None, str]] = {model.canonical(start): (None, "start")}
    queue = deque([(start, model.canonical(start))])
    transitions = 0

    def trace(key: tuple | None, last: str) -> list[str]:
        steps = [last]
        while key is not None:
            key, step = parents[key]
            steps.append(step)
        return list(reversed(steps))[1:]

    while queue:
        state, key = queue.popleft()
        moved = False
        try:
            for step, nxt in model.steps(state):
                moved = True
                transitions += 1
                k = model.canonical(nxt)
                if k not in parents:
                    parents[k] = (key, step)
                    if len(parents) > limit:
                        raise Violation(f"state limit: more than {limit} states")
                    queue.append((nxt, k))
            if not moved:
                model.check_terminal(state)
        except Violation as exc:
            return Result(config, len(parents), transitions, time.perf_counter() - began, str(exc),
                          trace(key, "(the violating step)"))
    return Result(config, len(parents), transitions, time.perf_counter() - began, None, [])
