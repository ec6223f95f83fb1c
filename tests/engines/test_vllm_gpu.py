"""vLLM end to end: the bundled tiny target with drafter A as vLLM draft model, certified by the
shipped black-box tests. Runs only where vLLM and a CUDA GPU exist (see
docs/black-box-engines.md for the command on a GPU runner)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.support import certify_engine

pytest_plugins = ["pytester"]

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (pip install vllm on a GPU runner)"
    ),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU: vLLM needs one"),
]


def test_vllm_draft_model_speculation_is_certified(pytester):
    """Greedy on == off and five one-sample PIT cells; a false failure has probability <= alpha 0.01."""
    result = certify_engine(
        pytester,
        "losscheck.engines.vllm:bundled_draft_model",
        "test_engine_greedy or test_engine_sampling",
        "--losscheck-device=cuda",
    )
    result.assert_outcomes(passed=6)
