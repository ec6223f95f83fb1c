"""The state of one losscheck run, built once from the `--losscheck-*` options.

Models load lazily (the plugin imports nothing heavy until a test needs it) and are cached for the
whole process, so every cell of a worker shares one target and one instance of each drafter.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from functools import cached_property
from typing import TYPE_CHECKING, Any

from losscheck.errors import OptionError
from losscheck.options import Options

if TYPE_CHECKING:
    from losscheck.blackbox import BlackBoxEngine
    from losscheck.contract import Drafter
    from losscheck.engine import Engine
    from losscheck.matrix import Cell
    from losscheck.mutants.registry import Mutant
    from losscheck.target import HFTarget


class Session:
    def __init__(self, options: Options) -> None:
        self.options = options
        self.n_statistical = 0  # statistical tests collected; set by the plugin
        self._baselines: dict[Any, Any] = {}

    def derive(self, **changes: Any) -> "Session":
        """A session with some options changed (seed, alpha, mutant…) that shares this one's
        loaded models and its statistical-test count."""
        new = Session(dataclasses.replace(self.options, **changes))
        new.n_statistical = self.n_statistical
        for cached in ("targets", "_drafters"):  # functools.cached_property storage
            if cached in self.__dict__:
                new.__dict__[cached] = self.__dict__[cached]
        return new

    @property
    def per_test_alpha(self) -> float:
        """Bonferroni share of the family-wise alpha for each collected statistical test."""
        from losscheck.stats.budget import per_test_alpha

        return per_test_alpha(self.options.alpha, max(self.n_statistical, 1))

    @cached_property
    def targets(self) -> "dict[str, HFTarget]":
        """"main": the target under test; "small": the small-vocabulary exact-mode fixture
        (only with the bundled models: a user's drafter is built for the user's target)."""
        import torch

        from losscheck import bundled
        from losscheck.target import HFTarget

        if os.environ.get("PYTEST_XDIST_WORKER"):
            # xdist already runs one worker per core; more threads per worker only contend.
            torch.set_num_threads(1)
        opts = self.options
        path = opts.target or bundled.target_path()
        found = {"main": HFTarget.from_pretrained(path, trust_remote_code=opts.trust_remote_code)}
        if opts.target is None and opts.drafter is None:
            found["small"] = HFTarget.from_pretrained(bundled.small_target_path())
        return found

    def drafters(self, target: str = "main") -> "dict[str, Drafter]":
        """Drafters certified against `target`, by cell name; the self-draft oracle always."""
        return self._drafters[target]

    @cached_property
    def _drafters(self) -> "dict[str, dict[str, Drafter]]":
        from losscheck.drafters import registry
        from losscheck.matrix import ORACLE

        out: dict[str, dict[str, Drafter]] = {}
        for name, target in self.targets.items():
            if name == "main" and self.options.drafter:
                out[name] = {"user": registry.from_factory(self.options.drafter, target)}
            else:
                out[name] = registry.bundled(name, target)
            out[name][ORACLE] = registry.self_draft(target)
        return out

    @cached_property
    def plan(self) -> "dict[str, list[Cell]]":
        """The cells of every certification test argument (`losscheck.matrix.plan`)."""
        from losscheck import matrix

        drafters = {name: self.drafters(name) for name in self.targets}
        bundled_families = self.options.target is None and self.options.drafter is None
        return matrix.plan(drafters, bundled_families, engine=self.options.engine is not None)

    def prompts(self, tier: str) -> list[list[int]]:
        """Prompt set `tier`: "low" / "mid" / "high" entropy for the main target, "small" for the
        exact-mode target."""
        from losscheck import bundled

        return bundled.load_prompts(tier)

    @property
    def prompt_tiers(self) -> tuple[str, ...]:
        from losscheck.bundled import PROMPT_TIERS

        return PROMPT_TIERS

    @cached_property
    def mutant(self) -> "Mutant | None":
        """The planted bug of `--losscheck-mutant`, or None."""
        from losscheck.mutants import get_mutant

        return None if self.options.mutant is None else get_mutant(self.options.mutant)

    def engine(self, cell: "Cell") -> "Engine":
        """The speculative engine of `cell`: its drafter, k and width, with the run's planted bug."""
        from losscheck.engine import Engine

        target, drafter = self.targets[cell.target], self.drafters(cell.target)[cell.drafter]
        if self.mutant is not None:
            return self.mutant.engine(target, drafter, cell.k, cell.width)
        return Engine(target, drafter, cell.k, cell.width)

    def baseline_engine(self, target: str) -> "Engine":
        """Plain decoding of `target`: the same loop with no drafter (never planted)."""
        from losscheck.engine import Engine

        return Engine(self.targets[target])

    @cached_property
    def blackbox(self) -> "BlackBoxEngine | None":
        """The `--losscheck-engine` black-box engine, built from the main target (or None)."""
        if self.options.engine is None:
            return None
        from losscheck.loading import load_object

        engine = load_object(self.options.engine, "--losscheck-engine")(self.targets["main"])
        if not callable(getattr(engine, "generate", None)):
            raise OptionError(
                f"--losscheck-engine={self.options.engine!r} returned {type(engine).__name__} without a "
                "generate(prompt, n, params, seed, max_new_tokens) method (see losscheck/blackbox.py)"
            )
        return engine

    def baseline(self, key: Any, make: Callable[[], Any]) -> Any:
        """Memoise a baseline result (shared by every cell of the same prompts and params)."""
        if key not in self._baselines:
            self._baselines[key] = make()
        return self._baselines[key]
