"""The suite's tiers, one directory each, and the fixtures its modules share.

A test's tier is the directory it lives in, set here as its marker (never written by hand):

- unit     closed-form toy models and pure functions; no bundled weights (tests/unit/conftest.py
           refuses any weight load);
- cells    the bundled models in process: real engine runs and cells sharing one session per worker;
- e2e      one concern each, in a process of its own (pytest in a subprocess, tensor-parallel
           ranks, a wheel in a venv);
- quality  Monte-Carlo calibration and power of the statistical tests (thousands of replicates);
- engines  real engines in environments of their own (tox -e vllm, openvino, llamacpp).

`tox -e unit`, `cells`, `e2e`, `quality` run one tier; `tox -e tests` (CI) runs every tier but the
engines'.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

TIERS = {
    "unit": "toy models and pure functions, no bundled weights (tests/unit)",
    "cells": "the bundled models in process (tests/cells)",
    "e2e": "one concern each in a process of its own (tests/e2e)",
    "quality": "Monte-Carlo calibration and power of the statistical tests (tests/quality)",
    "engines": "real engines in environments of their own (tests/engines)",
}
HERE = Path(__file__).parent


def pytest_configure(config: pytest.Config) -> None:
    for name, text in TIERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # xdist runs one worker per core: a second torch thread per worker only spins against the
        # other worker on the tiny tensors of the suite (`one_thread`'s reason, for every module)
        torch.set_num_threads(1)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each test of tests/<tier>/ gets the tier's marker (the shipped certification tests, outside
    tests/, get none)."""
    for item in items:
        parts = item.path.relative_to(HERE).parts if item.path.is_relative_to(HERE) else ()
        if parts and parts[0] in TIERS:
            item.add_marker(parts[0])


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for the module: the models are tiny, and on a shared, oversubscribed
    2-core machine a second thread only spins against other processes (30-50x slower there)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def session():
    """A run context of every bundled model (default options otherwise), shared by every test
    that only reads it (models load once per process)."""
    from losscheck.run.options import Options
    from losscheck.run.session import Session

    return Session(Options(bundled="all"))


@pytest.fixture(scope="session")
def target(session):
    """The bundled main target in fp32."""
    return session.target()


WRITTEN_RUN = re.compile(r"\d{8}T\d{6}-seed-?\d+")  # the run directories `certificate.write_run` makes


@pytest.fixture(scope="session", autouse=True)
def written_certificates_follow_the_schema(tmp_path_factory):
    """Every certificate losscheck writes during the tests (in process or in a pytester
    subprocess, anywhere under this process's temporary directory) is checked against the
    published schema when the session ends; hand-made certificates (in directories of other
    names) are the tests' own and may be broken on purpose."""
    yield
    from tests.support import certificate_errors

    found = [
        p for p in tmp_path_factory.getbasetemp().rglob("certificate.json") if WRITTEN_RUN.fullmatch(p.parent.name)
    ]
    broken = {str(p): errors for p in found if (errors := certificate_errors(json.loads(p.read_text())))}
    assert not broken, "certificates written by the tests break certificate.schema.json:\n" + "\n".join(
        f"{path}: {errors[:3]}" for path, errors in broken.items()
    )
