"""A black-box engine run sized for hardware from config.json alone (`losscheck.engines.hardware`):
`--plan-for HARDWARE` parsed strictly, parameters counted from a config, the instance policy chosen
from what fits, and `losscheck certify --list --plan-for` on a weightless 27B-shaped directory."""

from __future__ import annotations

import json

import pytest

from losscheck.cli import main
from losscheck.engines.hardware import Hardware, Sizing, fit, parameters, parse_hardware
from losscheck.errors import OptionError

LLAMA_2_7B = {  # its published count: 6,738,415,616 parameters
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "intermediate_size": 11008,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
}
# a 27B-shaped Llama decoder (Gemma-3-27B's widths) and a small draft model of its vocabulary
TARGET_27B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 5376,
    "intermediate_size": 21504,
    "num_hidden_layers": 62,
    "num_attention_heads": 32,
    "num_key_value_heads": 16,
    "head_dim": 128,
    "vocab_size": 262144,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "eos_token_id": 1,
}
DRAFT = {**TARGET_27B, "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 4, "num_key_value_heads": 8}


@pytest.mark.parametrize(
    "text, expected",
    [
        ("1xH100-80GB", Hardware(1, "H100", 80.0)),
        ("2xL40S-48GB", Hardware(2, "L40S", 48.0)),
        ("1xH200-141GB", Hardware(1, "H200", 141.0)),
        ("8xA100-40GB", Hardware(8, "A100", 40.0)),
    ],
)
def test_hardware_parses(text, expected):
    assert parse_hardware(text) == expected and parse_hardware(text).label == text


@pytest.mark.parametrize("text", ["H100-80GB", "0xH100-80GB", "1xH100", "1xH100-80gb", "1x-80GB", "1xH100-80GiB", ""])
def test_anything_else_is_refused_with_the_form(text):
    with pytest.raises(OptionError, match=r"--plan-for=.*: need COUNTxNAME-MEMGB, e\.g\. 1xH100-80GB"):
        parse_hardware(text)


def test_parameters_are_counted_from_the_config():
    assert parameters(LLAMA_2_7B) == 6_738_415_616
    assert 26.5e9 < parameters(TARGET_27B) < 27.5e9


@pytest.mark.parametrize("layout", ["hybrid_target", "target", "hybrid_moe", "mixtral"])
def test_parameters_match_the_model_transformers_builds_from_the_config(layout):
    """Counted from config.json alone, exactly what transformers builds: the bundled dense and
    hybrid (Qwen3-Next: linear-attention layers, gated attention) targets, a Qwen3-Next with experts
    and a shared expert, a Mixtral with an untied head."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, MixtralConfig, Qwen3NextConfig

    from losscheck import bundled

    if layout == "mixtral":
        config = MixtralConfig(
            hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=4, vocab_size=512, tie_word_embeddings=False,
        )  # fmt: skip
    elif layout == "hybrid_moe":
        hybrid = AutoConfig.from_pretrained(bundled.fixtures_dir() / "hybrid_target").to_dict()
        config = Qwen3NextConfig(**{**hybrid, "num_experts": 4, "num_experts_per_tok": 2})
    else:
        config = AutoConfig.from_pretrained(bundled.fixtures_dir() / layout)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert parameters(config.to_dict()) == sum(p.numel() for p in model.parameters())


def test_two_instances_that_do_not_fit_get_one_at_a_time_and_a_small_model_keeps_all():
    h100 = Hardware(1, "H100", 80.0)
    big = fit(h100, Sizing(parameters(TARGET_27B), parameters(DRAFT), "bf16", "bf16"))
    assert (big.policy, big.memory_fraction) == ("one-at-a-time", 0.9)
    assert 50 < big.sizing.instance_gib() < 0.9 * 80  # one fits, two do not
    small = fit(h100, Sizing(parameters(LLAMA_2_7B), 0, "bf16", "bf16"))
    assert small.policy == "keep-all" and small.memory_fraction == 0.2  # 13.8 GiB of 80, rounded up to 0.05


def test_a_plan_that_cannot_fit_is_refused_with_the_numbers():
    fp32 = Sizing(parameters(TARGET_27B), 0, "fp32", "fp32")
    with pytest.raises(OptionError, match=r"does not fit 1xH100-80GB: an engine instance needs 11\d\.\d GiB a device"):
        fit(Hardware(1, "H100", 80.0), fp32)
    assert fit(Hardware(1, "H200", 141.0), Sizing(parameters(TARGET_27B), 0, "bf16", "fp32")).policy == "one-at-a-time"
    with pytest.raises(OptionError, match="splits over 4 devices, 2 given"):
        fit(Hardware(2, "L40S", 48.0), Sizing(parameters(LLAMA_2_7B), 0, "bf16", "bf16", tensor_parallel=4))


def plan_for(tmp_path, capsys, hardware: str, *extra: str) -> tuple[int, str]:
    """`losscheck certify --engine vllm ... --list --plan-for HARDWARE` on config-only directories."""
    for name, config in (("target", TARGET_27B), ("draft", DRAFT)):
        (tmp_path / name).mkdir(exist_ok=True)
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    spec = {"method": "draft_model", "model": str(tmp_path / "draft"), "num_speculative_tokens": 4}
    args = ["certify", "--engine", "vllm", "--target", str(tmp_path / "target"), "--speculative-config"]
    args += [json.dumps(spec), "--engine-arg", "dtype=bfloat16", "--plan-for", hardware, *extra]
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_list_plan_for_sizes_a_weightless_27b_run_and_puts_the_split_out_of_scope_on_one_device(tmp_path, capsys):
    code, out = plan_for(tmp_path, capsys, "1xH100-80GB", "--list")
    assert code == 0, out
    assert "hardware plan for 1xH100-80GB" in out and "target 27.01B parameters, draft model 0.36B" in out, out
    assert "policy: one-at-a-time — two instances and the reference (166.4 GiB) do not fit in 72.0 GiB" in out
    assert "  phase 1: speculative engine   56.1 GiB" in out and "  phase 2: reference target     54.2 GiB" in out
    assert "(bf16, scoring, the draft model beside it in fp32)" in out
    assert (
        "out of scope on 1xH100-80GB: tensor_parallel=2 (engine-k4-T1-bf16-tensor-parallel-2, "
        "engine-k4-greedy-bf16-tensor-parallel-2) needs 2 devices, 1 given; declare it out" in out
    )
    code, out = plan_for(tmp_path, capsys, "2xH100-80GB", "--list")
    assert code == 0 and "out of scope on" not in out
    assert "then variant tensor_parallel=2: 2 cells in 9 phases, each instance 28.0 GiB a device" in out


@pytest.mark.parametrize(
    "hardware, extra, message",
    [
        ("1xH100", ("--list",), "argument --plan-for: need COUNTxNAME-MEMGB"),
        ("1xH100-80GB", (), "--plan-for plans without running: give it with --list"),
        (
            "1xH100-80GB",
            ("--list", "--engine-arg", "dtype=float32"),
            "the run does not fit 1xH100-80GB: an engine instance needs 112.",
        ),
    ],
)
def test_a_bad_plan_for_is_a_usage_error(tmp_path, capsys, hardware, extra, message):
    code, out = plan_for(tmp_path, capsys, hardware, *extra)
    assert code == 2 and message in out


def test_an_engine_given_no_policy_gets_the_one_its_accelerators_fit(tmp_path, monkeypatch):
    from losscheck.engines import hardware
    from losscheck.engines.pool import Policy

    for name, config in (("target", TARGET_27B), ("draft", DRAFT)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    target, draft = str(tmp_path / "target"), str(tmp_path / "draft")
    monkeypatch.setattr(hardware, "present", lambda: None)  # a CPU: nothing to share
    assert hardware.chosen_policy(target, draft, "bf16", "bf16", 1) is Policy.KEEP_ALL
    monkeypatch.setattr(hardware, "present", lambda: Hardware(1, "H100", 80.0))
    assert hardware.chosen_policy(target, draft, "bf16", "bf16", 1) is Policy.ONE_AT_A_TIME
    monkeypatch.setattr(hardware, "present", lambda: Hardware(1, "H200", 141.0))
    assert hardware.chosen_policy(str(tmp_path / "none"), None, "bf16", "bf16", 1) is Policy.KEEP_ALL  # no config


def test_a_two_sample_proxy_is_fp32_where_it_fits_else_the_targets_own_dtype(tmp_path, monkeypatch):
    from losscheck.engines import hardware

    for name, config in (("target", {**TARGET_27B, "torch_dtype": "bfloat16"}), ("draft", DRAFT)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    target, draft = str(tmp_path / "target"), str(tmp_path / "draft")
    monkeypatch.setattr(hardware, "present", lambda: None)
    assert hardware.chosen_proxy("auto", target, draft) == "fp32"  # a CPU: the machine's memory, not a device's
    h100, h200 = Hardware(1, "H100", 80.0), Hardware(1, "H200", 141.0)
    assert hardware.chosen_proxy("auto", target, draft, hardware=h100) == "bf16"  # 27B in fp32: 108 GB
    assert hardware.chosen_proxy("auto", target, draft, hardware=h200) == "fp32"
    assert hardware.chosen_proxy("fp32", target, draft, hardware=h100) == "fp32"  # as asked: the plan refuses it
    monkeypatch.setattr(hardware, "present", lambda: h100)
    assert hardware.chosen_proxy("auto", target, draft) == "bf16"
    assert hardware.chosen_proxy("auto", target, draft, tensor_parallel=2) == "fp32"  # nothing fits: the plan refuses


def test_on_one_accelerator_the_split_variants_are_out_of_scope_with_the_numbers(tmp_path, capsys, monkeypatch):
    from losscheck.engines import hardware

    monkeypatch.setattr(hardware, "present", lambda: Hardware(1, "H100", 80.0))
    code, out = plan_for(tmp_path, capsys, "1xH100-80GB", "--list")
    assert code == 0, out
    for line in (
        "engine-k4-T1-bf16-tensor-parallel-2",
        "tensor_parallel=2 needs 2 devices, 1 present (1xH100-80GB); run it on a machine with more, or declare "
        "it out (--scope=-tensor_parallel)",
    ):
        assert line in out, out
    monkeypatch.setattr(hardware, "present", lambda: Hardware(2, "H100", 80.0))
    code, out = plan_for(tmp_path, capsys, "2xH100-80GB", "--list")
    assert code == 0 and "needs 2 devices" not in out, out
