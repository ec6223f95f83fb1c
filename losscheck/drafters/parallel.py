"""Families B–E as `losscheck.core.contract.Drafter`s: one parallel backbone forward per block, then
the family's rule for turning slot logits into drafts.

- B, D (no head): every slot is sampled independently from its own processed marginal
  `q_j = process_logits(base_j)`; greedy takes each slot's argmax.
- C, E (a head): the path is fixed slot by slot. Slot j's candidates are the top-w tokens of its
  base logits (all V when w is None); the head scores them given the chosen predecessor (the
  pending token for slot 0), and the draft is drawn from
  `q_j(· | chosen_{j-1}) = process_logits(head logits restricted to the candidates)`,
  i.e. the truncated distribution renormalised, with temperature / top-k / top-p applied to it.
  That `q_j` is exactly what is reported, so truncation changes acceptance, never the output.

The drafters are stateless: everything they read (pending token, target feature) is in the
`DraftContext`, so `reset` and `commit` have nothing to roll back.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch

from losscheck.core.contract import DraftContext, Proposal, Target
from losscheck.core.precision import torch_dtype
from losscheck.core.sampling import process_logits, sample
from losscheck.drafters.block import BlockModel, SerialHead, TransitionHead
from losscheck.errors import LosscheckError
from losscheck.hashing import content_hash

PATH_WIDTHS: tuple[int | None, ...] = (1, 2, 4, 16, None)


def block_inputs(ctx: DraftContext, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """→ feature [B, H] (the target's hidden state after the last scored token; zeros for a row
    with nothing scored yet, i.e. a one-token prompt) and the pending token [B]."""
    if ctx.hidden is None:
        raise LosscheckError("block drafters read the target's hidden states; the engine passed none")
    rows = torch.arange(ctx.tokens.shape[0], device=ctx.tokens.device)
    pending = ctx.tokens[rows, ctx.lengths - 1]
    scored = ctx.lengths - 2  # last position the target has read and scored
    feature = ctx.hidden[rows, scored.clamp_min(0)] * (scored >= 0)[:, None]
    return feature.to(dtype), pending


def candidates(base: torch.Tensor, width: int | None) -> torch.Tensor | None:
    """Top-`width` token ids of each slot's base logits [B, k, V] → [B, k, w]; None = all."""
    if width is None or width >= base.shape[-1]:
        return None
    return base.topk(width, dim=-1).indices


class SerialPath:
    """Family C: the GRU state follows the chosen tokens; slot j's logits are the base logits
    plus the head's correction, restricted to the slot's candidates."""

    def __init__(self, head: SerialHead, z: torch.Tensor, base: torch.Tensor, cand: torch.Tensor | None) -> None:
        self.head, self.z, self.base = head, z, base  # z [B, k, d], base [B, k, V]
        self.allowed = None if cand is None else torch.zeros_like(base, dtype=torch.bool).scatter(-1, cand, True)
        self.state: torch.Tensor | None = None

    def __call__(self, j: int, prev: torch.Tensor) -> torch.Tensor:
        """prev [B] chosen predecessor of slot j → logits [B, V] (-inf outside the candidates)"""
        self.state, correction = self.head.step(self.state, prev, self.z[:, j])
        logits = self.base[:, j] + correction
        return logits if self.allowed is None else logits.masked_fill(~self.allowed[:, j], -math.inf)


class TransitionPath:
    """Family E: the transition cache holds the scores of every (predecessor candidate, candidate)
    pair of adjacent slots, computed in one parallel pass [B, k, w, w]; fixing the path is then a
    row lookup per slot. At full width the cache would be V x V per slot, so the row of the chosen
    predecessor is computed when it is needed instead (the same numbers)."""

    def __init__(
        self,
        head: TransitionHead,
        z: torch.Tensor,
        base: torch.Tensor,
        pending: torch.Tensor,
        cand: torch.Tensor | None,
    ) -> None:
        self.head, self.z, self.base, self.cand = head, z, base, cand
        self.rows = torch.arange(base.shape[0], device=base.device)
        self.cache = None
        if cand is not None:
            w = cand.shape[-1]
            # slot 0's only predecessor is the pending token (its w rows are copies; row 0 is read)
            pred = torch.cat([pending[:, None, None].expand(-1, 1, w), cand[:, :-1]], 1)  # [B, k, w]
            self.cache = base.gather(-1, cand)[:, :, None, :] + head.pairs(pred, z, cand)  # [B, k, w, w]

    def __call__(self, j: int, prev: torch.Tensor) -> torch.Tensor:
        if self.cache is None or self.cand is None:
            return self.base[:, j] + self.head.pairs(prev[:, None], self.z[:, j], None)[:, 0]
        row = torch.zeros_like(prev) if j == 0 else (self.cand[:, j - 1] == prev[:, None]).long().argmax(-1)
        scores = self.cache[self.rows, j, row]  # [B, w]
        return torch.full_like(self.base[:, j], -math.inf).scatter(-1, self.cand[:, j], scores)


class BlockDrafter:
    """A `Drafter` over a trained `BlockModel` (families B–E)."""

    uses_hidden = True

    def __init__(self, model: BlockModel, name: str) -> None:
        self.model = model.eval()
        self.name = name
        self.identity: dict[str, str] = {}  # where the weights came from and their sha256
        self.dtype = next(model.parameters()).dtype
        self.block_lengths = tuple(range(1, model.cfg.max_slots + 1))
        self.widths: tuple[int | None, ...] = PATH_WIDTHS if model.head is not None else ()

    def reset(self, batch_size: int, capacity: int) -> None:
        pass  # stateless, see the module docstring

    def forget_rows(self, rows: torch.Tensor) -> None:
        pass  # no per-row state

    def commit(self, accepted: torch.Tensor) -> None:
        pass

    @torch.inference_mode()
    def propose(self, ctx: DraftContext) -> Proposal:
        k, params, head = ctx.k, ctx.params, self.model.head
        if k > self.model.cfg.max_slots:
            raise LosscheckError(f"drafter {self.name!r} has {self.model.cfg.max_slots} slots; asked for k={k}")
        feature, pending = block_inputs(ctx, self.dtype)
        z, base = self.model(feature, pending, k)  # [B, k, d], [B, k, V]
        base = base.float()
        if head is None and params.reads_history:  # slot j's processing reads drafts < j
            return _slot_by_slot(ctx, lambda j, prev: base[:, j], pending)
        if head is None:
            q = process_logits(base, params)  # [B, k, V], slots independent
            tokens = q.argmax(-1) if params.greedy else sample(q, ctx.generator)
            return Proposal(tokens, None if params.greedy else q)

        cand = candidates(base, ctx.width)
        path = (
            SerialPath(head, z, base, cand)
            if isinstance(head, SerialHead)
            else TransitionPath(head, z, base, pending, cand)
        )
        return _slot_by_slot(ctx, lambda j, prev: path(j, prev).float(), pending)


def _slot_by_slot(
    ctx: DraftContext, logits_at: Callable[[int, torch.Tensor], torch.Tensor], pending: torch.Tensor
) -> Proposal:
    """Draft slot by slot: `logits_at(j, previous token [B]) -> [B, V]`, processed after the drafts
    before slot j (`DraftContext.process`); `pending [B]` stands before slot 0."""
    prev, drafts, dists = pending, list[torch.Tensor](), list[torch.Tensor]()
    for j in range(ctx.k):
        q = ctx.process(logits_at(j, prev), torch.stack(drafts, 1) if drafts else ctx.tokens[:, :0])  # [B, V]
        prev = q.argmax(-1) if ctx.params.greedy else sample(q, ctx.generator)
        drafts.append(prev)
        dists.append(q)
    tokens = torch.stack(drafts, 1)  # [B, k]
    return Proposal(tokens, None if ctx.params.greedy else torch.stack(dists, 1))


def from_path(path: str | Path, target: Target, precision: str = "fp32") -> BlockDrafter:
    """A family B–E drafter from a directory written by `BlockModel.save`."""
    path = Path(path)
    model = BlockModel.load(path).to(device=target.device, dtype=torch_dtype(precision))
    cfg = model.cfg
    if (cfg.vocab_size, cfg.feature_size) != (target.vocab_size, target.hidden_size):
        raise ValueError(
            f"drafter at {str(path)!r} was built for vocab {cfg.vocab_size} / hidden {cfg.feature_size}, "
            f"the target has {target.vocab_size} / {target.hidden_size}"
        )
    drafter = BlockDrafter(model, name=f"{cfg.family}:{path.name}")
    drafter.identity = {"path": str(path.resolve()), "sha256": content_hash(path)}
    return drafter
