"""Deprecated alias of `losscheck.plugin.certify.test_greedy` (see `losscheck.certify`)."""

from losscheck.plugin.certify.test_greedy import *  # noqa: F403
