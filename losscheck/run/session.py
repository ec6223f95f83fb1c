"""The context of one losscheck run, built once from the `--losscheck-*` options: the plan of the
matrix and the alpha split over it, the prompts, the planted bug if any, the black-box engine,
what cells share (`memo`) and the models (`losscheck.run.models`, loaded lazily: the plugin
imports nothing heavy until a test needs them). Engines and servers are built from it by
`losscheck.run.factory`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from losscheck.errors import OptionError, flag
from losscheck.plan.sampling_spec import parse_sampling
from losscheck.run.memo import MemoKey
from losscheck.run.models import Models
from losscheck.run.options import Options

if TYPE_CHECKING:
    import torch

    from losscheck.core.contract import Drafter
    from losscheck.core.precision import Precision
    from losscheck.core.target import HFTarget
    from losscheck.engines import BlackBoxEngine
    from losscheck.engines.registry import EngineSpec
    from losscheck.plan.cell import Cell
    from losscheck.plan.matrix import Declares
    from losscheck.run.plant import Plant


class Session:
    def __init__(self, options: Options, skeleton: bool = False) -> None:
        """`skeleton`: a session that only plans (`losscheck certify --list`): targets without
        weights, prompts not read."""
        self.options = options
        self.skeleton = skeleton
        self._n_statistical: int | None = None  # an explicit alpha split (calibration, mutants)
        self._memo: dict[MemoKey, Any] = {}
        self.models = Models(options, skeleton)
        # the black-box engine cells this process runs, in run order (set by the plugin once its
        # collection is final; empty under xdist, whose workers do not know their share)
        self.engine_cells: tuple[Cell, ...] = ()
        self._variant: tuple[tuple[tuple[str, int | str], ...], BlackBoxEngine] | None = None  # the one built

    def derive(self, **changes: Any) -> Session:
        """A session with some options changed (seed, alpha, mutant…) that shares this one's
        loaded models and its statistical-test count."""
        new = Session(dataclasses.replace(self.options, **changes))
        new._n_statistical = self._n_statistical
        new.models = self.models.sharing(new.options)
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
        if self.bundled_models and self.options.exact and not self.engine_only:
            return ("main", "small")
        return ("main",)

    @property
    def base_precision(self) -> Precision:
        return self.options.precisions[0]

    @property
    def device(self) -> torch.device:
        return self.models.device

    @property
    def targets(self) -> dict[str, HFTarget]:
        """Every target, in the base cell's precision."""
        return {name: self.target(name) for name in self.target_names}

    def target(self, name: str = "main", dtype: str | None = None) -> HFTarget:
        """Target `name` in `dtype` (default: the base precision's), loaded once per process."""
        return self.models.target(name, dtype or self.base_precision.target)

    def drafters(self, target: str = "main", precision: Precision | None = None) -> dict[str, Drafter]:
        """Drafters certified against `target` in `precision` (default: the base cell's), by cell
        name; the self-draft oracle always."""
        return self.models.drafters(target, precision or self.base_precision)

    @property
    def engine_only(self) -> bool:
        """A black-box engine without a drafter option: the run certifies the engine's cells only."""
        return self.options.engine is not None and self.options.drafter is None

    @property
    def plan(self) -> dict[str, list[Cell]]:
        """The cells of every certification test argument in the run's declared scope."""
        return self._scoped[0]

    @property
    def out_of_scope(self) -> list[dict[str, str]]:
        """The cells of the full matrix the declared scope leaves out: id and the term's reason."""
        return self._scoped[1]

    @cached_property
    def _scoped(self) -> tuple[dict[str, list[Cell]], list[dict[str, str]]]:
        from losscheck.plan import matrix
        from losscheck.run import drafters as registry

        if not self.skeleton:
            _ = self.prompt_sets  # a bad prompt file is one collection error, not one per test
        bundled: str | None = None  # the drafters are a bundled set (`losscheck.plan.bundled_sets`)
        if self.engine_only:
            drafters: dict[str, Mapping[str, Declares]] = {"main": {}}
            precision_drafters: frozenset[str] = frozenset()
        else:
            drafters = {name: self._planned_drafters(name) for name in self.target_names}
            if self.options.drafter is None:
                bundled = self.options.bundled
                precision_drafters = frozenset({"A"})  # the bundled families share A's model code paths
            else:
                precision_drafters = frozenset({"user"} if registry.takes_precision(self.options.drafter) else ())
        variants = list(self.engine_variants)
        served = "served" in self.options.scope.extras
        tokenizer = str(Path(self.options.target).expanduser().resolve()) if self.options.target else None
        sampling = [parse_sampling(spec, tokenizer) for spec in self.options.sampling]
        full = matrix.plan(
            drafters,
            bundled,
            self.blackbox,
            self.options.precisions,
            precision_drafters,
            variants,
            served,
            sampling,
            _vocabulary(tokenizer),
        )
        kept, out = self.options.scope.split(full, self.base_precision)
        return _within_devices(kept, out)

    def _planned_drafters(self, target: str) -> Mapping[str, Declares]:
        """What the plan reads of `target`'s drafters: the bundled set on the bundled targets by its
        declarations (no weights loaded: collection and `--list` stay cheap in every process),
        a user's drafter or target built as the cells will use them (their factories and weights
        are checked before any cell runs)."""
        from losscheck.run import drafters as registry

        if self.options.drafter is None and self.options.target is None:
            return registry.declared(target, self.options.bundled)
        return self.drafters(target)

    @cached_property
    def prompt_sets(self) -> dict[str, list[list[int]]]:
        """Tier ("low" / "mid" / "high" entropy) -> prompts of the main target: the
        `--losscheck-prompts` file (`losscheck.run.prompts`), else the bundled sets."""
        from losscheck import bundled
        from losscheck.run.prompts import TIERS, new_tokens, user_prompt_sets

        opts = self.options
        room = new_tokens(opts.profile)  # a prompt must leave the longest cell's tokens of positions
        if opts.prompts is not None:
            return user_prompt_sets(opts.prompts, self.target("main"), opts.target, opts.chat_template, room)
        sets = {tier: bundled.load_prompts(tier) for tier in TIERS}
        if opts.target is None:
            return sets  # the bundled target's own ids (tests/cells/test_fixtures.py)
        vocab = self.target("main").vocab_size
        if opts.target is not None and _has_tokenizer(opts.target):
            # a user's target with a tokenizer: the bundled text prompts, in its own tokens
            text = bundled.fixtures_dir() / "prompts" / "text.jsonl"
            return user_prompt_sets(text, self.target("main"), opts.target, opts.chat_template, room)
        if max(t for found in sets.values() for p in found for t in p) >= vocab:
            raise OptionError(
                f"the bundled prompts are token ids of the bundled target, outside the vocabulary of "
                f"{vocab} tokens of {flag('target')}={opts.target!r}; pass {flag('prompts')}=FILE "
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
        from losscheck.engines.named import ADAPTERS
        from losscheck.run.loading import engine_request, load_object

        name = self.options.engine
        if name in ADAPTERS:
            engine = ADAPTERS[name].build(self.targets["main"], engine_request(self.options))
        else:
            engine = load_object(name, flag("engine"))(self.targets["main"])
        return check_engine(engine, f"{flag('engine')}={name!r}")

    @cached_property
    def engine_variants(self) -> dict[tuple[str, int | str], EngineSpec]:
        """(axis, value) -> the request of each variant of the named engine, along the axes its
        adapter declares (`losscheck.engines.registry.EngineAxis`); none for a factory's engine."""
        from losscheck.engines.named import ADAPTERS
        from losscheck.run.loading import engine_request

        adapter = ADAPTERS.get(self.options.engine) if self.options.engine is not None else None
        if adapter is None:
            return {}
        return {(name, value): varied for name, value, varied in adapter.variants(engine_request(self.options))}

    def engine_for(self, cell: Cell) -> BlackBoxEngine | None:
        """The black-box engine of `cell`: the engine as named, or the variant the cell names, built
        on first use. One variant lives at a time: before one is built, the previous one and the
        named engine's instances are released (`losscheck.engines.pool`), and a cell of the named
        engine releases the variant."""
        from losscheck.engines.pool import free_memory, instances_of

        if not cell.variant or self.blackbox is None:
            if self._variant is not None:
                self._release_variant()
            return self.blackbox
        if self._variant is None or self._variant[0] != cell.variant:
            self._release_variant(free=False)
            named = instances_of(self.blackbox)
            if named is not None:
                named.close(free=False)
            free_memory()  # once, for the variant and the named engine's instances released here
            self._variant = (cell.variant, self._build_variant(cell))
        return self._variant[1]

    def _build_variant(self, cell: Cell) -> BlackBoxEngine:
        from losscheck.engines import check_engine
        from losscheck.engines.named import ADAPTERS
        from losscheck.errors import LosscheckError
        from losscheck.plan.cell import OWN_TARGET

        assert self.options.engine is not None
        (pair,) = cell.variant  # one variable per cell
        where = f"{flag('engine')}={self.options.engine!r} at {pair[0]}={pair[1]!r}"
        built = ADAPTERS[self.options.engine].build(self.targets["main"], self.engine_variants[pair])
        engine = check_engine(built, where)
        precision = None if cell.target == OWN_TARGET else cell.precision.target
        if engine.k != cell.k or engine.precision != precision:
            raise LosscheckError(
                f"{where} built an engine of k={engine.k}, precision={engine.precision!r}; its cells were "
                f"planned at k={cell.k}, precision={precision!r} (the axis's vary() and build() disagree)"
            )
        return engine

    def _release_variant(self, free: bool = True) -> None:
        """Drop the variant's engine and its instances; `free`: and collect what they held."""
        from losscheck.engines.pool import free_memory, instances_of

        if self._variant is None:
            return
        instances = instances_of(self._variant[1])
        if instances is not None:
            instances.close(free=False)
        self._variant = None
        if free:
            free_memory()  # once, after the variant itself is dropped

    @cached_property
    def engine_pins(self) -> dict[str, object]:
        """What the certificate pins of the black-box engine: its package's version, its draft
        model's hash, its options (`losscheck.engines.pins`); empty without one."""
        if self.options.engine is None:
            return {}
        from losscheck.engines.named import ADAPTERS
        from losscheck.engines.pins import engine_pins
        from losscheck.run.loading import engine_request

        name = self.options.engine
        if name in ADAPTERS:
            adapter, request = ADAPTERS[name], engine_request(self.options)
            return engine_pins(adapter.library, request, adapter.parse(request))
        return engine_pins(name.partition(":")[0])  # a user's factory: its module's distribution

    @cached_property
    def proxy_precision(self) -> str:
        """The precision of the proxy two-sample engine cells load (`--losscheck-proxy-precision`;
        auto: fp32 unless the machine's accelerators fit it nowhere, `hardware.chosen_proxy`)."""
        from losscheck.engines.hardware import chosen_proxy
        from losscheck.run.loading import engine_models

        return chosen_proxy(self.options.proxy_precision, *engine_models(self.options))

    def memo(self, key: MemoKey, make: Callable[[], Any]) -> Any:
        """`make()`, computed once per key for the whole run: what cells share (a baseline of the
        same prompts, an exact enumeration of the same parameters)."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]


def _within_devices(
    kept: dict[str, list[Cell]], out: list[dict[str, str]]
) -> tuple[dict[str, list[Cell]], list[dict[str, str]]]:
    """On accelerators, the engine variants that need more devices than the machine has (a
    `tensor_parallel` value above its count) declared out of scope with the numbers, as
    `--scope=-tensor_parallel` would; on a CPU every variant runs (its ranks are processes)."""
    from losscheck.engines.hardware import devices_needed, present

    hardware = present()
    if hardware is None:
        return kept, out
    fits: dict[str, list[Cell]] = {}
    for arg, cells in kept.items():
        fits[arg] = []
        for cell in cells:
            over = [(a, v) for a, v in cell.variant if devices_needed(a, v) > hardware.devices]
            if not over:
                fits[arg].append(cell)
                continue
            axis, value = over[0]
            why = (
                f"{axis}={value} needs {devices_needed(axis, value)} devices, {hardware.devices} present "
                f"({hardware.label}); run it on a machine with more, or declare it out (--scope=-{axis})"
            )
            out = [*out, {"cell": cell.id, "reason": why}]
    return fits, out


def _has_tokenizer(target_dir: str) -> bool:
    from pathlib import Path

    root = Path(target_dir).expanduser()
    return any((root / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json"))


def _vocabulary(target: str | None) -> str | None:
    """What the planned grammar cell compiles against: the bundled characters without `--target`,
    the target's tokenizer directory when it has one, else None (no grammar cell)."""
    from losscheck.core.grammar import BUNDLED

    if target is None:
        return BUNDLED
    found = any((Path(target) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))
    return target if found else None
