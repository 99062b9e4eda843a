"""Bounded rendezvous through the process group's store: every rank posts a value, every rank reads them all.

Set-up only (a group's facts, its heap's run id and segments): any backend, no device work, and a deadline.
Values are JSON, never pickle: what a peer sends is data, checked before use (`overlap.world`, `overlap.symm.heap`).

A rank that fails on its own during a rendezvous (it could not create its segment, its peers run another
install) posts its error instead of its value: its peers raise `OverlapError` naming it within a poll, not
at their deadline. A failure of the store itself on this rank (its connection lost) is reported as such, not
as a peer's timeout. The wait goes in slices of at most `SLICE_S`, so signal handlers (SIGTERM's cleanup, Ctrl-C)
run during it, and a local peer seen dead ends it at once (`OverlapTimeout` naming it, after the seconds waited).
"""

from __future__ import annotations

import contextvars
import datetime
import json
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from .errors import OverlapError, OverlapTimeout

#: seconds of one blocking wait on the store (signal handlers and the checks below run between two)
SLICE_S = 0.25

#: the op on whose behalf set-up rendezvous run (named by their timeouts); set by the ops' preamble
CALLER: contextvars.ContextVar[str] = contextvars.ContextVar("overlap_caller", default="setup")

_ROUNDS: dict[tuple[str, str], int] = {}


class PeerFailed(OverlapError):
    """A peer posted an error instead of its value in a rendezvous (raised on every other rank)."""


def _group_key(pg: dist.ProcessGroup) -> str:
    name = getattr(pg, "group_name", "") or ""
    return name if name else "g" + "-".join(str(dist.get_global_rank(pg, r)) for r in range(dist.get_world_size(pg)))


def _store():
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_default_store()


def exchange(pg: dist.ProcessGroup, tag: str, value: Any, timeout: float, *,
             failed: BaseException | None = None, gone: Callable[[int], bool] | None = None) -> list[Any]:
    """Every rank of `pg` posts `value` (anything JSON can write) under `tag`; returns every rank's value, in
    rank order, as JSON read it back.

    `failed`: this rank failed; it posts the error (so that its peers raise `PeerFailed` at once) and raises
    `failed` once it has posted. `gone(rank)`: whether a peer is known dead (its process gone), checked between
    two slices of the wait. Raises `OverlapTimeout` naming the first rank that never arrived within `timeout`
    seconds, `OverlapError` where the store fails on this rank. Every rank makes the same sequence of
    rendezvous with the same tags (rounds are counted)."""
    key = (_group_key(pg), tag)
    _ROUNDS[key] = round_ = _ROUNDS.get(key, 0) + 1
    prefix = f"overlap/{key[0]}/{tag}/{round_}"
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    caller = CALLER.get()
    if failed is None:
        payload = json.dumps({"ok": value})
    else:
        payload = json.dumps({"error": f"{type(failed).__name__}: {failed}"[:4000]})
    keys = [f"{prefix}/{r}" for r in range(world)]
    try:
        store = _store()
        store.set(keys[rank], payload)
        if failed is not None:
            store.set(f"{prefix}/error", json.dumps({"rank": rank}))
    except Exception as exc:  # noqa: BLE001 - the store's own error types
        raise OverlapError(f"overlap.{caller}: the process group's store failed on rank {rank} during rendezvous "
                           f"'{tag}': {type(exc).__name__}: {exc}") from (failed or exc)
    if failed is not None:
        raise failed
    _wait(store, keys, f"{prefix}/error", rank, tag, caller, timeout, gone)
    values = []
    for r, k in enumerate(keys):
        try:
            raw = store.get(k)
            item = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise OverlapError(f"overlap.{caller}: rank {r}'s value in rendezvous '{tag}' is not overlap's "
                               f"(another program uses this store's keys?): {exc}") from None
        except Exception as exc:  # noqa: BLE001 - the store's own error types
            raise OverlapError(f"overlap.{caller}: the process group's store failed on rank {rank} during "
                               f"rendezvous '{tag}': {type(exc).__name__}: {exc}") from exc
        if not isinstance(item, dict) or not ({"ok"} == item.keys() or {"error"} == item.keys()):
            raise OverlapError(f"overlap.{caller}: rank {r}'s value in rendezvous '{tag}' is not overlap's: {item!r}")
        if "error" in item:
            raise PeerFailed(f"overlap.{caller}: rank {r} failed during set-up ('{tag}'): {item['error']}")
        values.append(item["ok"])
    return values


def _wait(store, keys: list[str], error_key: str, rank: int, tag: str, caller: str, timeout: float,
          gone: Callable[[int], bool] | None) -> None:
    """Wait until every key of `keys` exists, a peer posted an error (return: the caller reads it), a local peer
    is gone, or `timeout` seconds have passed."""
    started = time.monotonic()
    deadline = started + timeout
    pending = list(keys)
    while True:
        slice_s = max(0.001, min(SLICE_S, deadline - time.monotonic()))
        start = time.monotonic()
        try:
            store.wait(pending, datetime.timedelta(seconds=slice_s))
            return
        except Exception as exc:  # noqa: BLE001 - the store raises its own error types on timeout
            # A timeout of the slice lasts the slice; an error sooner than that is the store failing here.
            if time.monotonic() - start < 0.5 * slice_s and "timeout" not in str(exc).lower():
                raise OverlapError(f"overlap.{caller}: the process group's store failed on rank {rank} during "
                                   f"rendezvous '{tag}': {type(exc).__name__}: {exc}") from exc
        try:
            if store.check([error_key]):
                failed = json.loads(store.get(error_key))["rank"]
                # (the failed rank's own key is set before the error key: the caller reads its error)
                raise PeerFailed(_failed_message(store, keys, int(failed), caller, tag))
            pending = [k for k in pending if not store.check([k])]
        except PeerFailed:
            raise
        except Exception as exc:  # noqa: BLE001
            raise OverlapError(f"overlap.{caller}: the process group's store failed on rank {rank} during "
                               f"rendezvous '{tag}': {type(exc).__name__}: {exc}") from exc
        if not pending:
            return
        missing = [keys.index(k) for k in pending]
        dead = [r for r in missing if gone is not None and gone(r)]
        if dead:  # (a timeout that came early: what a caller of a dead peer's group handles)
            raise OverlapTimeout(caller, rank, dead[0], f"rendezvous '{tag}'", round(time.monotonic() - started, 2),
                                 "its process exited")
        if time.monotonic() >= deadline:
            raise OverlapTimeout(caller, rank, missing[0], f"rendezvous '{tag}'", timeout, "never arrived")


def _failed_message(store, keys: list[str], failed: int, caller: str, tag: str) -> str:
    try:
        error = json.loads(store.get(keys[failed]))["error"]
    except Exception:  # noqa: BLE001 - the message only
        error = "(its error could not be read)"
    return f"overlap.{caller}: rank {failed} failed during set-up ('{tag}'): {error}"
