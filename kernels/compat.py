"""Fixes for the Triton versions `overlap` supports, applied once when the first kernel file is imported (by `flags`).

Triton 3.6's interpreter converts a one-element tensor to an index with ``int(handle.data)``; numpy 2.4
and later refuse ``int()`` of an array with one dimension ("only 0-dimensional arrays can be converted
to Python scalars"), so on that pair every interpreted kernel that indexes with a loaded value fails
(Triton 3.7 and later squeeze the array first). `fix_interpreter_index` gives the 3.6 interpreter the
later versions' conversion; it touches nothing on other versions, and only the interpreter (compiled
kernels never call it).
"""

from __future__ import annotations

import warnings

import triton

#: Triton versions whose interpreter converts an index with ``int(array)`` (fixed upstream in 3.7)
UNSQUEEZED_INDEX_BELOW = (3, 7)


def _version() -> tuple[int, ...]:
    parts = []
    for piece in triton.__version__.split("+")[0].split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def fix_interpreter_index() -> bool:
    """Make the Triton < 3.7 interpreter convert one-element tensors with ``int(data.squeeze())``.
    Returns True when the fix is in place (installed now or before), False where it does not apply."""
    if _version() >= UNSQUEEZED_INDEX_BELOW:
        return False
    try:
        from triton.runtime import interpreter
    except ImportError:  # no interpreter in this build: nothing to fix
        return False
    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None:
        warnings.warn(f"overlap: Triton {triton.__version__}'s interpreter has no _patch_lang_tensor: interpreted "
                      "kernels may fail under numpy >= 2.4", RuntimeWarning, stacklevel=2)
        return False
    if getattr(patch, "overlap_index_fix", False):
        return True

    def patch_lang_tensor(tensor, scope) -> None:
        patch(tensor, scope)
        # the later versions' conversion: a one-element array of any rank to a Python int
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_lang_tensor.overlap_index_fix = True
    interpreter._patch_lang_tensor = patch_lang_tensor  # looked up by name at each interpreted launch
    return True
