"""Flag primitives shared by the kernels: a bounded acquire-wait and a release-signal.

Flags are int32 words holding a call's epoch; "reached" is a non-negative int32 difference, so
epochs compare correctly modulo 2^32 (as in ``overlap._C``). System scope throughout: the other
side may be another GPU (through a peer mapping) or another process on the host.
"""

import triton
import triton.language as tl


@triton.jit
def wait_flag(flag_ptr, epoch, abort_ptr, err_ptr, src, timeout_ns, INTERPRETED: tl.constexpr):
    """Spin until ``*flag_ptr`` reaches `epoch`; past the deadline record ``src + 1`` in ``*err_ptr``.

    The deadline is per wait; once any wait of the call has given up (``*err_ptr`` set, polled after
    the first millisecond), every other wait stops too, so a dead peer costs one timeout, not one per
    tile and source.
    """
    # Epochs wrap modulo 2^32, so "reached" is a non-negative int32 difference (as in overlap._C).
    # System scope: the producer may be another GPU (or the host) writing through a peer mapping.
    ready = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    if INTERPRETED:
        aborted = tl.load(abort_ptr, volatile=True)
        while ((ready - epoch) < 0) & (aborted == 0):
            ready = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
            aborted = tl.load(abort_ptr, volatile=True)
    else:
        start = tl.extra.cuda.globaltimer()
        now = start
        failed = ready * 0
        while ((ready - epoch) < 0) & (now - start < timeout_ns) & (failed == 0):
            ready = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
            now = tl.extra.cuda.globaltimer()
            if now - start > 1_000_000:
                failed = tl.load(err_ptr, volatile=True)
    if (ready - epoch) < 0:
        # The host reads this word (pinned memory on GPUs): system scope.
        tl.atomic_max(err_ptr, src + 1, scope="sys")
