"""Exceptions raised by `overlap`, and `warn_once` for the fallbacks it takes."""

from __future__ import annotations

import logging
import warnings


class OverlapError(RuntimeError):
    """Base class of the runtime errors of `overlap`."""


class OverlapTimeout(OverlapError):
    """A wait on a peer passed its deadline.

    The group is unusable afterwards: peers may be blocked in the middle of the same call.
    Destroy the process group (``torch.distributed.destroy_process_group``), call
    ``overlap.release(group)``, and re-create both.
    """

    def __init__(self, op: str, rank: int, peer: int | str, chunk: int | str, timeout: float, what: str = ""):
        self.op, self.rank, self.peer, self.chunk, self.timeout = op, rank, peer, chunk, timeout
        detail = f" ({what})" if what else ""
        super().__init__(
            f"overlap.{op}: rank {rank} waited {timeout:g} s for peer {peer}, chunk {chunk}{detail}, "
            "and gave up. The peer is dead, stalled, or made a different call. This group is now unusable: "
            "destroy and re-create it (torch.distributed.destroy_process_group, overlap.release)."
        )


class OverlapMismatchError(ValueError):
    """Ranks of one group made different calls (op, shapes, dtype or plan). Raised on every rank."""

    @classmethod
    def of(cls, op: str, call: int, rank: int, signature: str, others: dict[int, str]) -> OverlapMismatchError:
        """The error for this rank, listing its signature and those of the ranks that differ."""
        lines = [f"  rank {rank}: {signature}"] + [f"  rank {p}: {sig}" for p, sig in sorted(others.items())]
        return cls(f"overlap.{op}: ranks disagree on call {call} of this group:\n" + "\n".join(lines) + "\n"
                   "every rank of a group must make the same calls with the same shapes, dtypes and plans")


_WARNED: set[str] = set()


def warn_once(message: str, category: type[Warning] = UserWarning, *, key: str | None = None,
              stacklevel: int = 2, log: bool = False) -> bool:
    """``warnings.warn(message, category)`` the first time this process sees `key` (default: the message);
    with `log` the same text also goes to the ``overlap`` logger as a warning. True where it warned.

    For fallbacks that would otherwise look like the feature working (a slower path taken silently)."""
    key = message if key is None else key
    if key in _WARNED:
        return False
    _WARNED.add(key)
    warnings.warn(message, category, stacklevel=stacklevel + 1)
    if log:
        logging.getLogger("overlap").warning(message)
    return True


class Terminated(SystemExit):
    """SIGTERM or SIGHUP reached a process while it had ranks running (`overlap.lifetime`): raised in its main
    thread so that ``finally`` blocks end the ranks. Exit status ``128 + signum``, as the signal's default
    action would give, where nothing catches it; ``signum`` is the signal."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum
