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


def test_a_reset_that_does_not_take_gives_no_figure(tmp_path, monkeypatch):
    """A kernel that accepts the write to clear_refs and keeps the old peak: the figure would be
    that older peak, so there is none."""
    from losscheck.perf import memory

    status = tmp_path / "status"
    status.write_text("VmHWM:\t 1400000 kB\nVmRSS:\t  300000 kB\n")  # a 1.3 GiB peak the reset left
    monkeypatch.setattr(memory, "STATUS", status)
    monkeypatch.setattr(memory, "CLEAR_REFS", tmp_path / "clear_refs")  # the write succeeds, changes nothing
    with peak_memory() as peak:
        pass
    assert (peak.mib, peak.source) == (None, None)
    status.write_text("VmHWM:\t 300100 kB\nVmRSS:\t  300000 kB\n")  # one that took: the peak is the resident set
    with peak_memory() as peak:
        pass
    assert peak.source == RSS and peak.mib == pytest.approx(300100 / 1024)
