"""The symmetric heap's layout: slots, flags, the control pad's words, and call signatures' hashes.

Every rank of a group computes the same addresses from these numbers; `overlap.symm`'s docstring is the
protocol they serve.
"""

from __future__ import annotations

import functools
import hashlib
import json

NUM_SLOTS = 4
MAX_PEERS = 128
MAX_FLAGS = 256  # ready flags per slot (chunks a producer can publish in one call)
HS_RING = 4
SIG_TEXT_BYTES = 240

# Control pad layout, in int32 words.
W_HS_EPOCH = 0  # epoch of the last handshake this rank posted
W_GEN_READY = 1  # heap generation this rank has created
W_GEN_MAPPED = 2  # heap generation this rank has mapped from every peer
W_REBASE_QUIET = 3  # re-base rounds in which this rank has stopped touching flags
W_REBASE_DONE = 4  # re-base rounds in which this rank has cleared its own flags
W_GEN_FAILED = 5  # heap generation this rank failed to create (it still arrives at the barrier)
#: peer + 1 of a stream-ordered wait of this rank that the host watchdog released at its deadline (GPU ranks;
#: never cleared: every rank's next call raises). See `overlap.symm.call.Call`.
W_ASYNC_ERR = 6
#: ``2 * epoch`` (plus one where they did not) once this rank's counterparts on other nodes agreed on the node call
#: of that epoch: a group across nodes' full handshake (`overlap.ops.hierarchical.agreement`)
W_NODE_VERDICT = 7

#: Epochs stay below this: the call that reaches it re-bases every flag of the group to zero, so
#: flags and epochs are always int32 values far apart from wrapping (see `SymmHeap._rebase`).
REBASE_EPOCH = 2**30
HS_BASE = 16
HS_STRIDE = 6 + SIG_TEXT_BYTES // 4  # tag, sig_lo, sig_hi, need_lo, need_hi, flags, text (`overlap.symm.handshake`)
SLOT_BASE = 512
assert HS_BASE + HS_RING * HS_STRIDE <= SLOT_BASE
SLOT_STRIDE = MAX_FLAGS + MAX_PEERS  # ready[MAX_FLAGS], done[MAX_PEERS]
CTRL_WORDS = SLOT_BASE + NUM_SLOTS * SLOT_STRIDE
ALIGN = 4096
#: the most bytes one slot may hold (a call or `overlap.reserve` that needs more raises before any communication)
MAX_SLOT_BYTES = 2**40


_SIGNALS = None


def signals():
    """`overlap.signals` (flags with deadlines), imported on first use."""
    global _SIGNALS
    if _SIGNALS is None:
        from .. import signals as module

        _SIGNALS = module
    return _SIGNALS


@functools.lru_cache(maxsize=1024)
def signature_hash(text: str) -> tuple[int, int]:
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    lo = int.from_bytes(digest[:4], "little", signed=True)
    hi = int.from_bytes(digest[4:], "little", signed=True)
    return lo, hi


@functools.lru_cache(maxsize=1)
def build_digest() -> dict[str, str]:
    """What the ranks of one group must share to use one heap: this layout's numbers and the ``overlap._C`` build
    (its file's hash): ranks of different installs raise at the heap's set-up (`overlap.symm.heap`)."""
    numbers = sorted((k, v) for k, v in globals().items() if k.isupper() and isinstance(v, int))
    layout = hashlib.blake2b(json.dumps(numbers).encode(), digest_size=8).hexdigest()
    with open(signals().BUILD_FILE, "rb") as f:
        build = hashlib.file_digest(f, lambda: hashlib.blake2b(digest_size=8)).hexdigest()
    return {"layout": layout, "_C": build}
