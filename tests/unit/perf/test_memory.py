"""A timed run's peak memory is its own: the peak before it does not count, its own allocation does."""

from __future__ import annotations

import mmap

import pytest

from losscheck.perf.memory import RSS, peak_memory


def _touched(mib: int) -> None:
    """Map `mib` MiB of fresh anonymous memory, touch every page, unmap it: the resident set grows
    by that much whatever the process's heap already holds free (a `bytes` of that size may be
    carved from freed heap pages that are still resident, and then raises no peak)."""
    page = b"\x01" * 2**20
    with mmap.mmap(-1, mib * 2**20) as block:
        for _ in range(mib):
            block.write(page)


def test_the_peak_resident_set_is_reset_for_each_run():
    _touched(300)  # a peak before the runs: 300 MiB touched, then freed
    with peak_memory() as quiet:
        pass
    if quiet.source is None:
        pytest.skip("this machine lets no process reset its peak resident set (/proc/self/clear_refs)")
    with peak_memory() as busy:
        _touched(200)  # 200 MiB touched inside the run
    assert quiet.source == busy.source == RSS
    assert quiet.mib is not None and busy.mib is not None
    assert busy.mib - quiet.mib > 150, (quiet.mib, busy.mib)  # the run's own 200 MiB
    assert quiet.mib < busy.mib < quiet.mib + 300  # the 300 MiB before the runs counted in neither
