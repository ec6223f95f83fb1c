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
    """The mutants of an attention-only target (the bundled ones)."""
    from losscheck.selftest.registry import CATALOGUE

    return CATALOGUE


def state_catalogue() -> tuple[Mutant, ...]:
    """The recurrent-state mutants, for a hybrid target (`losscheck.selftest.state_registry`)."""
    from losscheck.selftest.state_registry import STATE_CATALOGUE

    return STATE_CATALOGUE


def every_mutant() -> tuple[Mutant, ...]:
    """Both catalogues: the planted bugs this package registers (`losscheck.run.plant`)."""
    return catalogue() + state_catalogue()


def names() -> tuple[str, ...]:
    return tuple(m.name for m in every_mutant())


def get_mutant(name: str) -> Mutant:
    """The mutant called `name`, else `OptionError` listing both catalogues."""
    found = {m.name: m for m in every_mutant()}.get(name)
    if found is None:
        raise OptionError(
            f"{flag('mutant')}={name!r} is not a registered planted bug; choose one of: " + ", ".join(names())
        )
    return found
