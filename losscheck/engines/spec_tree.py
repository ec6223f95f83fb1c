"""losscheck's own loop drafting trees (`losscheck.core.tree_engine`) behind the black-box
interface: the bundled family-A draft model drafting a declared tree per round, verified by
multi-candidate speculative sampling, against the same target decoding plainly.

Select it like any engine: `--losscheck-engine=losscheck.engines.spec_tree:spec_tree` (the bundled tree
family's `branching:2,2,1,1`, i.i.d. siblings), `:spec_tree_chains` (`chains:3x4`), `:spec_tree_top`
(`branching:3,2,1`, top-token siblings). Its certificate has no drafter-side claims: the
teacher-forced draft model of the engine cells models a chain's drafts, not a tree's, so the
adapter gives none (`draft_model` is None) and the cells state power against the target-side
classes only.
"""

from __future__ import annotations

import torch

from losscheck.core.contract import Target
from losscheck.core.limits import ENGINE_BATCH
from losscheck.core.tree import TreeTopology, TreeVerifier
from losscheck.core.tree_engine import TreeEngine
from losscheck.drafters.tree import Siblings, TreeDrafter
from losscheck.engines.spec_loop import SpecLoopEngine


class SpecTreeEngine(SpecLoopEngine):
    """`TreeEngine(target, drafter, verifier)` with speculation on, `Engine(target)` off; its
    block length `k` is the tree's depth (the most drafts a round keeps)."""

    def __init__(
        self,
        target: Target,
        drafter: TreeDrafter,
        batch: int = ENGINE_BATCH,
        verifier: TreeVerifier | None = None,
        name: str = "spec-tree",
    ) -> None:
        super().__init__(target, drafter, drafter.tree.depth, batch, name=name)
        self.spec = TreeEngine(target, drafter, verifier)
        self.name = f"{name}({drafter.tree.label()}, {drafter.siblings})"

    def draft_model(self) -> torch.nn.Module | None:
        """None: the engine cells' draft law is a chain's (module docstring)."""
        return None


def bundled_tree(
    target: Target, spec: str, siblings: Siblings = "iid", verifier: TreeVerifier | None = None
) -> SpecTreeEngine:
    """The bundled drafter A drafting the tree `spec` (`TreeTopology.parse`)."""
    from losscheck import bundled
    from losscheck.drafters.tree import from_path

    drafter = from_path(bundled.fixtures_dir() / "drafter_a", target, TreeTopology.parse(spec), siblings)
    return SpecTreeEngine(target, drafter, verifier=verifier)


def spec_tree(target: Target) -> SpecTreeEngine:
    """The bundled tree family's tree (`branching:2,2,1,1`) with i.i.d. siblings."""
    return bundled_tree(target, "branching:2,2,1,1")


def spec_tree_chains(target: Target) -> SpecTreeEngine:
    """`chains:3x4`: three independent chains of four (multi-draft)."""
    return bundled_tree(target, "chains:3x4")


def spec_tree_top(target: Target) -> SpecTreeEngine:
    """`branching:3,2,1` whose siblings are the drafter's top tokens (point masses)."""
    return bundled_tree(target, "branching:3,2,1", "top")
