"""An own drafter, certified by losscheck: prompt lookup (n-gram) drafting.

It drafts by looking the last `n` committed tokens up earlier in the same row and proposing the
tokens that followed them there; with no match it repeats the last token. It chooses
deterministically, so its proposal is a point mass (`probs=None`) — the verifier must then use
the point mass, not a softmax. It needs no model of its own and keeps no state between rounds, so
rolling back after a rejection is nothing to do.

    losscheck certify --drafter examples.prompt_lookup_drafter:factory --scope=-slow

(from the repository root; `tests/e2e/test_examples.py` certifies it over the scope in examples/README.md).
"""

from __future__ import annotations

import torch

from losscheck import DraftContext, Proposal, Target


class PromptLookupDrafter:
    name = "prompt-lookup"
    block_lengths = (1, 2, 4, 8)
    widths = ()
    uses_hidden = False

    def __init__(self, n: int = 2) -> None:
        self.n = n  # tokens matched

    def reset(self, batch_size: int, capacity: int) -> None:
        pass  # no state

    def propose(self, ctx: DraftContext) -> Proposal:
        rows = [self._lookup(ctx.tokens[b, : int(ctx.lengths[b])], ctx.k) for b in range(ctx.tokens.shape[0])]
        return Proposal(torch.stack(rows))  # [B, k], a point mass

    def _lookup(self, row: torch.Tensor, k: int) -> torch.Tensor:
        """The k tokens after the latest earlier occurrence of the row's last n tokens."""
        n = min(self.n, len(row) - 1)
        if n >= 1:
            windows = row.unfold(0, n, 1)[:-1]  # [len - n, n]: every earlier n-gram
            hits = (windows == row[-n:]).all(-1).nonzero()
            if len(hits):
                start = int(hits[-1]) + n
                follow = row[start : start + k]
                if len(follow) == k:
                    return follow
                return torch.cat([follow, follow.new_full((k - len(follow),), int(row[-1]))])
        return row.new_full((k,), int(row[-1]))

    def commit(self, accepted: torch.Tensor) -> None:
        pass  # nothing built on the drafts


def factory(target: Target) -> PromptLookupDrafter:
    return PromptLookupDrafter()
