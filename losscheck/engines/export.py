"""Models converted for the engines that run another format than the Hugging Face directories
losscheck loads (OpenVINO IR, GGUF): the cache key of a directory, and `python -m
losscheck.engines.ENGINE export DIR...`, which fills the cache before the tests time anything."""

from __future__ import annotations

import hashlib
import sys
import time
from collections.abc import Callable
from pathlib import Path

from losscheck.errors import OptionError


def model_key(model_dir: Path) -> str:
    """The directory's name and a hash of its files' names, sizes and modification times: a model
    changed in place is exported again; reading weights is left to the export."""
    files = sorted(p for p in model_dir.iterdir() if p.is_file())
    stamp = repr([(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files])
    digest = hashlib.sha256(f"{model_dir.resolve()}\n{stamp}".encode()).hexdigest()[:16]
    return f"{model_dir.name}-{digest}"


def export_main(module: str, convert: Callable[[str], Path], argv: list[str] | None = None) -> int:
    """Convert each MODEL_DIR of `export MODEL_DIR...` with `convert`, one line per model: 0 when
    all converted, 1 on the first that cannot be, 2 on a usage error."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2 or args[0] != "export":
        print(f"usage: python -m {module} export MODEL_DIR...", file=sys.stderr)
        return 2
    for model in args[1:]:
        started = time.perf_counter()
        try:
            out = convert(model)
        except OptionError as exc:
            print(exc, file=sys.stderr)
            return 1
        print(f"{model}: {out} ({time.perf_counter() - started:.1f} s)")
    return 0
