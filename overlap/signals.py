"""The signals layer under a public name: what ``overlap._C`` (built from ``csrc/``) exports.

Flags with acquire/release ordering and deadlines on shared memory (`signal_store`, `signal_load`,
`signal_add`, `signal_wait`, `signal_wait_all`: waits release the GIL and yield the core) and, where the
extension was built with its CUDA half (`has_cuda`), stream-ordered flag writes and waits
(`cuda_stream_write_value32`, `cuda_stream_wait_value32`), host memory registered for the device
(`cuda_host_register`, `cuda_host_unregister`), the one-thread bounded device wait (`cuda_wait_flag_bounded`),
the MoE row copies between ranks (`moe_dispatch_rows`, `moe_combine_rows`) and `cuda_device_count` (without
the CUDA half these raise RuntimeError); in every build, the host watchdog that bounds stream-ordered waits
(`watchdog_arm`, `watchdog_cancel`, `watchdog_pending`, `watchdog_fired`). Every function takes raw
addresses, sizes and a stream handle; the signatures and what each raises are in ``csrc/bindings.cpp``.

Scripts (``bench/``) and the package's upper layers import this module, never ``overlap._C``: its
import raises ImportError (with the reason) where the extension is not built.
"""

from . import _C
from ._C import (  # the CUDA functions exist in every build; without the CUDA half they raise RuntimeError
    cuda_device_count,
    cuda_host_register,
    cuda_host_unregister,
    cuda_stream_wait_value32,
    cuda_stream_write_value32,
    cuda_wait_flag_bounded,
    has_cuda,
    moe_combine_rows,
    moe_dispatch_rows,
    signal_add,
    signal_load,
    signal_store,
    signal_wait,
    signal_wait_all,
    watchdog_arm,
    watchdog_cancel,
    watchdog_fired,
    watchdog_pending,
)

#: the extension's file: its hash is part of what the ranks of a group compare (`overlap.symm.layout.build_digest`)
BUILD_FILE: str = _C.__file__

__all__ = [
    "cuda_device_count",
    "cuda_host_register",
    "cuda_host_unregister",
    "cuda_stream_wait_value32",
    "cuda_stream_write_value32",
    "cuda_wait_flag_bounded",
    "has_cuda",
    "moe_combine_rows",
    "moe_dispatch_rows",
    "signal_add",
    "signal_load",
    "signal_store",
    "signal_wait",
    "signal_wait_all",
    "watchdog_arm",
    "watchdog_cancel",
    "watchdog_fired",
    "watchdog_pending",
]
