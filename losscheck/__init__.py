"""losscheck: certify that speculative decoding is lossless.

The public contract (docs/drafter-contract.md): `Proposal`, `DraftContext`, `Drafter` (with the
optional row-state protocols `ForgetsRows` and `AdmitsRows` of continuous batching), `Target`,
`SamplingParams` with `process_logits` (the logits processing a drafter's reported `q` must share
with the target's `p`), and `Engine` to drive them with a `Verifier` (`verify_block` by default, or
an engine author's own, returning a `BlockOutcome`). Imported lazily so that loading the pytest
plugin does not import torch.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

try:
    __version__ = version("losscheck")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

_EXPORTS = {
    "Proposal": "losscheck.core.contract",
    "DraftContext": "losscheck.core.contract",
    "Drafter": "losscheck.core.contract",
    "Target": "losscheck.core.contract",
    "ForgetsRows": "losscheck.core.contract",
    "AdmitsRows": "losscheck.core.contract",
    "SamplingParams": "losscheck.core.sampling",
    "process_logits": "losscheck.core.sampling",
    "Engine": "losscheck.core.engine",
    "HFTarget": "losscheck.core.target",
    "BlockOutcome": "losscheck.core.verify",
    "Verifier": "losscheck.core.verify",
    "verify_block": "losscheck.core.verify",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'losscheck' has no attribute {name!r}")
