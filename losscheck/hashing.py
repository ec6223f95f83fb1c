"""Content hashes of model files: what a certificate names a model by, whatever its path.

Imports nothing heavy: the engine pins hash a draft model's files without torch.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

WEIGHT_SUFFIXES = frozenset({".safetensors", ".json"})


def content_hash(path: Path) -> str:
    """sha256 over the weight and config files of a model directory (sorted by name)."""
    digest = hashlib.sha256()
    for file in sorted(path.glob("*")):
        if file.suffix in WEIGHT_SUFFIXES and file.name != "BUILD.json":
            digest.update(file.name.encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()


def model_sha256(path: str | Path) -> str | None:
    """The content hash of a model: a Hugging Face directory's weights and configs
    (`content_hash`), any other directory's files (an OpenVINO IR), or one file's bytes (a GGUF);
    None where nothing is on disk at `path` (a hub id the engine resolves itself)."""
    found = Path(path).expanduser()
    if found.is_file():
        return _files_hash([found])
    if not found.is_dir():
        return None
    if any(f.suffix in WEIGHT_SUFFIXES for f in found.glob("*")):
        return content_hash(found)
    return _files_hash(sorted(f for f in found.glob("*") if f.is_file()))


def _files_hash(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode())
        with file.open("rb") as stream:
            for block in iter(lambda: stream.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()
