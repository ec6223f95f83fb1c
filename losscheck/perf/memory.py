"""Peak memory over one timed run: the accelerator's, where this process has CUDA initialised
(`torch.cuda.max_memory_allocated` after `reset_peak_memory_stats`: what torch allocated in this
process; an engine whose model runs in a worker process, as vLLM's engine core does by default
on a GPU, is not in it), else this process's peak
resident set (`VmHWM` in /proc/self/status, reset before the run by writing 5 to
/proc/self/clear_refs, Linux 4.0 and later, and checked: right after it the peak must equal the
resident set). An engine serving from another process (a server) is
not in this process's figure; where neither can be read the figure is None, never a guess.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

CUDA = "this process's CUDA max_memory_allocated, reset per run; an engine in another process is not counted"
RSS = "this process's peak resident set (VmHWM), reset per run; an engine in another process is not counted"
STATUS, CLEAR_REFS = Path("/proc/self/status"), Path("/proc/self/clear_refs")


@dataclass
class Peak:
    mib: float | None = None  # read when the run ends
    source: str | None = None  # CUDA or RSS: what `mib` measured


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_initialized()


# right after the reset the peak equals the resident set, up to what the reads allocate: a peak
# further above it says the reset did not take (a kernel that ignores the write), and then the
# run's figure would be an older peak's
RESET_SLACK_MIB = 4.0


def _status_mib(field: str) -> float | None:
    """A field of /proc/self/status in MiB (`VmHWM`, `VmRSS`), None where it cannot be read."""
    try:
        found = re.search(rf"^{field}:\s+(\d+) kB", STATUS.read_text(), re.M)
    except OSError:
        return None
    return int(found.group(1)) / 1024 if found else None


def _reset_rss_peak() -> bool:
    """Reset this process's peak resident set to the current one; whether that took effect."""
    try:
        CLEAR_REFS.write_text("5")
    except OSError:
        return False
    peak, now = _status_mib("VmHWM"), _status_mib("VmRSS")
    return peak is not None and now is not None and peak <= now + RESET_SLACK_MIB


@contextmanager
def peak_memory() -> Iterator[Peak]:
    """`with peak_memory() as peak: run()`, then `peak.mib` and `peak.source`."""
    peak = Peak()
    if _cuda():
        import torch

        torch.cuda.reset_peak_memory_stats()
        yield peak
        peak.mib, peak.source = torch.cuda.max_memory_allocated() / 2**20, CUDA
        return
    reset = _reset_rss_peak()  # the peak resident set starts again from the current one
    yield peak
    if reset:
        peak.mib, peak.source = _status_mib("VmHWM"), RSS
