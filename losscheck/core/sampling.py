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

from losscheck.core.grammar import Grammar
from losscheck.core.stops import StopStrings
from losscheck.errors import OptionError


@dataclass(frozen=True)
class SamplingParams:
    """A request's sampling parameters. `temperature == 0` means greedy decoding.

    Beyond temperature, top-k and top-p, the knobs engines serve (vLLM / OpenAI semantics), each
    neutral by default: the penalties, logit bias, banned ids and min tokens read the request's
    history and are applied before temperature (`losscheck.core.history`, with the order); min-p
    after it, before top-k and top-p (`process_logits`).
    """

    temperature: float = 1.0  # 0 = greedy (argmax); otherwise logits / temperature
    top_k: int = 0  # keep the k most probable tokens; 0 = off
    top_p: float = 1.0  # keep the smallest set whose mass reaches top_p; 1.0 = off
    min_p: float = 0.0  # drop tokens below min_p x the most probable one's probability; 0 = off
    repetition_penalty: float = 1.0  # ids in the prompt or output: logit / r if > 0, else x r; 1 = off
    presence_penalty: float = 0.0  # minus this once an id is in the output; 0 = off
    frequency_penalty: float = 0.0  # minus this x the id's count in the output; 0 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (id, bias) added to the logit; a dict is accepted
    banned_ids: tuple[int, ...] = ()  # ids never sampled
    min_tokens: int = 0  # EOS and `stop_ids` masked until the output has this many tokens
    stop_ids: tuple[int, ...] = ()  # ids that end the output like EOS (the id is emitted)
    grammar: Grammar | None = None  # structured output: the ids a regex / JSON schema allows (core.grammar)
    stop_strings: StopStrings | None = None  # texts that end the output (core.stops; the token is emitted)

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise OptionError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.top_k < 0:
            raise OptionError(f"top_k must be >= 0 (0 = off), got {self.top_k!r}")
        if not (0 < self.top_p <= 1):
            raise OptionError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if not (0 <= self.min_p <= 1):
            raise OptionError(f"min_p must be in [0, 1] (0 = off), got {self.min_p!r}")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise OptionError(
                f"repetition_penalty must be a finite number > 0 (1 = off), got {self.repetition_penalty!r}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise OptionError(f"{name} must be a finite number (0 = off), got {getattr(self, name)!r}")
        if self.min_tokens < 0:
            raise OptionError(f"min_tokens must be >= 0 (0 = off), got {self.min_tokens!r}")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        pairs = tuple(sorted((_token_id("logit_bias", i), float(b)) for i, b in bias))
        if len({i for i, _ in pairs}) != len(pairs):
            raise OptionError(f"logit_bias names an id twice: {self.logit_bias!r}; give each id one bias")
        if not all(math.isfinite(b) for _, b in pairs):
            raise OptionError(f"logit_bias values must be finite numbers, got {self.logit_bias!r}; ban an id instead")
        object.__setattr__(self, "logit_bias", pairs)
        for name in ("banned_ids", "stop_ids"):
            ids = tuple(sorted({_token_id(name, i) for i in getattr(self, name)}))
            object.__setattr__(self, name, ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalised(self) -> bool:
        """Any of the repetition, presence and frequency penalties is on."""
        return self.repetition_penalty != 1.0 or bool(self.presence_penalty) or bool(self.frequency_penalty)

    @property
    def reads_history(self) -> bool:
        """A step of the processing reads the request's history (`losscheck.core.history`)."""
        return (
            self.penalised
            or bool(self.logit_bias)
            or bool(self.banned_ids)
            or self.min_tokens > 0
            or self.grammar is not None
        )

    def check_vocab(self, vocab: int, what: str = "the target") -> None:
        """Raise `OptionError` when an id the parameters name lies outside `vocab` ids, when the
        banned ids leave no token to sample, or when a stop string cannot be spelled."""
        for name, ids in (
            ("logit_bias", [i for i, _ in self.logit_bias]),
            ("banned_ids", self.banned_ids),
            ("stop_ids", self.stop_ids),
        ):
            outside = [i for i in ids if i >= vocab]
            if outside:
                raise OptionError(
                    f"{name} names ids {outside[:5]} outside the vocabulary of {what} [0, {vocab}); "
                    "use ids of its tokenizer"
                )
        if len(self.banned_ids) >= vocab:
            raise OptionError(f"banned_ids bans every id of {what}'s {vocab}; leave at least one token")
        if self.stop_strings is not None:
            self.stop_strings.check(vocab)

    def label(self) -> str:
        parts = ["greedy" if self.greedy else f"T{self.temperature:g}"]
        if self.top_k:
            parts.append(f"topk{self.top_k}")
        if self.top_p < 1:
            parts.append(f"topp{self.top_p:g}")
        if self.min_p:
            parts.append(f"minp{self.min_p:g}")
        if self.repetition_penalty != 1.0:
            parts.append(f"rep{self.repetition_penalty:g}")
        if self.presence_penalty:
            parts.append(f"pres{self.presence_penalty:g}")
        if self.frequency_penalty:
            parts.append(f"freq{self.frequency_penalty:g}")
        if self.logit_bias:
            parts.append("bias" + "_".join(f"{i}{b:+g}" for i, b in self.logit_bias))
        if self.banned_ids:
            parts.append("ban" + "_".join(map(str, self.banned_ids)))
        if self.min_tokens:
            parts.append(f"min{self.min_tokens}")
        if self.stop_ids:
            parts.append("stop" + "_".join(map(str, self.stop_ids)))
        if self.grammar is not None:
            parts.append(self.grammar.label())
        if self.stop_strings is not None:
            parts.append(self.stop_strings.label())
        return "-".join(parts)


def _token_id(name: str, value: object) -> int:
    """`value` as a token id (an int >= 0), else `OptionError` naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise OptionError(f"{name} must hold token ids (integers >= 0), got {value!r}")
    return int(value)


GREEDY = SamplingParams(temperature=0.0)


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn raw logits `[..., V]` into the sampling distribution `[..., V]` (float32, rows sum to 1).

    Greedy gives the one-hot of the argmax (lowest id on ties, as `torch.argmax`). Min-p, top-k
    and top-p are applied after temperature, in that order, as vLLM's sampler does (Hugging Face
    applies min-p last; the two orders differ only when min-p is combined with top-k or top-p);
    top-p keeps every token needed to reach the mass `top_p` (the token that crosses it
    included). The history-dependent steps come first (`losscheck.core.history.adjust_logits`).
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    # shifted to a maximum of 0 first: logits / T then cannot overflow however small T is
    logits = (logits - logits.amax(-1, keepdim=True)) / params.temperature
    if params.min_p:  # p >= min_p * max p, as logits: logit - max >= log(min_p) (the max is 0 here)
        logits = logits.masked_fill(logits < math.log(params.min_p), -math.inf)
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
