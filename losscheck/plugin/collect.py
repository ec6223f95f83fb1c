"""Where the certification matrix is collected from without `--pyargs losscheck.plugin.certify`.

A user who names what to certify (`--losscheck-target`, `--losscheck-drafter` or
`--losscheck-engine`, on the command line or in the ini file's `addopts`) and runs plain
`pytest -m lossless` in their own repository gets the matrix: its test modules join the run's
paths, unless those paths already reach them (`--pyargs losscheck.plugin.certify`, a path inside
the losscheck package, or a directory pytest recurses into that
holds it), so nothing is collected twice. A run naming none of them is left as it is.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from losscheck.run.options import Options

MATRIX = Path(__file__).resolve().parent / "certify"  # losscheck.plugin.certify, not imported here
PACKAGE = MATRIX.parents[1]  # losscheck


def names_a_subject(options: Options) -> bool:
    """The run names a target, a drafter or an engine of the user's."""
    return any(v is not None for v in (options.target, options.drafter, options.engine))


def matrix_args(config: pytest.Config, options: Options) -> list[str]:
    """The matrix's directory to add to the run's paths `config.args` (its node ids then read as
    under `--pyargs losscheck.plugin.certify`); none when the run names nothing or its paths reach
    the matrix."""
    if not names_a_subject(options):
        return []
    pyargs = bool(config.getoption("pyargs", False))
    paths = (_path_of(arg, pyargs, config.invocation_params.dir) for arg in config.args)
    if any(path is not None and _reaches_matrix(config, path) for path in paths):
        return []
    return [str(MATRIX)]


def _path_of(arg: str, pyargs: bool, invocation_dir: Path) -> Path | None:
    """The file or directory a collection argument names (`path::test[id]` or, with `--pyargs`, a
    module name as pytest resolves it)."""
    name = arg.split("::")[0]
    if pyargs:
        try:
            spec = importlib.util.find_spec(name)
        except (AttributeError, ImportError, ValueError):
            spec = None
        if spec is not None and spec.origin not in (None, "namespace"):
            origin = Path(str(spec.origin))
            return (origin.parent if spec.submodule_search_locations else origin).resolve()
    return (invocation_dir / name).resolve() if name else None


def _reaches_matrix(config: pytest.Config, path: Path) -> bool:
    """`path` is inside the losscheck package (the user pointed at it), or a directory pytest
    recurses into down to the matrix (not through a virtualenv, `norecursedirs` or `--ignore`)."""
    if path == PACKAGE or PACKAGE in path.parents:
        return True
    if path not in MATRIX.parents:
        return False
    below = [d for d in (MATRIX, *MATRIX.parents) if path in d.parents]
    return not any(config.hook.pytest_ignore_collect(collection_path=d, config=config) for d in below)
