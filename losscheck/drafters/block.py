"""The parallel block backbone shared by drafter families B–E, and the heads of C and E.

Input of one block (like EAGLE / Medusa): the target's last-layer feature of the last scored
position and the pending token, fused into one *context* vector, followed by `k` learned
placeholder *slots*. Slot j (0-based) predicts the token `j + 1` places after the pending one.

    sequence  [ctx, s_0, .., s_{k-1}]          # [B, k+1, d]
    attention  ctx -> ctx;  s_j -> {ctx, s_j}   # slots are blind to each other
    per layer  (E) inject  s_j += W_l · E(forming prediction of s_{j-1})   (s_0: E(pending))
               attention, (D) two-tap dynamic causal conv over neighbouring slots, SwiGLU MLP
    out        z [B, k, d] slot features; base logits [B, k, V] = z_j @ W_j, one output head
               per slot (multi-head, as Medusa); trained as the per-slot marginals

Families, by the mixing inside the backbone and the head after it:

- B: no mixing; no head, slots sampled independently.
- C: no mixing; serial head, a GRU over the chosen path re-scores the top-w candidates of each slot.
- D: a two-tap dynamic causal conv across slots; no head.
- E: the predecessor's forming prediction, projected into the token-embedding space, injected at
  every layer; transition-cache head, scores of adjacent top-w candidate pairs, computed in parallel.

A head turns the base logits into conditionals `logits_j(· | chosen predecessor)` (the
predecessor of slot 0 is the pending token). Everything here is an `nn.Module` of plain tensor
code; the drafting rule (truncation, processing, sampling) is in `losscheck.drafters.parallel`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

FAMILIES = {  # family -> (mixing, head)
    "B": ("none", "none"),
    "C": ("none", "serial"),
    "D": ("conv", "none"),
    "E": ("inject", "transition"),
}
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True)
class BlockConfig:
    family: str  # "B" | "C" | "D" | "E" (fixes mixing and head, see FAMILIES)
    vocab_size: int  # V, the target's vocabulary
    feature_size: int  # H, the target's hidden size
    dim: int = 64  # d, width of the backbone
    layers: int = 2
    heads: int = 4
    ffn: int = 128  # SwiGLU inner width
    max_slots: int = 16  # largest block length k
    head_dim: int = 32  # r, width of the serial head's state / the transition scores

    @property
    def mixing(self) -> str:
        return FAMILIES[self.family][0]

    @property
    def head(self) -> str:
        return FAMILIES[self.family][1]


class SlotAttention(nn.Module):
    def __init__(self, cfg: BlockConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.out = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        # x [B, n, d]; allowed [n, n] bool, query i may read key j
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(d // self.heads)  # [B, h, n, n]
        att = att.masked_fill(~allowed, -math.inf).softmax(-1)
        return self.out((att @ v).transpose(1, 2).reshape(b, n, d))


class DynamicConv(nn.Module):
    """Family D: `y_i = g0(u_i) ⊙ W u_i + g1(u_i) ⊙ W u_{i-1}`, taps generated from the input.
    Causal over the sequence [ctx, s_0, ..]: slot 0's left neighbour is the context."""

    def __init__(self, cfg: BlockConfig) -> None:
        super().__init__()
        self.gates = nn.Linear(cfg.dim, 2 * cfg.dim)
        self.value = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.out = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        # u [B, n, d]
        g0, g1 = torch.sigmoid(self.gates(u)).chunk(2, -1)
        v = self.value(u)
        left = F.pad(v, (0, 0, 1, 0))[:, :-1]  # v_{i-1}, zero before the context
        return self.out(g0 * v + g1 * left)


class Layer(nn.Module):
    def __init__(self, cfg: BlockConfig) -> None:
        super().__init__()
        self.mixing = cfg.mixing
        self.norm_attn = nn.RMSNorm(cfg.dim)
        self.attn = SlotAttention(cfg)
        self.norm_mlp = nn.RMSNorm(cfg.dim)
        self.up = nn.Linear(cfg.dim, 2 * cfg.ffn, bias=False)
        self.down = nn.Linear(cfg.ffn, cfg.dim, bias=False)
        if self.mixing == "conv":
            self.norm_conv = nn.RMSNorm(cfg.dim)
            self.conv = DynamicConv(cfg)
        if self.mixing == "inject":
            self.inject = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, allowed: torch.Tensor, predecessor: torch.Tensor | None) -> torch.Tensor:
        # x [B, k+1, d]; predecessor [B, k, d]: token-space features of each slot's predecessor
        if predecessor is not None:
            x = x + F.pad(self.inject(predecessor), (0, 0, 1, 0))  # the context gets nothing
        x = x + self.attn(self.norm_attn(x), allowed)
        if self.mixing == "conv":
            x = x + self.conv(self.norm_conv(x))
        gate, up = self.up(self.norm_mlp(x)).chunk(2, -1)
        return x + self.down(F.silu(gate) * up)


class Backbone(nn.Module):
    """One forward for all k slots → slot features z [B, k, d] and base logits [B, k, V]."""

    def __init__(self, cfg: BlockConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.fuse = nn.Linear(cfg.feature_size + cfg.dim, cfg.dim)
        self.slots = nn.Parameter(0.02 * torch.randn(cfg.max_slots, cfg.dim))
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.dim)
        # one output head per slot (multi-head, as Medusa): the slots share the backbone's
        # capacity, the 16 different read-outs would not fit one shared head of a d=64 model
        self.lm_heads = nn.Parameter(torch.randn(cfg.max_slots, cfg.dim, cfg.vocab_size) / math.sqrt(cfg.dim))

    def forward(self, feature: torch.Tensor, pending: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        # feature [B, H] (zeros where no position is scored yet), pending [B] long
        b = pending.shape[0]
        ctx = self.fuse(torch.cat([feature, self.embed(pending)], -1))  # [B, d]
        x = torch.cat([ctx[:, None], self.slots[:k].expand(b, -1, -1)], 1)  # [B, k+1, d]
        n = torch.arange(k + 1, device=feature.device)
        allowed = (n[None, :] == 0) | (n[None, :] == n[:, None])  # [k+1, k+1]
        for layer in self.layers:
            predecessor = self._forming_predecessor(x, pending) if self.cfg.mixing == "inject" else None
            x = layer(x, allowed, predecessor)
        z = self.norm(x[:, 1:])  # [B, k, d]
        return z, torch.einsum("bkd,kdv->bkv", z, self.lm_heads[:k])

    def _forming_predecessor(self, x: torch.Tensor, pending: torch.Tensor) -> torch.Tensor:
        """Family E: each slot's predecessor as an expected token embedding [B, k, d] — slot j-1's
        current prediction read through its output head; the pending token itself for slot 0."""
        k = x.shape[1] - 1
        forming = torch.einsum("bkd,kdv->bkv", self.norm(x[:, 1:-1]), self.lm_heads[: k - 1]).softmax(-1)
        return torch.cat([self.embed(pending)[:, None], forming @ self.embed.weight], 1)


class SerialHead(nn.Module):
    """Family C: a GRU over the chosen path; its state and the slot's (already formed) feature
    give a correction added to the slot's base logits."""

    def __init__(self, cfg: BlockConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.head_dim)
        self.rnn = nn.GRU(cfg.head_dim, cfg.head_dim, batch_first=True)
        self.mix = nn.Linear(cfg.head_dim + cfg.dim, cfg.head_dim)
        self.out = nn.Linear(cfg.head_dim, cfg.vocab_size)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def _correction(self, state: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mix(torch.cat([state, z], -1))))

    def step(
        self, state: torch.Tensor | None, prev: torch.Tensor, z: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """state [1, B, r] | None (block start), prev [B] chosen predecessor, z [B, d] →
        (state, correction [B, V])"""
        out, state = self.rnn(self.embed(prev)[:, None], state)
        return state, self._correction(out[:, 0], z)

    def teacher_forced(self, z: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """z [B, K, d], prev [B, K] (pending, x_1 .. x_{K-1}) → corrections [B, K, V]"""
        out, _ = self.rnn(self.embed(prev))  # [B, K, r]
        return self._correction(out, z)


class TransitionHead(nn.Module):
    """Family E: score(a → b at slot j) = tanh(A a + Z z_j) · B b, for predecessor a, candidate b."""

    def __init__(self, cfg: BlockConfig) -> None:
        super().__init__()
        self.src = nn.Embedding(cfg.vocab_size, cfg.head_dim)
        self.ctx = nn.Linear(cfg.dim, cfg.head_dim)
        self.dst = nn.Embedding(cfg.vocab_size, cfg.head_dim)
        nn.init.normal_(self.dst.weight, std=1e-3)

    def pairs(self, prev: torch.Tensor, z: torch.Tensor, cand: torch.Tensor | None) -> torch.Tensor:
        """prev [..., P] predecessor ids, z [..., d], cand [..., C] candidate ids (None: the whole
        vocabulary) → scores [..., P, C]"""
        u = torch.tanh(self.src(prev) + self.ctx(z)[..., None, :])  # [..., P, r]
        dst = self.dst.weight if cand is None else self.dst(cand)  # [V, r] | [..., C, r]
        return u @ dst.transpose(-1, -2)

    def teacher_forced(self, z: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """z [B, K, d], prev [B, K] → scores of every next token [B, K, V]"""
        return self.pairs(prev[..., None], z, None)[..., 0, :]


class BlockModel(nn.Module):
    """Backbone plus the family's head (if any)."""

    def __init__(self, cfg: BlockConfig) -> None:
        super().__init__()
        if cfg.family not in FAMILIES:
            raise ValueError(f"unknown block-drafter family {cfg.family!r}; one of {sorted(FAMILIES)}")
        self.cfg = cfg
        self.backbone = Backbone(cfg)
        heads: dict[str, type[SerialHead] | type[TransitionHead]] = {"serial": SerialHead, "transition": TransitionHead}
        self.head: SerialHead | TransitionHead | None = heads[cfg.head](cfg) if cfg.head in heads else None

    def forward(self, feature: torch.Tensor, pending: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.backbone(feature, pending, k)

    def teacher_forced(
        self, feature: torch.Tensor, pending: torch.Tensor, following: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Training view. following [B, K]: the true next K tokens. → (base logits [B, K, V],
        conditional logits [B, K, V] given the true predecessors; equal to base without a head)."""
        z, base = self.backbone(feature, pending, following.shape[1])
        if self.head is None:
            return base, base
        prev = torch.cat([pending[:, None], following[:, :-1]], 1)  # [B, K]
        return base, base + self.head.teacher_forced(z, prev)

    def save(self, path: Path) -> None:
        """`config.json` + `model.safetensors`, weights stored in float16 (half the bytes; `load`
        returns a float32 model whose weights are those float16 values exactly)."""
        from safetensors.torch import save_file

        path.mkdir(parents=True, exist_ok=True)
        (path / CONFIG_FILE).write_text(json.dumps({**asdict(self.cfg), "stored_dtype": "float16"}, indent=2) + "\n")
        save_file({k: v.to(torch.float16).contiguous() for k, v in self.state_dict().items()}, path / WEIGHTS_FILE)

    @classmethod
    def load(cls, path: Path) -> BlockModel:
        from safetensors.torch import load_file

        raw = json.loads((path / CONFIG_FILE).read_text())
        fields = BlockConfig.__dataclass_fields__
        model = cls(BlockConfig(**{k: v for k, v in raw.items() if k in fields}))
        model.load_state_dict(load_file(path / WEIGHTS_FILE))  # copied into the float32 parameters
        return model.eval()
