"""`losscheck selftest gpu`: nothing run without a GPU (exit 0, said), the steps it composes, how a
step's verdict is read; the tiny shape on the CPU end to end sits in the slow tier."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from losscheck.cli import main
from losscheck.selftest import gpu


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the suite would run")
def test_without_a_gpu_nothing_is_built_and_it_exits_0_saying_so(tmp_path, capsys):
    assert main(["selftest", "gpu", "--out", str(tmp_path)]) == 0
    assert "needs a CUDA GPU" in capsys.readouterr().out
    assert not any(tmp_path.iterdir())


def test_the_pair_shares_the_drafters_weights_with_the_target(tmp_path):
    from transformers import AutoModelForCausalLM

    pair = gpu.build_pair(tmp_path, gpu.SHAPES["tiny"], seed=1)
    target = AutoModelForCausalLM.from_pretrained(pair.target)
    drafter = AutoModelForCausalLM.from_pretrained(pair.drafter)
    assert drafter.config.num_hidden_layers == gpu.DRAFT_LAYERS < target.config.num_hidden_layers
    theirs = target.state_dict()
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(tensor, theirs[name]), name
    assert pair.parameters == sum(p.numel() for p in target.parameters())


def test_the_real_shape_is_llama_3_s_vocabulary_at_a_billion_parameters():
    shape = gpu.SHAPES["real"]
    embeddings = 2 * shape.vocab * shape.hidden
    attention = shape.hidden * shape.head_dim * (2 * shape.heads + 2 * shape.kv_heads)
    layer = attention + 3 * shape.hidden * shape.intermediate
    assert shape.vocab == 128_256
    assert 1.0e9 < embeddings + shape.layers * layer < 1.6e9


def test_each_certifying_step_selects_the_greedy_and_t1_cell_at_k(tmp_path):
    pair = gpu.Pair(tmp_path / "t", tmp_path / "d", 1, 0.0)
    found = {s.name: s for s in gpu.steps(pair, "cuda", "bf16", tmp_path, 7)}
    assert list(found) == ["loop", "hf-engine", "vllm-engine", "perf"]
    assert found["loop"].argv[-1] == f"user-k{gpu.K}-greedy] or user-k{gpu.K}-T1]"
    assert found["vllm-engine"].argv[-1] == f"engine-k{gpu.K}-greedy] or engine-k{gpu.K}-T1]"
    speculative = json.loads(found["vllm-engine"].argv[found["vllm-engine"].argv.index("--speculative-config") + 1])
    assert speculative == {"method": "draft_model", "model": str(pair.drafter), "num_speculative_tokens": gpu.K}
    assert "losscheck_instances=one-at-a-time" in found["vllm-engine"].argv  # one GPU: never two LLMs
    assert all(s.argv[s.argv.index("--device") + 1] == "cuda" for s in found.values())
    assert [s.name for s in found.values() if s.certifies] == ["loop", "hf-engine", "vllm-engine"]


def _certificate(out: Path, counts: dict[str, int]) -> None:
    (out / "run").mkdir(parents=True)
    (out / "run" / "certificate.json").write_text(json.dumps({"counts": counts}))


@pytest.mark.parametrize(
    ("counts", "verdict"),
    [
        ({"passed": 2, "failed": 0, "errored": 0, "not run": 61}, "PASS"),
        ({"passed": 1, "failed": 1, "errored": 0, "not run": 61}, "FAIL"),
        ({"passed": 1, "failed": 0, "errored": 0, "not run": 62}, "FAIL"),  # a selected cell did not run
        ({"passed": 1, "failed": 0, "errored": 1, "not run": 61}, "FAIL"),
        (None, "FAIL"),  # no certificate written
    ],
)
def test_a_certifying_step_passes_only_when_both_its_cells_passed(tmp_path, monkeypatch, counts, verdict):
    out = tmp_path / "out"
    out.mkdir()
    if counts is not None:
        _certificate(out, counts)
    monkeypatch.setattr(gpu.subprocess, "call", lambda *a, **k: 3)  # PARTIAL, as every selection exits
    step = gpu.Step("loop", ("certify", "--out", str(out)), certifies=True)
    assert gpu.run_step(step, tmp_path / "loop.log").verdict == verdict


def test_a_step_whose_command_fails_is_a_fail_and_a_missing_engine_not_run(tmp_path):
    bad = gpu.Step("perf", ("perf", "--perf-k", "zero"))
    outcome = gpu.run_step(bad, tmp_path / "perf.log")
    assert outcome.verdict == "FAIL" and outcome.detail.startswith("exit 2 ")  # usage
    assert "--perf-k" in (tmp_path / "perf.log").read_text()
    missing = gpu.run_step(gpu.Step("x", ("certify",), needs="no_such_module_here"), tmp_path / "x.log")
    assert (missing.verdict, missing.detail) == ("NOT RUN", "no_such_module_here is not installed here")


@pytest.mark.slow
def test_the_tiny_shape_passes_every_step_on_the_cpu(tmp_path):
    """The suite's own run at CPU size (about 4 minutes on 2 cores): every step PASS, vLLM's where installed."""
    assert gpu.run_suite(tmp_path, "tiny", "cpu", "fp32", seed=20261129)
