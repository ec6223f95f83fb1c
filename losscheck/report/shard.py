"""A shard's record in its certificate (`ShardRecord`): which share of the plan it certified, and
the fingerprint of the plan, by which `losscheck merge` tells shards of one plan from shards of
several. Torch-free: the xdist controller builds it from the manifests."""

from __future__ import annotations

import hashlib
import json

from losscheck.jsonrecord import encode
from losscheck.plan.shard import Shard, share
from losscheck.report.document import RunMeta, ShardRecord
from losscheck.report.manifest import Identity, Manifest


def fingerprint(meta: RunMeta, manifest: Manifest) -> str:
    """sha256 of what makes two runs shares of one plan: the matrix in scope (each cell's id, kind,
    argument, tier and estimate), the declared scope with the cells it leaves out, the alpha split,
    the seed, the sample-size profile, the options that judge a cell (--strict, --verifier, a planted
    bug) and every model's identity without its path (runners may keep a model at different paths;
    its hash names it). The environment is left out: shards run on different machines."""
    plan = {
        "matrix": encode(manifest.matrix),
        "scope": encode(manifest.scope),
        "alpha": encode(manifest.alpha),
        "seed": meta.seed,
        "profile": encode(meta.profile),
        "judged": {"strict": meta.strict, "verifier": meta.verifier_option, "mutant": meta.mutant},
        "targets": {name: _unplaced(t) for name, t in manifest.targets.items()},
        "drafters": {name: {k: _unplaced(d) for k, d in ds.items()} for name, ds in manifest.drafters.items()},
        "engine": None if manifest.engine is None else _unplaced_engine(manifest.engine),
    }
    return hashlib.sha256(json.dumps(plan, sort_keys=True, default=str).encode()).hexdigest()


def _unplaced(identity: Identity) -> Identity:
    return {k: v for k, v in identity.items() if k != "path"}


def _unplaced_engine(identity: Identity) -> Identity:
    """An engine's identity without where its draft model lies: its hash (`draft_model`) names it,
    and the speculative config's "model" is that path as the runner gave it."""
    unplaced = _unplaced(identity)
    if isinstance(draft := identity.get("draft_model"), dict):
        unplaced["draft_model"] = _unplaced(draft)
    options = identity.get("options")
    if isinstance(options, dict) and isinstance(config := options.get("speculative_config"), dict):
        unplaced["options"] = {**options, "speculative_config": {k: v for k, v in config.items() if k != "model"}}
    return unplaced


def record(shard: Shard, meta: RunMeta, manifest: Manifest) -> ShardRecord:
    """The record of `shard` of the plan `manifest` holds (its matrix: the cells in scope)."""
    return ShardRecord(shard.index, shard.count, fingerprint(meta, manifest), share(manifest.matrix, shard))
