"""Speculators-format checkpoints (EAGLE-3, P-EAGLE) as `losscheck.core.contract.Drafter`s.

`--losscheck-drafter=speculators:DIR` reads the checkpoint natively (the config in
`losscheck.drafters.speculators_config`, the weights by their published names) and runs the
published inference of its algorithm with the target's own decoder-layer classes. DFlash and
DSpark checkpoints of the same format are `losscheck.drafters.dspark`'s; `from_path` takes any.

**EAGLE-3** (`eagle3`). The drafter keeps one *entry* per committed token: entry e is
`(x_e, g_{e-1})`, the token and the target's states before it, at rotary position e, where
`g_t = concat(h_t[l] for l in eagle_aux_hidden_state_layer_ids)` [n·H] is projected by `fc` to
the drafter's width (zero for e = 0: nothing precedes the first token). The first decoder layer
reads `concat(input_layernorm(embed(x)), hidden_norm(h))` [2H] with the residual taken from `h`;
the rest are plain decoder layers; `lm_head(norm(out))` gives logits over the draft vocabulary.
Drafting a chain of k: the output of the pending token's entry gives draft 1; draft j+1 comes
from the entry `(d_j, out_j)` — the drafted token and the drafter's own output state (pre-norm,
or normed with `norm_output`) — appended at the next position. This is the loop the library
trains ("training-time test": step s attends to the context and to its own earlier steps) and
vLLM runs.

**P-EAGLE** (`peagle`): the same network; the k drafts come from one pass. After the context
entries come k-1 placeholder entries `(mask_token_id, fc(mask_hidden))` at the next positions;
the pending token's entry gives draft 1 and placeholder j gives draft j+1. Placeholders attend to
the context and to the placeholders before them, never to a drafted token, so the k slots are
drawn independently, each from its own `q_j`.

**Vocabulary.** A sub-vocabulary and its d2t map, as `losscheck.drafters.speculators_parts` says.

**Acceptance.** The greedy proposal's `verifier_accept_k > 1` with `accept_tolerance > 0`
accepts a draft anywhere in the verifier's top-k within the tolerance of the top token's
log-probability. losscheck runs a checkpoint as configured, so such a drafter brings that rule as
its `verifier` (`top_k_acceptance`) and the gate sees its output; exact verification otherwise.

State: the drafter's ragged KV cache over entries; after each round only the entries of
committed tokens (built from the target's states) are kept, the drafted ones are rebuilt.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, cast

import torch
from torch import nn

from losscheck.core.contract import DraftContext, Proposal, Target
from losscheck.core.precision import torch_dtype
from losscheck.core.ragged import RaggedKVCache
from losscheck.core.sampling import SamplingParams, process_logits, sample
from losscheck.core.verify import BlockOutcome, Verifier, acceptance_probability, point_mass, recovery_distribution
from losscheck.drafters import dspark
from losscheck.drafters.speculators_config import (
    BLOCK_ALGORITHMS,
    CheckpointConfig,
    GreedyProposal,
    check_against,
    read_config,
)
from losscheck.drafters.speculators_parts import draw, identity, is_full_vocab, load_weights, target_shape_of
from losscheck.drafters.speculators_parts import vocab_map as map_of
from losscheck.errors import LosscheckError


def _layer_classes(layer_type: str) -> tuple[type, type, type, type]:
    """(config, decoder layer, RMSNorm, rotary embedding) classes of transformers for a layer type."""
    if layer_type == "qwen3":
        from transformers.models.qwen3 import modeling_qwen3 as qwen3
        from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

        return Qwen3Config, qwen3.Qwen3DecoderLayer, qwen3.Qwen3RMSNorm, qwen3.Qwen3RotaryEmbedding
    from transformers import LlamaConfig
    from transformers.models.llama import modeling_llama as llama

    return LlamaConfig, llama.LlamaDecoderLayer, llama.LlamaRMSNorm, llama.LlamaRotaryEmbedding


class FirstLayer(Protocol):
    """The parts of a transformers decoder layer (Llama / Qwen3) that EAGLE-3's first layer
    uses, with the `hidden_norm` it adds."""

    self_attn: nn.Module
    input_layernorm: nn.Module
    post_attention_layernorm: nn.Module
    mlp: nn.Module
    hidden_norm: nn.Module


class Eagle3Network(nn.Module):
    """The EAGLE-3 / P-EAGLE network with the checkpoint's parameter names (see the module
    docstring for the forward)."""

    d2t: torch.Tensor  # [V_d] buffer: draft id i is target id i + d2t[i]
    t2d: torch.Tensor  # [V] bool buffer: the target ids the draft vocabulary covers

    def __init__(self, cfg: CheckpointConfig) -> None:
        super().__init__()
        config_class, layer_class, norm_class, rotary_class = _layer_classes(cfg.layer_type)
        fields = {
            k: v
            for k, v in cfg.layer_config.items()
            if k not in ("model_type", "architectures", "transformers_version")
        }
        self.layer_config = config_class(**fields)
        self.layer_config._attn_implementation = "sdpa"
        lc, width, feature = self.layer_config, cfg.hidden_size, cfg.target_hidden_size
        aux = len(cfg.aux_layers)
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.target_vocab_size, width)
        self.fc = nn.Linear(aux * feature, width, bias=False)
        self.input_norm = norm_class(aux * feature, eps=lc.rms_norm_eps) if cfg.flags["norm_before_fc"] else None
        self.fc_norm = (
            nn.ModuleList(norm_class(feature, eps=lc.rms_norm_eps) for _ in range(aux))
            if cfg.flags["fc_norm"]
            else None
        )
        self.layers = nn.ModuleList(layer_class(lc, i) for i in range(lc.num_hidden_layers))
        first = self.first_layer
        # EAGLE-3's first layer attends over [embedding ; hidden], twice the width
        first.self_attn.q_proj = nn.Linear(2 * width, lc.num_attention_heads * lc.head_dim, bias=lc.attention_bias)
        first.self_attn.k_proj = nn.Linear(2 * width, lc.num_key_value_heads * lc.head_dim, bias=lc.attention_bias)
        first.self_attn.v_proj = nn.Linear(2 * width, lc.num_key_value_heads * lc.head_dim, bias=lc.attention_bias)
        first.hidden_norm = norm_class(width, eps=lc.rms_norm_eps)
        self.norm = norm_class(width, eps=lc.rms_norm_eps)
        self.lm_head = nn.Linear(width, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(cfg.target_vocab_size, dtype=torch.bool))
        if cfg.model_type == "peagle":
            self.mask_hidden = nn.Parameter(torch.zeros(1, 1, aux * feature))
        self.rotary_emb = rotary_class(lc)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """Target states features [..., n·H_t] → the drafter's width [..., H]."""
        if self.input_norm is not None:
            features = self.input_norm(features)
        if self.fc_norm is not None:
            chunks = features.chunk(len(self.fc_norm), dim=-1)
            features = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks)], -1)
        return self.fc(features)

    def forward(
        self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, m] (target ids), hidden [B, m, H] (projected target states or the drafter's
        own carried state), positions [B, m], mask [B, 1, m, S] additive → (the state carried to
        the next step [B, m, H], logits over the draft vocabulary [B, m, V_d])."""
        rope = self.rotary_emb(hidden, positions)
        first = self.first_layer
        normed_hidden = first.hidden_norm(hidden)
        residual = normed_hidden if self.cfg.flags["norm_before_residual"] else hidden
        mixed = torch.cat([first.input_layernorm(self.embed_tokens(tokens)), normed_hidden], -1)  # [B, m, 2H]
        attn, _ = first.self_attn(hidden_states=mixed, position_embeddings=rope, attention_mask=mask, cache=cache)
        out = residual + attn
        out = out + first.mlp(first.post_attention_layernorm(out))
        for layer in self.layers[1:]:
            out = layer(out, attention_mask=mask, position_ids=positions, cache=cache, position_embeddings=rope)
        normed = self.norm(out)
        return (normed if self.cfg.flags["norm_output"] else out), self.lm_head(normed)

    @property
    def first_layer(self) -> FirstLayer:
        # ModuleList indexing is typed as a bare Module; layers[0] is a `_layer_classes` decoder layer
        return cast(FirstLayer, self.layers[0])

    @property
    def vocab_map(self) -> torch.Tensor:
        """[V_d] target id of each draft id."""
        return map_of(self.d2t)


def causal_mask(slots: torch.Tensor, visible: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [B, 1, m, visible]: query at cache slot `slots[b, i]` reads slots <= it."""
    allowed = torch.arange(visible, device=slots.device)[None, None, :] <= slots[:, :, None]
    return torch.zeros(allowed.shape, dtype=dtype, device=slots.device).masked_fill(~allowed, torch.finfo(dtype).min)[
        :, None
    ]


def load_network(cfg: CheckpointConfig, target: Target, dtype: torch.dtype) -> Eagle3Network:
    """The network with the checkpoint's weights (`speculators_parts.load_weights`)."""
    net = Eagle3Network(cfg)
    load_weights(cfg, net, target)
    return net.to(device=target.device, dtype=dtype).eval()


def top_k_acceptance(proposal: GreedyProposal) -> Verifier:
    """The speculators greedy proposal's acceptance with `verifier_accept_k` and
    `accept_tolerance`: a draft is also kept when it is among the verifier's top
    `verifier_accept_k` tokens and its log-probability is within `accept_tolerance` of the top
    token's. Greedy rounds keep nothing else; sampled rounds also keep what rejection sampling
    keeps. The first draft not kept is replaced as exact verification would (argmax / residual).
    Lossy for k > 1: a kept non-argmax draft is a token the target would not have emitted."""
    k_top, tolerance = proposal.verifier_accept_k, proposal.accept_tolerance

    def verify(
        logits: torch.Tensor,
        drafts: torch.Tensor,
        q: torch.Tensor | None,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> BlockOutcome:
        # logits [B, k+1, V], drafts [B, k], q [B, k, V] | None
        batch, k = drafts.shape
        p = torch.softmax(logits, -1) if params.greedy else process_logits(logits, params)  # [B, k+1, V]
        logp = p[:, :k].clamp_min(1e-30).log()  # [B, k, V]
        top = logp.topk(min(k_top, logp.shape[-1]), -1)  # [B, k, k_top]
        draft_logp = logp.gather(-1, drafts[..., None])[..., 0]  # [B, k]
        lenient = (top.indices == drafts[..., None]).any(-1) & (top.values[..., 0] - draft_logp <= tolerance)
        rows = torch.arange(batch, device=drafts.device)
        if params.greedy:
            best = logits.argmax(-1)  # [B, k+1]
            accepted = lenient.long().cumprod(-1).sum(-1)
            tokens = torch.cat([drafts, best[:, k:]], 1)
            tokens[rows, accepted] = best[rows, accepted]
            return BlockOutcome(accepted, tokens)
        q = point_mass(drafts, p.shape[-1]) if q is None else q
        u = torch.rand(batch, k, generator=generator, dtype=torch.float64, device=p.device)
        exact = u < acceptance_probability(
            p[:, :k].gather(-1, drafts[..., None])[..., 0], q.gather(-1, drafts[..., None])[..., 0]
        )
        accepted = (lenient | exact).long().cumprod(-1).sum(-1)
        tokens = torch.cat([drafts, drafts.new_zeros(batch, 1)], 1)
        tokens[rows, accepted] = sample(recovery_distribution(p, q)[rows, accepted], generator)
        return BlockOutcome(accepted, tokens)

    verify.__qualname__ = f"speculators top-k acceptance (verifier_accept_k={k_top}, accept_tolerance={tolerance})"
    return verify


class SpeculatorsDrafter:
    """A `Drafter` over an EAGLE-3 or P-EAGLE checkpoint (see the module docstring)."""

    widths: tuple[int | None, ...] = ()

    def __init__(self, net: Eagle3Network, cfg: CheckpointConfig, identity: dict[str, object]) -> None:
        self.net, self.cfg = net, cfg
        self.name = f"speculators:{cfg.model_type}:{cfg.path.name}"
        self.block_lengths = tuple(range(1, cfg.proposal.speculative_tokens + 1))
        self.uses_hidden: tuple[int, ...] = cfg.aux_layers
        self.identity = identity
        self.dtype = next(net.parameters()).dtype
        self.map = net.vocab_map  # [V_d]
        self.full_vocab = is_full_vocab(cfg, self.map)
        if cfg.proposal.relaxed:
            self.verifier = top_k_acceptance(cfg.proposal)
            self.acceptance_rule = (
                f"{cfg.proposal.describe()} (config.json speculators_config.proposal_methods): "
                "accepts drafts anywhere in the verifier's top-k, lossy for verifier_accept_k > 1"
            )
        self.cache: RaggedKVCache | None = None
        self.cached = torch.zeros(0, dtype=torch.long)  # [B] entries of committed tokens in the cache
        self._proposed_at = torch.zeros(0, dtype=torch.long)

    def reset(self, batch_size: int, capacity: int) -> None:
        self.cache = RaggedKVCache(batch_size, capacity)
        self.cached = torch.zeros(batch_size, dtype=torch.long, device=self.map.device)

    def forget_rows(self, rows: torch.Tensor) -> None:
        """Rows [n] take new requests (continuous batching): their entries are rebuilt from the start."""
        self.cached = self.cached.clone()
        self.cached[rows] = 0

    def commit(self, accepted: torch.Tensor) -> None:
        # every entry past the pending token's was built from drafted tokens: rebuild from there
        self.cached = self._proposed_at

    def _run(
        self, tokens: torch.Tensor, hidden: torch.Tensor, slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass of entries at cache slots `slots [B, m]` (= their positions)."""
        assert self.cache is not None, "propose before reset"
        visible = int(slots.max()) + 1
        self.cache.slots, self.cache.visible = slots, visible
        return self.net(tokens, hidden.to(self.dtype), slots, causal_mask(slots, visible, self.dtype), self.cache)

    @torch.inference_mode()
    def propose(self, ctx: DraftContext) -> Proposal:
        if ctx.hidden is None:
            raise LosscheckError(f"drafter {self.name!r} reads the target's hidden states; the engine passed none")
        if ctx.k > self.block_lengths[-1]:
            raise LosscheckError(
                f"drafter {self.name!r} drafts at most speculative_tokens={self.block_lengths[-1]}; asked for k={ctx.k}"
            )
        lengths, k = ctx.lengths, ctx.k
        rows = torch.arange(len(lengths), device=lengths.device)
        # catch up: entries cached .. lengths-1 (the pending token's is the last)
        behind = int((lengths - self.cached).max())
        entry = self.cached[:, None] + torch.arange(behind, device=lengths.device)  # [B, m]
        entry = entry.clamp_max(ctx.tokens.shape[1] - 1)
        feature = ctx.hidden.gather(1, (entry - 1).clamp_min(0)[..., None].expand(-1, -1, ctx.hidden.shape[2]))
        feature = feature * (entry >= 1)[..., None]  # entry 0 has no state before it
        carry, logits = self._run(ctx.tokens.gather(1, entry), self.net.project(feature.to(self.dtype)), entry)
        last = lengths - 1 - self.cached  # [B] index of the pending token's entry
        slot_logits = [logits[rows, last]]  # [B, V_d] per drafted slot
        carry = carry[rows, last]  # [B, H]
        drafts, dists = [], []
        token, q = self._draw(slot_logits[0], ctx, lengths[:, None][:, :0])
        drafts.append(token)
        dists.append(q)
        if self.cfg.model_type == "peagle" and k > 1:
            slots = lengths[:, None] + torch.arange(k - 1, device=lengths.device)  # [B, k-1]
            mask_ids = torch.full_like(slots, int(self.cfg.mask_token_id or 0))
            placeholder = self.net.project(self.net.mask_hidden).expand(len(lengths), k - 1, -1)
            _, block = self._run(mask_ids, placeholder, slots)
            for j in range(k - 1):
                token, q = self._draw(block[:, j], ctx, torch.stack(drafts, 1))
                drafts.append(token)
                dists.append(q)
        else:
            for j in range(1, k):
                carry, step = self._run(token[:, None], carry[:, None], (lengths - 1 + j)[:, None])
                carry = carry[:, 0]
                token, q = self._draw(step[:, 0], ctx, torch.stack(drafts, 1))
                drafts.append(token)
                dists.append(q)
        self._proposed_at = lengths.clone()
        tokens = torch.stack(drafts, 1)  # [B, k] target ids
        if ctx.params.greedy:
            return Proposal(tokens)
        probs = torch.stack(dists, 1)  # [B, k, V_d]
        return Proposal(tokens, probs, None if self.full_vocab else self.map)

    def _draw(
        self, logits: torch.Tensor, ctx: DraftContext, drafted: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return draw(logits, ctx, drafted, self.map, None if self.full_vocab else self.cfg.target_vocab_size)


def from_path(
    path: str | Path, target: Target, precision: str = "fp32"
) -> SpeculatorsDrafter | dspark.BlockSpeculatorsDrafter:
    """A drafter from a local speculators checkpoint, checked against `target`, in `precision`:
    EAGLE-3 and P-EAGLE here, DFlash and DSpark in `losscheck.drafters.dspark`."""
    cfg = read_config(path)
    check_against(cfg, target_shape_of(target))
    if cfg.model_type in BLOCK_ALGORITHMS:
        return dspark.build(cfg, target, precision)
    net = load_network(cfg, target, torch_dtype(precision))
    return SpeculatorsDrafter(net, cfg, identity(cfg, precision))
