"""Planted, realistic losslessness bugs that the gate must catch (docs/mutants.md).

`get_mutant(name)` returns a `Mutant` (`losscheck.selftest.registry`): the bug class it models,
what it plants in the speculative engine, which gate tests must catch it and the gate cells it
shows in. Run the gate against one with `pytest -m lossless --losscheck-mutant=NAME`, the whole
catalogue with `pytest -m mutants` or `losscheck mutants` (the catch table).

This module imports nothing heavy: the catalogue (torch, the engine) loads on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from losscheck.errors import OptionError, flag

if TYPE_CHECKING:
    from losscheck.selftest.registry import Mutant


def catalogue() -> tuple[Mutant, ...]:
    from losscheck.selftest.registry import CATALOGUE

    return CATALOGUE


def names() -> tuple[str, ...]:
    return tuple(m.name for m in catalogue())


def get_mutant(name: str) -> Mutant:
    """The mutant called `name`, else `OptionError` listing the catalogue."""
    found = {m.name: m for m in catalogue()}.get(name)
    if found is None:
        raise OptionError(
            f"{flag('mutant')}={name!r} is not a registered planted bug; choose one of: " + ", ".join(names())
        )
    return found
