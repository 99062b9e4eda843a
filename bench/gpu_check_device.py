"""Where the one-GPU check's virtual ranks run (bench/gpu_check.py): `Device` (a GPU with its streams and
stream-ordered flag writes, or the CPU under the Triton interpreter), the bounded drain every check ends with,
the kernels' tile configurations (`Tile`) and the timeouts that every virtual-rank section shares
(gpu_check_virtual, gpu_check_primitives, gpu_check_tp, gpu_check_moe).

NCCL refuses two ranks of one communicator on one GPU, so W virtual ranks live in one process, each with
its own stream (`Device.stream`); nothing a check enqueues is waited for unbounded (`Device.settle`).

Imports overlap: the entry point imports this module only after its self-install.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from gpu_check_common import Report, poll

from overlap import _C

KERNEL_TIMEOUT_NS = 10_000_000_000  # in-kernel waits of the checks that must not time out
SETTLE_TIMEOUT_S = 30.0  # host deadline for a device queue to drain
SHORT_TIMEOUT_NS = 200_000_000  # the waits that are meant to time out (checks c and d)
RELEASE_VALUE = 1 << 30  # what a watchdog writes into flags to release stuck waits


# ==============================================================================================
# Virtual ranks on one device
# ==============================================================================================


@dataclasses.dataclass(frozen=True)
class Tile:
    """A tile configuration of the fused kernel (num_warps/num_stages only matter on GPUs)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3

    def describe(self) -> str:
        return f"{self.block_m}x{self.block_n}x{self.block_k} w{self.num_warps} s{self.num_stages}"


class Device:
    """Where the virtual ranks run: a GPU (streams, stream-ordered flags) or the CPU (interpreter)."""

    def __init__(self, device: torch.device, report: Report):
        self.device, self.report = device, report
        self.cuda = device.type == "cuda"
        self.streams: list[torch.cuda.Stream] = []  # every stream made here, drained by settle()
        self.sm_count = torch.cuda.get_device_properties(device).multi_processor_count if self.cuda else 0
        # `_fused`'s default tiles: 128x128x64 for 16-bit types on GPUs (Triton's default warps and
        # stages), 32x32x32 interpreted.
        self.tile = Tile(128, 128, 64) if self.cuda else Tile(32, 32, 32)
        self._delay_words = torch.zeros(2, dtype=torch.int32, device=device)

    def stream(self) -> torch.cuda.Stream | None:
        """A new stream (None on the CPU). torch hands streams out round robin from a pool of 32 per
        priority, so the few streams one check makes are distinct (`distinct` asserts it)."""
        if not self.cuda:
            return None
        s = torch.cuda.Stream(device=self.device)
        self.streams.append(s)
        return s

    @staticmethod
    def distinct(streams: list[torch.cuda.Stream | None]) -> None:
        handles = [s.cuda_stream for s in streams if s is not None]
        assert len(set(handles)) == len(handles), f"streams shared between virtual ranks: {handles}"

    def on(self, stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def publish(self, flag: torch.Tensor, value: int, stream: torch.cuda.Stream | None) -> None:
        """Release-store `value` into a flag word: stream-ordered on a GPU, at once on the CPU."""
        if self.cuda:
            _C.cuda_stream_write_value32(flag.data_ptr(), value, stream.cuda_stream)
        else:
            _C.signal_store(flag.data_ptr(), value)

    def delay(self, stream: torch.cuda.Stream, ns: int) -> None:
        """Hold `stream` for about `ns`: overlap._C's one-thread bounded wait on a flag nobody sets."""
        w = self._delay_words
        _C.cuda_wait_flag_bounded(w[0].data_ptr(), 1, ns, w[1].data_ptr(), stream.cuda_stream)

    def settle(self, streams: list[torch.cuda.Stream | None], flags: list[torch.Tensor], what: str) -> None:
        """Wait (bounded) until `streams` drain. If they do not, write every flag in `flags` from a
        watchdog stream to release stream-ordered waits, wait again, and raise either way."""
        if not self.cuda:
            return
        events = []
        for s in [*[s for s in streams if s is not None], torch.cuda.current_stream(self.device)]:
            ev = torch.cuda.Event()
            ev.record(s)
            events.append(ev)
        if poll(events, SETTLE_TIMEOUT_S):
            return
        # High priority: another pool than the streams made here, so never one of the stuck streams.
        watchdog = torch.cuda.Stream(device=self.device, priority=-1)
        for f in flags:
            _C.cuda_stream_write_value32(f.data_ptr(), RELEASE_VALUE, watchdog.cuda_stream)
        if not poll(events, SETTLE_TIMEOUT_S):
            self.report.stuck = what
            raise RuntimeError(f"{what}: the device did not drain within {2 * SETTLE_TIMEOUT_S:.0f} s even after "
                               "a watchdog released the flags; later GPU sections are skipped")
        raise RuntimeError(f"{what}: the device drained only after a watchdog released the flags "
                           f"({SETTLE_TIMEOUT_S:.0f} s deadline)")

    def idle(self, what: str) -> None:
        """Bounded wait for everything this check enqueued, on every stream made here."""
        self.settle(self.streams, [], what)
