"""What vLLM's CPU build needs around an LLM: losscheck's fixes of its sampler put in place
(`cpu_setup`, `losscheck.engines.vllm_verifier.CPU_FIXES`), in its worker processes too
(`CPU_FIXES_ENV`, `worker_environment`), and its platform kernels registered once a process.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any
from unittest import mock

from losscheck.errors import OptionError

# set to "1" in the environment of a process vLLM starts (a server, a tensor-parallel worker): the
# `vllm.general_plugins` entry point (`vllm_server.cpu_fixes_plugin`) puts the CPU fixes in place there
CPU_FIXES_ENV = "LOSSCHECK_VLLM_CPU_FIXES"


@contextlib.contextmanager
def worker_environment(ranks: int, cpu_fixes: bool) -> Iterator[None]:
    """What vLLM's worker processes must find in their environment when an LLM runs `ranks` > 1 of
    them (the mp executor) on vLLM's CPU build, set while it is built (the workers start then):
    each rank's OpenMP threads bound to its own share of this process's CPUs
    (`VLLM_CPU_OMP_THREADS_BIND`, "0|1" for two; its "auto" binds whole NUMA nodes and refuses two
    ranks on one), unless set already; and with `cpu_fixes`, `CPU_FIXES_ENV`, so that the fixes,
    installed in this process, are installed in the workers, where the sampler runs."""
    from vllm.platforms import current_platform

    env: dict[str, str] = {}
    if ranks > 1 and current_platform.is_cpu():
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < ranks:
            raise OptionError(f"tensor_parallel_size={ranks} on vLLM's CPU build needs {ranks} CPUs; {len(cpus)} here")
        share = len(cpus) // ranks
        if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            shares = (",".join(map(str, cpus[r * share : (r + 1) * share])) for r in range(ranks))
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(shares)
        if cpu_fixes:
            env[CPU_FIXES_ENV] = "1"
    with mock.patch.dict(os.environ, env):
        yield


def cpu_setup(cpu_fixes: bool) -> dict[str, Any]:
    """Put the CPU fixes in place (when asked) before an LLM is built; the LLM arguments they need."""
    if not cpu_fixes:
        return {}
    from losscheck.engines.vllm_verifier import install_cpu_fixes

    register_platform_kernels_once()
    install_cpu_fixes()
    # vLLM rewinds a seeded request's generator (`set_offset`) when it discards a token sampled
    # after a partial prefill chunk, which a CPU generator refuses ("CPU Generator does not
    # use offset"): with thousands of seeded rows the baseline LLM crashes. Prompts whole:
    return {"enable_chunked_prefill": False}


def register_platform_kernels_once() -> None:
    """Every vLLM worker registers its platform's Triton-kernel overrides when it starts; the
    second registration in a process rescans every loaded module, and after an ngram LLM (which
    loads numba) that scan fails (`'_lib_fn_wrapper' object has no attribute 'get'` in
    `vllm.triton_utils.dispatcher._rebind_kernels`). The overrides are the same each time, so
    register them once here and let later workers skip it."""
    from vllm.platforms import current_platform

    from losscheck.engines.vllm_verifier import platform_kernels

    platform_kernels()
    current_platform.register_triton_kernel_overrides = lambda: None
