"""losscheck: certify that speculative decoding is lossless.

The public contract (docs/drafter-contract.md): `Proposal`, `DraftContext`, `Drafter`, `Target`,
`SamplingParams`, and `Engine` to drive them with a `Verifier` (`verify_block` by default, or an
engine author's own, returning a `BlockOutcome`). Imported lazily so that loading the pytest plugin
does not import torch.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Proposal": "losscheck.core.contract",
    "DraftContext": "losscheck.core.contract",
    "Drafter": "losscheck.core.contract",
    "Target": "losscheck.core.contract",
    "SamplingParams": "losscheck.core.sampling",
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
