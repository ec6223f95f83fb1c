"""The speculative loop with a drafted tree per round: draft the tree, score its `N` nodes and the
pending token in one target pass with tree attention, verify (`losscheck.core.tree`), pack the
kept path's keys and values behind the pending token, commit.

After a round that kept `a` nodes, the target's cache holds the pending token and the kept path
at slots `pending .. pending+a`, exactly what a chain round of `a` accepted drafts leaves, so
every other line of the loop (`losscheck.core.engine.Engine`: prefill, ends, budgets, the
log-probabilities, the counters per depth) is the chain loop's.

A tree round's tokens carry no per-token q and no round slot (`Generation.draft_q` and `slots` are
None): the cells read both through models of a chain's verification (`losscheck.stats.bugclass`),
which say nothing true of a tree's, so a tree's sampled cell is sized by, and claims, the classes
that are laws of the target's p alone, as a black-box engine without a draft model's is.
"""

from __future__ import annotations

import torch

from losscheck.core.contract import DraftContext, Drafter, Proposal, Target, validate_proposal
from losscheck.core.engine import Batch, Engine, parked
from losscheck.core.generation import Generation, LoopStats
from losscheck.core.ragged import RaggedLM, TreeBlock
from losscheck.core.sampling import SamplingParams, process_logits
from losscheck.core.tree import TreeOutcome, TreeTopology, TreeVerifier, checked_tree_outcome, verify_tree
from losscheck.core.verify import BlockOutcome
from losscheck.errors import LosscheckError


class TreeEngine(Engine):
    """Speculative decoding of a batch with a drafter of trees (a `Drafter` whose `tree` is the
    `TreeTopology` it drafts, `[B, N]` drafts per round: `losscheck.drafters.tree.TreeDrafter`);
    `verifier` decides each tree (default `verify_tree`, the exact one; a caller may plant another)."""

    def __init__(self, target: Target, drafter: Drafter, verifier: TreeVerifier | None = None) -> None:
        tree = getattr(drafter, "tree", None)
        if not isinstance(tree, TreeTopology):
            raise LosscheckError(
                f"drafter {drafter.name!r} declares no tree (a `tree` attribute, a losscheck.core.tree.TreeTopology); "
                "the tree loop needs one"
            )
        lm = getattr(target, "lm", None)
        if not isinstance(lm, RaggedLM):
            raise LosscheckError(
                f"tree drafting scores a tree in one pass of a ragged LM with tree attention; target "
                f"{target.name!r} has none (use losscheck.HFTarget)"
            )
        super().__init__(target, drafter, k=tree.size)
        self.tree = tree
        self.tree_verifier: TreeVerifier = verifier or verify_tree
        self._block_shape = TreeBlock(
            torch.arange(self.tree.size + 1), torch.tensor((0, *self.tree.depths)), self.tree.ancestry()
        )

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int, params: SamplingParams, generator: torch.Generator
    ) -> Generation:
        if params.reads_history:
            raise LosscheckError(
                f"tree drafting with {params.label()}: a step of its processing reads the request's history "
                "(penalties, logit bias, banned ids, min tokens or a grammar), which differs between the tree's "
                "branches; certify trees with temperature, top-k, top-p and stop ids"
            )
        longest = max(len(p) for p in prompts) if prompts else 0
        if longest + max_new_tokens + self.tree.depth > self.target.max_positions:
            raise LosscheckError(
                f"a prompt of {longest} tokens, max_new_tokens={max_new_tokens} and a tree of depth "
                f"{self.tree.depth} pass the target's {self.target.max_positions} positions; shorten one"
            )
        return super().generate(prompts, max_new_tokens, params, generator)

    def _block(self, batch: Batch) -> int:
        return self.tree.size

    round_slots = False  # no round slots (module docstring)

    def q_buffers(self, rows: int, capacity: int, params: SamplingParams) -> None:
        return None  # no per-token q (module docstring)

    def step(self, batch: Batch, params: SamplingParams, generator: torch.Generator, stats: LoopStats) -> None:
        """One round over the rows of `batch` not done: draft the tree, score, verify, pack, commit."""
        device, n, depth = self.target.device, self.tree.size, self.tree.depth
        at = parked(batch, depth, self.target.max_positions)  # [B] where each row drafts and is scored
        assert self.drafter is not None
        with stats.clock("draft", device):
            ctx = DraftContext(
                batch.tokens, at, None, n, None, params, generator, batch.prompt_lengths, self.target.eos_id
            )
            proposal = self.drafter.propose(ctx)
            proposal = validate_proposal(proposal, self.drafter.name, len(at), n, self.target.vocab_size, device)
        with stats.clock("target", device):
            pending = at - 1  # [B]
            scored = torch.cat([batch.tokens.gather(1, pending[:, None]), proposal.tokens], dim=1)  # [B, N+1]
            lm: RaggedLM = self.target.lm  # type: ignore[attr-defined]  # checked in __init__
            logits, states = self.target.checked(lm.forward(scored, pending, tree=self._block_shape))  # type: ignore[attr-defined]
            outcome = self.tree_verifier(logits, proposal.tokens, proposal.probs, self.tree, params, generator)
            outcome = checked_tree_outcome(outcome, self.tree_verifier, len(at), self.tree)
            self._pack(pending, outcome)
            chain, path_proposal, path_logits, path_states = self._as_chain(outcome, proposal, logits, states)
            reported = None
            if batch.logprob_of is not None:
                reported = self.logprobs(process_logits(path_logits, params), chain.tokens, path_proposal.probs)
        self._commit(batch, chain, path_states, stats, path_proposal, params, reported)

    def _pack(self, pending: torch.Tensor, outcome: TreeOutcome) -> None:
        """The kept path's keys and values moved behind the pending token (slot pending+1+d)."""
        depth = self.tree.depth
        lm: RaggedLM = self.target.lm  # type: ignore[attr-defined]
        assert lm.cache is not None
        dest = pending[:, None] + 1 + torch.arange(depth, device=pending.device)  # [B, D]
        source = torch.where(outcome.path >= 0, pending[:, None] + 1 + outcome.path, dest)  # unkept: stay
        lm.cache.move(source, dest)

    def _as_chain(
        self, outcome: TreeOutcome, proposal: Proposal, logits: torch.Tensor, states: torch.Tensor
    ) -> tuple[BlockOutcome, Proposal, torch.Tensor, torch.Tensor]:
        """The round as the chain of its kept path: (outcome [B, D+1], the path's drafts and q
        [B, D(, V)], the target's logits and states at the root and each kept node [B, D+1, ·])."""
        path = outcome.path.clamp_min(0)  # [B, D]; past `accepted` node 0: junk the commit ignores
        positions = torch.cat([torch.zeros_like(path[:, :1]), path + 1], 1)  # [B, D+1]

        def take(x: torch.Tensor) -> torch.Tensor:  # [B, N+1, ·] -> [B, D+1, ·] along the kept path
            return x.gather(1, positions[..., None].expand(-1, -1, x.shape[-1]))

        tokens = proposal.tokens.gather(1, path)
        probs = (
            None
            if proposal.probs is None
            else proposal.probs.gather(1, path[..., None].expand(-1, -1, proposal.probs.shape[-1]))
        )
        return BlockOutcome(outcome.accepted, outcome.tokens), Proposal(tokens, probs), take(logits), take(states)
