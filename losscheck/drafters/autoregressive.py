"""Family A: a small causal LM that drafts k tokens with k serial forwards.

Also the self-draft oracle: the target drafting for itself, whose drafts the target must accept
with probability 1 (greedy exactly; sampling up to float round-off between batch shapes).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from losscheck.core.contract import DraftContext, Proposal, Target
from losscheck.core.ragged import RaggedLM, forward_rows
from losscheck.core.recurrent import cache_for, layer_kinds
from losscheck.core.sampling import sample
from losscheck.core.target import HFTarget, load_causal_lm
from losscheck.hashing import content_hash


class AutoregressiveDrafter:
    """Drafts with its own ragged KV cache; after a rejection it keeps only the cache entries of
    committed tokens and re-reads the rest on the next `propose`."""

    block_lengths: tuple[int, ...] = (1, 2, 4, 8, 16)
    widths: tuple[int | None, ...] = ()
    uses_hidden = False

    def __init__(self, model: torch.nn.Module, name: str) -> None:
        # a hybrid model drafting (the self-draft of a hybrid target) keeps a state per row
        self.lm = RaggedLM(model, cache_for(layer_kinds(model.config)))
        self.name = name
        self.identity: dict[str, str] = {}  # where the weights came from and their sha256
        self.cached = torch.zeros(0, dtype=torch.long)  # [B] committed tokens in the draft cache
        self._proposed_at = torch.zeros(0, dtype=torch.long)  # [B] committed length at propose
        self._k = 0
        self._before_pending: object | None = None  # recurrent state at propose, the pending token unread

    def reset(self, batch_size: int, capacity: int) -> None:
        self.lm.reset(batch_size, capacity)
        self.cached = torch.zeros(batch_size, dtype=torch.long, device=self.lm.device)

    def forget_rows(self, rows: torch.Tensor) -> None:
        """A forgotten row re-reads its tokens from the start at the next `propose`."""
        self.cached = self.cached.clone()  # new tensors: the engine may hold the old ones
        self.cached[rows] = 0

    def admit_rows(self, tokens: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor) -> None:
        """Read the new rows' committed tokens (all but the pending one) now, those rows alone: a
        catch-up at the next `propose` would re-read every row's missing tokens in one [B, read]
        pass."""
        if self.lm.cache is None or not self.lm.cache.keys:  # nothing drafted yet: no cache to keep
            self.forget_rows(rows)
            return
        read = int((lengths[rows] - 1).max())
        if read > 0:
            forward_rows(self.lm, rows, tokens[rows, :read], torch.zeros_like(rows))
            self.lm.keep(lengths[rows] - 1)
        self.cached = self.cached.clone()
        self.cached[rows] = lengths[rows] - 1

    def propose(self, ctx: DraftContext) -> Proposal:
        lengths, k = ctx.lengths, ctx.k
        last = self.catch_up(ctx)  # [B, V]
        drafts: list[torch.Tensor] = []
        dists: list[torch.Tensor] = []
        for j in range(k):
            at_slot = replace(ctx, drafted=torch.stack(drafts, 1)) if drafts else ctx  # the round so far
            token, q = self.draw(last, at_slot)  # [B], [B, V]
            drafts.append(token)
            dists.append(q)
            if j + 1 < k:
                logits, _ = self.lm.forward(token[:, None], lengths - 1 + j + 1)
                last = logits[:, 0]
        self._proposed_at, self._k = lengths.clone(), k
        tokens = torch.stack(drafts, 1)  # [B, k]
        probs = None if ctx.params.greedy else torch.stack(dists, 1)  # [B, k, V]
        return Proposal(tokens, probs)

    def catch_up(self, ctx: DraftContext) -> torch.Tensor:
        """Read the committed tokens the draft cache lacks, the pending one last → the draft's
        logits after it [B, V]."""
        lengths = ctx.lengths
        # Rows cut short by EOS or the budget committed fewer tokens than they accepted; the
        # pending token is never cached, so re-reading it yields its next-token logits.
        self.cached = torch.minimum(self.cached, lengths - 1)
        # Catch up on committed tokens not yet read (always at least the pending one).
        behind = int((lengths - self.cached).max())
        read = (self.cached[:, None] + torch.arange(behind, device=lengths.device)).clamp_max(ctx.tokens.shape[1] - 1)
        logits, _ = self.lm.forward(ctx.tokens.gather(1, read), self.cached)
        assert self.lm.cache is not None
        # a recurrent state cannot be rolled back by slots: remember it before the pending token
        self._before_pending = self.lm.cache.checkpoint(lengths - 1 - self.cached)
        self.lm.keep(lengths - self.cached)  # the committed tokens, not the junk past a row's end
        return logits[torch.arange(len(lengths), device=lengths.device), lengths - 1 - self.cached]  # [B, V]

    def draw(self, logits: torch.Tensor, ctx: DraftContext) -> tuple[torch.Tensor, torch.Tensor]:
        """One slot after `ctx.drafted`: logits [B, V] → (token [B], the q [B, V] it was drawn from)."""
        q = ctx.process(logits)
        return (q.argmax(-1) if ctx.params.greedy else sample(q, ctx.generator)), q

    def commit(self, accepted: torch.Tensor) -> None:
        if self._before_pending is not None:  # recurrent state: back to propose, re-read from the pending token
            assert self.lm.cache is not None
            self.lm.cache.restore(self._before_pending)
            self.cached = self._proposed_at - 1
            return
        # The cache read drafts 1..k-1; of those, the accepted ones are now committed tokens.
        self.cached = self._proposed_at + torch.clamp(accepted, max=self._k - 1)


def from_path(path: str | Path, target: Target, precision: str = "fp32") -> AutoregressiveDrafter:
    """A family-A drafter from a local Hugging Face model directory."""
    model = load_causal_lm(path, precision, device=target.device)
    if model.config.vocab_size != target.vocab_size:
        raise ValueError(
            f"drafter at {str(path)!r} has vocab_size {model.config.vocab_size}, the target "
            f"{target.vocab_size}; a drafter must share the target's vocabulary"
        )
    drafter = AutoregressiveDrafter(model, name=f"A:{Path(path).name}")
    drafter.identity = {"path": str(Path(path).resolve()), "sha256": content_hash(Path(path))}
    return drafter


def self_draft(target: Target) -> AutoregressiveDrafter:
    """The oracle: the target's own model as the drafter (acceptance must be 1)."""
    if not isinstance(target, HFTarget):
        raise TypeError("self_draft needs an HFTarget (it reuses the target's module)")
    drafter = AutoregressiveDrafter(target.model, name="self-draft")
    drafter.identity = {**target.identity, "role": "the target drafting for itself"}
    return drafter
