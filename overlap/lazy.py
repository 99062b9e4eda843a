"""Packages whose public names are imported on first use (PEP 562): `exports` makes a package's ``__getattr__`` and
``__dir__`` from its table of names, so that importing the package costs nothing and a name loads only its own
submodule (the plans' op table without torch, the benchmark's names without its runner).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def exports(package: str, table: dict[str, str], namespace: dict[str, Any]
            ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` of `package` (its ``__name__``), whose public names are `table`'s keys, each
    defined in the submodule its value names; `namespace` is the package's ``globals()``, where a name is kept once
    imported (later lookups skip ``__getattr__``)."""

    def __getattr__(name: str) -> Any:
        if name not in table:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{table[name]}", package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(table))

    return __getattr__, __dir__
