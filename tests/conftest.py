"""Fixtures shared by test modules that run the bundled models in process."""

from __future__ import annotations

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
