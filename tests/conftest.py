"""Fixtures shared by test modules that run the bundled models in process."""

from __future__ import annotations

import json
import re

import pytest
import torch


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
