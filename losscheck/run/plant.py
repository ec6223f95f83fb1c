"""Planted bugs: how the self-test catalogue (or anyone testing losscheck itself) swaps a part of
the speculative engine for a broken one, without production code naming it.

A `Plant` is found by name among the objects that packages register under the entry-point group
`losscheck.plants` (each entry point names a function returning plants); losscheck's own
catalogue registers there like any other package would. `--losscheck-mutant=NAME` picks one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import cache
from importlib.metadata import entry_points
from typing import Protocol

from losscheck.core.contract import Drafter, Target
from losscheck.core.engine import EndRule
from losscheck.core.history import HistoryStep
from losscheck.core.logprobs import LogprobRule
from losscheck.core.stops import StopRule
from losscheck.core.verify import Verifier
from losscheck.errors import OptionError, flag
from losscheck.serving.batching import PlantsScheduler
from losscheck.serving.prefix_cache import PlantsPrefixCache

GROUP = "losscheck.plants"


class Plant(PlantsPrefixCache, PlantsScheduler, Protocol):
    """What a planted bug may replace; None leaves the part as it is. Only the speculative engine
    is planted: the drafter-less baseline stays plain decoding. The serving axes' parts (prefix
    cache, scheduler) are declared by their axes' protocols."""

    @property
    def name(self) -> str: ...

    @property
    def verifier(self) -> Verifier | None:
        """Used in place of the engine's own verifier."""
        ...

    @property
    def wrap_drafter(self) -> Callable[[Drafter], Drafter] | None:
        """Drafter -> planted drafter."""
        ...

    @property
    def wrap_target(self) -> Callable[[Target, int], Target] | None:
        """(target, k) -> planted target."""
        ...

    @property
    def history(self) -> HistoryStep | None:
        """Used in place of the engine's history-dependent processing of the target's logits
        (`losscheck.core.history.adjust_logits`); optional on a plant."""
        ...

    @property
    def ends(self) -> EndRule | None:
        """Used in place of the engine's rule for where a round's rows end
        (`losscheck.core.engine.emit_counts`); optional on a plant."""
        ...

    @property
    def logprobs(self) -> LogprobRule | None:
        """Used in place of the engine's rule for the log-probabilities it reports
        (`losscheck.core.logprobs.emitted_logprobs`); optional on a plant."""
        ...

    @property
    def stop_rule(self) -> StopRule | None:
        """Used in place of the engine's rule for the token that completes a stop string
        (`losscheck.core.stops.first_stop`); optional on a plant."""
        ...


@cache
def plants() -> dict[str, Plant]:
    """Every registered plant, by name."""
    found: dict[str, Plant] = {}
    for point in entry_points(group=GROUP):
        provided: Iterable[Plant] = point.load()()
        found.update({p.name: p for p in provided})
    return found


def get_plant(name: str) -> Plant:
    """The plant called `name`, else `OptionError` listing them."""
    found = plants().get(name)
    if found is None:
        known = ", ".join(plants()) or f"none: no package registers the entry-point group {GROUP!r}"
        raise OptionError(f"{flag('mutant')}={name!r} is not a registered planted bug; choose one of: {known}")
    return found
