"""Planted tree bugs, each shaped like one that shipped. Three verifiers — the correct tree
verifier (`losscheck.core.tree.verify_tree`) with one thing done wrong, each a `TreeVerifier`:

- `wrong_logits_slice`: every branch read with the logits of its depth's first node (TensorRT-LLM
  #15098: the EAGLE-3 tree verification sliced the wrong logits for a branch);
- `residual_not_updated`: siblings tested against p, the residual never updated after a rejected
  sibling, the last draw from p;
- `siblings_as_chains`: each sibling verified as if it were the first of an independent chain (its
  ratio against p, the residual `max(0, p − q)` of the last rejected one).

And one engine, `KVNotPacked`: the tree loop (`losscheck.core.tree_engine.TreeEngine`) leaving the
kept path's keys and values where the tree's pass wrote them, so that later rounds read a
sibling's (or a stale) entry where a kept token's belongs: the stale-cache-after-a-tree-round shape.
"""

from __future__ import annotations

import functools

import torch

from losscheck.core.sampling import SamplingParams
from losscheck.core.tree import SiblingRule, TreeOutcome, TreeTopology, TreeVerifier, verify_tree
from losscheck.core.tree_engine import TreeEngine
from losscheck.core.verify import residual_distribution


def _with_rule(name: str, rule: SiblingRule) -> TreeVerifier:
    """`verify_tree` deciding siblings by `rule`, named `name`."""
    verifier = functools.partial(verify_tree, rule=rule)
    verifier.__qualname__ = name  # type: ignore[attr-defined]  # a partial takes attributes
    return verifier


# BUG: a rejected sibling leaves r as it was (p): later siblings and the last draw read p
residual_not_updated = _with_rule(
    "residual_not_updated", SiblingRule(tested_against=lambda r, p: p, after_rejection=lambda r, p, q_c: r)
)

# BUG: each sibling tested against p, as a chain's first draft is; the residual of the last one alone
siblings_as_chains = _with_rule(
    "siblings_as_chains",
    SiblingRule(tested_against=lambda r, p: p, after_rejection=lambda r, p, q_c: residual_distribution(p, q_c)),
)


def wrong_logits_slice(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    q: torch.Tensor | None,
    tree: TreeTopology,
    params: SamplingParams,
    generator: torch.Generator,
) -> TreeOutcome:
    """logits [B, N+1, V]: every node's slice replaced by its depth's first node's."""
    first = {d: tree.depths.index(d) for d in set(tree.depths)}
    index = torch.tensor([0] + [first[d] + 1 for d in tree.depths])  # BUG: a branch reads its depth's first node
    return verify_tree(logits[:, index], drafts, q, tree, params, generator)


class KVNotPacked(TreeEngine):
    def _pack(self, pending: torch.Tensor, outcome: TreeOutcome) -> None:
        pass  # BUG: the kept path stays at the slots of its nodes


TREE_BUGS: dict[str, TreeVerifier] = {
    "wrong_logits_slice": wrong_logits_slice,
    "residual_not_updated": residual_not_updated,
    "siblings_as_chains": siblings_as_chains,
}
