"""A target's own multi-token-prediction (MTP) layers as a `losscheck.core.contract.Drafter`.

MTP releases (DeepSeek-V3, GLM, MiMo, Qwen3-Next, Mellum) ship extra prediction layers inside the
target's checkpoint; transformers 5.25 loads them with `transformers.modeling_layers.MtpModel`
and drafts with them in `generate(..., use_mtp=True)` (`MTPCandidateGenerator`). This drafter
runs those layers, loaded by transformers itself, in losscheck's loop.

An MTP layer keeps one *entry* per committed token e ≥ 1: `(x_e, h_{e-1})` at position e, where
h is the target's final state (`hidden_states[-1]`, losscheck's layer id `num_layers`); its
output at the pending token's entry gives draft slot 0 through the target's LM head. Entries
attend causally to the entries before them. Layer i + 1 reads layer i's output as its state
(transformers' chaining), so a checkpoint with n layers drafts n tokens; for k > n the last layer
runs again on its own output, as engines reuse a single MTP layer for longer blocks. A row whose
only token is its first (a lone BOS) has no state before it: its one entry reads a zero state.

State: none. Each round rebuilds the entries from the target's states (what transformers'
`MtpCache` keeps and crops after a rejection is recomputed), so a rejected draft leaves nothing.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from losscheck.core.contract import DraftContext, Proposal, Target
from losscheck.core.precision import torch_dtype
from losscheck.core.sampling import sample
from losscheck.errors import LosscheckError, OptionError

MAX_BLOCK = 4  # the longest block drafted by chaining the checkpoint's layers (the last one reused)


def entry_mask(counts: torch.Tensor, width: int, extra: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [B, 1, width + extra, width + extra] over each row's `counts [B]` entries at
    0..counts-1 and `extra` drafted entries at width..width+extra-1: causal, padding never read."""
    keys = torch.arange(width + extra, device=counts.device)
    valid = (keys[None, :] < counts[:, None]) | (keys[None, :] >= width)  # [B, W + extra]
    allowed = valid[:, None, :] & (keys[None, None, :] <= keys[None, :, None])  # [B, W + extra, W + extra]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=counts.device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[:, None]


class MTPDrafter:
    """A `Drafter` over the MTP layers of a target's checkpoint (see the module docstring)."""

    widths: tuple[int | None, ...] = ()

    def __init__(self, mtp: nn.Module, depth: int, name: str, identity: dict[str, object]) -> None:
        self.mtp, self.name, self.identity = mtp, name, identity
        self.layers = len(mtp.layers)  # type: ignore[arg-type]
        self.block_lengths = tuple(range(1, max(self.layers, MAX_BLOCK) + 1))
        self.uses_hidden: tuple[int, ...] = (depth,)  # the final state, hidden_states[-1]
        self.dtype = next(mtp.parameters()).dtype

    def reset(self, batch_size: int, capacity: int) -> None:
        pass  # no state: each round reads the context afresh

    def forget_rows(self, rows: torch.Tensor) -> None:
        pass

    def commit(self, accepted: torch.Tensor) -> None:
        pass

    def _layer(
        self, j: int, ids: torch.Tensor, state: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """MTP layer min(j, n - 1) over entries `ids [B, m]` with states `state [B, m, H]` → outputs [B, m, H]."""
        mtp: Any = self.mtp
        layer = min(j, self.layers - 1)
        embeds = mtp.embed_tokens(ids).to(self.dtype)
        per_layer = {"layer_type": mtp.config.layer_types[layer]} if mtp.has_per_layer_rope else {}
        rotary = mtp.rotary_emb(embeds, position_ids=positions, **per_layer) if mtp.rotary_emb is not None else None
        out = mtp.layers[layer](
            embeds, state, position_embeddings=rotary, attention_mask=mask, position_ids=positions, cache=None
        )
        return mtp.shared_post_norm(out) if getattr(mtp, "use_shared_post_norm", False) else out

    @torch.inference_mode()
    def block_logits(
        self, tokens: torch.Tensor, lengths: torch.Tensor, hidden: torch.Tensor, drafts: list[torch.Tensor]
    ) -> torch.Tensor:
        """The logits [B, V] of the slot after `drafts` (this round's drafts so far, each [B]), from the
        committed `tokens [B, T]` (`lengths [B]`) and the target's final states `hidden [B, T, H]`."""
        chain = _Chain(self, tokens, lengths, hidden)
        logits = chain.next(None)
        for drafted in drafts:
            logits = chain.next(drafted)
        return logits

    def propose(self, ctx: DraftContext) -> Proposal:
        if ctx.hidden is None:
            raise LosscheckError(f"drafter {self.name!r} reads the target's final states; the engine passed none")
        if ctx.k > self.block_lengths[-1]:
            raise LosscheckError(
                f"drafter {self.name!r} drafts at most {self.block_lengths[-1]} tokens; asked k={ctx.k}"
            )
        drafts: list[torch.Tensor] = []
        dists = []
        chain = _Chain(self, ctx.tokens, ctx.lengths, ctx.hidden)
        for _ in range(ctx.k):
            with torch.inference_mode():
                logits = chain.next(drafts[-1] if drafts else None)
            drafted = torch.stack(drafts, 1) if drafts else ctx.tokens[:, :0]
            q = ctx.process(logits, drafted)  # [B, V]
            drafts.append(q.argmax(-1) if ctx.params.greedy else sample(q, ctx.generator))
            dists.append(q)
        tokens = torch.stack(drafts, 1)
        return Proposal(tokens) if ctx.params.greedy else Proposal(tokens, torch.stack(dists, 1))


class _Chain:
    """One round's entries, drafted slot by slot: slot 0 reads the context's entries, slot j ≥ 1 one
    more entry `(d_j, the previous slot's output)` at position L - 1 + j. Each slot is one pass of
    its layer over every entry (no cache to crop: k passes a round)."""

    def __init__(self, drafter: MTPDrafter, tokens: torch.Tensor, lengths: torch.Tensor, hidden: torch.Tensor) -> None:
        self.drafter, self.lengths = drafter, lengths
        first = (lengths >= 2).long()  # entries e = first .. L-1 (a lone first token: e = 0, zero state)
        self.counts = lengths - first  # [B]
        self.width = int(self.counts.max())
        index = first[:, None] + torch.arange(self.width, device=lengths.device)  # [B, W] entry e
        index = torch.minimum(index, (lengths - 1)[:, None])  # padding repeats the last entry, never read
        self.ids = tokens.gather(1, index)  # [B, W]
        state = hidden.gather(1, (index - 1).clamp_min(0)[..., None].expand(-1, -1, hidden.shape[2]))
        self.state = state.to(drafter.dtype) * (index >= 1)[..., None]  # [B, W, H]
        self.positions = index  # [B, W]
        self.slot = 0
        self.previous: torch.Tensor | None = None  # [B, H] the last slot's output

    def next(self, drafted: torch.Tensor | None) -> torch.Tensor:
        """The logits [B, V] of the next slot; `drafted [B]`: the previous slot's draft (None at slot 0)."""
        j = self.slot
        if j:
            assert drafted is not None and self.previous is not None
            self.ids = torch.cat([self.ids, drafted[:, None]], 1)
            self.state = torch.cat([self.state, self.previous[:, None]], 1)
            self.positions = torch.cat([self.positions, (self.lengths - 1 + j)[:, None]], 1)
        mask = entry_mask(self.counts, self.width, j, self.drafter.dtype)
        out = self.drafter._layer(j, self.ids, self.state, self.positions, mask)  # [B, W + j, H]
        rows = torch.arange(len(self.lengths), device=self.lengths.device)
        self.previous = out[rows, self.counts - 1] if j == 0 else out[:, -1]
        self.slot += 1
        mtp: Any = self.drafter.mtp
        return mtp._project_to_logits(self.previous).float()


def from_target(target: Target, precision: str = "fp32") -> MTPDrafter:
    """`--drafter losscheck.drafters.mtp:from_target`: the MTP layers of the target's own checkpoint
    (config `num_mtp_layers`), loaded by transformers (`MtpModel.from_pretrained`), in `precision`."""
    model = getattr(target, "model", None)
    config = getattr(model, "config", None)
    layers = getattr(config.get_text_config(), "num_mtp_layers", None) if config is not None else None
    if model is None or not layers:
        raise OptionError(
            f"target {target.name!r} has no MTP layers (its config.json sets no num_mtp_layers); "
            "losscheck.drafters.mtp:from_target drafts with a target checkpoint's own MTP layers"
        )
    from transformers.modeling_layers import MtpModel

    try:
        mtp: nn.Module = MtpModel.from_pretrained(model, device_map={"": target.device})
    except (ValueError, RuntimeError) as exc:
        raise OptionError(f"target {target.name!r}: transformers could not load its MTP layers ({exc})") from exc
    dtype = torch_dtype(precision)
    if next(mtp.parameters()).dtype != dtype:
        mtp = copy.deepcopy(mtp).to(dtype)  # the shared embedding and head too, leaving the target's alone
    identity: dict[str, object] = {
        "format": "transformers",
        "algorithm": "mtp",
        "num_mtp_layers": int(layers),
        "of_target": target.identity,
        "precision": precision,
    }
    return MTPDrafter(mtp.eval(), int(getattr(target, "num_layers", 0)), f"mtp:{target.name}", identity)
