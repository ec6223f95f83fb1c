"""The state of one losscheck run, built once from the `--losscheck-*` options.

Models load lazily (the plugin imports nothing heavy until a test needs it) and are cached for the
whole process, so every cell of a worker shares one target and one instance of each drafter.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Callable

from losscheck.errors import OptionError
from losscheck.profiles import Profile


@dataclass(frozen=True)
class Options:
    """Parsed `--losscheck-*` options (see `losscheck.plugin` for their help)."""

    target: str | None = None  # model directory; None = the bundled tiny target
    drafter: str | None = None  # pkg.mod:factory; None = the bundled drafters
    engine: str | None = None  # pkg.mod:factory of a black-box engine (two-sample mode)
    seed: int = 20261129
    out: Path | None = None  # write the certificate under this directory
    alpha: float = 0.01  # family-wise false-alarm rate of the whole run
    profile: Profile = field(default_factory=lambda: Profile("ci"))
    strict: bool = False  # reduced-precision near-ties fail too
    trust_remote_code: bool = False
    mutant: str | None = None  # run the gate against a planted bug (losscheck.mutants)

    def __post_init__(self) -> None:
        if not 0 < self.alpha < 1:
            raise OptionError(f"--losscheck-alpha must be in (0, 1), got {self.alpha}")
        if not 0 < self.profile.detect_tv < 1:
            raise OptionError(f"--losscheck-detect-tv must be in (0, 1), got {self.profile.detect_tv}")


class Session:
    def __init__(self, options: Options) -> None:
        self.options = options
        self.n_statistical = 0  # statistical tests collected; set by the plugin
        self.records: list[dict[str, Any]] = []
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

    @property
    def bundled(self) -> bool:
        return self.options.target is None

    @cached_property
    def targets(self) -> dict[str, Any]:
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
        if self.bundled and opts.drafter is None:
            found["small"] = HFTarget.from_pretrained(bundled.small_target_path())
        return found

    def drafters(self, target: str = "main") -> dict[str, Any]:
        """Drafters certified against `target`, by cell name; the self-draft oracle always."""
        return self._drafters[target]

    @cached_property
    def _drafters(self) -> dict[str, dict[str, Any]]:
        from losscheck.drafters import registry

        out: dict[str, dict[str, Any]] = {}
        for name, target in self.targets.items():
            if name == "main" and self.options.drafter:
                out[name] = {"user": registry.from_factory(self.options.drafter, target)}
            else:
                out[name] = registry.bundled(name, target)
            out[name]["self"] = registry.self_draft(target)
        return out

    @cached_property
    def blackbox(self) -> Any:
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

    def engine_factory(self) -> Callable[..., Any]:
        """`Engine`, or the mutant's engine when the run plants a bug."""
        from losscheck.engine import Engine

        if self.options.mutant is None:
            return Engine
        from losscheck.mutants import get_mutant

        return get_mutant(self.options.mutant).engine

    def baseline(self, key: Any, make: Callable[[], Any]) -> Any:
        """Memoise a baseline generation (shared by every cell of the same prompts and params)."""
        if key not in self._baselines:
            self._baselines[key] = make()
        return self._baselines[key]
