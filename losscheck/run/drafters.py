"""Which drafters a run certifies: the bundled references, a user's factory or model directory,
the oracle."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from losscheck import bundled as fixtures
from losscheck.core.contract import Drafter, Target
from losscheck.drafters import (
    autoregressive,
    dflash,
    dflash_config,
    parallel,
    speculators,
    speculators_config,
    tree,
)
from losscheck.errors import OptionError, flag
from losscheck.plan import bundled_sets
from losscheck.run.loading import is_model_dir, load_object

BLOCK_FAMILIES = ("B", "C", "D", "E")  # parallel block drafters, losscheck.drafters.parallel
# speculators-format checkpoints (losscheck.drafters.speculators): registry name -> fixture directory
SPECULATORS = {"eagle3": "speculators_eagle3", "peagle": "speculators_peagle"}
# bundled drafter of the main target -> (loader, fixture directory)
LOADERS: dict[str, tuple[Callable[[Path, Target, str], Drafter], str]] = {
    "A": (autoregressive.from_path, "drafter_a"),
    **{family: (parallel.from_path, f"drafter_{family.lower()}") for family in BLOCK_FAMILIES},
    **{name: (speculators.from_path, directory) for name, directory in SPECULATORS.items()},
    "dflash": (dflash.from_path, "dflash"),  # transformers-format DFlash (losscheck.drafters.dflash)
    "dspark": (speculators.from_path, "speculators_dspark"),  # speculators-format DSpark (losscheck.drafters.dspark)
    "tree": (tree.bundled, "drafter_a"),  # family A's weights drafting a tree (losscheck.drafters.tree)
}


def bundled(target_name: str, target: Target, precision: str = "fp32", which: str = "all") -> dict[str, Drafter]:
    """The drafters trained against the bundled target `target_name`, in `precision`: those of
    bundled set `which` (`losscheck.plan.bundled_sets`: "reference" or "all"). The small target
    has family A's, and the tree family's over the same weights when the set has it."""
    root = fixtures.fixtures_dir()
    if target_name == "small":
        found_small: dict[str, Drafter] = {"A": autoregressive.from_path(root / "small_drafter_a", target, precision)}
        if "tree" in bundled_sets.families(which):
            found_small["tree"] = tree.bundled_small(root / "small_drafter_a", target, precision)
        return found_small
    found: dict[str, Drafter] = {}
    for name in bundled_sets.families(which):
        load, directory = LOADERS[name]
        found[name] = load(root / directory, target, precision)
    return found


@dataclass(frozen=True)
class Declared:
    """A bundled drafter's declarations, read from its files without building it: all a plan
    reads of a drafter (`losscheck certify --list`)."""

    name: str
    block_lengths: tuple[int, ...]
    widths: tuple[int | None, ...] = ()
    uses_hidden: bool | tuple[int, ...] = False


def declared(target_name: str, which: str = "all") -> dict[str, Declared]:
    """What `bundled(target_name, …, which=which)` and the oracle would declare, by cell name."""
    import json

    from losscheck.drafters.autoregressive import AutoregressiveDrafter
    from losscheck.drafters.block import FAMILIES
    from losscheck.drafters.parallel import PATH_WIDTHS
    from losscheck.plan.cell import ORACLE

    family_a = Declared("A", AutoregressiveDrafter.block_lengths)
    found: dict[str, Declared] = {"A": family_a} if target_name == "small" else {}
    if target_name == "small" and "tree" in bundled_sets.families(which):
        found["tree"] = Declared("tree", (tree.TreeTopology.parse(tree.SMALL_TOPOLOGY).depth,))
    root = fixtures.fixtures_dir()
    for name in () if target_name == "small" else bundled_sets.families(which):
        directory = root / LOADERS[name][1]
        if name == "A":
            found[name] = family_a
        elif name == "tree":
            found[name] = Declared(name, (tree.bundled_topology().depth,), tree.BUNDLED_WIDTHS)
        elif name in SPECULATORS:
            tokens = speculators_config.read_config(directory).proposal.speculative_tokens
            found[name] = Declared(name, tuple(range(1, tokens + 1)))
        elif name == "dspark":
            cfg = speculators_config.read_config(directory)
            found[name] = Declared(
                name, speculators_config.block_lengths(cfg), speculators_config.block_widths(cfg), cfg.aux_layers
            )
        elif name == "dflash":
            block = json.loads((directory / "config.json").read_text())["block_size"]
            found[name] = Declared(name, tuple(range(1, block)))
        else:
            cfg = json.loads((directory / "config.json").read_text())
            widths = PATH_WIDTHS if FAMILIES[cfg["family"]][1] != "none" else ()
            found[name] = Declared(name, tuple(range(1, cfg["max_slots"] + 1)), widths)
    found[ORACLE] = Declared(ORACLE, AutoregressiveDrafter.block_lengths)
    return found


def takes_precision(spec: str) -> bool:
    """Whether the factory of `spec` accepts a `precision` keyword (then losscheck sets the
    drafter's dtype, and the drafter gets the precision cells of the matrix)."""
    if is_model_dir(spec) or speculators_config.is_spec(spec) or dflash_config.is_dflash_dir(spec):
        return True  # from_dir and the speculators and DFlash loaders set the dtype
    params = inspect.signature(load_object(spec, flag("drafter"))).parameters.values()
    return any(p.name == "precision" or p.kind is p.VAR_KEYWORD for p in params)


def from_factory(spec: str, target: Target, precision: str = "fp32") -> Drafter:
    """`--losscheck-drafter=pkg.mod:factory`: call factory(target) — with `precision=` (fp32,
    bf16, fp16) when it takes one — and check the result. A directory instead of an import path
    is a local Hugging Face causal LM, certified as a family-A drafter (`from_dir`);
    `speculators:DIR` a speculators-format checkpoint (`losscheck.drafters.speculators`), and a
    directory of a transformers DFlash checkpoint a DFlash drafter (`losscheck.drafters.dflash`)."""
    if speculators_config.is_spec(spec):
        return speculators.from_path(speculators_config.spec_path(spec), target, precision)
    if dflash_config.is_dflash_dir(spec):
        return dflash.from_path(spec, target, precision)
    if is_model_dir(spec):
        return from_dir(spec, target, precision)
    factory = load_object(spec, flag("drafter"))
    drafter: Any = factory(target, precision=precision) if takes_precision(spec) else factory(target)
    missing = [
        a
        for a in ("name", "block_lengths", "widths", "uses_hidden", "reset", "propose", "commit")
        if not hasattr(drafter, a)
    ]
    if missing:
        raise OptionError(
            f"{flag('drafter')}={spec!r} returned {type(drafter).__name__}, which lacks "
            f"{missing}; a drafter implements losscheck.Drafter (see losscheck/core/contract.py)"
        )
    if not drafter.block_lengths or any(int(k) < 1 for k in drafter.block_lengths):
        raise OptionError(f"drafter {drafter.name!r} declares block_lengths {drafter.block_lengths!r}; need k >= 1")
    return drafter


def from_dir(path: str, target: Target, precision: str = "fp32") -> Drafter:
    """`--losscheck-drafter=DIR`: the causal LM in DIR drafting autoregressively (family A), named
    after the directory."""
    try:
        return autoregressive.from_path(Path(path).expanduser(), target, precision)
    except ValueError as exc:  # another vocabulary than the target's
        raise OptionError(f"{flag('drafter')}={path!r}: {exc}") from exc


def self_draft(target: Target) -> Drafter:
    return autoregressive.self_draft(target)
