"""Deprecated alias of `losscheck.plugin.certify.test_perf` (see `losscheck.certify`)."""

from losscheck.plugin.certify.test_perf import *  # noqa: F403
