"""The ``overlap`` logger's set-up (`configure`, applied by ``import overlap``): its level from
``OVERLAP_LOG`` (a value that is no level warns once and leaves ``warning``: a typo never breaks the import), one
handler whose lines read ``[overlap INFO rank 1] message``.

`OverlapFormatter` adds the rank once torch.distributed is initialized (read when a line is written, and
only where torch is already imported: a log line never imports torch). It also makes the plan in
``auto``'s choice readable, in this handler's lines only (the record is left as it was made):
``auto chose symm (shm x2)`` rather than the plan's signature text ``symm[shm=2]`` (`readable_plan`;
the signature that follows keeps the exact text).
"""

from __future__ import annotations

import logging
import re
import sys

from . import envs
from .links import LINK_CLASSES

#: the format of the ``overlap`` logger's handler: ``[overlap INFO rank 1] message``
LOG_FORMAT = "[overlap %(levelname)s%(rank)s] %(message)s"

#: the message of `overlap.plans.auto`'s choice; its second argument is the plan's signature text
AUTO_CHOICE = "overlap.%s: auto chose %s for %s (%s)"

#: fastest first: the order `overlap.Plan.label` writes chunks in
_LINK_ORDER = LINK_CLASSES

#: the bad OVERLAP_LOG values `configure` has warned about (once each per process)
_BAD_LEVELS: set[str] = set()

_PLAN_TEXT = re.compile(r"^(reference|pipelined|symm|fused)\[([^\]]*)\]$")


def readable_plan(text: str) -> str:
    """``Plan.describe()`` text as `overlap.Plan.label` writes it (``symm[shm=2,one_shot]`` -> ``symm (shm x2,
    one-shot)``); other text unchanged. Link classes not in the text run their default chunks."""
    found = _PLAN_TEXT.match(text)
    if not found:
        return text
    items = dict(item.partition("=")[::2] for item in filter(None, found.group(2).split(",")))
    parts = [f"{c} x{items.pop(c)}" for c in _LINK_ORDER if c in items]
    parts += ["one-shot" if key == "one_shot" else f"tile {value}" if key == "tile" else f"{key} x{value}"
              for key, value in items.items()]
    return f"{found.group(1)} ({', '.join(parts)})" if parts else found.group(1)


def _rank() -> str:
    """`` rank N`` once torch.distributed is initialized, else empty; never imports torch."""
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None) if torch is not None else None
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return f" rank {dist.get_rank()}"
    except Exception:  # noqa: BLE001 - a log line never fails for want of a rank
        pass
    return ""


class OverlapFormatter(logging.Formatter):
    """`LOG_FORMAT` with the rank (`_rank`) and ``auto``'s plan written readably (`readable_plan`), on a
    copy of the record: other handlers of the logger (a user's, a test's) see the record as it was made."""

    def __init__(self) -> None:
        super().__init__(LOG_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        record = logging.makeLogRecord(record.__dict__)
        record.rank = _rank()
        if record.msg == AUTO_CHOICE and isinstance(record.args, tuple) and len(record.args) == 4:
            op, plan, signature, how = record.args
            record.args = (op, readable_plan(str(plan)), signature, how)
        return super().format(record)


def configure() -> logging.Logger:
    """Give the ``overlap`` logger its handler (once) and the level of ``OVERLAP_LOG``; where that is no level
    (`envs.LOG_LEVELS`), the level ``WARNING`` and a warning on this logger, once per process and value, naming
    the variable and the levels it takes. Never an error, nor a Python warning (which ``-W error`` would turn
    into one): ``import overlap`` calls it."""
    log = logging.getLogger("overlap")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(OverlapFormatter())
        log.addHandler(handler)
    try:
        level, bad = envs.log_level(), None
    except ValueError as exc:
        level, bad = "WARNING", str(exc)
    log.setLevel(getattr(logging, level))
    if bad is not None and bad not in _BAD_LEVELS:
        _BAD_LEVELS.add(bad)
        log.warning("%s; logging at warning", bad)
    return log
