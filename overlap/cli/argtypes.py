"""Argument types of the command line: each raises argparse.ArgumentTypeError, which argparse turns into
exit code 2 with the message."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def int_at_least(lowest: int, what: str | None = None) -> Callable[[str], int]:
    """An int >= `lowest` (`what` names it in the message, default "an integer >= lowest")."""
    what = what or f"an integer >= {lowest}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < lowest:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value

    return parse


def positive_float(what: str = "a positive number") -> Callable[[str], float]:
    """A float > 0."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value

    return parse


def timeout_seconds(text: str) -> float:
    """``--timeout``: seconds, finite, > 0 and at most `envs.MAX_TIMEOUT_S` (7 days), as `envs.resolve_timeout`."""
    from ..envs import MAX_TIMEOUT_S

    value = positive_float("a positive number of seconds")(text)
    if not value <= MAX_TIMEOUT_S:  # (inf and more than 7 days)
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds > 0 and at most {MAX_TIMEOUT_S:g} "
                                         f"(7 days), got {text!r}")
    return value


#: what ``--ranks`` says in every command's help
RANKS_HELP = ("local ranks to start when not under torchrun (default: one per GPU, else 2 CPU ranks); --nproc is "
              "the same option, but torchrun's own parser rejects it (it reads it as its --nproc-per-node): under "
              "torchrun, whose --nproc-per-node sets the ranks, leave it out or write --ranks")


def add_ranks_option(parser: argparse.ArgumentParser) -> None:
    """``--ranks N`` (also ``--nproc N``; ``args.nproc``) on the parser of a command that starts ranks."""
    parser.add_argument("--ranks", "--nproc", dest="nproc", type=int_at_least(1, "a positive integer"), default=None,
                        metavar="N", help=RANKS_HELP)


def selection(values: list[tuple[str, ...]] | None, known: tuple[str, ...]) -> tuple[str, ...]:
    """The union of a repeatable comma-separated option's values, in the order of `known` (None: all)."""
    return tuple(k for k in known if any(k in group for group in values)) if values else known
