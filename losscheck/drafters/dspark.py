"""Speculators-format DFlash and DSpark checkpoints as `losscheck.core.contract.Drafter`s.

`--losscheck-drafter=speculators:DIR` with `speculators_model_type` "dflash" or "dspark" (the
config in `losscheck.drafters.speculators_config`, `BlockDrafting`). The network is the library's
DFlash backbone with its published parameter names; drafting is what vLLM's speculators-format
path runs.

Backbone, one forward per round, per row with L committed tokens (the last, the anchor x_{L-1},
not yet scored by the target):

- context: the target's states at `aux_hidden_state_layer_ids` (the state entering each decoder
  layer, as for EAGLE-3) of tokens 0..L-2, concatenated [L-1, n·H_t], through `fc` and
  `hidden_norm`; every layer reads them as keys and values (its own `k_proj`, `v_proj`, `k_norm`)
  at positions 0..L-2;
- the block: the anchor and mask tokens, embedded by `embed_tokens`, at positions L-1, L, ..;
  each reads the whole context and the whole block (bidirectional); Qwen3-shaped layers (`q_norm`,
  `k_norm`), then `norm` and `lm_head` over the draft vocabulary give the base logits.
- DFlash's layout (`sample_from_anchor` false): k mask tokens after the anchor, output j (1..k) is
  draft j-1. DSpark's (true): k-1 mask tokens, output j (0..k-1) is draft j. The block is as long
  as the round needs (vLLM's `1 + N` and `N` query tokens), not `block_size`.

DSpark's Markov head then draws the k slots left to right: slot j's logits are the base logits
plus `markov_w2(z_j)`, where z_j is read from the token before the slot (the anchor for slot 0,
else draft j-1) by `markov_w1`: as is (`vanilla`), gated by the slot's backbone state (`gated`), or
through a recurrent state over the block (`rnn`). At a truncation width w (vLLM's
`dspark_draft_topk`) only the backbone's top-w draft ids of each slot stay, the bias added to
them alone; the rest are -inf. Each slot's q is that, processed by the request, so q_j depends on
the drafts before it. DFlash (no head) draws its slots independently.

The confidence head (a per-slot acceptance estimate) is loaded and checked, and does not change
what is drafted or verified: losscheck verifies all k drafts, as vLLM does without adaptive
verification.

State: none. Each round rebuilds the context from the target's states, so a rejected draft
leaves nothing behind.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
from torch import nn
from torch.nn import functional as F

from losscheck.core.contract import DraftContext, Proposal, Target
from losscheck.core.precision import torch_dtype
from losscheck.drafters.dflash import block_mask, block_positions
from losscheck.drafters.speculators_config import BlockDrafting, CheckpointConfig, block_lengths, block_widths
from losscheck.drafters.speculators_parts import draw, identity, is_full_vocab, load_weights, vocab_map
from losscheck.errors import LosscheckError

if TYPE_CHECKING:
    from transformers.models.qwen3.configuration_qwen3 import Qwen3Config


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x [B, h, n, d] with cos, sin [B, n, d]."""
    from transformers.models.qwen3.modeling_qwen3 import rotate_half

    return x * cos[:, None] + rotate_half(x) * sin[:, None]


class BlockAttention(nn.Module):
    """Attention of the block over [context ; block]: keys and values of both through the same
    projections and `k_norm`, queries of the block only."""

    def __init__(self, lc: Qwen3Config) -> None:
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

        super().__init__()
        # Qwen3Config fills the head counts (key-value heads default to the heads)
        self.heads, self.kv_heads = int(lc.num_attention_heads), int(lc.num_key_value_heads or lc.num_attention_heads)
        self.head_dim = int(lc.head_dim or lc.hidden_size // self.heads)
        width, bias = lc.hidden_size, bool(lc.attention_bias)
        self.q_proj = nn.Linear(width, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, width, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=lc.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=lc.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, context: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        # x [B, m, H] the block, context [B, C, H], cos/sin [B, C+m, d], mask [B, 1, m, C+m] additive
        b, m, _ = x.shape
        both = torch.cat([context, x], 1)  # [B, C+m, H]
        q = self.q_norm(self.q_proj(x).view(b, m, self.heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(both).view(b, -1, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(both).view(b, -1, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos[:, -m:], sin[:, -m:]), _rotate(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)  # [B, h, m, d]
        return self.o_proj(out.transpose(1, 2).reshape(b, m, -1))


class BlockLayer(nn.Module):
    """A Qwen3 decoder layer whose attention also reads the context (`BlockAttention`)."""

    def __init__(self, lc: Qwen3Config) -> None:
        from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm

        super().__init__()
        self.input_layernorm = Qwen3RMSNorm(lc.hidden_size, eps=lc.rms_norm_eps)
        self.self_attn = BlockAttention(lc)
        self.post_attention_layernorm = Qwen3RMSNorm(lc.hidden_size, eps=lc.rms_norm_eps)
        self.mlp = Qwen3MLP(lc)

    def forward(
        self, x: torch.Tensor, context: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), context, cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class MarkovHead(nn.Module):
    """DSpark's low-rank bias `markov_w2(z)` from the previous token's `markov_w1` row (see the
    module docstring for z by head type)."""

    def __init__(self, target_vocab: int, draft_vocab: int, rank: int, hidden: int, kind: str) -> None:
        super().__init__()
        self.kind, self.rank = kind, rank
        self.markov_w1 = nn.Embedding(target_vocab, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden + rank, rank)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden, 3 * rank)

    def step(
        self, prev: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """prev [B] target ids, hidden [B, H] the slot's backbone state, state [B, r] (rnn) →
        (z [B, r], the next state)."""
        e = self.markov_w1(prev)  # [B, r]
        if self.kind == "vanilla":
            return e, state
        if self.kind == "gated":
            return torch.sigmoid(self.gate_proj(torch.cat([hidden, e], -1))) * e, state
        state = e.new_zeros(len(e), self.rank) if state is None else state
        gate, candidate, out = self.joint_proj(torch.cat([state, e, hidden], -1)).chunk(3, -1)
        gate = torch.sigmoid(gate)
        return torch.tanh(out), gate * state + (1.0 - gate) * torch.tanh(candidate)


class ConfidenceHead(nn.Module):
    """DSpark's per-slot acceptance estimate (a linear map to one logit); loaded, not used."""

    def __init__(self, inputs: int) -> None:
        super().__init__()
        self.proj = nn.Linear(inputs, 1)


class BlockNetwork(nn.Module):
    """The speculators DFlash backbone, with DSpark's heads when the checkpoint has them."""

    d2t: torch.Tensor  # [V_d] buffer: draft id i is target id i + d2t[i]
    t2d: torch.Tensor  # [V] bool buffer: the target ids the draft vocabulary covers

    def __init__(self, cfg: CheckpointConfig) -> None:
        from transformers.models.qwen3.configuration_qwen3 import Qwen3Config
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding

        super().__init__()
        block = cast(BlockDrafting, cfg.block)
        skip = ("model_type", "architectures", "transformers_version")
        lc = Qwen3Config(**{k: v for k, v in cfg.layer_config.items() if k not in skip})
        width, eps = cfg.hidden_size, lc.rms_norm_eps
        self.embed_tokens = nn.Embedding(cfg.target_vocab_size, width)
        self.fc = nn.Linear(len(cfg.aux_layers) * cfg.target_hidden_size, width, bias=False)
        self.hidden_norm = Qwen3RMSNorm(width, eps=eps)
        self.layers = nn.ModuleList(BlockLayer(lc) for _ in range(lc.num_hidden_layers))
        self.norm = Qwen3RMSNorm(width, eps=eps)
        self.lm_head = nn.Linear(width, cfg.draft_vocab_size, bias=False)
        self.rotary_emb = Qwen3RotaryEmbedding(lc)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(cfg.target_vocab_size, dtype=torch.bool))
        self.markov_head = (
            MarkovHead(cfg.target_vocab_size, cfg.draft_vocab_size, block.markov_rank, width, block.markov_head_type)
            if block.markov_rank
            else None
        )
        if block.confidence_head:
            self.confidence_head = ConfidenceHead(width + (block.markov_rank if block.confidence_with_markov else 0))

    def forward(self, block: torch.Tensor, features: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """block [B, m] token ids (the anchor, then masks), features [B, C, n·H_t] the target's
        states (row b's first `context[b]` valid) → the block's normed states [B, m, H]."""
        m = block.shape[1]
        ctx = self.hidden_norm(self.fc(features))  # [B, C, H]
        x = self.embed_tokens(block)  # [B, m, H]
        cos, sin = self.rotary_emb(x, block_positions(context, m))  # [B, C+m, d]
        mask = block_mask(context, m, x.dtype)  # [B, 1, m, C+m]
        for layer in self.layers:
            x = layer(x, ctx, cos, sin, mask)
        return self.norm(x)


def truncate(base: torch.Tensor, width: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """base logits [B, k, V_d] → (base with all but each slot's top `width` at -inf, the kept ids
    [B, k, width]); the logits as they are (None) at full width."""
    if width is None or width >= base.shape[-1]:
        return base, None
    kept = base.topk(width, -1).indices  # [B, k, w]
    return torch.full_like(base, float("-inf")).scatter(-1, kept, base.gather(-1, kept)), kept


class BlockSpeculatorsDrafter:
    """A `Drafter` over a speculators DFlash or DSpark checkpoint (see the module docstring)."""

    def __init__(self, net: BlockNetwork, cfg: CheckpointConfig, identity: dict[str, object]) -> None:
        self.net, self.cfg = net, cfg
        self.block = cast(BlockDrafting, cfg.block)
        self.name = f"speculators:{cfg.model_type}:{cfg.path.name}"
        self.block_lengths = block_lengths(cfg)
        self.uses_hidden: tuple[int, ...] = cfg.aux_layers
        self.widths = block_widths(cfg)
        self.identity = identity
        self.dtype = next(net.parameters()).dtype
        self.map = vocab_map(net.d2t)  # [V_d]
        self.target_vocab = None if is_full_vocab(cfg, self.map) else cfg.target_vocab_size
        self.mask_token_id = int(cast(int, cfg.mask_token_id))

    def reset(self, batch_size: int, capacity: int) -> None:
        pass  # no state: each round reads the context afresh

    def forget_rows(self, rows: torch.Tensor) -> None:
        pass

    def commit(self, accepted: torch.Tensor) -> None:
        pass

    @torch.inference_mode()
    def backbone(self, tokens: torch.Tensor, lengths: torch.Tensor, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """The block's states [B, k, H] of draft slots 0..k-1 after each row's committed `tokens
        [B, T]` (`lengths [B]`), from the target's states `hidden [B, T, n·H_t]`."""
        context = lengths - 1  # [B] states of tokens 0..L-2
        width = int(context.max())
        m = k if self.block.sample_from_anchor else k + 1
        rows = torch.arange(len(lengths), device=lengths.device)
        block = torch.full((len(lengths), m), self.mask_token_id, device=lengths.device)
        block[:, 0] = tokens[rows, lengths - 1]  # the anchor
        out = self.net(block, hidden[:, :width].to(self.dtype), context)  # [B, m, H]
        return out if self.block.sample_from_anchor else out[:, 1:]

    @torch.inference_mode()
    def propose(self, ctx: DraftContext) -> Proposal:
        if ctx.hidden is None:
            raise LosscheckError(f"drafter {self.name!r} reads the target's hidden states; the engine passed none")
        if ctx.k > self.block_lengths[-1]:
            raise LosscheckError(f"drafter {self.name!r} drafts at most {self.block_lengths[-1]}; asked for k={ctx.k}")
        states = self.backbone(ctx.tokens, ctx.lengths, ctx.hidden, ctx.k)  # [B, k, H]
        base, kept = truncate(self.net.lm_head(states).float(), ctx.width if self.widths else None)  # [B, k, V_d]
        head = self.net.markov_head
        prev = ctx.tokens[torch.arange(len(ctx.lengths), device=ctx.lengths.device), ctx.lengths - 1]  # [B] anchor
        state: torch.Tensor | None = None
        drafts: list[torch.Tensor] = []
        dists = []
        for j in range(ctx.k):  # left to right: the Markov bias and history steps read the drafts before
            logits = base[:, j]  # [B, V_d]
            if head is not None:
                z, state = head.step(prev, states[:, j], state)  # [B, r]
                if kept is None:
                    logits = logits + head.markov_w2(z).float()
                else:
                    bias = (head.markov_w2.weight[kept[:, j]] @ z[..., None])[..., 0]  # [B, w]
                    logits = logits.scatter_add(-1, kept[:, j], bias.float())
            drafted = torch.stack(drafts, 1) if drafts else ctx.tokens[:, :0]
            prev, q = self.draw(logits, base[:, j], ctx, drafted)
            drafts.append(prev)
            dists.append(q)
        tokens = torch.stack(drafts, 1)  # [B, k] target ids
        if ctx.params.greedy:
            return Proposal(tokens)
        return Proposal(tokens, torch.stack(dists, 1), None if self.target_vocab is None else self.map)

    def draw(
        self, logits: torch.Tensor, base: torch.Tensor, ctx: DraftContext, drafted: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A slot's draft (target id [B]) and q [B, V_d] from its `logits [B, V_d]` (the backbone's
        `base` plus the Markov bias) after `drafted [B, j]`."""
        return draw(logits, ctx, drafted, self.map, self.target_vocab)


def build(cfg: CheckpointConfig, target: Target, precision: str = "fp32") -> BlockSpeculatorsDrafter:
    """The drafter of a parsed DFlash or DSpark checkpoint (checked against `target` by the caller,
    `losscheck.drafters.speculators.from_path`), in `precision`."""
    net = BlockNetwork(cfg)
    load_weights(cfg, net, target)
    net = net.to(device=target.device, dtype=torch_dtype(precision)).eval()
    return BlockSpeculatorsDrafter(net, cfg, identity(cfg, precision))
