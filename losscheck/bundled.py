"""The bundled fixtures: a tiny trained target, its reference drafters and the prompt sets.

A source checkout keeps them in the top-level `fixtures/` (rebuilt by its build scripts); the
wheel carries their data as `losscheck/fixtures/` (pyproject.toml maps the one onto the other).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from losscheck.errors import LosscheckError

PROMPT_TIERS = ("low", "mid", "high")
PACKAGE = Path(__file__).resolve().parent
INSTALLED = PACKAGE / "fixtures"  # the wheel's copy
CHECKOUT = PACKAGE.parent / "fixtures"  # a source checkout's (pip install -e .)


def _has_fixtures(path: Path) -> bool:
    return (path / "target" / "config.json").is_file()


def fixtures_dir() -> Path:
    """`$LOSSCHECK_FIXTURES` if set, else the fixtures installed with the package, else `fixtures/`
    of the source checkout losscheck runs from."""
    env = os.environ.get("LOSSCHECK_FIXTURES")
    if env:
        if not _has_fixtures(Path(env)):
            raise LosscheckError(
                f"LOSSCHECK_FIXTURES={env!r} holds no target/config.json; point it at a fixtures "
                "directory (a copy of losscheck's fixtures/) or unset it to use the bundled ones"
            )
        return Path(env)
    for path in (INSTALLED, CHECKOUT):
        if _has_fixtures(path):
            return path
    raise LosscheckError(
        f"bundled fixtures not found: neither {str(INSTALLED)!r} (a wheel install) nor "
        f"{str(CHECKOUT)!r} (a source checkout) holds target/config.json. Reinstall losscheck, "
        "set LOSSCHECK_FIXTURES to a fixtures directory, or name your own models with "
        "--losscheck-target and --losscheck-drafter (losscheck certify: --target, --drafter)."
    )


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
