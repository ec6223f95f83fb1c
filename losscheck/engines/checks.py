"""An engine a user's factory returned, checked against the contract before anything runs
(`check_engine`, wrapping an old-contract engine), and its draft model (`draft_model`).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from losscheck.core.precision import DTYPE_NAMES
from losscheck.engines.contract import BlackBoxEngine, DraftModel, RunsDraftModel
from losscheck.engines.legacy import OLD_SIGNATURE, LegacyEngine, takes_old_signature
from losscheck.errors import OptionError

if TYPE_CHECKING:
    pass


def draft_model(engine: object, vocab_size: int) -> DraftModel | None:
    """The engine's draft model (`RunsDraftModel`) when it gives one, checked against the target's
    vocabulary; None when it gives none."""
    if not isinstance(engine, RunsDraftModel):
        return None
    given = engine.draft_model()
    if given is None:
        return None
    drafted = given if isinstance(given, DraftModel) else DraftModel(given)
    model, name = drafted.model, getattr(engine, "name", type(engine).__name__)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if not isinstance(vocab, int) or not hasattr(model, "forward"):
        raise OptionError(
            f"engine {name!r}: draft_model() returned {type(model).__name__}; return a Hugging Face causal LM "
            "(a model with .config.vocab_size and forward), a DraftModel of one, or None"
        )
    if drafted.law not in ("processed", "temperature", "greedy"):
        raise OptionError(
            f"engine {name!r}: draft_model() names the draft law {drafted.law!r}; "
            "use 'processed', 'temperature' or 'greedy' (losscheck.engines.DraftLaw)"
        )
    if vocab != vocab_size:
        raise OptionError(
            f"engine {name!r}: its draft model has a vocabulary of {vocab} tokens, the target {vocab_size}; "
            "teacher-forcing it for q needs the target's token ids (return None from draft_model to certify "
            "without the verifier's bug classes)"
        )
    return drafted


def check_engine(engine: object, source: str) -> BlackBoxEngine:
    """`engine` if it has the protocol's attributes with valid values (an old-contract engine
    wrapped in `LegacyEngine`, with a DeprecationWarning); else an error naming `source`."""
    where = f"{source} returned {type(engine).__name__}"
    generate = getattr(engine, "generate", None)
    if not callable(generate):
        raise OptionError(
            f"{where} without a generate(request: GenerationRequest) method "
            "(see losscheck/engines/contract.py, BlackBoxEngine)"
        )
    k = getattr(engine, "k", None)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise OptionError(f"{where} with k = {k!r}; declare the block length (tokens drafted per round) as an int >= 1")
    precision = getattr(engine, "precision", "missing")
    if precision is not None and precision not in DTYPE_NAMES:
        raise OptionError(
            f"{where} with precision = {precision!r}; declare the dtype its target runs in, "
            f"one of {list(DTYPE_NAMES)}, or None when losscheck cannot load that target"
        )
    if not isinstance(getattr(engine, "name", None), str):
        raise OptionError(f"{where} without a name (str)")
    if takes_old_signature(generate):
        warnings.warn(
            f"{where}, whose {OLD_SIGNATURE} is the old engine contract: write "
            "generate(self, request: losscheck.engines.GenerationRequest) -> LongTensor [P, n, L] "
            "(docs/black-box-engines.md). It is wrapped for now; the old form will be removed.",
            DeprecationWarning,
            stacklevel=2,
        )
        return LegacyEngine(engine)
    return engine  # type: ignore[return-value]
