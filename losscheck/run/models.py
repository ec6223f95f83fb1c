"""The run's models, loaded lazily and once per process: every cell of a worker shares one target
per (name, dtype) and one instance of each drafter per (target, precision)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

from losscheck.run.options import Options

if TYPE_CHECKING:
    import torch

    from losscheck.core.contract import Drafter
    from losscheck.core.precision import Precision
    from losscheck.core.target import HFTarget


class Models:
    def __init__(self, options: Options, skeleton: bool = False) -> None:
        self.options = options
        self.skeleton = skeleton  # targets without weights (`HFTarget.skeleton`): planning only
        self._targets: dict[tuple[str, str], HFTarget] = {}  # (target, dtype) -> loaded target
        self._drafter_sets: dict[tuple[str, Precision], dict[str, Drafter]] = {}
        self._drafts = _Drafts()  # a black-box engine's draft model, teacher-forced (`hold_draft`)

    def sharing(self, options: Options) -> Models:
        """A cache for `options` (the same models, other seeds or alpha) holding these models."""
        new = Models(options)
        new._targets, new._drafter_sets = self._targets, self._drafter_sets
        new._drafts = self._drafts
        return new

    @cached_property
    def device(self) -> torch.device:
        from losscheck.core.precision import resolve_device

        return resolve_device(self.options.device)

    def target(self, name: str, dtype: str) -> HFTarget:
        """Target `name` ("main" or "small") in `dtype`."""
        if (name, dtype) not in self._targets:
            self._targets[name, dtype] = self._load_target(name, dtype)
        return self._targets[name, dtype]

    def loaded(self) -> tuple[tuple[str, str], ...]:
        """The (name, dtype) of every target on the run's device now, the engine's draft model
        while it is placed there (`place_drafts`) included."""
        placed = self._drafts.held if self._drafts.placed else []
        return tuple(self._targets) + tuple((d.name, "draft model") for d in placed)

    def hold_draft(self, draft: HFTarget) -> HFTarget:
        """Keep a black-box engine's draft model, loaded on the CPU, under the run's memory plan: on
        the run's device while cells score (`place_drafts`), back on the CPU while an engine
        instance that holds the device is alive (`park_drafts`)."""
        self._drafts.held.append(draft)
        if self._drafts.placed:
            draft.move(self.device)
        return draft

    def place_drafts(self) -> None:
        """The engine's draft models onto the run's device, to be teacher-forced there."""
        for draft in self._drafts.held:
            draft.move(self.device)
        self._drafts.placed = True

    def park_drafts(self) -> None:
        """The engine's draft models back on the CPU, and the device memory they held returned."""
        from losscheck.engines.pool import free_memory

        if not self._drafts.placed:
            return
        for draft in self._drafts.held:
            draft.move("cpu")
        self._drafts.placed = False
        free_memory()

    def release(self, name: str) -> None:
        """Drop every loaded copy of target `name` and give its memory back (it loads again on
        next use); what still holds a reference to it keeps it alive."""
        from losscheck.engines.pool import free_memory

        dropped = [key for key in self._targets if key[0] == name]
        for key in dropped:
            del self._targets[key]
        if dropped:
            free_memory()

    def _load_target(self, name: str, dtype: str) -> HFTarget:
        import torch

        from losscheck import bundled
        from losscheck.core.target import HFTarget

        if os.environ.get("PYTEST_XDIST_WORKER"):
            # xdist already runs one worker per core; more threads per worker only contend.
            torch.set_num_threads(1)
        opts = self.options
        path = bundled.small_target_path() if name == "small" else opts.target or bundled.target_path()
        if self.skeleton:
            return HFTarget.skeleton(path, dtype, opts.trust_remote_code)
        if name == "small":
            return HFTarget.from_pretrained(path, dtype, device=self.device)
        # a rank of `losscheck.serving.split` loads its shard of the main target (HF's own plan)
        dist = torch.distributed
        split = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        return HFTarget.from_pretrained(path, dtype, opts.trust_remote_code, self.device, "auto" if split else None)

    def drafters(self, target: str, precision: Precision) -> dict[str, Drafter]:
        """Drafters certified against `target` in `precision`, by cell name: the user's (or the
        bundled ones), and the self-draft oracle always."""
        from losscheck.plan.cell import ORACLE
        from losscheck.run import drafters as registry

        key = (target, precision)
        if self.skeleton and not (target == "main" and self.options.drafter):
            # planning the bundled set: its declarations, no model built (`registry.declared`)
            return registry.declared(target, self.options.bundled)  # type: ignore[return-value]
        if key not in self._drafter_sets:
            model = self.target(target, precision.target)
            if target == "main" and self.options.drafter:
                found = {"user": registry.from_factory(self.options.drafter, model, precision.drafter)}
            else:
                found = registry.bundled(target, model, precision.drafter, self.options.bundled)
            found[ORACLE] = registry.self_draft(model)
            self._drafter_sets[key] = found
        return self._drafter_sets[key]


@dataclass
class _Drafts:
    """A black-box engine's draft models losscheck holds, and whether they are on the run's device
    now: one state, shared by every `Models.sharing` cache."""

    held: list[HFTarget] = field(default_factory=list)
    placed: bool = False
