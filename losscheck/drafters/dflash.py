"""DFlash checkpoints in the transformers format as `losscheck.core.contract.Drafter`s.

A DFlash drafter (block diffusion drafting) reads the target's hidden states at several layers
(`target_layer_ids`) and drafts a whole block in one forward. transformers 5.25 ships its
network as `MuseGlimmerAssistantModel` (`model_type` "muse_glimmer_assistant") and runs it in
assisted generation with `speculation_type="dflash"` (`DFlashTokenCandidateGenerator`); a
checkpoint is that model's `save_pretrained` directory. It has no embedding and no LM head of
its own: both are the target's.

One round, per row with L committed tokens (the last, the anchor x_{L-1}, not yet scored):

- context: the target's states at the checkpoint's layers after reading tokens 0..L-2,
  concatenated [L-1, n·H], projected by the drafter's `encoder` and read as keys and values by
  every layer at positions 0..L-2;
- noise: the anchor and `block_size - 1` mask tokens, embedded by the target's embedding, at
  positions L-1 .. L-1+block_size-1; every noise query reads the whole context and the whole
  noise block (bidirectional);
- output j (j = 1..block_size-1) through the target's LM head is the logits of draft slot j-1.

So the k ≤ block_size - 1 drafts are drawn independently, each from its own q_j processed by
the request (history-reading parameters see the drafts before the slot, as the target's p
does). transformers numbers a target layer id i as `hidden_states[i + 1]`, the state leaving
decoder layer i; losscheck's layer id i is the state entering layer i, so the drafter asks for
ids i + 1.

State: none. Each round rebuilds the context's keys and values from the target's states (what
transformers' `DFlashCache` keeps, and crops after a rejection, is recomputed instead), so a
rejected draft can leave nothing behind.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import nn

from losscheck.core.contract import DraftContext, Proposal, Target
from losscheck.core.precision import torch_dtype
from losscheck.core.sampling import sample
from losscheck.drafters.dflash_config import check_config, fail, read
from losscheck.errors import LosscheckError
from losscheck.hashing import content_hash


def block_mask(context: torch.Tensor, block: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [B, 1, block, C + block]: every noise query reads the row's valid context
    (`context [B]` entries of C) and the whole noise block."""
    width = int(context.max()) if len(context) else 0
    keys = torch.arange(width + block, device=context.device)  # [C + block]
    allowed = (keys[None, :] < context[:, None]) | (keys[None, :] >= width)  # [B, C + block]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=context.device)
    mask = mask.masked_fill(~allowed, torch.finfo(dtype).min)  # [B, C + block]
    return mask[:, None, None, :].expand(-1, 1, block, -1)


def block_positions(context: torch.Tensor, block: int) -> torch.Tensor:
    """Positions [B, C + block]: the context at 0..C-1 (past a row's own, masked), the row's noise
    block right after its context."""
    width = int(context.max()) if len(context) else 0
    keys = torch.arange(width, device=context.device).expand(len(context), -1)  # [B, C]
    noise = context[:, None] + torch.arange(block, device=context.device)  # [B, block]
    return torch.cat([keys, noise], 1)


class DFlashDrafter:
    """A `Drafter` over a transformers DFlash checkpoint (see the module docstring)."""

    widths: tuple[int | None, ...] = ()

    def __init__(
        self, net: nn.Module, embed: nn.Module, head: nn.Module, name: str, identity: dict[str, object]
    ) -> None:
        config: Any = net.config
        self.net, self.embed, self.head = net, embed, head
        self.name = name
        self.block_size = int(config.block_size)
        self.mask_token_id = int(config.mask_token_id)
        self.block_lengths = tuple(range(1, self.block_size))  # the anchor takes one place of the block
        self.uses_hidden: tuple[int, ...] = tuple(int(i) + 1 for i in config.target_layer_ids)
        self.identity = identity
        self.dtype = next(net.parameters()).dtype

    def reset(self, batch_size: int, capacity: int) -> None:
        pass  # no state: each round reads the context afresh

    def forget_rows(self, rows: torch.Tensor) -> None:
        pass

    def commit(self, accepted: torch.Tensor) -> None:
        pass

    @torch.inference_mode()
    def block_logits(self, tokens: torch.Tensor, lengths: torch.Tensor, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """The logits [B, k, V] of draft slots 0..k-1 after each row's committed `tokens [B, T]`
        (`lengths [B]`), from the target's states `hidden [B, T, n·H]` at the drafter's layers."""
        context = lengths - 1  # [B] states of tokens 0..L-2
        width = int(context.max())
        rows = torch.arange(len(lengths), device=lengths.device)
        noise = torch.full((len(lengths), self.block_size), self.mask_token_id, device=lengths.device)
        noise[:, 0] = tokens[rows, lengths - 1]  # the anchor
        out = self.net(
            noise_embeds=self.embed(noise).to(self.dtype),  # [B, block, H]
            context_hidden_states=hidden[:, :width].to(self.dtype),  # [B, C, n·H]
            attention_mask=dict.fromkeys(
                ("full_attention", "sliding_attention"), block_mask(context, self.block_size, self.dtype)
            ),
            position_ids=block_positions(context, self.block_size),
        )
        return self.head(out.last_hidden_state[:, 1 : k + 1]).float()  # [B, k, V]

    @torch.inference_mode()
    def propose(self, ctx: DraftContext) -> Proposal:
        if ctx.hidden is None:
            raise LosscheckError(f"drafter {self.name!r} reads the target's hidden states; the engine passed none")
        if ctx.k > self.block_lengths[-1]:
            raise LosscheckError(
                f"drafter {self.name!r} drafts at most block_size - 1 = {self.block_lengths[-1]} tokens a round; "
                f"asked for k={ctx.k}"
            )
        logits = self.block_logits(ctx.tokens, ctx.lengths, ctx.hidden, ctx.k)  # [B, k, V]
        drafts: list[torch.Tensor] = []
        dists = []
        for j in range(ctx.k):  # k slots; history-reading processing sees the drafts before each
            q = ctx.process(logits[:, j], torch.stack(drafts, 1) if drafts else ctx.tokens[:, :0])  # [B, V]
            drafts.append(q.argmax(-1) if ctx.params.greedy else sample(q, ctx.generator))
            dists.append(q)
        tokens = torch.stack(drafts, 1)  # [B, k]
        return Proposal(tokens) if ctx.params.greedy else Proposal(tokens, torch.stack(dists, 1))


def _target_parts(target: Target, path: Path, dtype: torch.dtype) -> tuple[nn.Module, nn.Module]:
    """The target's input embedding and LM head in `dtype` (copies when the target's dtype differs)."""
    model = getattr(target, "model", None)
    if model is None or not hasattr(model, "get_input_embeddings") or model.get_output_embeddings() is None:
        raise fail(
            path,
            f"DFlash drafts through the target's embedding and LM head, and target {target.name!r} is not a "
            "Hugging Face causal LM (losscheck.HFTarget) that exposes them",
        )
    parts = []
    for module in (model.get_input_embeddings(), model.get_output_embeddings()):
        if next(module.parameters()).dtype != dtype:
            module = copy.deepcopy(module).to(dtype)
        parts.append(module)
    return parts[0], parts[1]


def from_path(path: str | Path, target: Target, precision: str = "fp32") -> DFlashDrafter:
    """A drafter from a local transformers DFlash checkpoint, checked against `target`, in `precision`."""
    from transformers import AutoModel

    path = Path(path).expanduser()
    read(path)  # a clear error for a directory that is not a DFlash checkpoint
    dtype = torch_dtype(precision)
    net = AutoModel.from_pretrained(path, dtype=dtype, local_files_only=True, use_safetensors=True)
    check_config(net.config, path, target.hidden_size, target.vocab_size, int(getattr(target, "num_layers", 0)))
    net = net.to(target.device).eval()
    embed, head = _target_parts(target, path, dtype)
    identity: dict[str, object] = {
        "format": "transformers",
        "algorithm": "dflash",
        "model_type": net.config.model_type,
        "path": str(path.resolve()),
        "sha256": content_hash(path),
        "block_size": int(net.config.block_size),
        "target_layer_ids": [int(i) for i in net.config.target_layer_ids],
        "mask_token_id": int(net.config.mask_token_id),
        "precision": precision,
    }
    return DFlashDrafter(net, embed, head, f"dflash:{path.name}", identity)
