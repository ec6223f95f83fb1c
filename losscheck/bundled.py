"""The bundled fixtures: a tiny trained target, its reference drafters and the prompt sets."""

from __future__ import annotations

import json
import os
from pathlib import Path

from losscheck.errors import LosscheckError

PROMPT_TIERS = ("low", "mid", "high")


def fixtures_dir() -> Path:
    """`$LOSSCHECK_FIXTURES`, else `fixtures/` of the source checkout losscheck runs from."""
    env = os.environ.get("LOSSCHECK_FIXTURES")
    path = Path(env) if env else Path(__file__).resolve().parent.parent / "fixtures"
    if not (path / "target").is_dir():
        raise LosscheckError(
            f"bundled fixtures not found at {str(path)!r}. Install losscheck from a source "
            "checkout (pip install -e .), set LOSSCHECK_FIXTURES to its fixtures/ directory, "
            "or name your own model with --losscheck-target / --target."
        )
    return path


def target_path() -> Path:
    return fixtures_dir() / "target"


def small_target_path() -> Path:
    return fixtures_dir() / "small_target"


def load_prompts(tier: str) -> list[list[int]]:
    """Prompt set `tier` (low / mid / high entropy for the main target, small for the small one)."""
    file = fixtures_dir() / "prompts" / f"{tier}.json"
    if not file.is_file():
        raise LosscheckError(f"prompt set {tier!r} not found at {str(file)!r}")
    return [list(map(int, p)) for p in json.loads(file.read_text())["prompts"]]
