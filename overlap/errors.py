"""Exceptions raised by `overlap`."""

from __future__ import annotations


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
