"""Logits processing and seeded sampling, shared by the target, every drafter and the baseline.

One implementation for both sides is the point: a drafter that reports `q` processed differently
from how the target's `p` is processed (temperature on one side only, top-p on the draft side
only) is one of the commonest real losslessness bugs.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from losscheck.errors import OptionError


@dataclass(frozen=True)
class SamplingParams:
    """A request's sampling parameters. `temperature == 0` means greedy decoding."""

    temperature: float = 1.0  # 0 = greedy (argmax); otherwise logits / temperature
    top_k: int = 0  # keep the k most probable tokens; 0 = off
    top_p: float = 1.0  # keep the smallest set whose mass reaches top_p; 1.0 = off

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise OptionError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.top_k < 0:
            raise OptionError(f"top_k must be >= 0 (0 = off), got {self.top_k!r}")
        if not (0 < self.top_p <= 1):
            raise OptionError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def label(self) -> str:
        parts = ["greedy" if self.greedy else f"T{self.temperature:g}"]
        if self.top_k:
            parts.append(f"topk{self.top_k}")
        if self.top_p < 1:
            parts.append(f"topp{self.top_p:g}")
        return "-".join(parts)


GREEDY = SamplingParams(temperature=0.0)


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn raw logits `[..., V]` into the sampling distribution `[..., V]` (float32, rows sum to 1).

    Greedy gives the one-hot of the argmax (lowest id on ties, as `torch.argmax`). Top-k and top-p
    are applied after temperature, in that order, as Hugging Face's logits processors do; top-p
    keeps every token needed to reach the mass `top_p` (the token that crosses it included).
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    # shifted to a maximum of 0 first: logits / T then cannot overflow however small T is
    logits = (logits - logits.amax(-1, keepdim=True)) / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    probs = logits.softmax(-1)
    if params.top_p < 1:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly above each token
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


FP32_UNIT_ROUNDOFF = 2.0**-24


def top_p_band(tolerance: float, vocab: int) -> float:
    """How far above `top_p` the mass before a token may lie and another implementation of the
    same rule still keep it: logits that differ by up to `tolerance` move every token's mass before
    it by at most a factor e^(2 tolerance), and a float32 sum of `vocab` probabilities in any order
    is off by at most (vocab - 1) unit round-offs (Higham's bound for recursive summation). Hugging
    Face sums ascending and tests `cumsum <= 1 - top_p`; losscheck sums descending: the same rule,
    on 8,192 tokens about 1 position in 500 at top-p 0.9 keeps a different last token."""
    return math.expm1(2 * tolerance) + vocab * FP32_UNIT_ROUNDOFF


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Draw one token per row from `probs [..., V]` → LongTensor `[...]`.

    Uses the exponential race (argmax of p / E, E ~ Exp(1)), which samples exactly from `probs`
    in one vectorised pass and never picks a zero-probability token.
    """
    race = torch.empty_like(probs, dtype=torch.float32).exponential_(generator=generator)
    return (probs.float() / race).argmax(-1)


def derive_seed(run_seed: int, *names: object) -> int:
    """A 63-bit seed for one named stream (cell, rank, purpose), traceable to the run seed."""
    digest = hashlib.sha256(repr((run_seed, *names)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def make_generator(run_seed: int, *names: object, device: torch.device | str = "cpu") -> torch.Generator:
    """A `torch.Generator` on `device` seeded from the run seed and a stream name."""
    gen = torch.Generator(device=device)
    gen.manual_seed(derive_seed(run_seed, *names))
    return gen
