"""Verification of a drafted *tree*: several candidates per slot, verified together. Pure tensor
functions, no state.

A tree's topology is declared once (`TreeTopology`): node `i`'s parent is `parents[i]` (−1: the
root, the pending token), parents listed before their children, siblings in the order the
verifier tries them. A row drafts one token per node; node `i` is drawn from `q_i`, its law given
its parent's path, each sibling independently of the others (i.i.d. when siblings share a law,
as SpecInfer's multi-candidate sampling draws them; a point mass each when a drafter proposes
its top tokens deterministically).

Multi-candidate speculative sampling (Miao et al. 2024, SpecInfer §4.2), at the current node
(the root first), with `r` the target's processed distribution `p` there:

- for each child `c` in order: keep it with probability `min(1, r(x_c) / q_c(x_c))`; if it is not
  kept, `r ← norm(max(0, r − q_c))` (the residual updated after each rejected sibling);
- if a child is kept, emit its token and go on from it; if none is, emit a draw from `r` and
  stop; at a leaf (no children) that draw is from `p`: the bonus.

The emitted tokens are distributed exactly as the target's (the theorem holds for independent
candidates, each from its own law). Greedy verification keeps the first child equal to the
target's argmax and otherwise emits the argmax.

Shapes, for `B` rows of a tree of `N` nodes and depth `D`: drafts `[B, N]`, q `[B, N, V]` (None:
each node a point mass), target distributions `p [B, N+1, V]` where `p[:, 0]` follows the root and
`p[:, i+1]` follows node `i`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from losscheck.core.sampling import SamplingParams, process_logits, sample
from losscheck.core.verify import acceptance_probability, residual_distribution
from losscheck.errors import LosscheckError, OptionError

ROOT = -1


@dataclass(frozen=True)
class TreeTopology:
    """A draft tree's shape: `parents[i]` is node i's parent (−1 the root), parents first."""

    parents: tuple[int, ...]
    depths: tuple[int, ...] = field(init=False)  # node i's depth (the root's children: 1)

    def __post_init__(self) -> None:
        if not self.parents:
            raise OptionError("a draft tree needs at least one node (parents is empty)")
        depths: list[int] = []
        for i, parent in enumerate(self.parents):
            if not ROOT <= parent < i:
                raise OptionError(
                    f"draft tree node {i} has parent {parent}; each node's parent is -1 (the root) or an "
                    f"earlier node (0..{i - 1}), parents listed before their children"
                )
            depths.append(1 if parent == ROOT else depths[parent] + 1)
        object.__setattr__(self, "depths", tuple(depths))

    @property
    def size(self) -> int:
        return len(self.parents)

    @property
    def depth(self) -> int:
        return max(self.depths)

    def children(self, node: int) -> tuple[int, ...]:
        """Node `node`'s children (ROOT: the first level), in the order they are tried."""
        return tuple(i for i, parent in enumerate(self.parents) if parent == node)

    def widths(self) -> tuple[int, ...]:
        """Nodes per depth, 1..D."""
        return tuple(self.depths.count(d) for d in range(1, self.depth + 1))

    def path(self, node: int) -> tuple[int, ...]:
        """The nodes from the root's child down to `node`."""
        out = []
        while node != ROOT:
            out.append(node)
            node = self.parents[node]
        return tuple(reversed(out))

    def ancestry(self) -> torch.Tensor:
        """[N+1, N+1] bool: entry (i, j) is whether position j (0 the root, j the node j−1) is
        position i or one of its ancestors: the attention mask of a tree scored in one pass."""
        n = self.size
        mask = torch.eye(n + 1, dtype=torch.bool)
        mask[:, 0] = True
        for i in range(n):
            for node in self.path(i):
                mask[i + 1, node + 1] = True
        return mask

    def fits(self, k: int) -> None:
        """A `OptionError` unless the tree's depth is at most the block length `k`."""
        if self.depth > k:
            raise OptionError(f"draft tree {self.label()} has depth {self.depth}, more than the block length k = {k}")

    def label(self) -> str:
        """The shortest spec that `parse` reads back into this tree."""
        if (
            len(set(self.widths())) == 1
            and self.children(ROOT)
            and self == TreeTopology.chains(self.widths()[0], self.depth)
        ):
            return f"chains:{self.widths()[0]}x{self.depth}"
        if self.branching():
            return "branching:" + ",".join(str(b) for b in self.branching())
        return "parents:" + ",".join(str(p) for p in self.parents)

    def branching(self) -> tuple[int, ...]:
        """Children per node at each depth 0..D−1 if every node of a depth has as many (else ())."""
        out = []
        for d in range(self.depth):
            level = [ROOT] if d == 0 else [i for i, depth in enumerate(self.depths) if depth == d]
            counts = {len(self.children(node)) for node in level}
            if len(counts) != 1:
                return ()
            out.append(counts.pop())
        return tuple(out)

    @classmethod
    def chains(cls, width: int, k: int) -> TreeTopology:
        """`width` independent chains of `k` drafts from the root (multi-draft: SpecTr, SpecInfer)."""
        if width < 1 or k < 1:
            raise OptionError(f"a tree of chains needs width >= 1 and k >= 1; got width {width}, k {k}")
        return cls(tuple(ROOT if d == 0 else c * k + d - 1 for c in range(width) for d in range(k)))

    @classmethod
    def parse(cls, spec: str) -> TreeTopology:
        """`chains:WxK` (W chains of K), `branching:B1,B2,..` (each node at depth d has B_{d+1}
        children: `branching:2,1,1` is 2 chains of 3 sharing nothing but the root) or
        `parents:P0,P1,..`; a `OptionError` naming the forms otherwise."""
        kind, _, body = spec.partition(":")
        try:
            if kind == "chains" and (m := re.fullmatch(r"(\d+)x(\d+)", body)):
                return cls.chains(int(m[1]), int(m[2]))
            if kind == "branching" and body:
                return cls(_branching(tuple(int(b) for b in body.split(","))))
            if kind == "parents" and body:
                return cls(tuple(int(p) for p in body.split(",")))
        except ValueError:
            pass
        raise OptionError(
            f"draft tree {spec!r} is not a topology; write chains:WxK (e.g. chains:2x4), branching:B1,B2,.. "
            f"(children per node at each depth, e.g. branching:3,2,1) or parents:P0,P1,.. (-1 the root)"
        )


def _branching(counts: tuple[int, ...]) -> tuple[int, ...]:
    """Parents of the tree in which every node at depth d has `counts[d]` children, level by level."""
    if not counts or min(counts) < 1:
        raise ValueError("branching counts must be positive")
    parents: list[int] = []
    level = [ROOT]
    for count in counts:
        nxt = []
        for node in level:
            for _ in range(count):
                parents.append(node)
                nxt.append(len(parents) - 1)
        level = nxt
    return tuple(parents)


@dataclass(frozen=True)
class TreeOutcome:
    """What verification decided for one drafted tree, per row."""

    accepted: torch.Tensor  # [B] long, depth of the kept path (0..D)
    path: torch.Tensor  # [B, D] long, the kept node at each depth; −1 past `accepted`
    tokens: torch.Tensor  # [B, D+1] long; tokens[b, :accepted[b]+1] are emitted, the rest is junk


# A tree verifier: (raw target logits [B, N+1, V], drafts [B, N], q [B, N, V] or None, topology,
# the request's sampling parameters, generator) -> TreeOutcome.
TreeVerifier = Callable[
    [torch.Tensor, torch.Tensor, "torch.Tensor | None", TreeTopology, SamplingParams, torch.Generator], TreeOutcome
]


def _walk(
    tree: TreeTopology,
    batch: int,
    decide: Callable[[int, torch.Tensor], torch.Tensor],
    device: torch.device,
    moved: Callable[[torch.Tensor, torch.Tensor], None] = lambda kept, current: None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Walk every row down the tree: at each depth, `decide(child, rows [B] bool)` → [B] bool, the
    rows among `rows` (those at the child's parent, none kept yet at this depth) that keep `child`;
    then `moved(kept [B] bool, current [B])` with each row's node after the depth.
    → (current node [B], path [B, D]); a row stops where no child is kept."""
    current = torch.full((batch,), ROOT, dtype=torch.long, device=device)
    path = torch.full((batch, tree.depth), ROOT, dtype=torch.long, device=device)
    going = torch.ones(batch, dtype=torch.bool, device=device)
    for d in range(1, tree.depth + 1):
        kept = torch.zeros(batch, dtype=torch.bool, device=device)
        nxt = current.clone()
        for child in (i for i, depth in enumerate(tree.depths) if depth == d):
            here = going & ~kept & (current == tree.parents[child])
            keep = decide(child, here) & here
            nxt = torch.where(keep, child, nxt)
            kept |= keep
        path[:, d - 1] = torch.where(kept, nxt, ROOT)
        moved(kept, nxt)
        current, going = nxt, kept
    return current, path


def _emitted_drafts(drafts: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
    """tokens [B, D+1] whose first `accepted` entries are the kept path's drafts (the last slot 0)."""
    kept = drafts.gather(1, path.clamp_min(0))  # [B, D]
    return torch.cat([torch.where(path >= 0, kept, 0), kept.new_zeros(len(kept), 1)], dim=1)


def verify_tree_greedy(p: torch.Tensor, drafts: torch.Tensor, tree: TreeTopology) -> TreeOutcome:
    """Greedy tree verification: at each node keep the first child equal to the target's argmax.
    p [B, N+1, V] target scores, drafts [B, N]."""
    best = p.argmax(-1)  # [B, N+1]
    rows = torch.arange(len(drafts), device=drafts.device)

    def decide(child: int, here: torch.Tensor) -> torch.Tensor:
        parent = tree.parents[child] + 1
        return drafts[:, child] == best[:, parent]

    current, path = _walk(tree, len(drafts), decide, drafts.device)
    accepted = (path >= 0).sum(-1)
    tokens = _emitted_drafts(drafts, path)
    tokens[rows, accepted] = best[rows, current + 1]
    return TreeOutcome(accepted=accepted, path=path, tokens=tokens)


@dataclass(frozen=True)
class SiblingRule:
    """The two lines multi-candidate sampling turns on, as functions of `r` (the residual so far),
    `p` (the target's law at the node) and `q_c` (the rejected sibling's law), each [B, V] float64:
    the law a sibling's ratio reads, and the residual a rejection leaves. `SPECINFER` is the exact
    rule; the planted tree bugs (`losscheck.selftest.tree_bugs`) change one of them."""

    tested_against: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (r, p) -> law in the ratio
    after_rejection: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (r, p, q_c) -> r


SPECINFER = SiblingRule(tested_against=lambda r, p: r, after_rejection=lambda r, p, q_c: residual_distribution(r, q_c))


def verify_tree_rejection(
    p: torch.Tensor,
    drafts: torch.Tensor,
    q: torch.Tensor | None,
    tree: TreeTopology,
    generator: torch.Generator,
    rule: SiblingRule = SPECINFER,
) -> TreeOutcome:
    """Multi-candidate rejection sampling over the tree (module docstring). p [B, N+1, V] processed
    target distributions, drafts [B, N], q [B, N, V] or None (point masses). The generator gives
    `B·N` acceptance uniforms and then `B` draws, whatever is kept, so the stream does not depend on
    the outcome."""
    batch, n = drafts.shape
    rows = torch.arange(batch, device=drafts.device)
    u = torch.rand(batch, n, generator=generator, dtype=torch.float64, device=p.device)
    here = p[:, 0].double()  # [B, V] the target's law at each row's current node
    residual = here  # [B, V] r there

    def law(child: int) -> torch.Tensor:
        """[B, V] float64: the law node `child` was drawn from (renormalised, as verify_rejection)."""
        if q is None:
            return torch.zeros_like(residual).scatter_(-1, drafts[:, child, None], 1.0)
        q_c = q[:, child].double()
        return q_c / q_c.sum(-1, keepdim=True)

    def decide(child: int, at: torch.Tensor) -> torch.Tensor:
        nonlocal residual
        q_c = law(child)
        x = drafts[:, child, None]
        tested = rule.tested_against(residual, here).gather(-1, x)[:, 0]
        keep = u[:, child] < acceptance_probability(tested, q_c.gather(-1, x)[:, 0].clamp_min(1e-300))
        rejected = at & ~keep  # rows at other nodes keep their residual
        residual = torch.where(rejected[:, None], rule.after_rejection(residual, here, q_c), residual)
        return keep

    def moved(kept: torch.Tensor, current: torch.Tensor) -> None:
        nonlocal residual, here  # a row that kept a child starts again from p at it
        here = torch.where(kept[:, None], p[rows, current + 1].double(), here)
        residual = torch.where(kept[:, None], here, residual)

    _, path = _walk(tree, batch, decide, drafts.device, moved)
    accepted = (path >= 0).sum(-1)
    tokens = _emitted_drafts(drafts, path)
    tokens[rows, accepted] = sample(residual, generator)
    return TreeOutcome(accepted=accepted, path=path, tokens=tokens)


def verify_tree(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    q: torch.Tensor | None,
    tree: TreeTopology,
    params: SamplingParams,
    generator: torch.Generator,
    rule: SiblingRule = SPECINFER,
) -> TreeOutcome:
    """The correct `TreeVerifier`: greedy at temperature 0, otherwise multi-candidate rejection
    sampling against the target's logits processed exactly as the drafter's q was (`rule`: the
    exact one unless a planted bug says otherwise)."""
    if params.greedy:
        return verify_tree_greedy(logits, drafts, tree)
    return verify_tree_rejection(process_logits(logits, params), drafts, q, tree, generator, rule)


def checked_tree_outcome(outcome: object, verifier: object, batch: int, tree: TreeTopology) -> TreeOutcome:
    """`outcome` if it is a well-formed `TreeOutcome` for `batch` rows of `tree`, else a
    `LosscheckError` naming the verifier and what it returned."""
    name = getattr(verifier, "__qualname__", None) or type(verifier).__qualname__
    if not isinstance(outcome, TreeOutcome):
        raise LosscheckError(f"tree verifier {name} returned {type(outcome).__name__}, not a losscheck TreeOutcome")
    d = tree.depth
    shapes = (tuple(outcome.accepted.shape), tuple(outcome.path.shape), tuple(outcome.tokens.shape))
    if shapes != ((batch,), (batch, d), (batch, d + 1)):
        raise LosscheckError(
            f"tree verifier {name} returned accepted {shapes[0]}, path {shapes[1]} and tokens {shapes[2]}; "
            f"expected ({batch},), ({batch}, {d}) and ({batch}, {d + 1}) for {batch} rows of a depth-{d} tree"
        )
    return outcome
