"""Deprecated alias of `losscheck.plugin.certify.test_engine_perf` (see `losscheck.certify`)."""

from losscheck.plugin.certify.test_engine_perf import *  # noqa: F403
