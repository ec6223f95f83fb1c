"""Deprecated alias of `losscheck.plugin.certify.test_sampling` (see `losscheck.certify`)."""

from losscheck.plugin.certify.test_sampling import *  # noqa: F403
