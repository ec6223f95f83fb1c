"""A tree drafter: a small causal LM (family A's) drafting a declared tree of candidates per round,
one draft pass per depth with tree attention (`losscheck.core.ragged.TreeBlock`).

Siblings are drawn independently from their parent's processed law (`iid`: SpecInfer's
multi-candidate sampling), or are that law's top tokens (`top`: EAGLE's static trees; under
sampling each is reported as a point mass, which multi-candidate verification takes exactly, and
greedy requests always draft the top tokens). The drafter reports every node's law as the
`Proposal`'s q, `[B, N, V]`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch

from losscheck.core.contract import DraftContext, Proposal, Target
from losscheck.core.ragged import TreeBlock
from losscheck.core.sampling import sample
from losscheck.core.target import load_causal_lm
from losscheck.core.tree import ROOT, TreeTopology
from losscheck.drafters.autoregressive import AutoregressiveDrafter
from losscheck.errors import OptionError
from losscheck.hashing import content_hash

Siblings = Literal["iid", "top"]

# The bundled tree family ("tree", `losscheck.run.drafters`): on the main target, W children at the
# root, two below each, then a chain to depth 4 (`branching:W,2,1,1`, W = 2 unless a cell's tree
# width says otherwise); on the small-vocabulary target of the exact cells, three siblings at depth 1.
BUNDLED_WIDTH = 2
BUNDLED_WIDTHS = (1, 3)  # the tree widths the family declares beside the default


def bundled_topology(width: int = BUNDLED_WIDTH) -> TreeTopology:
    return TreeTopology.parse(f"branching:{width},2,1,1")


SMALL_TOPOLOGY = "branching:3"


class TreeDrafter(AutoregressiveDrafter):
    """Drafts `tree` (its `k` is the tree's node count); its cache keeps the committed tokens and
    re-reads a round's kept path at the next `propose`."""

    widths: tuple[int | None, ...] = ()

    def __init__(self, model: torch.nn.Module, name: str, tree: TreeTopology, siblings: Siblings = "iid") -> None:
        super().__init__(model, name=f"{name}-tree[{tree.label()}]-{siblings}")
        self.base_name = name
        if siblings not in ("iid", "top"):
            raise OptionError(
                f"tree siblings {siblings!r}: draw them 'iid' from the parent's law or take its 'top' tokens"
            )
        self.tree, self.siblings = tree, siblings
        self.block_lengths = (tree.depth,)  # a cell's k is the tree's depth: the most drafts a round keeps
        ancestry = tree.ancestry()  # [N+1, N+1]
        self._levels = []  # per depth 1..D−1: (its nodes, their TreeBlock in the draft's pass)
        for d in range(1, tree.depth):
            nodes = torch.tensor([i for i, depth in enumerate(tree.depths) if depth == d])
            self._levels.append((nodes, TreeBlock(nodes + 1, torch.full_like(nodes, d), ancestry[nodes + 1])))
        self._rank = [tree.children(parent).index(i) for i, parent in enumerate(tree.parents)]

    def at_width(self, width: int) -> TreeDrafter:
        """This drafter (the same model) drafting the bundled tree of `width` (`bundled_topology`); an
        `OptionError` for a width it does not declare (its own tree is not the bundled family's)."""
        if width not in self.widths:
            raise OptionError(
                f"tree drafter {self.name!r} declares tree widths {list(self.widths)}, not {width}; its tree "
                f"{self.tree.label()} has no width axis of losscheck's"
            )
        drafter = TreeDrafter(self.lm.model, self.base_name, bundled_topology(width), self.siblings)
        drafter.identity = {**self.identity, "tree": drafter.tree.label()}
        drafter.widths = self.widths
        return drafter

    def propose(self, ctx: DraftContext) -> Proposal:
        tree, lengths = self.tree, ctx.lengths
        rows, n = len(lengths), tree.size
        after = {ROOT: self.catch_up(ctx)}  # node -> the draft's logits after it [B, V]
        tokens = torch.zeros(rows, n, dtype=torch.long, device=lengths.device)
        laws: torch.Tensor | None = None  # [B, N, V] each node's law
        top = self.siblings == "top" or ctx.params.greedy
        for d in range(1, tree.depth + 1):
            for i in (i for i, depth in enumerate(tree.depths) if depth == d):
                q = ctx.process(after[tree.parents[i]])  # [B, V]
                if top:
                    tokens[:, i] = q.topk(self._rank[i] + 1, dim=-1).indices[:, -1]
                    q = torch.zeros_like(q).scatter_(-1, tokens[:, i, None], 1.0)  # drafted with certainty
                else:
                    tokens[:, i] = sample(q, ctx.generator)
                laws = q.new_zeros(rows, n, q.shape[-1]) if laws is None else laws
                laws[:, i] = q
            if d < tree.depth:
                nodes, block = self._levels[d - 1]
                logits, _ = self.lm.forward(tokens[:, nodes], lengths - 1, tree=block)  # [B, w_d, V]
                after.update({int(node): logits[:, j] for j, node in enumerate(nodes)})
        self._proposed_at, self._k = lengths.clone(), n
        return Proposal(tokens, None if ctx.params.greedy else laws)

    def commit(self, accepted: torch.Tensor) -> None:
        # the cache read the committed tokens through the pending one; the kept path is re-read
        self.cached = self._proposed_at


def from_path(
    path: str | Path,
    target: Target,
    tree: TreeTopology | None = None,
    siblings: Siblings = "iid",
    precision: str = "fp32",
) -> TreeDrafter:
    """A tree drafter from a local Hugging Face causal LM directory sharing the target's vocabulary
    (`tree` None: the bundled family's, `bundled_topology()`)."""
    tree = tree or bundled_topology()
    model = load_causal_lm(path, precision, device=target.device)
    if model.config.vocab_size != target.vocab_size:
        raise OptionError(
            f"tree drafter at {str(path)!r} has vocab_size {model.config.vocab_size}, the target "
            f"{target.vocab_size}; a drafter must share the target's vocabulary"
        )
    drafter = TreeDrafter(model, f"A:{Path(path).name}", tree, siblings)
    drafter.identity = {"path": str(Path(path).resolve()), "sha256": content_hash(Path(path)), "tree": tree.label()}
    return drafter


def bundled(path: Path, target: Target, precision: str = "fp32") -> TreeDrafter:
    """The bundled tree family on the main target (`bundled_topology()`, its other widths declared):
    a loader of `losscheck.run.drafters`."""
    drafter = from_path(path, target, precision=precision)
    drafter.widths = BUNDLED_WIDTHS
    return drafter


def bundled_small(path: Path, target: Target, precision: str = "fp32") -> TreeDrafter:
    """The bundled tree family on the small-vocabulary target (`SMALL_TOPOLOGY`)."""
    return from_path(path, target, TreeTopology.parse(SMALL_TOPOLOGY), precision=precision)


def bundled_a(target: Target) -> TreeDrafter:
    """`--drafter losscheck.drafters.tree:bundled_a`: the bundled drafter A's weights drafting the
    bundled family's tree, certified as a user's drafter would be (docs/trees.md)."""
    from losscheck import bundled as fixtures

    return from_path(fixtures.fixtures_dir() / "drafter_a", target)
