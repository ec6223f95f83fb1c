"""Black-box engines: implementations that only return generated ids (`--losscheck-engine`).

An engine is certified against **itself with drafting off** (docs/statistics.md), never against
losscheck's own decoder: greedy output with speculation on must equal it with speculation off,
token for token; sampled output is tested one-sample by teacher-forced PIT when losscheck can load
the engine's target (`precision` names its dtype), else two-sample, on against off
(`precision = None`).

The contract (docs/black-box-engines.md): `generate(request: GenerationRequest)` → LongTensor
[P, n, L] (`losscheck.engines.request`), and optionally `counters()` → `EngineCounters`
(`losscheck.engines.counters`), the engine's own draft and accept counts, which the certificate
records per cell. An adapter written against the old six-argument `generate` is wrapped
(`LegacyEngine`) with a DeprecationWarning. `losscheck.engines.pool` keeps an adapter's instances
(speculation on and off) under an explicit memory policy.

One adapter per module: `spec_loop` (losscheck's own loop), `hf` (Hugging Face assisted
generation), `vllm` (vLLM's `LLM` with a speculative config), `openvino` (OpenVINO GenAI's
`LLMPipeline` with a draft model), `llamacpp` (llama-cpp-python with a draft model).

Imports nothing heavy: the certificate's records read `EngineCounters` without torch.

This package's `__init__` re-exports the contract's names; each lives in a module of its own:
`contract` (the protocols, `DraftModel`, `EngineOutputError`), `checks` (`check_engine`,
`draft_model`), `outputs` (samples, logprobs and counters checked; `lengths`, `row_by_row`),
`legacy` (the old six-argument contract's wrapper).
"""

from __future__ import annotations

from losscheck.engines.checks import check_engine, draft_model
from losscheck.engines.contract import (
    BlackBoxEngine,
    DraftLaw,
    DraftModel,
    EngineOutputError,
    ReportsCounters,
    ReportsLogprobs,
    ReportsPromptLogprobs,
    ReportsTopLogprobs,
    RunsDraftModel,
)
from losscheck.engines.counters import EngineCounters
from losscheck.engines.legacy import LegacyEngine
from losscheck.engines.outputs import (
    checked_logprobs,
    checked_samples,
    checked_top_logprobs,
    engine_counters,
    lengths,
    request_lengths,
    row_by_row,
)
from losscheck.engines.request import GenerationRequest

__all__ = [
    "BlackBoxEngine",
    "DraftLaw",
    "DraftModel",
    "EngineCounters",
    "EngineOutputError",
    "GenerationRequest",
    "LegacyEngine",
    "ReportsCounters",
    "ReportsLogprobs",
    "ReportsPromptLogprobs",
    "ReportsTopLogprobs",
    "RunsDraftModel",
    "check_engine",
    "checked_logprobs",
    "checked_samples",
    "checked_top_logprobs",
    "draft_model",
    "engine_counters",
    "lengths",
    "request_lengths",
    "row_by_row",
]
