"""Deprecated alias of `losscheck.plugin.certify.test_mutants` (see `losscheck.certify`)."""

from losscheck.plugin.certify.test_mutants import *  # noqa: F403
