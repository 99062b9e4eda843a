"""The synchronization protocol of overlap's buffers, written once as data: what each role does, in order, with each
memory operation's semantics and scope. The model checker (`tests.protocol.model`) executes these sequences, and the
sequence tests (`tests.protocol.test_sequences`) compare them with what the code does (the Triton kernels' PTX, the
C++ sources, the CPU ranks' Python path).

Roles (docs/protocol.md, "Epochs, slots and flags" and "Waits on GPUs"):

* ``PRODUCER_TILE``: one tile of a producing kernel (the reduce-scatter's scatter GEMM, the MoE combine GEMM, the MoE
  dispatch copy): every warp stores its part of the chunk (plain stores to a peer's buffer), a CTA barrier, then one
  thread counts the tile (an acq_rel add at system scope); the tile that counts last resets the counter (relaxed,
  the next call's kernel is stream-ordered after it) and publishes the call's epoch in the chunk's flag (a release
  at system scope).
* ``CONSUMER_WAIT``: a consumer's bounded wait on one chunk's flag (an acquire load at system scope, repeated; the
  exit decided CTA-wide by a reducing barrier), the error word polled, a plain store of the error word past the
  deadline; then the chunk's loads.
* ``WATCHDOG``: the host watchdog releasing a stream-ordered wait nobody published: the error word (plain), then the
  flag raised by a compare-and-swap (acq_rel), so whoever sees the raised flag sees the error word.
* ``HOST_PRODUCER`` / ``HOST_CONSUMER``: the CPU ranks (`overlap.symm`): the data copied, then the flag stored with
  release (`signals.signal_store`); a deadline-bounded acquire wait (`signals.signal_wait_all`), then the data read.

Epochs are int32 and compare as a wrapping difference: a flag has reached ``epoch`` when
``int32(flag - epoch) >= 0`` (`reached`), as in ``overlap._C`` (``flag_reached``) and ``kernels/flags.py``.
"""

from __future__ import annotations

import dataclasses

PLAIN, RELAXED, ACQUIRE, RELEASE, ACQ_REL = "plain", "relaxed", "acquire", "release", "acq_rel"
SYS, GPU, CTA = "sys", "gpu", "cta"


@dataclasses.dataclass(frozen=True)
class Op:
    """One synchronization-relevant operation of a role: ``kind`` (``store``, ``load``, ``rmw`` (a read-modify-write),
    ``barrier``, ``fence``), its semantics and scope, and what it touches (``data``, ``count``, ``counter``, ``flag``,
    ``err``)."""

    kind: str
    what: str
    sem: str = PLAIN
    scope: str = SYS

    def describe(self) -> str:
        return f"{self.kind} {self.what}" + (f" {self.sem}" if self.sem != PLAIN else "") + \
            (f".{self.scope}" if self.kind != "barrier" else "")


@dataclasses.dataclass(frozen=True)
class Protocol:
    """The protocol the model checker runs: each role's sequence and the two decisions made on values (whether a flag
    has reached an epoch; whether a tile is the chunk's last). A mutation is a `Protocol` with one thing changed."""

    producer: tuple[Op, ...]  # warp 0 of a tile (warp 1 runs the data store and the barrier where there is one)
    consumer_flag: Op  # the wait's load of the flag
    watchdog: tuple[Op, ...]
    last_tile_offset: int = 1  # the tile whose count returns ``tiles - last_tile_offset`` is the last
    reach_slack: int = 0  # a flag has reached epoch e when int32(flag - e) >= -reach_slack
    wraps: bool = True  # the comparison is the wrapping difference (False: a plain ``flag >= e``)
    deadline: bool = True  # a wait gives up past its deadline
    checks_err: bool = True  # a wait released without data reads the error word before the data
    release_after_error: bool = False  # the host unmaps a heap a raising call may still be written into
    rebase_clears: bool = True  # the epochs' re-base clears every flag, counter and done word

    def reached(self, flag: int, epoch: int) -> bool:
        if not self.wraps:
            return flag >= epoch
        return int32(flag - epoch) >= -self.reach_slack


def int32(x: int) -> int:
    """`x` as a two's-complement int32 (wrapping)."""
    x &= 0xFFFFFFFF
    return x - (1 << 32) if x & 0x80000000 else x


PRODUCER_TILE = (Op("store", "data"), Op("barrier", "cta", scope=CTA), Op("rmw", "count", ACQ_REL, SYS),
                 Op("store", "counter", RELAXED, GPU), Op("store", "flag", RELEASE, SYS))
CONSUMER_WAIT = (Op("load", "flag", ACQUIRE, SYS), Op("barrier", "cta", scope=CTA), Op("load", "err", RELAXED, SYS),
                 Op("store", "err", PLAIN, SYS), Op("load", "data"))
WATCHDOG = (Op("store", "err", PLAIN, SYS), Op("rmw", "flag", ACQ_REL, SYS))
HOST_PRODUCER = (Op("store", "data"), Op("store", "flag", RELEASE, SYS))
HOST_CONSUMER = (Op("load", "flag", ACQUIRE, SYS), Op("load", "data"))

PROTOCOL = Protocol(PRODUCER_TILE, CONSUMER_WAIT[0], WATCHDOG)


def _replace_op(ops: tuple[Op, ...], what: str, **changes) -> tuple[Op, ...]:
    return tuple(dataclasses.replace(op, **changes) if op.what == what else op for op in ops)


def _without(ops: tuple[Op, ...], what: str) -> tuple[Op, ...]:
    return tuple(op for op in ops if op.what != what)


#: Planted bugs in the protocol, each a `Protocol` the model checker must find wrong (tests/protocol/test_model.py);
#: the same bugs planted in the code are `tests.protocol.mutate`'s.
MUTATIONS: dict[str, Protocol] = {
    "the flag's release made relaxed": dataclasses.replace(
        PROTOCOL, producer=_replace_op(PRODUCER_TILE, "flag", sem=RELAXED)),
    "the flag's acquire made relaxed": dataclasses.replace(
        PROTOCOL, consumer_flag=dataclasses.replace(CONSUMER_WAIT[0], sem=RELAXED)),
    "the flag's scope narrowed to the GPU": dataclasses.replace(
        PROTOCOL, producer=_replace_op(PRODUCER_TILE, "flag", scope=GPU)),
    "the barrier before the count removed": dataclasses.replace(PROTOCOL, producer=_without(PRODUCER_TILE, "cta")),
    "the count made relaxed": dataclasses.replace(PROTOCOL, producer=_replace_op(PRODUCER_TILE, "count", sem=RELAXED)),
    "the last-tile test off by one (early)": dataclasses.replace(PROTOCOL, last_tile_offset=2),
    "the last-tile test off by one (never)": dataclasses.replace(PROTOCOL, last_tile_offset=0),
    "the counter never reset": dataclasses.replace(PROTOCOL, producer=_without(PRODUCER_TILE, "counter")),
    "the data written after the flag": dataclasses.replace(
        PROTOCOL, producer=(*_without(PRODUCER_TILE, "data"), PRODUCER_TILE[0])),
    "a wait without its deadline": dataclasses.replace(PROTOCOL, deadline=False),
    "the epoch comparison off by one": dataclasses.replace(PROTOCOL, reach_slack=1),
    "the epoch comparison without the wrap": dataclasses.replace(PROTOCOL, wraps=False),
    "the watchdog raises the flag before the error word": dataclasses.replace(
        PROTOCOL, watchdog=tuple(reversed(WATCHDOG))),
    "the watchdog's raise made relaxed": dataclasses.replace(
        PROTOCOL, watchdog=_replace_op(WATCHDOG, "flag", sem=RELAXED)),
    "a passed wait not reading the error word": dataclasses.replace(PROTOCOL, checks_err=False),
    "a heap unmapped after a raising call": dataclasses.replace(PROTOCOL, release_after_error=True),
    "the re-base leaving the flags": dataclasses.replace(PROTOCOL, rebase_clears=False),
}
