"""Loading user code named by import path (`pkg.mod:factory`)."""

from __future__ import annotations

import importlib
from typing import Any

from losscheck.errors import OptionError


def load_object(spec: str, option: str) -> Any:
    """Resolve `pkg.mod:attr` (or `pkg.mod.attr`); raise OptionError naming `option` on failure."""
    module_name, sep, attr = spec.partition(":")
    if not sep:
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr:
        raise OptionError(f"{option}={spec!r}: expected an import path like 'pkg.module:factory'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise OptionError(
            f"{option}={spec!r}: cannot import module {module_name!r} ({exc}); make it importable "
            "(install it, or run pytest from the directory that contains it)"
        ) from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise OptionError(f"{option}={spec!r}: module {module_name!r} has no attribute {attr!r}") from None
