"""Make Triton's CPU interpreter usable for tests: ``import`` this before any kernel runs.

Why this exists: Triton 3.6's interpreter turns a scalar into a 1-element numpy array and
``range()`` over it calls ``int()`` on that array, which numpy >= 2.4 refuses ("only
0-dimensional arrays can be converted to Python scalars"), so every loop whose bound is a
kernel argument fails under ``TRITON_INTERPRET=1``. This wraps the one patch function so
``__index__`` reads the single element. It changes nothing when the interpreter is not used,
and nothing on a GPU.
"""

from __future__ import annotations

import os
from typing import Any


def enable() -> bool:
    """Apply the fix if the interpreter is on; returns whether it was applied."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_fp4select_fixed", False):
        return True

    def patched(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    # a marker on the function object, which mypy does not let a def carry
    patched._fp4select_fixed = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched
    return True
