"""Planted, realistic losslessness bugs that the gate must catch (DESIGN §4.3).

`get_mutant(name)` returns a `Mutant`: its engine (an `Engine` subclass with the bug), the bug
class it models, which gate tests must catch it and the gate cells it shows in. Run the gate
against one with `pytest -m lossless --losscheck-mutant=NAME`, the whole catalogue with
`pytest -m mutants` or `losscheck mutants` (the catch table).

This module imports nothing heavy, so option parsing can check a name cheaply; the catalogue
itself (torch, the engines) loads on first `get_mutant`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from losscheck.errors import OptionError

if TYPE_CHECKING:
    from losscheck.mutants.registry import Mutant

MUTANT_NAMES = (
    "unnormalised_residual",
    "residual_is_p",
    "inverted_ratio",
    "temperature_p_only",
    "temperature_q_only",
    "truncation_draft_only",
    "greedy_draft_softmax_q",
    "truncated_candidates_full_q",
    "bonus_from_wrong_slot",
    "recovered_after_rejected",
    "shared_uniform",
    "typical_acceptance",
    "bonus_counted_not_written",
    "stale_target_cache",
    "batch_max_positions",
    "rows_mixed_up",
)


def check_name(name: str) -> str:
    """`name` if it is in the catalogue, else `OptionError` listing the catalogue."""
    if name not in MUTANT_NAMES:
        raise OptionError(
            f"--losscheck-mutant={name!r} is not in the mutant catalogue; choose one of: "
            + ", ".join(MUTANT_NAMES)
        )
    return name


def get_mutant(name: str) -> "Mutant":
    from losscheck.mutants.registry import BY_NAME

    return BY_NAME[check_name(name)]


def catalogue() -> "tuple[Mutant, ...]":
    from losscheck.mutants.registry import CATALOGUE

    return CATALOGUE
