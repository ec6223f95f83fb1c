"""A transformers DFlash checkpoint's config.json, recognised and checked against a target without
torch (`losscheck.run.loading` checks `--drafter DIR` before any model loads; the drafter itself
is `losscheck.drafters.dflash`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from losscheck.errors import OptionError

MODEL_TYPES = ("muse_glimmer_assistant",)  # transformers' DFlash networks, by config.json model_type


def is_dflash_dir(path: str | Path | None) -> bool:
    """Whether `path` is a directory holding a transformers DFlash checkpoint (by its config's
    `model_type`)."""
    if path is None:
        return False
    config = Path(path).expanduser() / "config.json"
    if not config.is_file():
        return False
    try:
        return json.loads(config.read_text()).get("model_type") in MODEL_TYPES
    except (OSError, ValueError):
        return False


def fail(path: Path | str, why: str) -> OptionError:
    return OptionError(f"DFlash checkpoint {str(path)!r}: {why}")


def check_config(config: Any, path: Path | str, hidden_size: int, vocab_size: int, depth: int) -> None:
    """A clear error for a checkpoint (`config`: its parsed config, attributes as config.json's keys)
    that cannot draft for a target of `hidden_size`, `vocab_size` and `depth` decoder layers (0:
    unknown)."""
    layers = [int(i) for i in (getattr(config, "target_layer_ids", None) or [])]
    if int(config.hidden_size) != hidden_size:
        raise fail(
            path,
            f"hidden_size {config.hidden_size} is not the target's {hidden_size} (DFlash reads the target's "
            "embeddings and LM head at its own width)",
        )
    if not layers or min(layers) < 0 or (depth and max(layers) >= depth):
        raise fail(
            path,
            f"target_layer_ids {layers}: need ids of the target's decoder layers, 0..{depth - 1} "
            "(transformers reads hidden_states[i + 1])",
        )
    if int(config.block_size) < 2:
        raise fail(path, f"block_size {config.block_size}: need at least 2 (the anchor and one draft)")
    if not 0 <= int(config.mask_token_id) < vocab_size:
        raise fail(path, f"mask_token_id {config.mask_token_id} is not an id of the target's {vocab_size}")


def read(path: str | Path, weights: bool = True) -> dict[str, Any]:
    """config.json of the DFlash checkpoint at `path`, with its weights beside it (`weights`)."""
    path = Path(path).expanduser()
    if not is_dflash_dir(path):
        raise fail(path, f"no config.json with model_type in {list(MODEL_TYPES)}; pass a DFlash checkpoint directory")
    if weights and not any(path.glob("*.safetensors")):
        raise fail(path, "no *.safetensors weights beside config.json")
    config: dict[str, Any] = json.loads((path / "config.json").read_text())
    return config
