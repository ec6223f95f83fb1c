"""Whether two functions are one definition imported twice: the registries (engine adapters,
statistical tests) take a module's registrations again when the module is imported again (pytest's
in-process runs drop losscheck's modules and import them afresh) and refuse another definition
under a taken name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def same_definition(a: Callable[..., Any], b: Callable[..., Any]) -> bool:
    """True when `a` and `b` come from one place in the source: module, qualified name and line."""
    return _where(a) == _where(b)


def _where(function: Callable[..., Any]) -> tuple[str, str, int]:
    code = getattr(function, "__code__", None)
    line = code.co_firstlineno if code is not None else -1
    return getattr(function, "__module__", ""), getattr(function, "__qualname__", repr(function)), line
