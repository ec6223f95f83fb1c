"""The wheel: built from this tree, installed alone into a fresh virtual environment, it carries the
fixtures and certifies from an empty directory (`pip install losscheck` works from anywhere).

Reused from the current environment, so that the test runs offline: the interpreter (the new
environment is `python -m venv` of it), pip and setuptools (they build and install the wheel), and
every dependency — torch, transformers, pytest, pytest-xdist … — through a .pth file in the new
environment that lists the current site-packages. losscheck itself comes from the wheel only: the
current environment's editable install is a hook that runs from a .pth file of its own site-packages,
and a directory listed by a .pth file has its .pth files ignored (the test checks where losscheck
imports from).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.support import ROOT

pytestmark = pytest.mark.e2e  # starts processes (subprocess pytest, ranks, a venv)

CELL = "A-k2-greedy"  # one greedy cell of drafter A (no precision variant shares its name)


def run(*cmd: str | Path, cwd: Path, env: dict[str, str] | None = None) -> str:
    """`cmd`'s stdout; the test fails with its output if it exits non-zero."""
    cmd_line = [str(c) for c in cmd]
    done = subprocess.run(cmd_line, check=False, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (
        f"{' '.join(cmd_line)} exited {done.returncode}\n{done.stdout[-6000:]}\n{done.stderr[-3000:]}"
    )
    return done.stdout


def build_wheel(tmp: Path) -> Path:
    """`pip wheel` of a copy of the tree (setuptools reuses a build/ directory it finds, so a
    module deleted from the tree could still ship from the checkout's)."""
    src = tmp / "src"
    shutil.copytree(
        ROOT,
        src,
        ignore=shutil.ignore_patterns(
            ".git", ".tox", ".venv", "build", "dist", "reports", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis"
        ),
    )
    run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        ".",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "-w",
        tmp / "dist",
        cwd=src,
    )
    [wheel] = (tmp / "dist").glob("losscheck-*.whl")
    return wheel


def assert_ships_fixtures_and_modules(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    fixture_data = [
        f"losscheck/fixtures/{f.relative_to(ROOT / 'fixtures').as_posix()}"
        for d in (ROOT / "fixtures").iterdir()
        if d.is_dir() and d.name != "__pycache__"
        for f in d.rglob("*")
        if f.is_file() and "__pycache__" not in f.parts
    ]
    assert "losscheck/fixtures/target/model.safetensors" in fixture_data
    missing = [n for n in fixture_data if n not in names]
    assert not missing, f"fixture files missing from the wheel (extend package-data in pyproject.toml): {missing}"
    modules = [
        f.relative_to(ROOT).as_posix() for f in (ROOT / "losscheck").rglob("*.py") if "__pycache__" not in f.parts
    ]
    missing = [m for m in modules if m not in names]
    assert not missing, f"modules missing from the wheel (add their package to pyproject.toml): {missing}"
    assert "losscheck/report/certificate.schema.json" in names, "the certificate's schema is not in the wheel"


def fresh_venv(tmp: Path) -> tuple[Path, Path]:
    """A venv that sees the current environment's packages but not its losscheck: (python, venv)."""
    venv = tmp / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp)
    python = venv / "bin" / "python"
    site = Path(run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp).strip())
    current = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (site / "_current_env.pth").write_text("".join(f"{p}\n" for p in current))
    return python, venv


def test_the_wheel_installs_alone_and_certifies_from_an_empty_directory(tmp_path):
    wheel = build_wheel(tmp_path)
    assert_ships_fixtures_and_modules(wheel)

    python, venv = fresh_venv(tmp_path)
    # --ignore-installed: the current environment's losscheck metadata is visible through the .pth.
    run(python, "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed", wheel, cwd=tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "LOSSCHECK_", "PYTHONPATH"))}

    where = run(python, "-c", "import losscheck; print(losscheck.__file__)", cwd=empty, env=env).strip()
    assert Path(where).is_relative_to(venv), f"losscheck imports from {where}, not from the wheel in {venv}"
    fixtures = Path(run(venv / "bin" / "losscheck", "fixtures", cwd=empty, env=env).strip())
    assert fixtures.is_relative_to(venv) and (fixtures / "target" / "model.safetensors").is_file(), fixtures

    # No ini file here: the markers come from the plugin (and --strict-markers is off).
    out = run(
        python,
        "-m",
        "pytest",
        "--pyargs",
        "losscheck.plugin.certify",
        "-m",
        "lossless",
        "-k",
        CELL,
        "-p",
        "no:cacheprovider",
        cwd=empty,
        env=env,
    )
    assert " 1 passed" in out and f"{CELL}  greedy  PASS" in out and "1/1 cells passed" in out, out[-6000:]
    assert not list(empty.iterdir()), "the run wrote into the working directory"


def test_every_fixture_directory_is_a_listed_package():
    """setuptools treats each data directory of `losscheck.fixtures` as a package and warns at every
    build when one is not in `packages` (a later setuptools would leave it out of the wheel)."""
    import tomllib

    packages = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    fixtures = {f"losscheck.fixtures.{d.name}" for d in (ROOT / "fixtures").iterdir() if d.is_dir()}
    fixtures -= {"losscheck.fixtures.__pycache__"}
    assert fixtures <= packages, f"add to [tool.setuptools] packages in pyproject.toml: {sorted(fixtures - packages)}"
