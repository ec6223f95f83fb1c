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
from losscheck.progress import QUIET, Progress
from losscheck.run.options import Options

if TYPE_CHECKING:
    import torch

    from losscheck.core.contract import Drafter
    from losscheck.core.precision import Precision
    from losscheck.core.target import HFTarget
    from losscheck.engines import BlackBoxEngine
    from losscheck.plan.cell import Cell
    from losscheck.run.plant import Plant


class Session:
    def __init__(self, options: Options) -> None:
        self.options = options
        self._n_statistical: int | None = None  # an explicit alpha split (calibration, mutants)
        self.manifest_sent = False  # this process's manifest went out on a report (plugin)
        self.progress: Progress = QUIET  # stages of a long cell; the plugin shows them on a terminal
        self._baselines: dict[Any, Any] = {}
        self._models: dict[tuple[str, str], HFTarget] = {}  # (target, dtype) -> loaded target
        self._drafter_sets: dict[tuple[str, Precision], dict[str, Drafter]] = {}

    def derive(self, **changes: Any) -> Session:
        """A session with some options changed (seed, alpha, mutant…) that shares this one's
        loaded models and its statistical-test count."""
        new = Session(dataclasses.replace(self.options, **changes))
        new._n_statistical = self._n_statistical
        new._models, new._drafter_sets = self._models, self._drafter_sets
        return new

    @property
    def n_statistical(self) -> int:
        """Statistical tests the family-wise alpha is split over: those of the full matrix
        (`matrix.statistical_tests`), fixed before any `-k` / `-m` selection or xdist split."""
        if self._n_statistical is not None:
            return self._n_statistical
        from losscheck.plan.matrix import statistical_tests

        return statistical_tests(self.plan)

    @n_statistical.setter
    def n_statistical(self, count: int) -> None:
        self._n_statistical = count

    @property
    def per_test_alpha(self) -> float:
        """Bonferroni share of the family-wise alpha for each statistical test of the matrix."""
        from losscheck.stats.budget import per_test_alpha

        return per_test_alpha(self.options.alpha, max(self.n_statistical, 1))

    @property
    def bundled_models(self) -> bool:
        """Certifying losscheck's own fixtures (no user target or drafter)."""
        return self.options.target is None and self.options.drafter is None

    @property
    def target_names(self) -> tuple[str, ...]:
        """ "main": the target under test; "small": the small-vocabulary exact-mode fixture (only
        with the bundled models — a user's drafter is built for the user's target — and unless
        `--losscheck-exact=off`)."""
        return ("main", "small") if self.bundled_models and self.options.exact else ("main",)

    @property
    def base_precision(self) -> Precision:
        return self.options.precisions[0]

    @cached_property
    def device(self) -> torch.device:
        from losscheck.core.precision import resolve_device

        return resolve_device(self.options.device)

    @property
    def targets(self) -> dict[str, HFTarget]:
        """Every target, in the base cell's precision."""
        return {name: self.target(name) for name in self.target_names}

    def target(self, name: str = "main", dtype: str | None = None) -> HFTarget:
        """Target `name` in `dtype` (default: the base precision's), loaded once per process."""
        dtype = dtype or self.base_precision.target
        if (name, dtype) not in self._models:
            self._models[name, dtype] = self._load_target(name, dtype)
        return self._models[name, dtype]

    def _load_target(self, name: str, dtype: str) -> HFTarget:
        import torch

        from losscheck import bundled
        from losscheck.core.target import HFTarget

        if os.environ.get("PYTEST_XDIST_WORKER"):
            # xdist already runs one worker per core; more threads per worker only contend.
            torch.set_num_threads(1)
        opts = self.options
        if name == "small":
            return HFTarget.from_pretrained(bundled.small_target_path(), dtype, device=self.device)
        path = opts.target or bundled.target_path()
        # a rank of `losscheck.serving.split` loads its shard of the main target (HF's own plan)
        split = (
            torch.distributed.is_available()
            and torch.distributed.is_initialized()
            and (torch.distributed.get_world_size() > 1)
        )
        return HFTarget.from_pretrained(path, dtype, opts.trust_remote_code, self.device, "auto" if split else None)

    def drafters(self, target: str = "main", precision: Precision | None = None) -> dict[str, Drafter]:
        """Drafters certified against `target` in `precision` (default: the base cell's), by cell
        name; the self-draft oracle always."""
        from losscheck.plan.matrix import ORACLE
        from losscheck.run import drafters as registry

        precision = precision or self.base_precision
        key = (target, precision)
        if key not in self._drafter_sets:
            model = self.target(target, precision.target)
            if target == "main" and self.options.drafter:
                found = {"user": registry.from_factory(self.options.drafter, model, precision.drafter)}
            else:
                found = registry.bundled(target, model, precision.drafter)
            found[ORACLE] = registry.self_draft(model)
            self._drafter_sets[key] = found
        return self._drafter_sets[key]

    @cached_property
    def plan(self) -> dict[str, list[Cell]]:
        """The cells of every certification test argument (`losscheck.plan.matrix.plan`)."""
        from losscheck.plan import matrix
        from losscheck.run import drafters as registry

        _ = self.prompt_sets  # a bad prompt file is one collection error, not one per test
        drafters = {name: self.drafters(name) for name in self.target_names}
        if self.options.drafter is None:
            precision_drafters = frozenset({"A"})  # the bundled families share A's model code paths
        else:
            precision_drafters = frozenset({"user"} if registry.takes_precision(self.options.drafter) else ())
        return matrix.plan(drafters, self.bundled_models, self.blackbox, self.options.precisions, precision_drafters)

    @cached_property
    def prompt_sets(self) -> dict[str, list[list[int]]]:
        """Tier ("low" / "mid" / "high" entropy) -> prompts of the main target: the
        `--losscheck-prompts` file (`losscheck.run.prompts`), else the bundled sets."""
        from losscheck import bundled
        from losscheck.run.prompts import TIERS, user_prompt_sets

        opts = self.options
        if opts.prompts is not None:
            return user_prompt_sets(opts.prompts, self.target("main"), opts.target, opts.chat_template)
        sets = {tier: bundled.load_prompts(tier) for tier in TIERS}
        vocab = self.target("main").vocab_size
        if max(t for found in sets.values() for p in found for t in p) >= vocab:
            raise OptionError(
                f"the bundled prompts are token ids of the bundled target, outside the vocabulary of "
                f"{vocab} tokens of --losscheck-target={opts.target!r}; pass --losscheck-prompts=FILE "
                '(JSONL, one {"text": ...} or {"ids": [...]} per line)'
            )
        return sets

    def prompts(self, tier: str) -> list[list[int]]:
        """Prompt set `tier`: one of `prompt_tiers` for the main target, "small" for the exact-mode
        target."""
        from losscheck import bundled

        return bundled.load_prompts(tier) if tier == "small" else self.prompt_sets[tier]

    @property
    def prompt_tiers(self) -> tuple[str, ...]:
        """The main target's non-empty prompt tiers."""
        return tuple(self.prompt_sets)

    @cached_property
    def plant(self) -> Plant | None:
        """The planted bug of `--losscheck-mutant` (`losscheck.run.plant`), or None."""
        from losscheck.run.plant import get_plant

        return None if self.options.mutant is None else get_plant(self.options.mutant)

    def cell_target(self, cell: Cell) -> HFTarget:
        """The target of `cell`, in the cell's precision."""
        return self.target(cell.target, cell.precision.target)

    @cached_property
    def blackbox(self) -> BlackBoxEngine | None:
        """The `--losscheck-engine` black-box engine, built from the main target (or None)."""
        if self.options.engine is None:
            return None
        from losscheck.engines import check_engine
        from losscheck.run.loading import load_object

        engine = load_object(self.options.engine, "--losscheck-engine")(self.targets["main"])
        return check_engine(engine, f"--losscheck-engine={self.options.engine!r}")

    def baseline(self, key: Any, make: Callable[[], Any]) -> Any:
        """Memoise a baseline result (shared by every cell of the same prompts and params)."""
        if key not in self._baselines:
            self._baselines[key] = make()
        return self._baselines[key]
