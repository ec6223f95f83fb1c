"""A timed run's peak memory is its own: the peak before it does not count, its own allocation does."""

from __future__ import annotations

import pytest

from losscheck.perf.memory import RSS, peak_memory


def test_the_peak_resident_set_is_reset_for_each_run():
    before = b"\x01" * (300 * 2**20)  # a peak before the runs: 300 MiB touched, then freed
    del before
    with peak_memory() as quiet:
        pass
    if quiet.source is None:
        pytest.skip("this machine lets no process reset its peak resident set (/proc/self/clear_refs)")
    with peak_memory() as busy:
        data = b"\x01" * (200 * 2**20)  # 200 MiB touched inside the run
        del data
    assert quiet.source == busy.source == RSS
    assert quiet.mib is not None and busy.mib is not None
    assert busy.mib - quiet.mib > 150, (quiet.mib, busy.mib)  # the run's own 200 MiB
    assert quiet.mib < busy.mib < quiet.mib + 300  # the 300 MiB before the runs counted in neither
