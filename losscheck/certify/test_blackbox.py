"""Deprecated alias of `losscheck.plugin.certify.test_blackbox` (see `losscheck.certify`)."""

from losscheck.plugin.certify.test_blackbox import *  # noqa: F403
