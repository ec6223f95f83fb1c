"""Precision and device: which dtype each model runs in, where, and how far its round-off reaches.

A cell's `Precision` names the target's and the drafter's dtype ("bf16" both, or a mismatched pair
such as "bf16/fp32": target bf16, drafter fp32). Greedy verification depends on the target's
argmax only, so the *target's* dtype decides whether a divergence can be a numerical near-tie:
two batch shapes of the same reduced-precision model (one token at a time in the baseline,
`k + 1` at once in the speculative loop) round differently and can flip an argmax whose true
margin is within that round-off.

`LOGIT_TOLERANCE` bounds, per dtype, how far a top-2 logit margin computed by the model in any
batch shape lies from the same margin with the LM head applied in float64 to the final hidden
state (`losscheck.core.divergence.top2_float64`). It is measured by `losscheck bench near-ties`
(`losscheck.perf.bench.margin_noise`) on the bundled fixtures and set to 4x the largest deviation
seen, rounded up; docs/precision.md has the figures. A divergence whose float64 margin is
below the tolerance is a *near-tie*; in fp32 every divergence is a failure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from losscheck.errors import OptionError, flag

if TYPE_CHECKING:  # torch loads only when a model does: the plugin imports this module
    import torch

DTYPE_NAMES = ("fp32", "bf16", "fp16")

# |model margin - float64 margin| bound, in logits (see the module docstring for how it is set).
LOGIT_TOLERANCE = {"fp32": 4e-5, "bf16": 0.3, "fp16": 0.04}

DEVICES = ("cpu", "cuda", "mps")


@dataclass(frozen=True)
class Precision:
    """The dtypes of one cell's target and drafter."""

    target: str = "fp32"
    drafter: str = "fp32"

    def __post_init__(self) -> None:
        for side, name in (("target", self.target), ("drafter", self.drafter)):
            if name not in DTYPE_NAMES:
                raise OptionError(f"{side} precision {name!r} is not one of {list(DTYPE_NAMES)}")

    @classmethod
    def parse(cls, text: str) -> Precision:
        """ "bf16" (both sides) or "bf16/fp32" (target / drafter)."""
        target, _, drafter = text.strip().partition("/")
        return cls(target, drafter or target)

    def label(self) -> str:
        return self.target if self.target == self.drafter else f"{self.target}/{self.drafter}"

    def id(self) -> str:
        """The label in a pytest id (no '/', which -k expressions cannot name)."""
        return self.target if self.target == self.drafter else f"t{self.target}-d{self.drafter}"

    @property
    def reduced(self) -> bool:
        """The target runs below fp32, so greedy divergences are triaged by margin."""
        return self.target != "fp32"

    @property
    def tolerance(self) -> float:
        """The target's logit round-off bound (`LOGIT_TOLERANCE`)."""
        return LOGIT_TOLERANCE[self.target]


def parse_precisions(text: str) -> tuple[Precision, ...]:
    """`--losscheck-precision`: a comma-separated list; the first entry is the base cell's. The
    messages leave the option's name to the caller (pytest's and the CLI's spellings differ)."""
    found = tuple(Precision.parse(part) for part in text.split(",") if part.strip())
    if not found:
        raise OptionError(f"{text!r} names no precision; give e.g. fp32 or bf16,fp32 (from {', '.join(DTYPE_NAMES)})")
    twice = sorted({p.label() for p in found if found.count(p) > 1})
    if twice:
        raise OptionError(f"{text!r} names {', '.join(twice)} twice; each precision is one cell")
    return found


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of precision `name` (fp32, bf16, fp16)."""
    import torch

    if name not in DTYPE_NAMES:
        raise OptionError(f"precision {name!r} is not one of {list(DTYPE_NAMES)}")
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def resolve_device(name: str | None) -> torch.device:
    """`--losscheck-device`: cuda when present unless named; an unavailable device is an error."""
    import torch

    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in DEVICES:
        raise OptionError(f"{flag('device')}={name!r} is not one of {list(DEVICES)}")
    available = {"cpu": True, "cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available()}
    if not available[name]:
        raise OptionError(
            f"{flag('device')}={name}: no {name} device is available on this machine; "
            "pass --losscheck-device=cpu (or leave it unset)"
        )
    return torch.device(name)


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels, so a wall clock read after it covers them."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
