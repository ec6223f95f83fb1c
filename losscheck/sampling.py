"""Deprecated: logits processing and seeded sampling moved to `losscheck.core.sampling`.

A drafter imports `process_logits` and `SamplingParams` from `losscheck` (the public contract,
docs/drafter-contract.md); this alias warns and goes with the first release after 0.1.0
(CHANGELOG.md, Deprecated).
"""

from __future__ import annotations

import warnings

from losscheck.core.sampling import GREEDY, SamplingParams, derive_seed, make_generator, process_logits, sample

__all__ = ["GREEDY", "SamplingParams", "derive_seed", "make_generator", "process_logits", "sample"]

warnings.warn(
    "losscheck.sampling moved to losscheck.core.sampling: import process_logits and SamplingParams "
    "from losscheck (or losscheck.core.sampling); the old path will be removed after 0.1.0",
    DeprecationWarning,
    stacklevel=2,
)
