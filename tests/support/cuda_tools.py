"""Where the CUDA binary tools are, for the tests that read compiled kernels (SASS)."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path


def cuobjdump() -> str | None:
    """``cuobjdump`` on PATH, else the one Triton's wheel carries; None where neither exists."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    spec = importlib.util.find_spec("triton")
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / "backends" / "nvidia" / "bin" / "cuobjdump"
        if candidate.exists():
            return str(candidate)
    return None
