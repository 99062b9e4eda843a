"""The fused operations, one module each (see each module's docstring).

Import the functions from `overlap` (``overlap.all_gather_matmul``); ``overlap.ops.<name>`` is
the module that implements one. `function` looks a public op function up by ``module.function``
at call time: the op table's calls (`overlap.plans.OpSpec.call`) use it, so a function replaced on
its module (a test's wrong op) is the one called.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable


def function(path: str) -> Callable:
    """The function ``overlap.ops.<module>.<name>`` for `path` ``"<module>.<name>"``; raises ValueError
    for a path that names no public function."""
    module, _, name = path.rpartition(".")
    try:
        fn = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    except (ImportError, AttributeError, ValueError):
        fn = None
    if not callable(fn) or not module or name.startswith("_") or module.startswith("_"):
        raise ValueError(f"overlap.ops has no public function {path!r}")
    return fn
